"""One process of two threads against two Ray workers of one thread each, profiling the built-in model.

Both runs profile the same cells from the same windows; the Ray run's time includes starting a local
Ray instance and each worker loading the model (what a user waits for), and is also printed without
them (first cell to last). The tables are compared: bit for bit only when thread counts match, so
here within a relative tolerance (two threads can add a matmul's terms in another order than one).

    python benchmarks/profile_ray.py [--calib-tokens 2048] [--rounds 2]
"""

from __future__ import annotations

import argparse
import os
import platform
import time

import torch

from machine import cpu_name

from allocmoe import profile_sensitivity, read_text
from allocmoe.models import inspect_model


def largest_relative_difference(a, b) -> float:
    return max(abs(x - y) / abs(y) for row_a, row_b in zip(a, b) for x, y in zip(row_a, row_b))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calib-tokens", type=int, default=2048)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    text, _ = read_text(None, "calibration")
    folder = str(inspect_model(None).path)
    config = {"calib_tokens": args.calib_tokens, "progress": False}
    print(f"machine: {cpu_name()} ({os.cpu_count()} logical CPUs), {platform.system()}, torch {torch.__version__}")
    print(f"built-in model, {args.calib_tokens} calibration tokens, prefix cache on")
    singles, rays, firsts = [], [], []
    for round_ in range(args.rounds):
        torch.set_num_threads(2)
        started = time.perf_counter()
        single = profile_sensitivity(folder, None, text, config)
        singles.append(time.perf_counter() - started)
        arrivals = []
        started = time.perf_counter()
        on_ray = profile_sensitivity(folder, None, text, {**config, "ray": "local", "ray_workers": 2,
                                                          "threads_per_worker": 1},
                                     on_cell=lambda layer, k: arrivals.append(time.perf_counter()))
        rays.append(time.perf_counter() - started)
        firsts.append(arrivals[-1] - arrivals[0])
        print(f"round {round_ + 1}: 1 process x 2 threads {singles[-1]:.1f} s; 2 Ray workers x 1 thread "
              f"{rays[-1]:.1f} s with Ray start and model loads ({firsts[-1]:.1f} s first cell to last); "
              f"tables differ by at most {largest_relative_difference(on_ray['sensitivity'], single['sensitivity']):.1e} "
              "relative")
    best_single, best_ray = min(singles), min(rays)
    print(f"best of {args.rounds}: 1 x 2 threads {best_single:.1f} s, 2 workers x 1 thread {best_ray:.1f} s: "
          f"ratio (single / Ray) {best_single / best_ray:.2f}")


if __name__ == "__main__":
    main()
