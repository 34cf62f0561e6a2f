"""How much each rank of the substitute's linear term buys: test perplexity of one fixed allocation
per model (Alloc-L's DP at half budget, static top-k) with the stand-ins at rank 0 (MoNE's means
alone) up to --ranks, against the same allocation without a substitute, uniform top-k and the full
model. Every fit on the built-in calibration split (8,192 tokens), every score on the test split.

    python benchmarks/substitute_rank.py [--models builtin,qwen3_moe,olmoe] [--ranks 0,1,2,4,8,16,32]
           [--output docs/quality/substitute_rank.json]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

import allocmoe
from allocmoe.calibrate.means import measure_expert_means
from allocmoe.scoring.perplexity import evaluate_perplexity, tokenize_windows
from machine import cpu_name

ROOT = Path(__file__).resolve().parents[1]
MODELS = {"builtin": None, "qwen3_moe": ROOT / "examples" / "models" / "qwen3_moe",
          "olmoe": ROOT / "examples" / "models" / "olmoe"}
SEQ_LEN, CALIB_TOKENS, TEST_TOKENS = 512, 8192, 16384     # the sweep's settings


def test_ppl(model, tok, text, windows, plan) -> float:
    with allocmoe.apply_plan(model, plan):
        return evaluate_perplexity(model, tok, text, {"progress": False}, windows=windows).perplexity


def run(name: str, ranks: list[int]) -> dict:
    model, tok = allocmoe.load_model(MODELS[name])
    calib, _ = allocmoe.read_text(None, "calibration")
    test, _ = allocmoe.read_text(None, "test")
    calib_windows = tokenize_windows(tok, calib, SEQ_LEN, CALIB_TOKENS)
    test_windows = tokenize_windows(tok, test, SEQ_LEN, TEST_TOKENS)
    profile = allocmoe.profile_sensitivity(model, tok, calib, {"seq_len": SEQ_LEN, "calib_tokens": CALIB_TOKENS,
                                                               "progress": False})
    plan = allocmoe.allocate("1/2", "alloc-l", profile=profile)
    full = evaluate_perplexity(model, tok, test, {"progress": False}, windows=test_windows).perplexity
    uniform = test_ppl(model, tok, test, test_windows, allocmoe.allocate("1/2", "uniform", model=model))
    row = {"allocation": plan.k_text(), "full": full, "uniform": uniform,
           "none": test_ppl(model, tok, test, test_windows, plan), "ranks": {}}
    for rank in ranks:
        started = time.time()
        plan.means = measure_expert_means(model, calib_windows, rank=rank)
        fit = time.time() - started
        row["ranks"][rank] = {"perplexity": test_ppl(model, tok, test, test_windows, plan),
                              "fit_seconds": round(fit, 1)}
    share = lambda p: (p - full) / (uniform - full)                       # noqa: E731
    print(f"\n## {name}: full {full:.2f}, uniform {uniform:.2f}, alloc-l top-{row['allocation']} alone "
          f"{row['none']:.2f} ({share(row['none']):.3f})")
    print("| rank | test ppl | share of uniform's increase | fit s |\n|---|---|---|---|")
    for rank, r in row["ranks"].items():
        print(f"| {rank} | {r['perplexity']:.2f} | {share(r['perplexity']):.3f} | {r['fit_seconds']} |", flush=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--ranks", default="0,1,2,4,8,16,32")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--output", type=Path, default=None, help="also write the rows as JSON")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    ranks = [int(r) for r in args.ranks.split(",")]
    result = {"machine": cpu_name(), "calibration_tokens": CALIB_TOKENS, "test_tokens": TEST_TOKENS,
              "seq_len": SEQ_LEN, "models": {name: run(name, ranks) for name in args.models.split(",")}}
    if args.output:
        args.output.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
