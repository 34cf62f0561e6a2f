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
