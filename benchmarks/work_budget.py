"""One budget for all the work, measured: a sweep's plans with their stated cost, test perplexity and speed.

Reads the folder of `allocmoe sweep` on the built-in model (e.g. `--methods auto,uniform,alloc-moe
--budgets 1/2 --output DIR`): each row's test perplexity, measured activations and measured cost
(activations + stand-ins in activation-equivalents). Then rebuilds `auto`'s plan with its stand-ins
(its means measured again on the same calibration windows `auto` fitted them on, kept on the layers
its `cost.standin_per_slot` names), checks that it scores the sweep's test perplexity, and times it
with `allocmoe bench`'s benchmark beside the unmodified model and the same plan without its stand-ins,
and the uniform plan of the same budget.

    python benchmarks/work_budget.py DIR [--input-len 64] [--output-len 8] [--repeats 3] [--output FILE]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

import allocmoe
from allocmoe.calibrate.means import measure_expert_means
from allocmoe.measure.bench import BenchConfig, benchmark
from allocmoe.scoring import evaluate_perplexity, tokenize_windows
from allocmoe.scoring.perplexity import window_len
from machine import cpu_name


def auto_plan(model, tok, plan_dict: dict, results: dict) -> allocmoe.Plan:
    """The sweep's `auto` plan with its means: measured on auto's calibration windows (AllocateConfig's
    defaults, as the sweep ran it) and kept on the layers the plan's cost gives stand-ins."""
    plan = allocmoe.Plan.from_dict(plan_dict)
    layers = [int(i) for i in (plan_dict.get("cost") or {}).get("standin_per_slot", {})]
    if layers:
        calib, _ = allocmoe.read_text(None, "calibration")
        windows = tokenize_windows(tok, calib, window_len(model, None), 8192)
        means = measure_expert_means(model, windows, 4, progress=False, rank=8)
        plan.means = means.restricted(layers)
        plan.standins = {int(i): u for i, u in plan_dict["cost"]["standin_per_slot"].items()}
    return plan


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", type=Path)
    parser.add_argument("--input-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--output", type=Path, default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    results = json.loads((args.folder / "results.json").read_text())
    plans = json.loads((args.folder / "plans.json").read_text())
    model, tok = allocmoe.load_model()
    test, _ = allocmoe.read_text(None, "test")
    ev = results["evaluation"]
    out = {"machine": cpu_name(), "threads": args.threads, "full": results["full"]["perplexity"], "rows": []}
    bench = BenchConfig(input_len=args.input_len, output_len=args.output_len, repeats=args.repeats)
    for row in results["rows"]:
        key = next(k for k in plans if k.startswith(f"{row['method']}@"))
        plan = auto_plan(model, tok, plans[key], results) if row["method"] == "auto" else \
            allocmoe.Plan.from_dict(plans[key])
        entry = {k: row[k] for k in ("method", "budget", "budget_activations", "perplexity", "activations_per_token",
                                     "cost_per_token", "k_per_layer")}
        entry["stated_cost"] = plan.cost()
        if row["method"] == "auto":
            windows = tokenize_windows(tok, test, window_len(model, None), 16384)      # as the sweep's default
            with allocmoe.apply_plan(model, plan):
                entry["rebuilt_perplexity"] = evaluate_perplexity(
                    model, tok, "", {"windows_per_pass": ev["batch_size"], "progress": False},
                    windows=windows).perplexity
        timed = benchmark(model, plan, bench, progress=False)
        entry["speed"] = {k: timed[k] for k in ("prefill_speedup", "decode_speedup", "measured_cost_per_token")}
        if "substitute_cost" in timed:
            entry["speed"]["standins_time_ratio"] = {p: timed["substitute_cost"][p]["ratio"]
                                                     for p in ("prefill", "decode")}
        out["rows"].append(entry)
        print(json.dumps({k: v for k, v in entry.items() if k != "stated_cost"}), flush=True)
    if args.output:
        args.output.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
