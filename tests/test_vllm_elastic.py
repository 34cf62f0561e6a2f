"""The vLLM plugin's elastic budget without vLLM (integrations/vllm_elastic.py): the ladder it builds
from ALLOCMOE_PLANS / ALLOCMOE_LADDER, the settings it refuses, each request's plan in a step (named
plans kept, opt-outs at the top, floors), the measured step under a clock only the test moves, and the
recorded plans. tests_vllm/test_vllm_elastic.py runs the same in real vLLM."""

from __future__ import annotations

import pytest

from allocmoe.core.plan import Plan
from allocmoe.core.policies import StaticTopK
from allocmoe.errors import AllocMoeError
from allocmoe.integrations import vllm_elastic
from allocmoe.integrations.vllm_elastic import VllmElastic, make_rungs, parse_target, request_floor
from allocmoe.integrations.vllm_plugin import PluginConfig

MODEL = {"model_type": "qwen3_moe", "num_experts": 8, "k_orig": 2, "num_moe_layers": 2, "moe_layers": [0, 1]}


def plan(k0: int, k1: int) -> Plan:
    return Plan(model=dict(MODEL), layers={0: StaticTopK(k0), 1: StaticTopK(k1)}, method="uniform", budget=k0 + k1)


NAMES = ["default", "b2", "b3", "wide"]
PLANS = [None, plan(1, 1), plan(1, 2), plan(2, 2)]        # the full model, 2, 3 and 4 activations per token


def test_the_ladder_is_the_top_then_the_named_plans_below_it_by_budget():
    rungs = make_rungs(NAMES[:3], PLANS[:3], None)
    assert [(r.index, r.name, r.activations) for r in rungs] == [(0, "default", 4.0), (2, "b3", 3.0), (1, "b2", 2.0)]
    assert [r.name for r in make_rungs(NAMES, PLANS, ["b2"])] == ["default", "b2"]
    # ALLOCMOE_PLAN as the top: the ladder's plans must spend less than it
    assert [r.name for r in make_rungs(["default", "b2"], [plan(1, 2), plan(1, 1)], None)] == ["default", "b2"]


def test_the_default_ladder_leaves_out_plans_that_do_not_spend_less_than_the_top():
    assert [r.name for r in make_rungs(NAMES, PLANS, None)] == ["default", "b3", "b2"]     # "wide" is full


@pytest.mark.parametrize("ladder, said", [
    (["b3", "wide"], "names wide, which spend as much as the top"),
    (["b3", "nope"], "names 'nope', not in ALLOCMOE_PLANS"),
    (["b3", "b3"], "names a plan twice"),
])
def test_a_ladder_that_cannot_step_down_is_refused(ladder, said):
    with pytest.raises(AllocMoeError, match=said):
        make_rungs(NAMES, PLANS, ladder)
    with pytest.raises(AllocMoeError, match="needs a ladder of plans below the top"):
        make_rungs(["default", "wide"], [None, plan(2, 2)], None)


@pytest.mark.parametrize("env, said", [
    ({"ALLOCMOE_LATENCY_TARGET_MS": "fast"}, "must be a number of milliseconds above 0"),
    ({"ALLOCMOE_LATENCY_TARGET_MS": "0"}, "must be a number of milliseconds above 0"),
    ({"ALLOCMOE_LATENCY_TARGET_MS": "-5"}, "must be a number of milliseconds above 0"),
    ({"ALLOCMOE_LATENCY_TARGET_MS": "inf"}, "must be a number of milliseconds above 0"),
    ({"ALLOCMOE_LATENCY_TARGET_MS": "50"}, "needs a ladder of plans"),
    ({"ALLOCMOE_LADDER": "b2"}, "set that too"),
])
def test_bad_settings_are_refused_in_one_line(env, said):
    with pytest.raises(AllocMoeError, match=said) as info:
        PluginConfig.from_env(env)
    assert "\n" not in str(info.value)


def test_the_settings_read(tmp_path):
    path = tmp_path / "b2.json"
    plan(1, 1).save(path)
    config = PluginConfig.from_env({"ALLOCMOE_PLANS": f"b2={path}", "ALLOCMOE_LATENCY_TARGET_MS": "40",
                                    "ALLOCMOE_LADDER": "b2", "ALLOCMOE_RECORD_PLANS": "1"})
    assert (config.target, config.ladder, config.record) == (pytest.approx(0.040), ["b2"], True)
    assert parse_target(" 12.5") == pytest.approx(0.0125)


