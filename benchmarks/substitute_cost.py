"""What the substitute costs at inference: a plan with its substitute against the same plan without it.

All run the same experts (same activations per token). The means alone (rank 0) add, per MoE layer,
a [T, E] scatter and one [T, E] x [E, H] product; a rank-r linear term adds 2 x H x r multiply-adds
per skipped slot (gathered at decode, grouped by expert at prefill). Timed interleaved (A, B, A, B,
...) in one process,
median of --repeats, for a prefill pass (batch x input tokens) and a batched decode step (one token
per sequence, with the KV cache of the prefill), on the built-in model and on the DeepSeek-V2-Lite
shape (random weights, --num-layers decoder layers: 3 holds 2 MoE layers, 4.4 GB in fp32). The
substitutes there are random: only time is measured.

    python benchmarks/substitute_cost.py [--repeats 15] [--num-layers 3] [--ranks 0,8] [--output FILE]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time

import torch

import allocmoe
from allocmoe.core.means import ExpertMeans, LinearTerm
from allocmoe.measure.synthetic import build_synthetic
from machine import cpu_name


@torch.no_grad()
def timings(model, plans: dict, batch: int, input_len: int, repeats: int) -> dict:
    """Median seconds of a prefill and of one decode step under each plan, taking turns round by round."""
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (batch, input_len), generator=gen)
    step = torch.randint(0, model.config.vocab_size, (batch, 1), generator=gen)
    times = {name: {"prefill": [], "decode": []} for name in plans}
    for round_ in range(repeats + 1):                     # round 0 warms up, untimed
        for name, p in plans.items():
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
        plain = statistics.median(times["plain"][phase])
        out[phase] = {f"{name}_ms": round(1000 * statistics.median(times[name][phase]), 3) for name in plans}
        out[phase].update({f"{name}_ratio": round(statistics.median(times[name][phase]) / plain, 4)
                           for name in plans if name != "plain"})
    return out


def random_substitute(model, plan, rank: int) -> ExpertMeans:
    gen = torch.Generator().manual_seed(1)
    num_experts, hidden = plan.model["num_experts"], model.config.hidden_size
    layers = plan.model["moe_layers"]
    means = {i: torch.randn(num_experts, hidden, generator=gen) * 0.01 for i in layers}
    linear = None if not rank else {i: LinearTerm(torch.randn(num_experts, hidden, generator=gen),
                                                  torch.randn(num_experts, hidden, rank, generator=gen) * 0.01,
                                                  torch.randn(num_experts, rank, hidden, generator=gen) * 0.01)
                                    for i in layers}
    return ExpertMeans(means, tokens=1, linear=linear)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--num-layers", type=int, default=3, help="decoder layers of the DeepSeek-V2-Lite shape")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--models", default="builtin,deepseek-v2-lite")
    parser.add_argument("--ranks", default="0,8", help="substitute ranks to time beside the plain plan")
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
        plans = {"plain": plan}
        for rank in (int(r) for r in args.ranks.split(",")):
            plans[f"rank{rank}"] = dataclasses.replace(plan, means=random_substitute(model, plan, rank))
        got = timings(model, plans, batch, input_len, args.repeats)
        rows.append({"model": name, "plan": f"uniform top-{plan.k_text()} (half budget)", "batch": batch,
                     "input_len": input_len, **got})
        for phase, what in (("prefill", f"prefill {batch}x{input_len}"), ("decode", f"decode step x{batch}")):
            print(f"{name:18} {what:16}: {got[phase]['plain_ms']:9.2f} ms plain; " + "; ".join(
                f"{n} {got[phase][n + '_ms']:9.2f} ms, ratio {got[phase][n + '_ratio']:.3f}" for n in plans
                if n != "plain"), flush=True)
        del model
    result = {"machine": cpu_name(), "threads": args.threads, "repeats": args.repeats, "dtype": "float32",
              "rows": rows}
    print(f"# {result['machine']}, {args.threads} torch threads, fp32, median of {args.repeats} interleaved rounds")
    if args.output:
        with open(args.output, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
