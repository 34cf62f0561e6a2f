"""Is one plan's task accuracy really higher than another's? A paired comparison on the same items.

Two plans of one model scored on the same items agree on most of them, so the difference of their
accuracies is known far more precisely than either accuracy: its standard error is that of the
per-item differences, stdev(a_i - b_i) / sqrt(n), not sqrt(se_a^2 + se_b^2). Reads the per-item
scores that `allocmoe eval --tasks ... --output` writes under "task_items".

Across tasks, the items are also pooled into one paired difference, each item weighing the same
(lm-eval's size-weighted group mean): more items, so a smaller error than any one task's.
"""

from __future__ import annotations

import math

from ...errors import AllocMoeError


def paired_difference(a: list[float], b: list[float]) -> dict[str, float]:
    """Mean of a - b over paired items, its standard error, and how many items each alone got."""
    if len(a) != len(b) or not a:
        raise AllocMoeError(f"paired scores need the same non-zero number of items (got {len(a)} and {len(b)}); evaluate both on the same tasks and --limit")
    n = len(a)
    diffs = [x - y for x, y in zip(a, b)]                  # per item: +1, 0 or -1 for 0/1 scores
    mean = sum(diffs) / n
    stderr = math.sqrt(sum((d - mean) ** 2 for d in diffs) / (n - 1) / n) if n > 1 else None
    return {"items": n, "a": sum(a) / n, "b": sum(b) / n, "difference": mean, "stderr": stderr,
            "z": mean / stderr if stderr else None,             # None: one item, or every item alike
            "a_only": sum(d > 0 for d in diffs), "b_only": sum(d < 0 for d in diffs)}


def compare_results(a: dict, b: dict, metric: str = "acc", names: tuple[str, str] = ("A", "B")) -> dict:
    """{"tasks": {task: paired_difference}, "pooled": paired_difference over all their items, or None
    for a single task} for every task both `allocmoe eval` results scored."""
    items = []
    for result, name in zip((a, b), names):
        if not isinstance(result, dict) or not isinstance(result.get("task_items"), dict):
            raise AllocMoeError(f"{name} has no per-item task scores; make it with "
                                "`allocmoe eval --tasks ... --output FILE`")
        items.append(result["task_items"])
    tasks = sorted(set(items[0]) & set(items[1]))
    if not tasks:
        raise AllocMoeError(f"{names[0]} and {names[1]} share no task; evaluate both on the same --tasks")
    out, pooled = {}, ([], [])
    for task in tasks:
        x, y = items[0][task], items[1][task]
        if x.get("items_digest") != y.get("items_digest"):
            raise AllocMoeError(f"{task} was scored on different items in {names[0]} and {names[1]} "
                                "(another --limit, --num-fewshot or task version); evaluate both alike")
        if metric in x and metric in y:                  # e.g. open-vocabulary tasks have no acc_norm
            out[task] = paired_difference(x[metric], y[metric])
            pooled[0].extend(x[metric])
            pooled[1].extend(y[metric])
    if not out:
        raise AllocMoeError(f"no shared task has per-item {metric!r} ({', '.join(tasks)}); try --metric acc")
    return {"tasks": out, "pooled": paired_difference(*pooled) if len(out) > 1 else None}


def markdown(comparison: dict, names: tuple[str, str], metric: str = "acc") -> str:
    a, b = names
    lines = [f"| task | items | {metric}: {a} | {metric}: {b} | difference | paired std. error | z "
             f"| right only in {a} | right only in {b} |", "|---|---|---|---|---|---|---|---|---|"]
    def fmt(value, spec):
        return "n/a" if value is None else format(value, spec)

    rows = list(comparison["tasks"].items())
    if comparison["pooled"]:
        rows.append(("all items, pooled", comparison["pooled"]))
    for task, r in rows:
        lines.append(f"| {task} | {r['items']} | {r['a']:.3f} | {r['b']:.3f} | {r['difference']:+.3f} "
                     f"| {fmt(r['stderr'], '.3f')} | {fmt(r['z'], '+.1f')} | {r['a_only']} | {r['b_only']} |")
    return "\n".join(lines)
