"""CPU speed on real model shapes (random weights, a few layers to fit memory), side by side.

For the DeepSeek-V2-Lite shape at half budget: prefill and decode speedup of uniform top-3 and of
Alloc-T against the unmodified model, each as a fraction of the ideal speedup (from the time with
routed experts off); Alloc-T's prefill cost against static top-3 at the same budget; with
batched decode, distinct experts per step against the budget; and the full model's prefill with
allocmoe's experts kernel against transformers' grouped_mm (the budget figures use allocmoe's
kernel on both sides).

    python benchmarks/cpu_speed.py [--num-layers 3] [--repeats 5] [--input-len 256] [--output-json FILE]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics

import torch

from allocmoe import apply_plan
from allocmoe.routing.apply import allocmoe_experts
from allocmoe.measure.bench import BenchConfig, Generation, benchmark
from allocmoe.core.files import atomic_write_json
from allocmoe.calibrate.methods import allocate
from allocmoe.measure.synthetic import build_synthetic


def interleaved_prefill(model, ids: torch.Tensor, repeats: int, conditions: dict) -> dict[str, list[float]]:
    """Prefill seconds per condition (name -> factory of the context to time it in), the conditions
    taking turns in each round, after one untimed round."""
    samples = {name: [] for name in conditions}
    for rep in range(repeats + 1):
        for name, context in conditions.items():
            with context():
                prefill = Generation(model, ids, 0).prefill()
            if rep:
                samples[name].append(prefill)
    return samples


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", default="synthetic:deepseek-v2-lite")
    parser.add_argument("--num-layers", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=16)
    parser.add_argument("--output-json", default=None, help="also write every timing here")
    args = parser.parse_args()
    torch.set_grad_enabled(False)
    model = build_synthetic(args.shape, args.num_layers)
    print(f"{args.shape}, {args.num_layers} layers, fp32, {torch.get_num_threads()} threads; "
          f"batch 1, prompt {args.input_len}, {args.output_len} decode steps, {args.repeats} repeats")
    config = BenchConfig(input_len=args.input_len, output_len=args.output_len, sequences=1, repeats=args.repeats)
    results = {}
    plans = {m: allocate("0.5", m, model=model) for m in ("uniform", "alloc-t")}
    for method, plan in plans.items():
        r = benchmark(model, plan, config, synthetic=True, progress=False)
        results[method] = r
        print(f"  {method:8s} prefill {r['prefill_speedup']:.3f}x of ideal {r['prefill_ideal_speedup']:.3f}x "
              f"({r['prefill_fraction_of_ideal']:.0%} of the ideal gain, {r['prefill_fraction_of_ideal_paired']:.0%} "
              f"paired by round); decode {r['decode_speedup']:.3f}x of ideal {r['decode_ideal_speedup']:.3f}x "
              f"({r['decode_fraction_of_ideal']:.0%}, {r['decode_fraction_of_ideal_paired']:.0%} paired)")
    # Alloc-T vs static top-3, prefill, interleaved
    ids = torch.randint(0, model.config.vocab_size, (1, args.input_len))
    samples = interleaved_prefill(model, ids, args.repeats,
                                  {m: (lambda plan=plan: apply_plan(model, plan)) for m, plan in plans.items()})
    ratio = statistics.median(samples["alloc-t"]) / statistics.median(samples["uniform"])
    print(f"  alloc-t prefill / static top-3 prefill: {ratio:.3f} (target <= 1.05)")
    # the kernel alone: full model, transformers' experts function vs allocmoe's, interleaved
    kernel = interleaved_prefill(model, ids, args.repeats, {"transformers": contextlib.nullcontext,
                                                            "allocmoe": lambda: allocmoe_experts(model)})
    kernel_gain = statistics.median(kernel["transformers"]) / statistics.median(kernel["allocmoe"])
    print(f"  full-model prefill, allocmoe experts kernel vs transformers grouped_mm: {kernel_gain:.3f}x")
    distinct = {}
    # distinct experts per decode step vs budget, batch 8
    print("  batch-8 decode, distinct routed experts per layer and step (of 64):")
    for budget in ("1/3", "1/2", "2/3", "1"):
        plan = allocate(budget, "alloc-t", model=model)
        r = benchmark(model, plan, BenchConfig(input_len=32, output_len=4, sequences=8, repeats=1, warmup=0),
                      synthetic=True, progress=False)
        d = distinct[budget] = r["distinct_experts_per_decode_step"]
        print(f"    B={budget:>3s}: {d['plan']:.1f} (full K: {d['full']:.1f})")
    print(json.dumps({"environment": results["uniform"]["environment"]}, indent=None))
    if args.output_json:
        atomic_write_json(args.output_json, {"settings": vars(args), "half_budget": results,
                                             "alloc_t_over_static_prefill": ratio,
                                             "alloc_t_prefill_seconds": samples["alloc-t"],
                                             "static_prefill_seconds": samples["uniform"],
                                             "distinct_experts_batch8": distinct,
                                             "full_prefill_seconds_by_experts_kernel": kernel,
                                             "experts_kernel_prefill_gain": kernel_gain})


if __name__ == "__main__":
    main()
