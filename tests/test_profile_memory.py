"""Profiling a model bigger than memory (`--max-memory`, calibrate/walk.py and onload.py): the table
the whole model gives on every family, walked in several groups; the weight reads and work it
counts; a tied head; the naive protocol; a model that fits; resuming; refusals before any weight is
read; and, in a subprocess, a 400 MiB model profiled under a 190 MiB cap, its peak resident memory
read from the process itself, with its 13 cells in several walks."""

import json
import re
import os
import subprocess
import sys

import pytest
import torch

from allocmoe.calibrate import onload
from allocmoe.calibrate.profile import profile_cells, profile_sensitivity
from allocmoe.calibrate.walk import memory_plan, parse_size
from allocmoe.cli import main
from allocmoe.errors import AllocMoeError
from allocmoe.models import inspect_model
from conftest import FAMILIES, KillAfter, build_tiny, relative_difference

TEXT = " ".join(f"word{i % 37} and thing{i % 11}." for i in range(400))
CFG = {"seq_len": 32, "calib_tokens": 256, "windows_per_pass": 3, "progress": False}   # 8 windows: batches of 3, 3, 2
TOKENS = 8 * 32


def saved(family, tok, folder, **overrides):
    extra = {"layer_types": ["sliding_attention", "full_attention"] * 2} if family == "gpt_oss" else {}
    model = build_tiny(family, vocab_size=len(tok), num_hidden_layers=4, **{**extra, **overrides})
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return model


def cap_for(folder, tok, cells_per_walk, config=CFG):
    """The cap that lets `cells_per_walk` cells walk together (the plan's own arithmetic)."""
    from allocmoe.scoring.perplexity import tokenize_windows

    onloaded = onload.OnloadedModel(inspect_model(folder))
    windows = tokenize_windows(tok, TEXT, config["seq_len"], config["calib_tokens"])
    return memory_plan(onloaded, windows, config["windows_per_pass"], 10**12).peak(cells_per_walk)


def expected_reads(profile, starts_of_walks, num_decoder_layers):
    """Decoder layer j is read by every walk that starts at or before it."""
    return [sum(start <= j for start in starts_of_walks) for j in range(num_decoder_layers)]


def count_decoder_layer_passes():
    """Tokens x decoder layers that really ran, over every model (a layer handed through returns its input)."""
    count = [0]

    def hook(module, args, kwargs, output):
        if type(module).__name__.endswith("DecoderLayer"):
            hidden = args[0] if args else kwargs["hidden_states"]
            if output is not hidden and not (isinstance(output, tuple) and output[0] is hidden):
                count[0] += hidden.shape[0] * hidden.shape[1]

    return count, torch.nn.modules.module.register_module_forward_hook(hook, with_kwargs=True)


# -- the numbers ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_walked_in_groups_the_profile_equals_the_whole_model_one_on_every_family(tok, tmp_path, family):
    model = saved(family, tok, tmp_path)
    reference = profile_sensitivity(model, tok, TEXT, CFG)
    ran, hook = count_decoder_layer_passes()
    try:
        walked = profile_sensitivity(str(tmp_path), None, TEXT, {**CFG, "max_memory": cap_for(tmp_path, tok, 2)})
    finally:
        hook.remove()
    assert relative_difference(walked["sensitivity"], reference["sensitivity"]) < 1e-5
    facts = walked["provenance"]
    assert facts["layer_by_layer"] and facts["prefix_cache"]
    cells = len(profile_cells(reference["num_layers"], reference["k_orig"]))
    per_walk = facts["memory"]["cells_per_walk"]
    assert sum(per_walk) == cells and max(per_walk) == 2 and facts["memory"]["walks"] == len(per_walk) > 1
    # the work counted is the work run: the unmodified stream to the last cell's layer, each cell from its own
    moe_layers, k = walked["model"]["moe_layers"], walked["k_orig"]
    starts = sorted(moe_layers[next((p for p, kk in enumerate(cfg) if kk != k), len(cfg) - 1)]
                    for cfg in profile_cells(len(moe_layers), k))
    assert facts["layer_passes"] == ran[0] == TOKENS * (starts[-1] + sum(4 - s for s in starts))
    assert facts["naive_layer_passes"] == TOKENS * 4 * cells
    # each walk reads the layers from its first cell's down; only the first reads the embedding
    walk_starts = [0] + [starts[sum(per_walk[:g])] for g in range(1, len(per_walk))]
    reads = facts["weight_reads"]
    assert reads["decoder_layers"] == expected_reads(walked, walk_starts, 4)
    assert reads["max"] == len(per_walk) and reads["embedding"] == 1 and reads["head"] == len(per_walk)
    assert facts["memory"]["planned_peak_bytes"] <= facts["memory"]["cap_bytes"]


