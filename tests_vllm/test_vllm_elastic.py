"""The elastic budget in vLLM (ALLOCMOE_LATENCY_TARGET_MS, issue 38 item 2) on vLLM CPU 0.32.0.

One vLLM engine, in this test's subprocess, serves two waves: one request alone, then 16 at once
(one with a floor, one opted out, one naming a plan) whose lengths differ, so the steps shrink from
16 requests to 1. The plugin's clock is moved only by the model's forward passes (`vllm_run.py
--cost-clock`): a step costs FIXED plus PER_TOKEN x each token's plan budget / full, so every
assertion is on the plugin's own measured and predicted times, never on the wall clock. Under that
cost the full model meets T up to 10 requests a decode step, 3/4 of the budget up to 14, 1/2 up to 21.

Checked against independent expectations: each request replayed alone by allocmoe's own engine
(transformers) with the plan sequence the plugin recorded gives vLLM's tokens; the activations and
tokens the plugin's MoE layers counted per plan equal what the recorded sequences imply; the summed
measured step times equal the cost model over those tokens; eager and torch.compile runs agree.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import tiny_models  # noqa: E402
from test_vllm_plugin import PROMPTS, run_vllm  # noqa: E402

FIXED, PER_TOKEN, TARGET_MS = 0.010, 0.002, 31
BUDGETS = {"default": 4, "b3": 3, "b2": 2}          # activations per token; full = 2 layers x top-2
FLOOR, OPTED_OUT, NAMED = 3, 4, 5                   # request indices (wave 1)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from allocmoe import allocate, load_model

    folder = tiny_models.build("qwen3_moe", tmp_path_factory.mktemp("elastic") / "model")
    model, tok = load_model(folder)
    files = {name: folder.parent / f"{name}.json" for name in BUDGETS}
    allocate(1.0, "uniform", model=model).save(files["default"])     # the full model, for the replay
    allocate(3, "ascending", model=model).save(files["b3"])          # k 1 in layer 0, 2 in layer 1
    allocate(2, "uniform", model=model).save(files["b2"])            # k 1 in both
    prompts = [tok(p)["input_ids"] for p in PROMPTS]
    requests = [{"prompt_ids": prompts[0], "max_tokens": 12, "wave": 0}]
    requests += [{"prompt_ids": prompts[i % 3], "max_tokens": 6 + i // 2, "wave": 1} for i in range(16)]
    requests[FLOOR]["extra"] = {"allocmoe_min_budget": 0.75}
    requests[OPTED_OUT]["extra"] = {"allocmoe_elastic": False}
    requests[NAMED]["plan"] = "b2"
    return folder, model, tok, files, requests


def elastic_run(setup, tmp_path, compile: bool, **env):
    folder, _, _, files, requests = setup
    return run_vllm(folder, requests, tmp_path, compile=compile, args=("--cost-clock", f"{FIXED},{PER_TOKEN}"),
                    ALLOCMOE_PLANS=f"b3={files['b3']},b2={files['b2']}", ALLOCMOE_LATENCY_TARGET_MS=TARGET_MS,
                    ALLOCMOE_RECORD_PLANS=1, ALLOCMOE_STATS=1, **env)


@pytest.fixture(scope="module")
def runs(setup, tmp_path_factory):
    """(eager, compiled) results, each with "records": the recorded plans in the requests' order."""
    out = []
    for compile in (False, True):
        result = elastic_run(setup, tmp_path_factory.mktemp("run"), compile)
        by_id = {rid.rsplit("-", 1)[0]: runs for rid, runs in result["elastic"]["plans"].items()}
        result["records"] = [by_id[rid] for rid in result["request_ids"]]     # vLLM's id + "-" + 8 characters
        out.append(result)
    return out


def cost(tokens: int, plan: str) -> float:
    return PER_TOKEN * tokens * BUDGETS[plan] / BUDGETS["default"]


def test_at_low_load_the_request_alone_runs_full_and_under_load_steps_switch_by_size(runs, setup):
    eager = runs[0]
    steps = eager["elastic"]["steps"]    # [tokens, requests, rung, predicted, per output token, pass, learnt]
    assert eager["records"][0] == [["default", 12]]       # alone: every step at the full model
    alone, busy = steps[:12], steps[12:]
    assert [s[2] for s in alone] == [0] * 12 and all(s[4] <= TARGET_MS / 1000 for s in alone)
    assert busy[0][:2] == [sum(len(r["prompt_ids"]) for r in setup[4][1:]), 16]   # every prompt in one step
    rung_by_tokens = [(s[0], s[2]) for s in busy]
    # a step whose full-model cost misses T never ran its elastic requests at full; as the batch shrank to
    # 1 and 2 tokens a step, they went back to full (the full model is measured at 1 token only, so the
    # controller, which never steps up on a guess, predicts it in proportion to the tokens: 24 ms at 2)
    assert all(rung >= 1 for tokens, rung in rung_by_tokens if tokens >= 11), rung_by_tokens
    assert all(rung == 0 for tokens, rung in rung_by_tokens if tokens <= 2), rung_by_tokens
    assert {rung for _, rung in rung_by_tokens} == {0, 1, 2}
    assert not any(s[6] for s in steps if s[0] != s[1])       # a step with prompt tokens is not a cell's time
    # decode steps (one token per request) the controller predicted within T measured within T
    decode = [s for s in busy if s[0] == s[1] and s[3] is not None and s[3] <= TARGET_MS / 1000]
    assert len(decode) >= 8 and all(s[4] <= TARGET_MS / 1000 + 1e-9 for s in decode), decode
    # the elastic requests got less than full on average, the one alone the full model
    elastic = [i for i in range(1, 17) if i not in (FLOOR, OPTED_OUT, NAMED)]
    spent = [sum(BUDGETS[p] * n for p, n in eager["records"][i]) / sum(n for _, n in eager["records"][i])
             for i in elastic]
    assert sum(spent) / len(spent) < 3.5


