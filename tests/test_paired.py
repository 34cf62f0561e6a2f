"""Paired task comparison: the arithmetic against a hand-computed case, and its refusals."""

import math
import statistics

import pytest

from allocmoe.errors import AllocMoeError
from allocmoe.measure.evaluate.paired import compare_results, markdown, paired_difference


def test_paired_difference_matches_a_hand_computed_case():
    a, b = [1, 1, 0, 0, 1], [1, 0, 0, 1, 0]
    r = paired_difference(a, b)
    # differences 0, +1, 0, -1, +1: mean 0.2, sample variance 2.8 / 4 = 0.7, error sqrt(0.7 / 5)
    assert r["difference"] == pytest.approx(0.2)
    assert r["stderr"] == pytest.approx(math.sqrt(0.14))
    assert r["stderr"] == pytest.approx(statistics.stdev([0, 1, 0, -1, 1]) / math.sqrt(5))
    assert (r["a"], r["b"], r["a_only"], r["b_only"], r["items"]) == (0.6, 0.4, 2, 1, 5)
    assert r["z"] == pytest.approx(0.2 / math.sqrt(0.14))


def test_items_scored_alike_have_no_z_and_the_table_says_so():
    r = paired_difference([1, 0, 1], [1, 0, 1])
    assert r["difference"] == 0 and r["stderr"] == 0 and r["z"] is None
    assert "n/a" in markdown({"tasks": {"t": r}, "pooled": None}, ("x.json", "y.json"))


def _result(digest="d1", acc=(1.0, 0.0, 1.0)):
    return {"task_items": {"t": {"acc": list(acc), "items_digest": digest}}}


def test_compare_refuses_results_it_cannot_pair():
    with pytest.raises(AllocMoeError, match="no per-item task scores"):
        compare_results({"tasks": {}}, _result())
    with pytest.raises(AllocMoeError, match="different items"):
        compare_results(_result("d1"), _result("d2"))
    with pytest.raises(AllocMoeError, match="share no task"):
        compare_results(_result(), {"task_items": {"other": {"acc": [1.0], "items_digest": "d1"}}})
    with pytest.raises(AllocMoeError, match="no shared task has per-item 'acc_norm'"):
        compare_results(_result(), _result(), metric="acc_norm")
    with pytest.raises(AllocMoeError, match="same non-zero number"):
        compare_results(_result(acc=(1.0,)), _result(acc=(1.0, 0.0)))


def test_tasks_without_the_metric_are_left_out_not_fatal():
    a, b = _result(), _result(acc=(0.0, 0.0, 1.0))
    for result in (a, b):
        result["task_items"]["u"] = {"acc": [1.0, 1.0], "acc_norm": [1.0, 0.0], "items_digest": "d9"}
    only_u = compare_results(a, b, metric="acc_norm")
    assert list(only_u["tasks"]) == ["u"] and only_u["pooled"] is None      # one task: nothing to pool
    both = compare_results(a, b)
    assert list(both["tasks"]) == ["t", "u"]
    assert both["tasks"]["t"]["difference"] == pytest.approx(1 / 3)


def test_pooled_row_weighs_every_item_alike():
    a, b = _result(acc=(1.0, 0.0, 1.0)), _result(acc=(0.0, 0.0, 1.0))
    a["task_items"]["u"] = {"acc": [0.0], "items_digest": "d9"}
    b["task_items"]["u"] = {"acc": [1.0], "items_digest": "d9"}
    pooled = compare_results(a, b)["pooled"]
    # items' differences +1, 0, 0 (task t) and -1 (task u): mean 0, not the tasks' mean (1/3 - 1) / 2
    assert (pooled["items"], pooled["difference"], pooled["a_only"], pooled["b_only"]) == (4, 0.0, 1, 1)
    assert pooled["stderr"] == pytest.approx(statistics.stdev([1, 0, 0, -1]) / 2)
    assert "| all items, pooled | 4 |" in markdown(compare_results(a, b), ("x", "y"))