def test_a_tied_output_head_is_read_from_the_embedding(tok, tmp_path):
    model = saved("qwen3_moe", tok, tmp_path, tie_word_embeddings=True)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    reference = profile_sensitivity(model, tok, TEXT, CFG)
    walked = profile_sensitivity(tmp_path, tok, TEXT, {**CFG, "max_memory": cap_for(tmp_path, tok, 3)})
    assert walked["sensitivity"] == reference["sensitivity"]
    reads = walked["provenance"]["weight_reads"]
    assert reads["head"] == walked["provenance"]["memory"]["walks"] > 1 and reads["embedding"] == 1


def test_without_the_prefix_cache_every_cell_walks_from_the_embedding_as_the_naive_protocol(tok, tmp_path):
    model = saved("deepseek_v2", tok, tmp_path)
    naive = profile_sensitivity(model, tok, TEXT, {**CFG, "prefix_cache": False})
    walked = profile_sensitivity(tmp_path, tok, TEXT, {**CFG, "prefix_cache": False,
                                                        "max_memory": cap_for(tmp_path, tok, 4)})
    assert walked["sensitivity"] == naive["sensitivity"]
    facts = walked["provenance"]
    assert not facts["prefix_cache"] and facts["layer_passes"] == facts["naive_layer_passes"]
    assert facts["weight_reads"]["decoder_layers"] == [facts["memory"]["walks"]] * 4


def test_a_model_that_fits_under_the_cap_is_loaded_whole_and_profiled_as_usual(tok, tmp_path):
    model = saved("olmoe", tok, tmp_path)
    reference = profile_sensitivity(model, tok, TEXT, CFG)
    profile = profile_sensitivity(tmp_path, tok, TEXT, {**CFG, "max_memory": "1GiB"})
    assert profile["sensitivity"] == reference["sensitivity"]
    facts = profile["provenance"]
    assert not facts["layer_by_layer"] and "fits under the cap" in facts["memory"]["loaded"]
    assert facts["weight_reads"]["decoder_layers"] == [1] * 4 and facts["weight_reads"]["max"] == 1
    assert facts["layer_passes"] == reference["provenance"]["layer_passes"]      # the usual prefix-cached run


@pytest.mark.parametrize("kill_after", [1, 4])                  # in the first walk, in a later one
def test_a_kill_mid_walk_leaves_only_the_partial_file_and_resumes_to_the_same_table(tok, tmp_path, kill_after):
    folder, out = tmp_path / "model", tmp_path / "out" / "profile.json"
    out.parent.mkdir()
    model = saved("olmoe", tok, folder)
    reference = profile_sensitivity(model, tok, TEXT, CFG)
    config = {**CFG, "max_memory": cap_for(folder, tok, 2)}
    with pytest.raises(KeyboardInterrupt):
        profile_sensitivity(folder, tok, TEXT, config, output=out, on_cell=KillAfter(kill_after))
    assert sorted(p.name for p in out.parent.iterdir()) == ["profile.json.partial.json"]
    resumed = profile_sensitivity(folder, tok, TEXT, config, output=out)
    assert resumed["provenance"]["configurations_resumed"] == kill_after
    assert resumed["sensitivity"] == reference["sensitivity"]
    assert sorted(p.name for p in out.parent.iterdir()) == ["profile.json"]


# -- refusals -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("text, expected", [("300MiB", 300 * 2**20), ("2GB", 2 * 10**9), ("1.5GiB", 3 * 2**29),
                                            ("300 mib", 300 * 2**20), ("4096", 4096), (123456, 123456),
                                            ("64KiB", 65536), (" 1TB ", 10**12)])
