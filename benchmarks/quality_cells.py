"""The quality comparison: every method at every default budget, on five model families.

Runs `allocmoe sweep` (all methods, budgets 1/3, 1/2, 2/3, 5/6 of the total cost; profile and every
choice on calibration text, perplexity on test text) on
  builtin     the built-in model (DeepSeek-V2 style: shared experts, no top-k renormalisation)
  qwen3_moe   examples/models/qwen3_moe (renormalised top-k, norm_topk_prob=true)
  olmoe       examples/models/olmoe (no renormalisation)
these three on the built-in calibration and test splits (Brown + KJV), which allocmoe was developed on;
  granitemoe  examples/models/granitemoe (top-k logits, then a softmax over the k)
  mixtral     examples/models/mixtral (softmax, top-k, renormalised)
these two trained on another text, the Debian fortunes (scripts/fortunes.py), and scored on its
held-out calibration and test parts (examples/texts/fortunes/); allocmoe was not tuned on either
(issue 37: they are touched only to evaluate). Then it prints, per cell, the share of uniform top-k's perplexity increase each method keeps,
(ppl - ppl_full) / (ppl_uniform - ppl_full), and which method won. A model whose sweep folder
already holds results.json is not rerun (delete the folder to rerun it).

`--methods auto,uniform --others docs/quality/cells.json` reruns only those methods (after a change
to `auto` alone, say) and takes every other method's test perplexity from an earlier run's cells, as
they were measured there (the JSON records which came from where).

    python benchmarks/quality_cells.py [--models builtin,qwen3_moe,olmoe] [--root runs/quality]
           [--methods auto,uniform --others docs/quality/cells.json] [--output docs/quality/cells.json]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

import allocmoe
from machine import cpu_name

ROOT = Path(__file__).resolve().parents[1]
MODELS = {"builtin": None, "qwen3_moe": ROOT / "examples" / "models" / "qwen3_moe",
          "olmoe": ROOT / "examples" / "models" / "olmoe", "granitemoe": ROOT / "examples" / "models" / "granitemoe",
          "mixtral": ROOT / "examples" / "models" / "mixtral"}
FORTUNES = ROOT / "examples" / "texts" / "fortunes"
# (calibration, test) text files per model; None: the built-in splits
TEXTS = {"granitemoe": (FORTUNES / "calibration.txt", FORTUNES / "test.txt"),
         "mixtral": (FORTUNES / "calibration.txt", FORTUNES / "test.txt")}
DEFAULT = "auto"          # the default method of `allocmoe allocate`
THRESHOLD = ("top-p", "naee")   # match the budget only on average over calibration text


def run_sweep(name: str, folder: Path, threads: int, methods: list[str] | None = None) -> dict:
    done = folder / "results.json"
    if done.exists():
        return json.loads(done.read_text())
    torch.set_num_threads(threads)
    model, tok = allocmoe.load_model(MODELS[name])
    calib_file, test_file = TEXTS.get(name, (None, None))
    calib, _ = allocmoe.read_text(calib_file, "calibration")
    test, _ = allocmoe.read_text(test_file, "test")
    return allocmoe.sweep(model, tok, calib, test, {"progress": True, **({"methods": methods} if methods else {})},
                          output_dir=folder)


def cells(results: dict, others: list[dict] | None = None) -> list[dict]:
    """Per budget: each method's test perplexity, its share of uniform's increase, the winner; methods this
    run did not score are taken from `others` (an earlier run's cells of the same model), where given."""
    full = results["full"]["perplexity"]
    by_budget: dict[float, dict[str, float]] = {}
    for row in results["rows"]:
        by_budget.setdefault(row["budget"], {})[row["method"]] = row["perplexity"]
    earlier = {round(c["budget"], 6): c for c in others or []}
    out = []
    for budget, ppl in sorted(by_budget.items()):
        taken = {}
        if others is not None:
            before = earlier[round(budget, 6)]
            if abs(before["full"] - full) > 1e-6 * full or abs(before["uniform"] - ppl["uniform"]) > 1e-6 * full:
                raise SystemExit(f"the earlier cells' full model or uniform ({before['full']:.4f}, {before['uniform']:.4f}) "
                                 f"differ from this run's ({full:.4f}, {ppl['uniform']:.4f}): not the same setting")
            taken = {m: p for m, p in before["perplexity"].items() if m not in ppl}
            ppl = {**ppl, **taken}
        uniform = ppl["uniform"]
        share = {m: (p - full) / (uniform - full) for m, p in ppl.items()}
        winner = min(ppl, key=ppl.get)
        out.append({"budget": budget, "full": full, "uniform": uniform, "perplexity": ppl, "share": share,
                    "winner": winner, "default_wins": ppl[DEFAULT] <= min(ppl.values()),
                    **({"from_earlier_run": sorted(taken)} if taken else {})})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--root", type=Path, default=ROOT / "runs" / "quality", help="sweep folders go here")
    parser.add_argument("--threads", type=int, default=2, help="torch threads for the sweeps")
    parser.add_argument("--output", type=Path, default=None, help="also write the cells as JSON")
    parser.add_argument("--methods", default=None, help="run only these methods (default: all ten)")
    parser.add_argument("--others", type=Path, default=None, help="an earlier run's cells JSON: the methods not "
                        "run here are taken from it")
    args = parser.parse_args()
    summary = {"machine": cpu_name(), "models": {}}
    earlier = json.loads(args.others.read_text())["models"] if args.others else None
    if args.others:
        summary["others_from"] = str(args.others)
    for name in args.models.split(","):
        started = time.time()
        results = run_sweep(name, args.root / name, args.threads, args.methods.split(",") if args.methods else None)
        rows = cells(results, earlier[name]["cells"] if earlier else None)
        summary["models"][name] = {"cells": rows, "calibration_tokens": results["calibration"].get("tokens_scored"),
                                   "test_tokens": results["evaluation"]["tokens"],
                                   "sweep_seconds": results.get("seconds"), "environment": results["environment"]}
        print(f"\n## {name} ({'fortunes' if name in TEXTS else 'built-in'} text): full {rows[0]['full']:.2f}; calibration {results['calibration'].get('tokens_scored')} "
              f"tokens, test {results['evaluation']['tokens']} tokens; sweep {results.get('seconds')} s "
              f"({time.time() - started:.0f} s here)")
        methods = sorted((m for m in rows[0]["perplexity"] if m != "uniform"), key=lambda m: (m != DEFAULT, m))
        print("| budget | uniform | " + " | ".join(methods) + " | winner |")
        print("|---|---|" + "---|" * len(methods) + "---|")
        for cell in rows:
            shown = [f"{cell['perplexity'][m]:.2f} ({cell['share'][m]:.3f})" for m in methods]
            print(f"| {cell['budget']:.3f} | {cell['uniform']:.2f} | " + " | ".join(shown) + f" | {cell['winner']} |")
        exact = [r for r in results["rows"] if r["method"] not in THRESHOLD]
        spent = {id(r): r.get("cost_per_token", r["activations_per_token"]) for r in exact}   # activations + stand-ins
        above = max((spent[id(r)] - r["budget_activations"]) / r["budget_activations"] for r in exact)
        floor = max(min(abs(spent[id(r)] - b) for b in (r["budget_activations"], int(r["budget_activations"] + 1e-9)))
                    / r["budget_activations"] for r in exact)
        summary["models"][name]["budget_exact"] = {"most_above_budget": above, "most_off_whole_budget": floor}
        print(f"budget-exact methods, measured cost per token (activations plus stand-ins): at most "
              f"{100 * max(above, 0):.3f}% above the budget; each within {100 * floor:.3f}% of B or of floor(B) "
              "(whole-k allocations spend floor(B); alloc-t a fractional B; stand-ins leave what buys no whole k)")
    won = [c["default_wins"] for m in summary["models"].values() for c in m["cells"]]
    print(f"\n{DEFAULT} (the default) is best in {sum(won)} of {len(won)} cells; machine: {summary['machine']}")
    if args.output:
        args.output.write_text(json.dumps(summary, indent=1) + "\n")


if __name__ == "__main__":
    main()
