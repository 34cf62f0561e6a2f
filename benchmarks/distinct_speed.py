"""Batched decode under a distinct-expert budget, side by side with the unmodified model and uniform
top-k, on a real MoE shape with random weights (issue 23, part 4).

Builds the shape (synthetic.py), measures each MoE layer's unrestricted union U_l (mean distinct
experts per decode step of top-K routing at the batch size, on other random prompts than the timed
ones), makes the distinct plan M_l = round(fraction * U_l), and times in one interleaved run: the
unmodified model, the distinct plan, uniform top-k at the activations per token the distinct plan
spends (rounded to a whole k) and the model with routed experts off. Prints decode tokens/s, step
latency, distinct experts per step, the ideal speedup from distinct experts and the share of the
ideal gain reached, and writes everything, with the machine and settings, to --output-json.

    python benchmarks/distinct_speed.py [--num-layers 6] [--batch-size 16] [--fraction 0.5]
        [--input-len 64] [--output-len 32] [--repeats 5] [--output-json docs/speed/distinct_batch16.json]

On a GPU: --device cuda --dtype bfloat16 --num-layers 27 (the real DeepSeek-V2-Lite dimensions).
With --packed-experts (CPU) the experts' weights are also packed for oneDNN, which doubles their
memory: 6 layers then need 23 GiB, 5 layers 19 GiB (too much beside the KV cache on a 24 GiB host),
4 layers (3 of them MoE) 15 GiB.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from machine import cpu_name  # noqa: E402

from allocmoe import apply_plan, static_plan  # noqa: E402
from allocmoe.core.files import atomic_write_json  # noqa: E402
from allocmoe.measure.bench import (BenchConfig, Generation, benchmark, distinct_plan_for, format_table,  # noqa: E402
                                    prompt_ids)
from allocmoe.measure.synthetic import build_synthetic  # noqa: E402
from allocmoe.routing.adapters import adapter_for_model  # noqa: E402
from allocmoe.routing.experts import compact_experts_forward, pack_experts  # noqa: E402


@torch.no_grad()
def experts_kernel_alone(model, plans: dict, config: BenchConfig, steps: int, repeats: int) -> dict:
    """The first MoE layer's experts kernel alone, on the real inputs it gets in the first `steps`
    decode steps under each plan: ms per step (median over repeats, the plans taking turns), the
    distinct experts and (token, expert) rows of each step, and a least-squares fit
    ms = per_expert * distinct + per_row * rows over all of them."""
    layer = adapter_for_model(model).moe_layers(model)[0]
    num_experts = adapter_for_model(model).num_experts()
    captured = {name: [] for name in plans}
    for name, plan in plans.items():
        hook = layer.experts.register_forward_hook(lambda module, args, out, name=name: captured[name].append(args))
        try:
            with apply_plan(model, plan):
                gen = Generation(model, prompt_ids(model, config), steps)
                gen.prefill()
                captured[name].clear()
                for _ in range(steps):
                    gen.step()
        finally:
            hook.remove()
    samples = {name: [[] for _ in range(steps)] for name in plans}
    for _ in range(repeats):
        for step in range(steps):
            for name in plans:
                hidden, index, weights = captured[name][step]
                start = time.perf_counter()
                compact_experts_forward(layer.experts, hidden, index, weights)
                samples[name][step].append(time.perf_counter() - start)
    out, points = {}, []
    for name in plans:
        rows = [{"distinct": len({e for e in index.reshape(-1).tolist() if e < num_experts}),
                 "rows": int((index < num_experts).sum()), "ms": 1000 * statistics.median(times)}
                for (_, index, _), times in zip(captured[name], samples[name])]
        points += rows
        out[name] = {"steps": rows, "ms": statistics.median(r["ms"] for r in rows),
                     "distinct": statistics.mean(r["distinct"] for r in rows),
                     "rows": statistics.mean(r["rows"] for r in rows)}
    design = torch.tensor([[p["distinct"], p["rows"]] for p in points], dtype=torch.float64)
    fit = torch.linalg.lstsq(design, torch.tensor([p["ms"] for p in points], dtype=torch.float64)[:, None]).solution
    return {"layer": layer.index, "per_plan": out, "fit_ms": {"per_expert": float(fit[0]), "per_row": float(fit[1])}}


def _commit() -> str | None:
    """The checkout's commit (with '+changes' when files differ from it), or None outside git."""
    import subprocess

    here = os.path.dirname(os.path.abspath(__file__))
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=here, capture_output=True,
                               text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None
    return commit + ("+changes" if dirty else "")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="synthetic:deepseek-v2-lite")
    parser.add_argument("--num-layers", type=int, default=6, help="decoder layers to build (6: 1 dense + 5 MoE)")
    parser.add_argument("--batch-size", type=int, default=16, help="sequences decoded side by side")
    parser.add_argument("--fraction", type=float, default=0.5, help="M_l as a fraction of the unrestricted union")
    parser.add_argument("--input-len", type=int, default=64, help="prompt tokens per sequence")
    parser.add_argument("--output-len", type=int, default=32, help="decode steps per round")
    parser.add_argument("--repeats", type=int, default=5, help="timed rounds")
    parser.add_argument("--warmup", type=int, default=1, help="untimed rounds first")
    parser.add_argument("--kernel-steps", type=int, default=8,
                        help="then time the experts kernel alone on this many decode steps' real inputs (0: skip)")
    parser.add_argument("--kernel-repeats", type=int, default=10, help="repeats of that kernel timing")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default=None, choices=("float32", "bfloat16", "float16"),
                        help="default: float32 on CPU, bfloat16 on CUDA")
    parser.add_argument("--packed-experts", action="store_true",
                        help="CPU fp32: pack the experts' weights for oneDNN (a second copy; routing/experts.py)")
    parser.add_argument("--output-json", default=None, help="write the result here (e.g. docs/speed/distinct_batch16.json)")
    args = parser.parse_args()
    torch.set_grad_enabled(False)
    dtype = getattr(torch, args.dtype) if args.dtype else (torch.float32 if args.device == "cpu" else torch.bfloat16)
    machine = torch.cuda.get_device_name() if args.device.startswith("cuda") else cpu_name()
    print(f"{args.shape}, {args.num_layers} layers, {str(dtype).removeprefix('torch.')} on {machine}, "
          f"{torch.get_num_threads()} threads; batch {args.batch_size}, prompt {args.input_len}, "
          f"{args.output_len} decode steps, {args.repeats} rounds after {args.warmup} warm-up", file=sys.stderr)
    started, load_at_start = time.time(), os.getloadavg()[0]
    model = build_synthetic(args.shape, args.num_layers, dtype=dtype, device=args.device)
    config = BenchConfig(input_len=args.input_len, output_len=args.output_len, sequences=args.batch_size,
                         repeats=args.repeats, warmup=args.warmup)
    if args.packed_experts:
        pack_experts(model)                       # the packed copies live until the script exits
    plan, union = distinct_plan_for(model, config, fraction=args.fraction)
    print("unrestricted union per layer: " + ", ".join(f"{u:.1f}" for u in union.values())
          + f"; M per layer: {', '.join(str(p.max_experts) for p in plan.layers.values())}", file=sys.stderr)
    result = benchmark(model, plan, config, synthetic=True)
    result["unrestricted_union"] = {"fraction": args.fraction, "per_layer": {str(i): u for i, u in union.items()},
                                    "measured_on": "other random prompts (seed 1), same batch and decode steps"}
    result["machine"] = machine
    result["host_load_average_1min"] = {"start": load_at_start, "end": os.getloadavg()[0]}   # a shared host says so
    result["commit"] = _commit()
    result["packed_experts"] = args.packed_experts
    result["script"] = {"argv": sys.argv[1:], **vars(args), "minutes": (time.time() - started) / 60}
    print(format_table(result))
    if args.kernel_steps:
        k_orig = result["model"]["k_orig"]
        layers = result["model"]["num_moe_layers"]
        kernel = experts_kernel_alone(model, {"full": static_plan(model, [k_orig] * layers), "plan": plan,
                                              "uniform": static_plan(model, [result["configurations"]["uniform"]["k"]] * layers)},
                                      config, args.kernel_steps, args.kernel_repeats)
        result["experts_kernel_alone"] = kernel
        full = kernel["per_plan"]["full"]
        print(f"\nthe experts kernel alone, MoE layer {kernel['layer']}, its real inputs in the first {args.kernel_steps} "
              f"decode steps ({args.kernel_repeats} repeats, medians):\n\n"
              "| configuration | distinct experts | rows (token, expert) | kernel ms | of full | distinct, of full |\n"
              "|---|---|---|---|---|---|")
        for name, k in kernel["per_plan"].items():
            print(f"| {result['configurations'][name]['label']} | {k['distinct']:.1f} | {k['rows']:.1f} | {k['ms']:.1f} | "
                  f"{k['ms'] / full['ms']:.3f} | {k['distinct'] / full['distinct']:.3f} |")
        fit = kernel["fit_ms"]
        print(f"\nfit over the {3 * args.kernel_steps} steps: ms = {fit['per_expert']:.3f} x distinct experts + "
              f"{fit['per_row']:.3f} x rows")
    if args.output_json:
        atomic_write_json(args.output_json, result)
        print(f"wrote {args.output_json}", file=sys.stderr)


if __name__ == "__main__":
    main()
