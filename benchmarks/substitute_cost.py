"""What the substitute costs at inference: a plan with expert means against the same plan without them.

Both run the same experts (same activations per token); the substitute adds, per MoE layer, a
[T, E] scatter and one [T, E] x [E, H] product. Timed interleaved (A, B, A, B, ...) in one process,
median of --repeats, for a prefill pass (batch x input tokens) and a batched decode step (one token
per sequence, with the KV cache of the prefill), on the built-in model and on the DeepSeek-V2-Lite
shape (random weights, --num-layers decoder layers: 3 holds 2 MoE layers, 4.4 GB in fp32). Means
there are random: only time is measured.

    python benchmarks/substitute_cost.py [--repeats 15] [--num-layers 3] [--output FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

import allocmoe
from allocmoe.core.means import ExpertMeans
from allocmoe.measure.synthetic import build_synthetic
from machine import cpu_name


@torch.no_grad()
def timings(model, plan, batch: int, input_len: int, repeats: int) -> dict:
    """Median seconds of a prefill and of one decode step, plan without and with its means."""
    with_means = plan
    without = allocmoe.Plan(model=plan.model, layers=plan.layers, method=plan.method, budget=plan.budget)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (batch, input_len), generator=gen)
    step = torch.randint(0, model.config.vocab_size, (batch, 1), generator=gen)
    times = {name: {"prefill": [], "decode": []} for name in ("plain", "substitute")}
    for round_ in range(repeats + 1):                     # round 0 warms up, untimed
        for name, p in (("plain", without), ("substitute", with_means)):
            with allocmoe.apply_plan(model, p):
                start = time.perf_counter()
                out = model(input_ids=ids, use_cache=True)
                middle = time.perf_counter()
                model(input_ids=step, past_key_values=out.past_key_values, use_cache=True)
                end = time.perf_counter()
            if round_:
                times[name]["prefill"].append(middle - start)
                times[name]["decode"].append(end - middle)
    out = {}
    for phase in ("prefill", "decode"):
        plain, sub = (statistics.median(times[n][phase]) for n in ("plain", "substitute"))
        out[phase] = {"plain_ms": round(1000 * plain, 3), "substitute_ms": round(1000 * sub, 3),
                      "ratio": round(sub / plain, 4)}
    return out


def random_means(model, plan) -> ExpertMeans:
    gen = torch.Generator().manual_seed(1)
    num_experts, hidden = plan.model["num_experts"], model.config.hidden_size
    return ExpertMeans({i: torch.randn(num_experts, hidden, generator=gen) * 0.01 for i in plan.model["moe_layers"]},
                       tokens=1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--num-layers", type=int, default=3, help="decoder layers of the DeepSeek-V2-Lite shape")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--models", default="builtin,deepseek-v2-lite")
    parser.add_argument("--output", default=None, help="also write the results as JSON")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rows = []
    for name in args.models.split(","):
        if name == "builtin":
            model, _ = allocmoe.load_model()
            batch, input_len = 4, 256
        else:
            model = build_synthetic(name, num_layers=args.num_layers).eval()
            batch, input_len = 4, 128
        plan = allocmoe.allocate("1/2", "uniform", model=model)
        plan.means = random_means(model, plan)
        got = timings(model, plan, batch, input_len, args.repeats)
        rows.append({"model": name, "plan": f"uniform top-{plan.k_text()} (half budget)", "batch": batch,
                     "input_len": input_len, **got})
        print(f"{name:18} prefill {batch}x{input_len}: {got['prefill']['plain_ms']:9.2f} ms plain, "
              f"{got['prefill']['substitute_ms']:9.2f} ms with means, ratio {got['prefill']['ratio']:.3f}; "
              f"decode step x{batch}: {got['decode']['plain_ms']:8.2f} ms, {got['decode']['substitute_ms']:8.2f} ms, "
              f"ratio {got['decode']['ratio']:.3f}", flush=True)
        del model
    result = {"machine": cpu_name(), "threads": args.threads, "repeats": args.repeats, "dtype": "float32",
              "rows": rows}
    print(f"# {result['machine']}, {args.threads} torch threads, fp32, median of {args.repeats} interleaved rounds")
    if args.output:
        with open(args.output, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
