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
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from machine import cpu_name  # noqa: E402

from allocmoe.core.files import atomic_write_json  # noqa: E402
from allocmoe.measure.bench import BenchConfig, benchmark, distinct_plan_for, format_table  # noqa: E402
from allocmoe.measure.synthetic import build_synthetic  # noqa: E402


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
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default=None, choices=("float32", "bfloat16", "float16"),
                        help="default: float32 on CPU, bfloat16 on CUDA")
    parser.add_argument("--output-json", default=None, help="write the result here (e.g. docs/speed/distinct_batch16.json)")
    args = parser.parse_args()
    torch.set_grad_enabled(False)
    dtype = getattr(torch, args.dtype) if args.dtype else (torch.float32 if args.device == "cpu" else torch.bfloat16)
    machine = torch.cuda.get_device_name() if args.device.startswith("cuda") else cpu_name()
    print(f"{args.shape}, {args.num_layers} layers, {str(dtype).removeprefix('torch.')} on {machine}, "
          f"{torch.get_num_threads()} threads; batch {args.batch_size}, prompt {args.input_len}, "
          f"{args.output_len} decode steps, {args.repeats} rounds after {args.warmup} warm-up", file=sys.stderr)
    started = time.time()
    model = build_synthetic(args.shape, args.num_layers, dtype=dtype, device=args.device)
    config = BenchConfig(input_len=args.input_len, output_len=args.output_len, batch_size=args.batch_size,
                         repeats=args.repeats, warmup=args.warmup)
    plan, union = distinct_plan_for(model, config, fraction=args.fraction)
    print("unrestricted union per layer: " + ", ".join(f"{u:.1f}" for u in union.values())
          + f"; M per layer: {', '.join(str(p.max_experts) for p in plan.layers.values())}", file=sys.stderr)
    result = benchmark(model, plan, config, synthetic=True)
    result["unrestricted_union"] = {"fraction": args.fraction, "per_layer": {str(i): u for i, u in union.items()},
                                    "measured_on": "other random prompts (seed 1), same batch and decode steps"}
    result["machine"] = machine
    result["script"] = {"argv": sys.argv[1:], **vars(args), "minutes": (time.time() - started) / 60}
    print(format_table(result))
    if args.output_json:
        atomic_write_json(args.output_json, result)
        print(f"wrote {args.output_json}", file=sys.stderr)


if __name__ == "__main__":
    main()
