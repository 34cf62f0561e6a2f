"""Quality at equal decode latency: perplexity vs distinct experts per decode step (issue 23, part 5).

In memory-bound batched decoding a step's cost is the distinct experts it loads per layer, so the
fair comparison is at equal distinct experts per step, measured. On one model, every configuration
is scored on the test text as `allocmoe eval --decode-batch B` scores it (B windows side by side,
one position of each per step) and reports (distinct experts per step, test perplexity):

  latency budget   allocate_distinct at fractions of the unrestricted union (the DP over the
                   distinct profile, measured at decode batch B on calibration text)
  distinct, even   the same policy without the allocation: M_l = round(f * U_l) in every layer
                   (what `bench --max-distinct-experts f` times), at the same fractions
  uniform top-k    k = 1..K in every layer
  Alloc-MoE        allocmoe.allocate(budget, "alloc-moe", substitute off, no refinement) from the
                   Alloc-L profile, at budgets k/K and (k + 1/2)/K; Alloc-T pools per step

Each method's points form a curve; a latency-budget point is compared with another method's curve
linearly interpolated at the same measured distinct experts per step (only inside that curve's
range). Everything is chosen on calibration text; the test text is only scored.

    python benchmarks/distinct_quality.py [--model FOLDER] [--name builtin] [--decode-batch 16]
        [--calib-tokens 8192] [--test-tokens 16384] [--fractions 0.3,0.4,0.5,0.6,0.75,0.9]
        [--output-dir docs/distinct]

Writes <output-dir>/<name>.json (every point, the settings, token counts, machine) and
<name>.png (perplexity vs distinct experts per step, one line per method); prints the table.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from fractions import Fraction
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from machine import cpu_name  # noqa: E402

import allocmoe  # noqa: E402
from allocmoe.calibrate.distinct import distinct_profile  # noqa: E402
from allocmoe.core.budget import round_half_up  # noqa: E402
from allocmoe.core.files import atomic_write_json  # noqa: E402
from allocmoe.scoring.perplexity import tokenize_windows  # noqa: E402
from allocmoe.measure.report import save_png  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
LATENCY, EVEN, UNIFORM, ALLOC_MOE = "latency budget", "distinct, even", "uniform top-k", "Alloc-MoE"


def measure(model, plan, windows, decode_batch: int) -> dict:
    """Test perplexity and what each decode step loads, scored as eval --decode-batch scores it."""
    with allocmoe.apply_plan(model, plan) as handle:
        result = allocmoe.evaluate_perplexity(model, None, "", {"decode_batch": decode_batch, "progress": False},
                                              windows=windows)
        return {"perplexity": result.perplexity, "distinct_experts_per_step": handle.distinct_experts_per_step(),
                "max_distinct_experts_per_step": handle.max_distinct_experts_per_step(),
                "activations_per_token": handle.activations_per_token()}


def interpolate(curve: list[tuple[float, float]], x: float) -> float | None:
    """The curve's y at x, linear between its points sorted by x; None outside its range."""
    curve = sorted(curve)
    for (x1, y1), (x2, y2) in zip(curve, curve[1:]):
        if x1 <= x <= x2:
            return y1 if x2 == x1 else y1 + (y2 - y1) * (x - x1) / (x2 - x1)
    return curve[0][1] if len(curve) == 1 and curve[0][0] == x else None


def compare(rows: list[dict]) -> None:
    """Beside each latency-budget point, per other method: its curve interpolated at the same
    distinct experts per step (`at_equal_distinct`), and its cheapest measured point that loads at
    least as many (`at_least_as_many`: setting, distinct, perplexity), which needs no interpolation."""
    others = (EVEN, UNIFORM, ALLOC_MOE)
    for row in rows:
        if row["method"] != LATENCY:
            continue
        x = row["distinct_experts_per_step"]
        row["at_equal_distinct"], row["at_least_as_many"] = {}, {}
        for m in others:
            points = [r for r in rows if r["method"] == m]
            row["at_equal_distinct"][m] = interpolate([(r["distinct_experts_per_step"], r["perplexity"])
                                                       for r in points], x)
            slower = [r for r in points if r["distinct_experts_per_step"] >= x]
            best = min(slower, key=lambda r: r["distinct_experts_per_step"]) if slower else None
            row["at_least_as_many"][m] = None if best is None else {
                "setting": best["setting"], "distinct_experts_per_step": best["distinct_experts_per_step"],
                "perplexity": best["perplexity"]}


