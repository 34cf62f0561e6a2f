"""The prefix-cached profile against the naive one (every cell a full pass): the same table on every
family, the work it counts against the decoder layers that really ran, bounded memory, resuming
after a kill mid-layer, the fallback when a model refuses, and time left from the work left."""

import io

import pytest
import torch

from allocmoe.calibrate.prefix import cell_schedule, layer_passes, naive_layer_passes, profile_start_layer
from allocmoe.calibrate.cells import CellBar
from allocmoe.calibrate.profile import profile_cells, profile_sensitivity
from conftest import FAMILIES, KillAfter, build_tiny, relative_difference

TEXT = " ".join(f"word{i % 37} and thing{i % 11}." for i in range(400))
CFG = {"seq_len": 32, "calib_tokens": 256, "windows_per_pass": 3, "progress": False}   # 8 windows: batches of 3, 3, 2


def tiny(family, tok, num_layers=4):
    extra = {"layer_types": ["sliding_attention", "full_attention"] * (num_layers // 2)} if family == "gpt_oss" else {}
    return build_tiny(family, vocab_size=len(tok), num_hidden_layers=num_layers, **extra)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_cached_profile_equals_the_naive_one_on_every_family(tok, family):
    model = tiny(family, tok)
    naive = profile_sensitivity(model, tok, TEXT, {**CFG, "prefix_cache": False})
    cached = profile_sensitivity(model, tok, TEXT, CFG)
    assert relative_difference(cached["sensitivity"], naive["sensitivity"]) < 1e-5
    facts = cached["provenance"]
    assert facts["prefix_cache"] and "prefix_cache_refused" not in facts
    assert facts["layer_passes"] < facts["naive_layer_passes"] == naive["provenance"]["layer_passes"]
    assert naive["provenance"]["layer_passes"] == naive["provenance"]["naive_layer_passes"]


def count_decoder_layer_passes(model):
    """Tokens x decoder layers that really ran (a layer handed through returns its input object)."""
    count = [0]

    def hook(module, args, kwargs, output):
        hidden = args[0] if args else kwargs["hidden_states"]
        if output is not hidden:
            count[0] += hidden.shape[0] * hidden.shape[1]

    for layer in model.model.layers:
        layer.register_forward_hook(hook, with_kwargs=True)
    return count


@pytest.mark.parametrize("family", ["deepseek_v2", "qwen3_moe"])      # a dense first layer, and none
@pytest.mark.parametrize("cached", [True, False])
def test_the_work_counted_is_the_work_run_and_the_schedule_predicts_it(tok, family, cached):
    model = tiny(family, tok)
    ran = count_decoder_layer_passes(model)
    facts = profile_sensitivity(model, tok, TEXT, {**CFG, "prefix_cache": cached})["provenance"]
    assert facts["layer_passes"] == ran[0]
    fp = model.config
    moe_layers = [1, 2, 3] if family == "deepseek_v2" else [0, 1, 2, 3]
    steps = cell_schedule(list(profile_cells(len(moe_layers), fp.num_experts_per_tok)),
                          profile_start_layer(moe_layers, fp.num_experts_per_tok), 4, prefix_cache=cached)
    tokens, window = 8 * 32, 32
    assert layer_passes(steps, tokens, window) == facts["layer_passes"]
    assert naive_layer_passes(steps, tokens, 4) == facts["naive_layer_passes"]


def test_a_deepseek_v2_lite_shaped_profile_costs_at_most_0_55_of_the_naive_one():
    moe_layers, k_orig, tokens = list(range(1, 27)), 6, 8192        # 27 decoder layers, the first dense
    steps = cell_schedule(list(profile_cells(26, k_orig)), profile_start_layer(moe_layers, k_orig), 27)
    assert sum(step.kind == "cell" for step in steps) == 26 * 6 - 25
    assert layer_passes(steps, tokens, 2048) <= 0.55 * naive_layer_passes(steps, tokens, 27)


def test_the_states_of_one_layer_and_one_batch_are_held_at_most(tok):
    model = tiny("deepseek_v2", tok)
    facts = profile_sensitivity(model, tok, TEXT, CFG)["provenance"]
    hidden, float_bytes = model.config.hidden_size, 4
    assert facts["peak_cache_bytes"] == (8 * 32 + 3 * 32) * hidden * float_bytes


@pytest.mark.parametrize("family", ["deepseek_v2", "olmoe"])
@pytest.mark.parametrize("kill_after", [2, 5])                       # mid first layer, mid second layer
def test_a_kill_mid_layer_resumes_to_the_same_table(tok, tmp_path, family, kill_after):
    model = tiny(family, tok)
    reference = profile_sensitivity(model, tok, TEXT, {**CFG, "prefix_cache": False})
    out = tmp_path / "profile.json"
    with pytest.raises(KeyboardInterrupt):
        profile_sensitivity(model, tok, TEXT, CFG, output=out, on_cell=KillAfter(kill_after))
    assert not out.exists() and (tmp_path / "profile.json.partial.json").exists()
    for layer in model.model.layers:                                  # nothing left patched by the kill
        assert "forward" not in layer.__dict__ and not layer._forward_pre_hooks
    resumed_cells = []
    resumed = profile_sensitivity(model, tok, TEXT, CFG, output=out, on_cell=lambda l, k: resumed_cells.append(1))
    total = len(profile_cells(len(reference["sensitivity"]), reference["k_orig"]))
    assert len(resumed_cells) == total - kill_after                   # no finished cell ran again
    assert resumed["provenance"]["configurations_resumed"] == kill_after
    assert relative_difference(resumed["sensitivity"], reference["sensitivity"]) < 1e-5


def test_a_model_whose_layers_leave_state_for_deeper_ones_fails_the_check_and_runs_naive(tok, capsys):
    """Layer 0 leaves its output for layer 3: skipping layer 0 would feed layer 3 a stale one."""
    model = tiny("olmoe", tok)
    left = {}
    first, last = model.model.layers[0], model.model.layers[3]

    class Leaves(type(first)):
        def forward(self, hidden_states, *args, **kwargs):
            left["out"] = super().forward(hidden_states, *args, **kwargs)
            return left["out"]

    class Uses(type(last)):
        def forward(self, hidden_states, *args, **kwargs):
            return super().forward(hidden_states + 0.5 * left["out"], *args, **kwargs)

    first.__class__, last.__class__ = Leaves, Uses
    reference = profile_sensitivity(model, tok, TEXT, {**CFG, "prefix_cache": False})
    profile = profile_sensitivity(model, tok, TEXT, CFG)
    assert "warning: no prefix cache for this model" in capsys.readouterr().err
    facts = profile["provenance"]
    assert not facts["prefix_cache"] and "differs from a full pass" in facts["prefix_cache_refused"]
    assert facts["peak_cache_bytes"] > 0                              # states were held before the check refused
    assert profile["sensitivity"] == reference["sensitivity"]
    assert facts["naive_layer_passes"] == reference["provenance"]["layer_passes"]


def test_a_model_without_a_decoder_stack_is_profiled_the_naive_way(tok, monkeypatch, capsys):
    model = tiny("olmoe", tok)
    reference = profile_sensitivity(model, tok, TEXT, {**CFG, "prefix_cache": False})
    monkeypatch.setattr(model.config, "num_hidden_layers", 5)        # the stack no longer matches the config
    profile = profile_sensitivity(model, tok, TEXT, CFG)
    assert "not model.model.layers" in capsys.readouterr().err
    assert profile["sensitivity"] == reference["sensitivity"]


def test_time_left_follows_the_work_left_not_the_cells_left():
    bar = CellBar(total=10, work_total=100, file=io.StringIO(), bar_format="{remaining}")
    bar.update(5)
    bar.work_done = 90                                                # half the cells, 90% of the work
    bar.start_t = bar._time() - 90.0
    assert bar.format_meter(**bar.format_dict) == "00:10"
    bar.close()