def test_named_plans_opt_outs_and_floors_are_kept(runs, setup):
    records = runs[0]["records"]
    requests = setup[4]
    assert records[NAMED] == [["b2", requests[NAMED]["max_tokens"]]]
    assert records[OPTED_OUT] == [["default", requests[OPTED_OUT]["max_tokens"]]]
    assert {p for p, _ in records[FLOOR]} <= {"default", "b3"} and "b3" in {p for p, _ in records[FLOOR]}
    for request, record in zip(requests, records):
        assert sum(n for _, n in record) == request["max_tokens"]      # one plan per step that gave a token


def test_the_plugins_counts_and_measured_times_equal_the_recorded_plans(runs, setup):
    requests = setup[4]
    for result in runs:
        tokens = dict.fromkeys(BUDGETS, 0)
        for request, record in zip(requests, result["records"]):
            for j, (plan, n) in enumerate(record):         # the first step holds the prompt, then one a step
                tokens[plan] += n + (len(request["prompt_ids"]) - 1 if j == 0 else 0)
        counted = result["stats"]["plans"]
        assert {p: counted[p]["tokens"] for p in BUDGETS} == tokens
        assert {p: counted[p]["activations"] for p in BUDGETS} == {p: tokens[p] * BUDGETS[p] for p in BUDGETS}
        steps = result["elastic"]["steps"]
        assert sum(s[0] for s in steps) == sum(tokens.values())        # every step measured
        expected = len(steps) * FIXED + sum(cost(tokens[p], p) for p in BUDGETS)
        assert sum(s[5] for s in steps) == pytest.approx(expected, rel=1e-9)


def test_each_request_replayed_alone_with_its_recorded_plans_gives_vllms_tokens(runs, setup):
    from allocmoe.routing.layout import load_plan
    from allocmoe.serve.elastic import replay
    from allocmoe.serve.sampling import SamplingParams

    folder, model, tok, files, requests = setup
    eager = runs[0]
    plans = {name: load_plan(files[name], model) for name in BUDGETS}
    three = [i for i, r in enumerate(eager["records"]) if len(r) >= 3]
    two = [i for i, r in enumerate(eager["records"]) if len(r) == 2]
    assert len(three) >= 2 and two, eager["records"]          # requests that ran under three plans, two
    teeth = 0
    for i in three[:2] + two[:1] + [FLOOR]:
        params = SamplingParams(max_new_tokens=requests[i]["max_tokens"], temperature=0, ignore_eos=True)
        alone = replay(model, tok, requests[i]["prompt_ids"], plans, eager["records"][i], params)
        assert alone.generated == eager["outputs"][i], (i, eager["records"][i])
        full = replay(model, tok, requests[i]["prompt_ids"], plans, [["default", requests[i]["max_tokens"]]], params)
        teeth += full.generated != alone.generated
    assert teeth >= 1, "no replayed request differs from the full model: the check could not tell the plans apart"


def test_eager_and_compiled_runs_choose_the_same_plans(runs):
    eager, compiled = runs
    assert compiled["records"] == eager["records"]
    assert [s[:3] for s in compiled["elastic"]["steps"]] == [s[:3] for s in eager["elastic"]["steps"]]
    assert compiled["outputs"] == eager["outputs"]


def test_a_bad_elastic_setting_stops_vllm_in_one_line_before_loading(setup, tmp_path):
    folder, _, _, files, _ = setup
    requests = [{"prompt_ids": [1, 2, 3], "max_tokens": 2}]
    plans = f"b3={files['b3']},b2={files['b2']}"
    for env, said in (({"ALLOCMOE_LATENCY_TARGET_MS": "fast"}, "must be a number of milliseconds above 0"),
                      ({"ALLOCMOE_LATENCY_TARGET_MS": "50", "ALLOCMOE_LADDER": "b3,nope"}, "not in ALLOCMOE_PLANS")):
        proc = run_vllm(folder, requests, tmp_path, expect_failure=True, ALLOCMOE_PLANS=plans, **env)
        last = [line for line in proc.stderr.splitlines() if line.strip()][-1]
        assert last.startswith("allocmoe vLLM plugin: ") and said in last, proc.stderr[-2000:]
        assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
        assert "Loading weights" not in proc.stdout + proc.stderr