def run(args) -> dict:
    started = time.time()
    model, tok = allocmoe.load_model(args.model)
    fingerprint = allocmoe.model_fingerprint(model)
    num_layers, k_orig = fingerprint["num_moe_layers"], fingerprint["k_orig"]
    calib, _ = allocmoe.read_text(None, "calibration")
    test, _ = allocmoe.read_text(None, "test")
    seq_len = min(args.seq_len, args.calib_tokens // args.decode_batch)
    test_windows = tokenize_windows(tok, test, seq_len, args.test_tokens)
    say = (lambda *a: print(*a, file=sys.stderr)) if not args.quiet else (lambda *a: None)
    say(f"{args.name}: {num_layers} MoE layers x {fingerprint['num_experts']} experts, K={k_orig}; "
        f"decode batch {args.decode_batch}, windows of {seq_len}")

    t0 = time.time()
    dprofile = distinct_profile(model, tok, calib, {"decode_batch": args.decode_batch, "seq_len": seq_len,
                                                    "calib_tokens": args.calib_tokens, "m_step": args.m_step,
                                                    "progress": not args.quiet}, calib_name="builtin:calibration")
    distinct_seconds = time.time() - t0
    t0 = time.time()
    aprofile = allocmoe.profile_sensitivity(model, tok, calib, {"calib_tokens": args.calib_tokens, "seq_len": seq_len,
                                                                "progress": not args.quiet},
                                            calib_name="builtin:calibration")
    alloc_l_seconds = time.time() - t0

    configs = []                                       # (method, setting, plan)
    for f in args.fractions:
        plan = allocmoe.allocate_distinct(str(f), profile=dprofile)
        configs.append((LATENCY, f"f={f:g}", plan))
        even = [max(1, round_half_up(f * u)) for u in dprofile["union_mean"]]
        configs.append((EVEN, f"f={f:g}", allocmoe.distinct_plan(model, even)))
    for k in range(1, k_orig + 1):
        configs.append((UNIFORM, f"k={k}", allocmoe.static_plan(model, [k] * num_layers, method="uniform")))
    budgets = sorted({Fraction(k, k_orig) for k in range(1, k_orig)} |
                     {Fraction(2 * k + 1, 2 * k_orig) for k in range(1, k_orig - 1)})
    for b in budgets:
        plan = allocmoe.allocate(str(b), "alloc-moe", profile=aprofile, config={"substitute": False, "refine": 0})
        configs.append((ALLOC_MOE, f"B={b}", plan))

    rows = []
    for index, (method, setting, plan) in enumerate(configs):
        point = measure(model, plan, test_windows, args.decode_batch)
        caps = [p.max_experts for _, p in sorted(plan.layers.items())] if method in (LATENCY, EVEN) else None
        ks = [p.k for _, p in sorted(plan.layers.items())] if method in (UNIFORM, ALLOC_MOE) else None
        rows.append({"method": method, "setting": setting, **point, "max_experts_per_layer": caps,
                     "k_per_layer": ks})
        say(f"[{index + 1}/{len(configs)}] {method:15s} {setting:8s} distinct/step "
            f"{point['distinct_experts_per_step']:6.2f} (max {point['max_distinct_experts_per_step']}) "
            f"ppl {point['perplexity']:.3f}")

    compare(rows)
    full = next(r for r in rows if r["method"] == UNIFORM and r["setting"] == f"k={k_orig}")
    return {
        "model": args.name, "fingerprint": fingerprint, "machine": cpu_name(), "torch_threads": torch.get_num_threads(),
        "settings": {"decode_batch": args.decode_batch, "seq_len": seq_len, "calib_tokens": args.calib_tokens,
                     "test_tokens": args.test_tokens, "fractions": args.fractions, "m_step": args.m_step,
                     "alloc_moe_budgets": [str(b) for b in budgets], "k_floor": dprofile["k_floor"]},
        "calibration": {**dprofile["calibration"], "text": "builtin:calibration"},
        "test": {"text": "builtin:test", "tokens_scored": int(test_windows.numel() - test_windows.size(0)),
                 "windows": int(test_windows.size(0)), "seq_len": int(test_windows.size(1))},
        "unrestricted": {"union_mean": dprofile["union_mean"], "union_max": dprofile["union_max"],
                         "test_distinct_experts_per_step": full["distinct_experts_per_step"],
                         "test_perplexity": full["perplexity"],
                         "calibration_perplexity": dprofile["unrestricted_perplexity"]},
        "cost": {"distinct_profile_cells": dprofile["provenance"]["cells"],
                 "distinct_profile_seconds": round(distinct_seconds, 1),
                 "distinct_profile_layer_passes": dprofile["provenance"]["layer_passes"],
                 "alloc_l_profile_seconds": round(alloc_l_seconds, 1), "total_seconds": round(time.time() - started, 1)},
        "distinct_sensitivity": dprofile["sensitivity"], "rows": rows,
    }


def table(result: dict) -> str:
    """Markdown: every latency-budget point beside the others interpolated at its distinct experts,
    then every measured point."""
    out = [f"| latency budget | M per layer | distinct/step (max) | test ppl | {EVEN} | {UNIFORM} | {ALLOC_MOE} |",
           "|---|---|---|---|---|---|---|"]

    def fmt(value, own):
        return "n/a (outside its range)" if value is None else f"{value:.3f} ({value - own:+.3f})"

    for r in result["rows"]:
        if r["method"] == LATENCY:
            eq = r["at_equal_distinct"]
            out.append(f"| {r['setting']} | {' '.join(map(str, r['max_experts_per_layer']))} | "
                       f"{r['distinct_experts_per_step']:.2f} ({r['max_distinct_experts_per_step']}) | "
                       f"{r['perplexity']:.3f} | {fmt(eq[EVEN], r['perplexity'])} | "
                       f"{fmt(eq[UNIFORM], r['perplexity'])} | {fmt(eq[ALLOC_MOE], r['perplexity'])} |")
    out += ["", "Against each method's cheapest measured point that loads at least as many distinct experts per step "
            "(no interpolation):", "",
            f"| latency budget | distinct/step | test ppl | {EVEN} | {UNIFORM} | {ALLOC_MOE} |", "|---|---|---|---|---|---|"]
    for r in result["rows"]:
        if r["method"] == LATENCY:
            cells = []
            for m in (EVEN, UNIFORM, ALLOC_MOE):
                p = r["at_least_as_many"][m]
                cells.append("none" if p is None else f"{p['setting']}: {p['perplexity']:.3f} at "
                             f"{p['distinct_experts_per_step']:.2f} ({p['perplexity'] - r['perplexity']:+.3f})")
            out.append(f"| {r['setting']} | {r['distinct_experts_per_step']:.2f} | {r['perplexity']:.3f} | "
                       + " | ".join(cells) + " |")
    out += ["", "| method | setting | distinct/step | max | activations/token | test ppl |", "|---|---|---|---|---|---|"]
    for r in result["rows"]:
        out.append(f"| {r['method']} | {r['setting']} | {r['distinct_experts_per_step']:.2f} | "
                   f"{r['max_distinct_experts_per_step']} | {r['activations_per_token']:.2f} | {r['perplexity']:.3f} |")
    return "\n".join(out)


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for method, style in ((LATENCY, "o-"), (EVEN, "s--"), (UNIFORM, "^-"), (ALLOC_MOE, "d-")):
        pts = sorted((r["distinct_experts_per_step"], r["perplexity"]) for r in result["rows"]
                     if r["method"] == method)
        ax.plot(*zip(*pts), style, label=method)
    full = result["unrestricted"]
    ax.axhline(full["test_perplexity"], color="grey", ls=":", lw=1, label="full model")
    s = result["settings"]
    ax.set_xlabel(f"distinct experts per decode step, mean over layers (batch {s['decode_batch']}, "
                  f"of {result['fingerprint']['num_experts']})")
    ax.set_ylabel("test perplexity (lower is better)")
    ax.set_title(f"{result['model']}: quality at equal decode latency")
    top = max(r["perplexity"] for r in result["rows"] if r["distinct_experts_per_step"] >=
              0.25 * full["test_distinct_experts_per_step"])
    ax.set_ylim(full["test_perplexity"] * 0.98, top * 1.05)
    ax.grid(alpha=0.3)
    ax.legend()
    save_png(fig, path)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="model folder (default: the built-in model)")
    parser.add_argument("--name", default=None, help="name in the output files (default: the folder's name or builtin)")
    parser.add_argument("--decode-batch", type=int, default=16)
    parser.add_argument("--calib-tokens", type=int, default=8192)
    parser.add_argument("--test-tokens", type=int, default=16384)
    parser.add_argument("--seq-len", type=int, default=512, help="window (at most calib-tokens / decode-batch)")
    parser.add_argument("--fractions", default="0.3,0.4,0.5,0.6,0.75,0.9",
                        help="latency budgets, fractions of the unrestricted union")
    parser.add_argument("--m-step", type=int, default=1, help="distinct profile: every N-th M")
    parser.add_argument("--output-dir", default=str(ROOT / "docs" / "distinct"))
    parser.add_argument("--quiet", action="store_true")
    parser.add_argument("--from-json", default=None, metavar="FILE",
                        help="measure nothing: recompute the comparisons, table and plot of a result this script wrote")
    args = parser.parse_args()
    args.fractions = [float(f) for f in args.fractions.split(",")]
    args.name = args.name or (Path(args.model).name if args.model else "builtin")
    torch.set_grad_enabled(False)
    if args.from_json:
        result = json.loads(Path(args.from_json).read_text())
        compare(result["rows"])
        args.name = result["model"]
    else:
        result = run(args)
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_json(out / f"{args.name}.json", result)
    plot(result, out / f"{args.name}.png")
    c, t = result["calibration"], result["test"]
    print(f"{args.name} on {result['machine']} ({result['torch_threads']} threads): decode batch "
          f"{result['settings']['decode_batch']}, calibration {c['tokens_scored']} tokens ({c['windows']} windows of "
          f"{c['seq_len']}), test {t['tokens_scored']} tokens ({t['windows']} windows of {t['seq_len']}); "
          f"{result['cost']['total_seconds']:.0f} s in all")
    print(table(result))
    print(f"wrote {out / (args.name + '.json')} and {out / (args.name + '.png')}", file=sys.stderr)


if __name__ == "__main__":
    main()
