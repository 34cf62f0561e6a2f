"""What the prefix cache saves in profiling, side by side with the naive protocol (every cell a full pass).

1. Work, counted, not run: decoder-layer passes (tokens x decoder layers) of a profile of a
   DeepSeek-V2-Lite-shaped model (27 layers, the first dense, 64 routed experts, top-6), from the
   same schedule and counting functions the profiler runs and records (calibrate/prefix.py).
2. Wall clock, measured: full profiles of the built-in model, cached and naive taking turns in one
   process, every time printed, with the work each recorded and the tables compared.

    python benchmarks/profile_cost.py [--calib-tokens 4096] [--rounds 3] [--threads 1]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time

import torch

from machine import cpu_name

from allocmoe import load_model, model_fingerprint, profile_sensitivity, read_text
from allocmoe.calibrate.prefix import cell_schedule, layer_passes, naive_layer_passes, profile_start_layer
from allocmoe.calibrate.profile import profile_cells
from allocmoe.measure.synthetic import synthetic_config




def counted_work(shape: str, tokens: int, seq_len: int, batch_size: int) -> None:
    from transformers import AutoModelForCausalLM

    config = synthetic_config(shape)
    with torch.device("meta"):                       # layer layout only: no weights are made
        model = AutoModelForCausalLM.from_config(config)
    fp = model_fingerprint(model)
    configurations = list(profile_cells(fp["num_moe_layers"], fp["k_orig"]))
    print(f"{shape}: {config.num_hidden_layers} decoder layers, MoE layers {fp['moe_layers'][0]}..{fp['moe_layers'][-1]}"
          f", {fp['num_experts']} experts, top-{fp['k_orig']}; {len(configurations)} configurations; "
          f"{tokens} calibration tokens in windows of {seq_len}, batches of {batch_size}")
    start_layer = profile_start_layer(fp["moe_layers"], fp["k_orig"])
    naive = naive_layer_passes(cell_schedule(configurations, start_layer, config.num_hidden_layers, prefix_cache=False),
                               tokens, config.num_hidden_layers)
    steps = cell_schedule(configurations, start_layer, config.num_hidden_layers)
    cached = layer_passes(steps, tokens, min(seq_len, tokens))   # the check runs one window
    print(f"  decoder-layer passes: cached {cached:,}  naive {naive:,}  ratio {cached / naive:.3f}")


def measured_time(calib_tokens: int, rounds: int) -> None:
    model, tok = load_model()
    text, name = read_text(None, "calibration")
    settings = {"calib_tokens": calib_tokens, "progress": False}
    fp = model_fingerprint(model)
    print(f"built-in model ({model.config.model_type}, {model.config.num_hidden_layers} decoder layers, "
          f"{fp['num_moe_layers']} MoE, top-{fp['k_orig']} of {fp['num_experts']}), fp32 on CPU; "
          f"{calib_tokens} {name} tokens, seq_len and batch size at their defaults; "
          f"{rounds} rounds, cached and naive taking turns")
    seconds: dict[bool, list[float]] = {True: [], False: []}
    cpu_seconds: dict[bool, list[float]] = {True: [], False: []}    # this process only: steadier when shared
    tables, work = {}, {}
    for round_index in range(rounds):
        for cached in (True, False):
            started, cpu_started = time.perf_counter(), time.process_time()
            profile = profile_sensitivity(model, tok, text, {**settings, "prefix_cache": cached}, calib_name=name)
            seconds[cached].append(time.perf_counter() - started)
            cpu_seconds[cached].append(time.process_time() - cpu_started)
            tables[cached], work[cached] = profile["sensitivity"], profile["provenance"]["layer_passes"]
            print(f"  round {round_index + 1} {'cached' if cached else 'naive '}: {seconds[cached][-1]:6.2f} s wall, "
                  f"{cpu_seconds[cached][-1]:6.2f} s CPU", flush=True)
    difference = max(abs(a - b) / abs(b) for ra, rb in zip(tables[True], tables[False]) for a, b in zip(ra, rb))
    for what, times in (("wall", seconds), ("CPU", cpu_seconds)):
        per_round = ", ".join(f"{c / n:.3f}" for c, n in zip(times[True], times[False]))
        cached, naive = statistics.median(times[True]), statistics.median(times[False])
        print(f"  median {what:4s}: cached {cached:.2f} s, naive {naive:.2f} s, ratio {cached / naive:.3f} "
              f"(per round {per_round})")
    print(f"  tables differ by at most {difference:.1e} (relative)")
    print(f"  decoder-layer passes recorded: cached {work[True]:,}  naive {work[False]:,}  "
          f"ratio {work[True] / work[False]:.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calib-tokens", type=int, default=4096, help="built-in model: calibration tokens")
    parser.add_argument("--rounds", type=int, default=3, help="built-in model: cached/naive pairs timed")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads (1 keeps timings steady on a shared machine)")
    parser.add_argument("--shape-tokens", type=int, default=8192, help="counted shape: calibration tokens")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"machine: {cpu_name()}, {os.cpu_count()} cores seen, {torch.get_num_threads()} torch thread(s); "
          f"torch {torch.__version__}, python {platform.python_version()}")
    counted_work("deepseek-v2-lite", args.shape_tokens, 2048, 4)
    measured_time(args.calib_tokens, args.rounds)


if __name__ == "__main__":
    main()