def test_request_floors_and_what_they_may_not_go_with():
    assert request_floor(None, PLANS, False) is None
    assert request_floor({"allocmoe_min_budget": 0.75}, PLANS, False) == 3
    assert request_floor({"allocmoe_min_budget": "1/2"}, PLANS, False) == 2
    assert request_floor({"allocmoe_min_budget": 0.5, "allocmoe_elastic": 1}, PLANS, False) == 2
    for args, named, said in (({"allocmoe_min_budget": 0.5}, True, "names a plan"),
                              ({"allocmoe_min_budget": 0.5, "allocmoe_elastic": False}, False, "only to elastic"),
                              ({"allocmoe_min_budget": True}, False, "must be a number"),
                              ({"allocmoe_min_budget": 9}, False, "above the full budget"),
                              ({"allocmoe_elastic": "no"}, False, "true or false"),
                              ({"allocmoe_elastic": 2}, False, "true or false"),
                              ({"allocmoe_min_budget": 0.5, "allocmoe_elastic": 0}, False, "only to elastic"),
                              ({"allocmoe_min_budget": 0.5, "allocmoe_elastic": "false"}, False, "only to elastic")):
        with pytest.raises(AllocMoeError, match=said):
            request_floor(args, PLANS, named)


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_each_request_gets_its_plan_and_each_step_is_measured_and_recorded(monkeypatch):
    clock = Clock()
    monkeypatch.setattr(vllm_elastic, "clock", clock)
    elastic = VllmElastic(make_rungs(NAMES[:3], PLANS[:3], None), 0.030, NAMES[:3], PLANS[:3], record=True)

    def step(rows, seconds, gap=0.0):
        clock.now += gap
        elastic.begin()
        chosen = elastic.choose(rows)
        clock.now += seconds
        elastic.end()
        return chosen

    assert step([("a", 7, None, None)], 0.020) == [0]             # nothing measured: full
    assert elastic.steps[-1] == [7, 1, 0, None, 0.020, 0.020, False]   # a prompt's step: not a cell's time
    assert step([("a", 1, None, None)], 0.012, gap=0.004) == [0]
    assert elastic.steps[-1] == [1, 1, 0, None, pytest.approx(0.012), pytest.approx(0.012), False]   # the rung's first decode step: not learnt
    assert step([("a", 1, None, None)], 0.012, gap=0.004) == [0]
    assert elastic.steps[-1] == [1, 1, 0, None, pytest.approx(0.016), pytest.approx(0.012), True]   # from the last decode's end
    assert elastic.overhead[0] > 0                                 # the 4 ms wait is learnt apart from the pass
    # 4 requests: full, measured at 1 only, is predicted in proportion (48 ms > T); the rung below
    rows = [("a", 1, None, None), ("b", 1, {"allocmoe_elastic": 0}, None), ("c", 1, None, 1),   # 0: vllm_xargs' false
            ("d", 1, {"allocmoe_min_budget": 0.75}, None)]
    assert step(rows, 0.050) == [2, 0, 1, 2]                      # elastic at b3; opt-out full; named b2
    assert elastic.steps[-1][:3] == [4, 4, 1] and elastic.steps[-1][6] is False
    assert step(rows, 0.050) == [2, 0, 1, 2] and elastic.steps[-1][6] is True   # b3 measured: 50 ms > T
    # now b2 is tried, but not below a floor: "d" stays at b3
    assert step(rows, 0.040) == [1, 0, 1, 2]
    # no elastic row, every row at one ladder plan: still measured, at that rung
    assert step([("c", 1, None, 1)], 0.010) == [1]
    assert elastic.steps[-1][:3] == [1, 1, 2]
    # a mix of plans with no elastic row teaches nothing
    n = len(elastic.steps)
    step([("c", 1, None, 1), ("b", 1, {"allocmoe_elastic": False}, None)], 0.010)
    assert len(elastic.steps) == n
    # a step carrying prompt tokens is decided by its requests (1: full) and not learnt
    assert step([("e", 9, None, None)], 0.030) == [0] and elastic.steps[-1][6] is False
    report = elastic.report()
    assert report["plans"] == {"a": [["default", 3], ["b3", 2], ["b2", 1]], "b": [["default", 4]],
                               "c": [["b2", 5]], "d": [["b3", 3]], "e": [["default", 1]]}
    assert report["rungs"] == [["default", 4.0], ["b3", 3.0], ["b2", 2.0]]
