"""The Python API keeps the CLI's contract (issue 21): the same mistake raises AllocMoeError with the
message the CLI prints after `allocmoe: error: `, before any forward pass; and a PlanHandle never
lets a model silently run without the plan it was given (re-entered after exit, nested, a second
plan on the same model, a plan or handle of another model, a copy of a patched model)."""

from __future__ import annotations

import copy
import json
import shutil

import pytest
import torch

from allocmoe import AllocMoeError, allocate, evaluate_model, load_model, static_plan
from allocmoe.cli import main
from allocmoe.routing.apply import active_handle, apply_plan, apply_plans, routed_experts_off
from conftest import build_tiny


@pytest.fixture(scope="module")
def setup(tmp_path_factory, tiny_folder):
    root = tmp_path_factory.mktemp("api_contract")
    model, tok = load_model(tiny_folder)
    other = build_tiny("olmoe", vocab_size=len(tok))
    static_plan(other, [2, 2, 2]).save(root / "other_plan.json")
    (root / "short.txt").write_text("too short")
    bad = root / "m_badjson"
    shutil.copytree(tiny_folder, bad)
    (bad / "config.json").write_text("{oops")
    trunc = root / "m_trunc"
    shutil.copytree(tiny_folder, trunc)
    weights = (trunc / "model.safetensors").read_bytes()
    (trunc / "model.safetensors").write_bytes(weights[: len(weights) // 2])
    llama = root / "m_llama"
    shutil.copytree(tiny_folder, llama)
    config = json.loads((llama / "config.json").read_text())
    (llama / "config.json").write_text(json.dumps({**config, "model_type": "llama"}))
    return root, model


def cli_line(argv, capsys) -> str:
    with pytest.raises(SystemExit) as exc:
        main(argv)
    lines = capsys.readouterr().err.strip().splitlines()
    assert exc.value.code == 2
    return lines[-1]


def api_message(call) -> str:
    with pytest.raises(AllocMoeError) as exc:
        call()
    return f"allocmoe: error: {exc.value}"


@pytest.fixture
def no_forward():
    """Fails the test if any module runs a forward pass while it is active."""
    calls = []
    hook = torch.nn.modules.module.register_module_forward_pre_hook(lambda module, args: calls.append(module))
    yield calls
    hook.remove()
    assert not calls, f"{len(calls)} forward calls"


# -- the same mistake, the same message ---------------------------------------------------------------
@pytest.mark.parametrize("budget", ["nan", "0", "-0.5", "13", "2", "abc", "1/0"])
def test_a_bad_budget_reads_the_same_in_python_and_on_the_command_line(budget, setup, tiny_folder, tmp_path, capsys,
                                                                       no_forward):
    _, model = setup
    api = api_message(lambda: allocate(budget, "uniform", model=model))
    cli = cli_line(["allocate", "--model", str(tiny_folder), "--budget", budget, "--method", "uniform",
                    "--output", str(tmp_path / "p.json")], capsys)
    assert api == cli


def test_a_missing_or_short_text_reads_the_same(setup, tiny_folder, tmp_path, capsys, no_forward):
    root, _ = setup
    for text in (tmp_path / "missing.txt", root / "short.txt", root):
        api = api_message(lambda: evaluate_model(tiny_folder, text=text, progress=False))
        assert api == cli_line(["eval", "--model", str(tiny_folder), "--text", str(text)], capsys)


@pytest.mark.parametrize("folder, message", [("m_badjson", "is not JSON"), ("m_trunc", "truncated or corrupt"),
                                             ("m_llama", "unsupported architecture 'llama'"),
                                             ("nowhere", "model folder not found")])
def test_a_bad_model_folder_reads_the_same(folder, message, setup, capsys, no_forward):
    root, _ = setup
    api = api_message(lambda: load_model(root / folder))
    assert message in api
    assert api == api_message(lambda: evaluate_model(root / folder, progress=False))
    assert api == cli_line(["eval", "--model", str(root / folder)], capsys)


def test_a_seq_len_past_the_context_reads_the_same(setup, tiny_folder, capsys, no_forward):
    from allocmoe import profile_sensitivity
    from allocmoe.texts import read_text

    _, model = setup
    tok = load_model(tiny_folder)[1]
    api = api_message(lambda: evaluate_model(tiny_folder, seq_len=4096, progress=False))
    assert "outside this model's context of 1..256" in api
    assert api == cli_line(["eval", "--model", str(tiny_folder), "--seq-len", "4096"], capsys)
    text, _ = read_text(None, "calibration")
    assert api == api_message(lambda: profile_sensitivity(model, tok, text, {"seq_len": 4096, "progress": False}))


def test_a_plan_of_another_model_reads_the_same(setup, tiny_folder, capsys, no_forward):
    root, model = setup
    plan = root / "other_plan.json"
    api = api_message(lambda: evaluate_model(tiny_folder, plan=plan, progress=False))
    assert "made for another model" in api
    assert api == cli_line(["eval", "--model", str(tiny_folder), "--plan", str(plan)], capsys)
    from allocmoe import Plan

    assert api == api_message(lambda: apply_plan(model, Plan.load(plan)))


def test_a_device_that_does_not_exist_reads_the_same(setup, tiny_folder, capsys):
    root, _ = setup
    for device in ("tpu", "cpu:3", "cuda:99"):
        api = api_message(lambda: load_model(tiny_folder, device=device))
        cli = cli_line(["bench", "--model", str(tiny_folder), "--plan", str(root / "other_plan.json"),
                        "--device", device, "--input-len", "8", "--output-len", "2"], capsys)
        assert api == cli


def test_task_options_without_tasks_read_the_same(tiny_folder, capsys, no_forward):
    api = api_message(lambda: evaluate_model(tiny_folder, task_options={"num_fewshot": 2}, progress=False))
    assert "applies only with tasks" in api
    assert api == cli_line(["eval", "--model", str(tiny_folder), "--num-fewshot", "2"], capsys)


# -- PlanHandle: never silently the unpatched (or the wrong) model ----------------------------------------
@pytest.fixture
def patched():
    torch.manual_seed(1)
    model = build_tiny("olmoe")
    ids = torch.randint(0, 96, (2, 12))
    with torch.no_grad():
        full = model(ids).logits
        plan = static_plan(model, [1, 1, 1])
        with apply_plan(model, plan):
            cut = model(ids).logits
    assert not torch.equal(cut, full)
    return model, ids, plan, full, cut


@torch.no_grad()
def test_a_handle_that_has_exited_refuses_to_be_entered_or_extended(patched):
    model, ids, plan, full, _ = patched
    with apply_plan(model, plan) as handle:
        pass
    with pytest.raises(AllocMoeError, match="was removed"):
        with handle:
            pass
    with pytest.raises(AllocMoeError, match="was removed"):
        handle.add_plan(plan)
    assert torch.equal(model(ids).logits, full) and active_handle(model) is None


@torch.no_grad()
def test_a_handle_refuses_a_nested_with_block_and_the_outer_block_keeps_the_plan(patched):
    model, ids, plan, _, cut = patched
    with apply_plan(model, plan) as handle:
        with pytest.raises(AllocMoeError, match="already in a `with` block"):
            with handle:
                pass
        assert torch.equal(model(ids).logits, cut)          # not removed by the refused inner block
    assert not handle.active


@torch.no_grad()
def test_applying_a_second_plan_is_refused_and_the_first_keeps_routing(patched):
    model, ids, plan, full, cut = patched
    wider = static_plan(model, [3, 3, 3])
    with apply_plan(model, plan):
        for second in (plan, wider):
            with pytest.raises(AllocMoeError, match="already applied to this model; remove its handle first"):
                apply_plan(model, second)
            with pytest.raises(AllocMoeError, match="already applied"):
                apply_plans(model, [second])
        assert torch.equal(model(ids).logits, cut)          # nothing stacked, nothing half-installed
    assert torch.equal(model(ids).logits, full)


@torch.no_grad()
def test_a_plan_or_handle_of_another_model_is_refused(patched):
    model, ids, plan, full, _ = patched
    mixtral = build_tiny("mixtral")
    with pytest.raises(AllocMoeError, match="made for another model"):
        apply_plan(mixtral, plan)
    with apply_plan(model, plan) as handle:
        with pytest.raises(AllocMoeError, match="made for another model"):
            handle.add_plan(static_plan(mixtral, [1, 1, 1]))
        assert len(handle.plans) == 1
    assert active_handle(mixtral) is None and torch.equal(model(ids).logits, full)


@torch.no_grad()
def test_a_copy_of_a_patched_model_refuses_to_run_until_cleared(patched):
    """A copy keeps the patches, bound to the original's routers and counters: it would route with the
    original's weights and count into the original's handle, so it refuses instead."""
    model, ids, plan, full, cut = patched
    with apply_plan(model, plan) as handle:
        twin = copy.deepcopy(model)
        with pytest.raises(AllocMoeError, match="is a copy of a model that had a plan applied"):
            twin(ids)
        with pytest.raises(AllocMoeError, match="is a copy of a model"):
            apply_plan(twin, plan)
        with pytest.raises(AllocMoeError, match="is a copy of a model"):
            apply_plan(copy.copy(model), plan)
        assert handle.tokens_seen() == 0
    with pytest.raises(AllocMoeError, match="is a copy of a model"):
        twin(ids)                                           # still refused after the original's handle left
    active_handle(twin).remove()
    assert torch.equal(twin(ids).logits, full)
    with apply_plan(twin, plan):
        assert torch.equal(twin(ids).logits, cut)
    assert torch.equal(model(ids).logits, full)


@torch.no_grad()
def test_a_plan_is_refused_inside_a_block_that_swapped_the_experts(patched):
    model, ids, plan, _, _ = patched
    with routed_experts_off(model):
        off = model(ids).logits
        with pytest.raises(AllocMoeError, match="already run a replaced forward"):
            apply_plan(model, plan)
        assert torch.equal(model(ids).logits, off)          # the swap is intact


# -- issue 39: every public function checks its arguments at the door ------------------------------------
def _add_plan(model, plan, second):
    with apply_plan(model, plan) as handle:         # removed on the way out, refusal or not
        handle.add_plan(second)


def _bad_calls(model, tok, folder, tmp_path):
    """(call, a substring of its message): plain mistakes, each an AllocMoeError before any work."""
    from allocmoe.pipelines.sweep import SweepConfig, sweep
    from allocmoe import (AllocateConfig, Plan, DistinctConfig, PerplexityConfig, ProfileConfig, allocate_distinct,
                          distinct_plan, distinct_profile, evaluate_perplexity, generate, profile_sensitivity,
                          read_text)

    text, _ = read_text(None, "calibration")
    (tmp_path / "f.txt").write_text("a file, not a folder")
    plain = static_plan(model, [1, 1, 1])
    nan, inf = float("nan"), float("inf")
    return [
        # apply_plan: a Plan, a plan file's path or a plan document; nothing else
        (lambda: apply_plan(model, None), "plan must be a Plan, a plan file's path or a plan document"),
        (lambda: apply_plan(model, 5), "plan must be a Plan"),
        (lambda: apply_plan(model, [plain]), "plan must be a Plan"),
        (lambda: apply_plan(model, {}), "format_version"),
        (lambda: apply_plan(model, {"format_version": 1}), "plan"),
        (lambda: apply_plan(model, tmp_path / "missing.json"), "plan file not found"),
        (lambda: apply_plan(model, tmp_path), "is a folder"),
        (lambda: apply_plan(None, plain), "model must be a loaded model"),
        (lambda: apply_plan("model", plain), "model must be a loaded model"),
        (lambda: apply_plan(model, plain, renormalize="yes"), "renormalize must be true or false or None"),
        (lambda: apply_plans(model, plain), "plans must be a list of plans"),
        (lambda: apply_plans(model, []), "at least one plan"),
        (lambda: _add_plan(model, plain, None), "add_plan: plan must be a Plan"),
        # allocate: the profile, the budget, the method, the model, the text
        (lambda: allocate(0.5, "alloc-l", profile={}), "format_version"),
        (lambda: allocate(0.5, "alloc-l", profile={"format_version": 1}), "profile"),
        (lambda: allocate(0.5, "alloc-l", profile=tmp_path / "missing.json"), "profile file not found"),
        (lambda: allocate(0.5, "alloc-l", profile=tmp_path), "is a folder"),
        (lambda: allocate(0.5, "alloc-l", profile=[1, 2]), "profile must be a profile"),
        (lambda: allocate(True, "uniform", model=model), "budget must be"),
        (lambda: allocate([0.5], "uniform", model=model), "budget must be"),
        (lambda: allocate(0.5, 3, model=model), "method must be a string"),
        (lambda: allocate(0.5, "uniform", model=42), "model must be a loaded model (allocmoe.load_model(...)[0]) "
                                                     "or a model folder's path"),
        (lambda: allocate(0.5, "uniform", model=tmp_path / "folder"), "model folder not found"),   # a path: a folder
        (lambda: allocate(0.5, "lexi", model=folder), "needs the model loaded, not its folder"),
        (lambda: allocate(0.5, "uniform", model=model, tokenizer=5), "tokenizer must be the model's tokenizer"),
        (lambda: allocate(0.5, "top-p", model=model, tokenizer=tok, calib_text=b"bytes"), "must be a string of text"),
        (lambda: allocate(0.5, "top-p", model=model, tokenizer=tok, calib_text="\0" * 20000), "is not text"),
        (lambda: allocate(0.5, "top-p", model=model, tokenizer=tok, calib_text="  "), "is empty"),
        (lambda: allocate(0.5, "uniform", model=model, refine_memo=[1]), "refine_memo must be"),
        (lambda: allocate(0.5, "uniform", model=model, config=[1]), "must be a AllocateConfig or a dict"),
        (lambda: allocate(0.5, "uniform", model=model, config={"bogus": 1}), "unknown AllocateConfig field(s)"),
        (lambda: allocate(0.5, "uniform", model=model, config={1: 2}), "field names must be strings"),
        (lambda: allocate(0.5, "alloc-t", model=model, config={"k_base": 5}), "above this model's K = 4"),
        (lambda: allocate(0.5, "alloc-t", model=model, config={"k_base": 3}), "1..2, or a larger budget"),
        (lambda: allocate(0.5, "alloc-moe", model=model, profile=None, config={"k_base": 9}), "needs a sensitivity"),
        # AllocateConfig: all eleven fields, strictly typed, in range
        (lambda: AllocateConfig(seq_len="32"), "seq_len (--seq-len) must be a whole number or None"),
        (lambda: AllocateConfig(seq_len=1), "seq_len (--seq-len) must be a whole number >= 2"),
        (lambda: AllocateConfig(windows_per_pass=0), "windows_per_pass (--windows-per-pass) must be a whole number >= 1"),
        (lambda: AllocateConfig(windows_per_pass=True), "windows_per_pass (--windows-per-pass) must be a whole number"),
        (lambda: AllocateConfig(batch_size=2.0), "windows_per_pass (--windows-per-pass) must be a whole number"),
        (lambda: AllocateConfig(calib_tokens=-5), "calib_tokens (--calib-tokens) must be a whole number >= 2"),
        (lambda: AllocateConfig(calib_tokens=nan), "calib_tokens (--calib-tokens) must be a whole number"),
        (lambda: AllocateConfig(k_base=-1), "k_base (--k-base) must be a whole number >= 0"),
        (lambda: AllocateConfig(k_base="2"), "k_base (--k-base) must be a whole number"),
        (lambda: AllocateConfig(pool="tokens"), "pool (--pool) must be 'batch' or 'sequence'"),
        (lambda: AllocateConfig(pool=None), "pool (--pool) must be a string"),
        (lambda: AllocateConfig(lexi_samples=0), "lexi_samples"),
        (lambda: AllocateConfig(lexi_samples=10 ** 12), "above the most allocmoe takes"),
        (lambda: AllocateConfig(seed=-1), "seed"),
        (lambda: AllocateConfig(seed=2 ** 70), "above the most allocmoe takes"),
        (lambda: AllocateConfig(progress="no"), "progress (--quiet) must be true or false"),
        (lambda: AllocateConfig(substitute=1), "substitute (--substitute) must be true or false or None"),
        (lambda: AllocateConfig(refine=-1), "refine (--refine) must be a whole number >= 0"),
        (lambda: AllocateConfig(refine=inf), "refine (--refine) must be a whole number"),
        (lambda: AllocateConfig(substitute_rank=-1), "substitute_rank (--substitute-rank) must be a whole number >= 0"),
        (lambda: AllocateConfig(1, "batch", 8192, None, 4, 512, 0, True, None, None, 8, "skipped", False, 9),
         "takes at most 13"),
        (lambda: AllocateConfig(2, k_base=3), "twice"),
        (lambda: AllocateConfig(bogus=1), "unknown AllocateConfig field(s) ['bogus']"),
        # the other configs
        (lambda: PerplexityConfig(eval_tokens=0), "eval_tokens (--eval-tokens) must be a whole number >= 1"),
        (lambda: PerplexityConfig(windows_per_pass="4"), "windows_per_pass (--windows-per-pass) must be a whole number"),
        (lambda: PerplexityConfig(decode_batch=False), "decode_batch (--decode-batch) must be a whole number"),
        (lambda: ProfileConfig(calib_tokens=1.5), "calib_tokens (--calib-tokens) must be a whole number"),
        (lambda: ProfileConfig(prefix_cache="yes"), "prefix_cache (--no-prefix-cache) must be true or false"),
        (lambda: ProfileConfig(max_memory=2.5), "max_memory (--max-memory) must be"),
        (lambda: DistinctConfig(decode_batch=None), "decode_batch (--decode-batch) must be a whole number"),
        (lambda: DistinctConfig(m_step=0), "m_step (--m-step) must be a whole number >= 1"),
        # static_plan / distinct_plan: one whole number per MoE layer, in range
        (lambda: static_plan(model, [0, 1, 1]), "for MoE layer 1 is 0; give a whole number in 1..4"),
        (lambda: static_plan(model, [5, 1, 1]), "is 5; give a whole number in 1..4"),
        (lambda: static_plan(model, [1, 1]), "has 2 entries but the model has 3 MoE layers"),
        (lambda: static_plan(model, [1, 1, 1, 1]), "has 4 entries"),
        (lambda: static_plan(model, [1.5, 1, 1]), "is 1.5; give a whole number"),
        (lambda: static_plan(model, [2.0, 1, 1]), "is 2.0; give a whole number"),
        (lambda: static_plan(model, [True, 1, 1]), "is True; give a whole number"),
        (lambda: static_plan(model, ["2", 1, 1]), "is '2'; give a whole number"),
        (lambda: static_plan(model, {1: 1, 2: 1}), "names layers [1, 2] but the model's MoE layers are"),
        (lambda: static_plan(model, {0: 1, 1: 1, 2: 1, 7: 1}), "names layers"),
        (lambda: static_plan(model, 2), "must be a list of one whole number per MoE layer"),
        (lambda: static_plan(model, "222"), "must be a list"),
        (lambda: static_plan(None, [1, 1, 1]), "model must be a loaded model"),
        (lambda: static_plan(model, [1, 1, 1], method=None), "method must be a string"),
        (lambda: distinct_plan(model, 0), "give a whole number in 1..8"),
        (lambda: distinct_plan(model, 9), "give a whole number in 1..8"),
        (lambda: distinct_plan(model, 2.5), "must be a list"),
        (lambda: distinct_plan(model, 4, k_floor=5), "k_floor 5 is outside 1..4"),
        (lambda: distinct_plan(model, 4, k_floor=True), "k_floor must be a whole number"),
        # profile_sensitivity: an output it could not write is refused before 35 s of compute
        (lambda: profile_sensitivity(model, tok, text, output=tmp_path), "is a folder; give a file path"),
        (lambda: profile_sensitivity(model, tok, text, output=tmp_path / "f.txt" / "p.json"), "which is a file"),
        (lambda: profile_sensitivity(model, tok, text, output=5), "output must be"),
        (lambda: profile_sensitivity(model, tok, None), "must be a string of text"),
        (lambda: profile_sensitivity(model, tok, "\0" * 20000), "is not text"),
        (lambda: profile_sensitivity(model, None, text), "tokenizer must be the model's tokenizer"),
        (lambda: profile_sensitivity(42, tok, text), "model must be a loaded model"),
        (lambda: profile_sensitivity(None, tok, text), "or a model folder's path"),
        (lambda: allocate(0.5, "uniform"), "neither a model nor a profile was given; pass model="),
        (lambda: profile_sensitivity(model, tok, text, {"windows_per_pass": 0}), "windows_per_pass (--windows-per-pass)"),
        (lambda: profile_sensitivity(model, tok, text, on_cell=3), "on_cell must be a function"),
        # load_model
        (lambda: load_model(123), "model must be a model folder's path"),
        (lambda: load_model(["a"]), "model must be a model folder's path"),
        (lambda: load_model(folder, dtype="float32"), "dtype must be a floating torch dtype"),
        (lambda: load_model(folder, dtype=torch.int64), "dtype must be a floating torch dtype"),
        (lambda: load_model(folder, trust_remote_code="no"), "trust_remote_code must be true or false"),
        # evaluate_perplexity / evaluate_model
        (lambda: evaluate_perplexity(model, None, text), "tokenizer must be the model's tokenizer"),
        (lambda: evaluate_perplexity(model, tok, None), "must be a string of text"),
        (lambda: evaluate_perplexity(model, tok, 5), "must be a string of text"),
        (lambda: evaluate_perplexity(model, tok, "\0\1\2" * 1000), "is not text"),
        (lambda: evaluate_perplexity(None, tok, text), "model must be a loaded model"),
        (lambda: evaluate_perplexity(model, tok, text, windows=[[1, 2]]), "windows must be a [N, S] tensor"),
        (lambda: evaluate_perplexity(model, tok, text, windows=torch.ones(4, 8)), "windows must be a [N, S] tensor"),
        (lambda: evaluate_perplexity(model, tok, text, {"seq_len": "16"}), "seq_len (--seq-len) must be"),
        (lambda: evaluate_model(folder, plan=5, progress=False), "plan must be a Plan"),
        (lambda: evaluate_model(folder, tasks="allocmoe_cloze", progress=False), "tasks must be a list of task names"),
        (lambda: evaluate_model(folder, windows_per_pass=0, progress=False), "windows_per_pass (--windows-per-pass)"),
        (lambda: evaluate_model(folder, max_tokens=-3, progress=False), "eval_tokens (--eval-tokens)"),
        (lambda: evaluate_model(folder, seq_len=1.5, progress=False), "seq_len (--seq-len) must be"),
        (lambda: evaluate_model(folder, trust_remote_code=1, progress=False), "trust_remote_code must be"),
        (lambda: evaluate_model(123, progress=False), "model must be a model folder's path"),
        # distinct
        (lambda: allocate_distinct(None, model=model, tokenizer=tok, calib_text=text), "max_distinct_experts must be"),
        (lambda: allocate_distinct(0.5, profile=[1]), "profile must be the dict distinct_profile returns"),
        (lambda: allocate_distinct(0.5, model=model, tokenizer=tok, calib_text="\0" * 100), "is not text"),
        (lambda: distinct_profile(model, None, text), "tokenizer must be the model's tokenizer"),
        # read_text
        (lambda: read_text(5, "test"), "source must be a text file's path"),
        (lambda: read_text(None, "nope"), "unknown built-in split"),
        # a file's path must be a path: os.stat would read 5 as an open file descriptor
        (lambda: Plan.load(5), "plan file must be a path"),
        (lambda: Plan.load(b"plan.json"), "plan file must be a path"),
        # a plan is data: it is checked against a model's fingerprint, which routing reads off the model
        (lambda: plain.check_model(model), "Plan.check_model takes the model's fingerprint, got"),
        (lambda: allocate(profile=5, budget=0.5), "profile must be a profile"),
        # generate
        (lambda: generate(model, None, "x"), "generate: tokenizer must be the model's tokenizer"),
        (lambda: generate(None, tok, "x"), "generate: model must be a loaded model"),
        (lambda: generate(model, tok, 5), "generate: prompt must be a string or a list of token ids"),
        (lambda: generate(model, tok, "x", stop="ab"), "generate: stop must be a list of strings"),
        (lambda: generate(model, tok, "x", plan=5), "generate: plan must be a Plan"),
        (lambda: generate(model, tok, "x", chat="yes"), "generate: chat must be true or false"),
        (lambda: generate(model, tok, "x", max_new_tokens="5"), "max new tokens must be a whole number"),
        # sweep: its config at the door, and a batch past the test text's windows before the profile
        (lambda: SweepConfig(bogus=1), "unknown SweepConfig field(s) ['bogus']"),
        (lambda: SweepConfig(windows_per_pass=0), "windows_per_pass (--windows-per-pass) must be a whole number >= 1"),
        (lambda: SweepConfig(seq_len="32"), "seq_len (--seq-len) must be a whole number"),
        (lambda: SweepConfig(budgets="0.5"), "budgets (--budgets) must be a tuple of strings"),
        (lambda: sweep(model, tok, text, text, {"methods": ["uniform"], "seq_len": 32, "eval_tokens": 256,
                                                "windows_per_pass": 10**9, "progress": False}),
         "is more than the 8 window(s) of 32 tokens"),
    ]


BAD_CALLS = 138          # rows in the table above: a row dropped by mistake fails the count


@pytest.mark.parametrize("index", range(BAD_CALLS))
def test_a_plain_mistake_in_a_public_call_is_an_allocmoe_error_before_any_work(index, setup, tiny_folder, tmp_path,
                                                                                no_forward):
    _, model = setup
    tok = load_model(tiny_folder)[1]
    calls = _bad_calls(model, tok, tiny_folder, tmp_path)
    assert len(calls) == BAD_CALLS
    call, message = calls[index]
    before = sorted(tmp_path.rglob("*"))
    with pytest.raises(AllocMoeError) as exc:
        call()
    assert message in str(exc.value), str(exc.value)
    assert "; " in str(exc.value) and "\n" not in str(exc.value), str(exc.value)
    assert sorted(tmp_path.rglob("*")) == before


# -- issue 39: the same refusals in Python and on the command line ------------------------------------------
def _model_copy(tiny_folder, root, name, config_edit=None, index=None):
    folder = root / name
    shutil.copytree(tiny_folder, folder)
    if config_edit is not None:
        config = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps({**config, **config_edit}))
    if index is not None:
        (folder / "model.safetensors").rename(folder / "model-00001-of-00001.safetensors")
        (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": index}))
    return folder


@pytest.mark.parametrize("edit, message", [({"num_experts_per_tok": 0}, "num_experts_per_tok = 0 is outside 1..8"),
                                           ({"num_experts_per_tok": 1000}, "num_experts_per_tok = 1000 is outside 1..8"),
                                           ({"num_experts_per_tok": 2.5}, "num_experts_per_tok = 2.5 is outside"),
                                           ({"num_experts_per_tok": True}, "num_experts_per_tok = True is outside")])
def test_a_config_whose_top_k_cannot_route_reads_the_same(edit, message, tiny_folder, tmp_path, capsys, no_forward):
    folder = _model_copy(tiny_folder, tmp_path, "m_topk", edit)
    api = api_message(lambda: load_model(folder))
    assert message in api and "restore the model's config.json" in api
    assert api == cli_line(["eval", "--model", str(folder)], capsys)


@pytest.mark.parametrize("entry", ["../plan.json", "/etc/hostname", "sub/../../x.safetensors", "."])
def test_an_index_naming_a_file_outside_the_model_folder_is_refused_before_reading_it(entry, tiny_folder, tmp_path,
                                                                                      capsys, no_forward):
    (tmp_path / "plan.json").write_text("{}")
    folder = _model_copy(tiny_folder, tmp_path, "m_escape", index={"lm_head.weight": entry,
                                                                   "model.embed_tokens.weight":
                                                                       "model-00001-of-00001.safetensors"})
    api = api_message(lambda: load_model(folder))
    assert "names weight files outside the model folder" in api and repr(entry) in api
    assert api == cli_line(["eval", "--model", str(folder)], capsys)


def test_an_index_inside_the_folder_still_loads(tiny_folder, tmp_path):
    from safetensors import safe_open

    with safe_open(str(tiny_folder / "model.safetensors"), "pt") as weights:
        names = list(weights.keys())
    folder = _model_copy(tiny_folder, tmp_path, "m_sharded",
                         index={name: "model-00001-of-00001.safetensors" for name in names})
    model, _ = load_model(folder)
    assert model is not None


def test_text_that_is_not_text_reads_the_same(tiny_folder, tmp_path, capsys, no_forward):
    for name, body in (("nul.txt", "\0" * 20000), ("binary.txt", "ab\x01\x02\x03" * 1000)):
        path = tmp_path / name
        path.write_text(body)
        api = api_message(lambda: evaluate_model(tiny_folder, text=path, progress=False))
        assert "is not text" in api
        assert api == cli_line(["eval", "--model", str(tiny_folder), "--text", str(path)], capsys)
        assert api == cli_line(["profile", "--model", str(tiny_folder), "--calib-text", str(path), "--output",
                                str(tmp_path / "p.json")], capsys)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["binary.txt", "nul.txt"]


def test_a_k_base_the_plan_could_not_keep_reads_the_same(setup, tiny_folder, tmp_path, capsys, no_forward):
    _, model = setup
    for k_base, said in ((3, "above the 2 expert(s) per token each MoE layer gets at budget 0.5"),
                         (5, "above this model's K = 4")):
        api = api_message(lambda: allocate("0.5", "alloc-t", model=model, config={"k_base": k_base}))
        assert said in api
        assert api == cli_line(["allocate", "--model", str(tiny_folder), "--budget", "0.5", "--method", "alloc-t",
                                "--k-base", str(k_base), "--output", str(tmp_path / "p.json")], capsys)
    plan = allocate("0.5", "alloc-t", model=model, config={"k_base": 2})
    assert plan.provenance["details"]["k_base"] == 2 and {p.k_base for p in plan.layers.values()} == {2}


def test_sizes_past_the_text_read_the_same(setup, tiny_folder, tmp_path, capsys, no_forward):
    from allocmoe import profile_sensitivity
    from allocmoe.texts import read_text

    _, model = setup
    tok = load_model(tiny_folder)[1]
    text, _ = read_text(None, "calibration")
    api = api_message(lambda: evaluate_model(tiny_folder, windows_per_pass=10 ** 9, progress=False))
    assert "is more than the" in api and "window(s)" in api
    assert api == cli_line(["eval", "--model", str(tiny_folder), "--windows-per-pass", str(10 ** 9)], capsys)
    api = api_message(lambda: evaluate_model(tiny_folder, eval_tokens=10 ** 11, progress=False))
    assert "tokens the text has" in api
    assert api == cli_line(["eval", "--model", str(tiny_folder), "--eval-tokens", str(10 ** 11)], capsys)
    api = api_message(lambda: profile_sensitivity(model, tok, text, {"calib_tokens": 10 ** 11, "progress": False}))
    assert api == cli_line(["profile", "--model", str(tiny_folder), "--calib-tokens", str(10 ** 11), "--output",
                            str(tmp_path / "p.json")], capsys)
    api = api_message(lambda: profile_sensitivity(model, tok, text, {"windows_per_pass": 10 ** 9, "progress": False}))
    assert api == cli_line(["profile", "--model", str(tiny_folder), "--windows-per-pass", str(10 ** 9), "--output",
                            str(tmp_path / "p.json")], capsys)
    api = api_message(lambda: allocate(None, "uniform", model=model, tokenizer=tok, calib_text=text,
                                       target_ppl="1e308"))
    assert "times the perplexity of guessing uniformly" in api
    assert api == cli_line(["allocate", "--model", str(tiny_folder), "--target-ppl", "1e308", "--method", "uniform",
                            "--output", str(tmp_path / "p.json")], capsys)
    assert not list(tmp_path.iterdir())