def test_sizes_are_read_in_bytes(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("bad", ["", "abc", "300XB", "-5MiB", "0", "0MiB", "nan", "inf", "1e9", "MiB", "3..5GB",
                                 True, 0, -1, 1.5, None, [300]])
def test_a_size_that_is_not_one_is_refused_with_an_example(bad):
    with pytest.raises(AllocMoeError, match=r"; give e\.g\. 300MiB$"):
        parse_size(bad)


def test_a_loaded_model_with_a_cap_is_refused_the_cap_needs_the_folder(tok):
    model = build_tiny("olmoe", vocab_size=len(tok))
    with pytest.raises(AllocMoeError, match="needs the model's folder"):
        profile_sensitivity(model, tok, TEXT, {**CFG, "max_memory": "300MiB"})


@pytest.fixture
def no_weights_read(monkeypatch):
    """Fails the test if a weight is read or a module runs."""
    def refuse(*args, **kwargs):
        raise AssertionError("a weight was read")

    monkeypatch.setattr(onload.StoredTensor, "__getitem__", refuse)
    hook = torch.nn.modules.module.register_module_forward_pre_hook(lambda module, args: refuse())
    yield
    hook.remove()


@pytest.mark.parametrize("cap, message", [("1KiB", "too small to profile this model layer by layer: it needs at least"),
                                          ("--max-memory=12 parsecs", "is not a size; give e.g. 300MiB"),
                                          ("0", "is not a positive size")])
def test_the_cli_refuses_a_bad_or_too_small_cap_in_one_line_before_any_weight_is_read(
        tok, tmp_path, capsys, no_weights_read, cap, message):
    folder = tmp_path / "model"
    saved("olmoe", tok, folder)
    text = tmp_path / "text.txt"
    text.write_text(TEXT)
    out = tmp_path / "profile.json"
    flag = [cap] if cap.startswith("--") else ["--max-memory", cap]
    capsys.readouterr()                                    # the saving's progress bar
    with pytest.raises(SystemExit) as exc:
        main(["profile", "--model", str(folder), "--calib-text", str(text), "--seq-len", "32", "--calib-tokens", "256",
              "--output", str(out), "--quiet", *flag])
    err = capsys.readouterr().err.strip().splitlines()
    assert exc.value.code == 2 and len(err) == 1 and message in err[0], err
    assert not out.exists() and not out.with_name("profile.json.partial.json").exists()
    if cap == "1KiB":                                      # the least cap that works, which then works
        least = err[0].split("give at least ")[1].split(",")[0]
        assert parse_size(least) >= cap_for(folder, tok, 1, {**CFG, "windows_per_pass": 4})


# -- several devices ---------------------------------------------------------------------------------------
def test_a_pass_started_at_a_layer_goes_through_accelerates_device_hooks_and_leaves_them(tok):
    """device_map="auto" over several GPUs puts accelerate's hook on each decoder layer (an instance
    forward that moves the input to the layer's device); the prefix cache hands such a layer through
    and puts the hook back. Here every device is the CPU, with the hooks forced."""
    accelerate = pytest.importorskip("accelerate")
    from allocmoe.calibrate.prefix import Captured, capture_before, started_at

    model = build_tiny("olmoe", vocab_size=len(tok), num_hidden_layers=4)
    ids = torch.randint(0, len(tok), (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        full = model(input_ids=ids).logits
        held = []
        with capture_before(model, 2, held):
            with pytest.raises(Captured):
                model(input_ids=ids)
    device_map = {"model.embed_tokens": "cpu", **{f"model.layers.{i}": "cpu" for i in range(4)}, "model.norm": "cpu",
                  "model.rotary_emb": "cpu", "lm_head": "cpu"}
    model = accelerate.dispatch_model(model, device_map=device_map, main_device="cpu", force_hooks=True)
    hooks = [layer.__dict__["forward"] for layer in model.model.layers]
    with torch.no_grad(), started_at(model, 2, held):
        started = model(input_ids=ids).logits
    assert torch.equal(started, full)
    assert [layer.__dict__["forward"] for layer in model.model.layers] == hooks


# -- memory, in a process of its own --------------------------------------------------------------------------
BIG = dict(hidden_size=512, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
           head_dim=64, max_position_embeddings=256, num_experts=64, num_experts_per_tok=4, moe_intermediate_size=256,
           norm_topk_prob=True)                   # 398 MiB of float32 weights, 99 MiB a decoder layer; 13 cells
CAP_MIB = 190
# What the cap does not cover: Python, torch, transformers and the model's code, the tokenizer and the
# tokenised text. Measured as the peak of the same command refused before any weight is read (a cap
# too small), plus this margin for what the plan does not see (Python objects made while profiling,
# allocator slack). docs/profiling.md gives the figures.
MARGIN_MIB = 32
_PEAK = ("import atexit, runpy, sys\n"
         "atexit.register(lambda: sys.stderr.write('\\npeak-rss-kib ' + open('/proc/self/status').read()"
         ".split('VmHWM:')[1].split()[0] + '\\n'))\n"
         "sys.argv = ['allocmoe'] + sys.argv[1:]\n"
         "runpy.run_module('allocmoe', run_name='__main__')\n")


def peak_mib_of_cli(*argv) -> tuple[int, float, str]:
    """Exit status, the process's own peak resident memory (VmHWM) in MiB, and its stderr."""
    proc = subprocess.run([sys.executable, "-c", _PEAK, *argv], capture_output=True, text=True,
                          env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=300)
    peak = int(proc.stderr.rsplit("peak-rss-kib ", 1)[1].split()[0]) / 1024
    return proc.returncode, peak, proc.stderr


@pytest.fixture(scope="module")
def big_folder(tmp_path_factory, tok):
    from transformers import AutoConfig, AutoModelForCausalLM

    folder = tmp_path_factory.mktemp("big")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model("qwen3_moe", vocab_size=len(tok), **BIG))
    assert 390 * 2**20 < sum(p.numel() for p in model.parameters()) * 4 < 400 * 2**20
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    from allocmoe.texts import read_text

    (folder / "calib.txt").write_text(read_text(None, "calibration")[0][:100_000])
    return folder


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads the peak from /proc/self/status")
def test_a_model_twice_the_cap_is_profiled_to_the_same_table_under_the_cap_plus_the_stated_overhead(
        big_folder, tmp_path):
    args = ["profile", "--model", str(big_folder), "--calib-text", str(big_folder / "calib.txt"),
            "--calib-tokens", "2048", "--seq-len", "128", "--quiet"]       # 4 MiB of states a cell
    code, baseline, err = peak_mib_of_cli(*args, "--output", str(tmp_path / "refused.json"), "--max-memory", "1MiB")
    assert code == 2 and "too small" in err                  # everything but the weights: imports, tokenizer, text
    out = tmp_path / "capped.json"
    code, peak, err = peak_mib_of_cli(*args, "--output", str(out), "--max-memory", f"{CAP_MIB}MiB")
    assert code == 0, err
    capped = json.loads(out.read_text())
    facts = capped["provenance"]
    assert facts["layer_by_layer"] and facts["memory"]["walks"] > 1             # the cells did not fit in one walk
    assert facts["weight_reads"]["max"] == facts["memory"]["walks"] and facts["weight_reads"]["embedding"] == 1
    assert facts["memory"]["model_bytes"] > 2 * CAP_MIB * 2**20
    print(f"\npeak resident: baseline {baseline:.0f} MiB, capped run {peak:.0f} MiB "
          f"(cap {CAP_MIB} + overhead {baseline:.0f} + {MARGIN_MIB} = {CAP_MIB + baseline + MARGIN_MIB:.0f})")
    assert peak <= baseline + CAP_MIB + MARGIN_MIB
    whole = profile_sensitivity(str(big_folder), None, (big_folder / "calib.txt").read_text(),
                                {"calib_tokens": 2048, "seq_len": 128, "progress": False})
    assert relative_difference(capped["sensitivity"], whole["sensitivity"]) < 1e-5


# -- memory the host can give: MemAvailable, not MemFree ------------------------------------------------------
def fake_meminfo(path, free_gib, available_gib, cached_gib):
    kib = 2**20                                            # KiB in a GiB
    lines = [f"MemTotal:       {64 * kib} kB", f"MemFree:        {free_gib * kib} kB"]
    if available_gib is not None:
        lines.append(f"MemAvailable:   {available_gib * kib} kB")
    lines += [f"Buffers:        {kib // 4} kB", f"Cached:         {cached_gib * kib} kB"]
    path.write_text("\n".join(lines) + "\n")
    return path


def test_the_host_gives_what_memavailable_says_not_only_its_free_pages(tmp_path):
    from allocmoe.core import memory

    meminfo = fake_meminfo(tmp_path / "meminfo", free_gib=11, available_gib=22, cached_gib=11)
    assert memory.available_memory_bytes(torch.device("cpu"), meminfo) == 22 * 2**30
    need = int(12.8 * 2**30)                                # synthetic:deepseek-v2-lite, 6 layers
    memory.check_free_memory(need, torch.device("cpu"), "the model", "fix", meminfo=meminfo)   # 12.8 <= 0.8 * 22
    tight = fake_meminfo(tmp_path / "tight", free_gib=11, available_gib=15, cached_gib=4)
    with pytest.raises(AllocMoeError, match=r"the model needs 12\.8 GiB, 15\.0 GiB is available; fix"):
        memory.check_free_memory(need, torch.device("cpu"), "the model", "fix", meminfo=tight)   # 12.8 > 12


def test_without_memavailable_the_host_falls_back_to_its_free_pages(tmp_path):
    from allocmoe.core import memory

    pages = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    old_kernel = fake_meminfo(tmp_path / "meminfo", free_gib=11, available_gib=None, cached_gib=11)
    for path in (old_kernel, tmp_path / "absent"):
        # the free pages move between two reads; the fallback is that figure, not a made-up one
        assert abs(memory.available_memory_bytes(torch.device("cpu"), path) - pages) < 2**30


def test_bench_refuses_a_synthetic_model_bigger_than_memavailable_and_says_available(tmp_path, monkeypatch, capsys):
    from allocmoe.core import memory

    monkeypatch.setattr(memory, "MEMINFO", str(fake_meminfo(tmp_path / "meminfo", 11, 22, 11)))
    with pytest.raises(SystemExit) as exc:                 # 27 layers: ~58 GiB of float32 weights
        main(["bench", "--model", "synthetic:deepseek-v2-lite", "--num-layers", "27", "--budget", "0.5"])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip()
    assert re.fullmatch(r"allocmoe: error: synthetic:deepseek-v2-lite with 27 layers needs [\d.]+ GiB of weights, "
                        r"22\.0 GiB is available; pass a smaller --num-layers", err), err
