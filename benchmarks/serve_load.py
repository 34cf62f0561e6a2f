"""A bounded load test of `allocmoe serve` on loopback: the full model and a half-budget plan, side
by side in one run, at 1, 8 and 32 concurrent clients.

    python benchmarks/serve_load.py                      # built-in model, writes docs/serve/
    python benchmarks/serve_load.py --requests 16 --max-tokens 32 --concurrency 1,8

It starts the real server (`allocmoe serve`, a subprocess on a free 127.0.0.1 port), sends a fixed
number of streaming completions per (plan, concurrency) cell from that many client threads, and
stops by itself. Every request must come back in full (`max_tokens` tokens, `ignore_eos`); the
counts are printed, so nothing lost goes unseen. Cells alternate full/plan at each concurrency, so
both see the same machine state. Reported per cell: generated tokens/s over the cell's wall time,
latency p50/p95, time to first token p50/p95, and the ratios that matter: tokens/s at 8 clients
over 1 client (batching must pay: >= 3x), and the plan's tokens/s over the full model's.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import queue
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

PROMPTS = ["The king said unto them", "Once upon a time there was a", "In the beginning of the year",
           "A man walked into the room and", "She looked at him and said", "And it came to pass that the",
           "The people of the city", "He went out into the field"]


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def start_server(args, plan_file: Path, log) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [sys.executable, "-m", "allocmoe.cli", "serve", "--port", str(port), "--plan", f"half={plan_file}",
           "--max-batch-size", str(args.max_batch_size), "--max-queue", "1024", "--log-level", "warning"]
    if args.model:
        cmd += ["--model", args.model]
    return launch(cmd, port, log, seconds=300)


def launch(cmd: list[str], port: int, log, seconds: float) -> tuple[subprocess.Popen, str]:
    """Start `allocmoe serve` (cmd, on loopback `port`) and wait until /health answers, at most `seconds`."""
    proc = subprocess.Popen(cmd, stdout=log, stderr=log)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited with {proc.returncode}; see {log.name}")
        try:
            if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                return proc, base
        except httpx.HTTPError:
            time.sleep(0.2)
    proc.kill()
    raise SystemExit(f"the server did not come up within {seconds:.0f} s")


def one_request(http: httpx.Client, base: str, model: str, prompt: str, max_tokens: int) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    first, usage, finish = None, None, None
    with http.stream("POST", f"{base}/v1/completions", json=body) as response:
        if response.status_code != 200:
            return {"ok": False, "status": response.status_code, "error": response.read().decode()[:200]}
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if event.get("choices"):
                first = first or time.perf_counter()
                finish = event["choices"][0]["finish_reason"] or finish
            if event.get("usage"):
                usage = event["usage"]
    end = time.perf_counter()
    tokens = usage["completion_tokens"] if usage else 0
    return {"ok": tokens == max_tokens and finish == "length", "tokens": tokens, "latency": end - start,
            "ttft": (first or end) - start, "activations_per_token": usage["allocmoe"]["activations_per_token"]
            if usage else None}


def run_cell(base: str, model: str, concurrency: int, requests: int, max_tokens: int) -> dict:
    """`requests` completions from `concurrency` client threads; returns the cell's figures."""
    jobs: queue.Queue = queue.Queue()
    for i in range(requests):
        jobs.put(PROMPTS[i % len(PROMPTS)])
    results, lock = [], threading.Lock()

    def client():
        with httpx.Client(timeout=600) as http:
            while True:
                try:
                    prompt = jobs.get_nowait()
                except queue.Empty:
                    return
                try:
                    result = one_request(http, base, model, prompt, max_tokens)
                except httpx.HTTPError as exc:
                    result = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
                with lock:
                    results.append(result)

    start = time.perf_counter()
    threads = [threading.Thread(target=client) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    done = [r for r in results if r["ok"]]
    lat = sorted(r["latency"] for r in done) or [float("nan")]
    ttft = sorted(r["ttft"] for r in done) or [float("nan")]
    acts = [r["activations_per_token"] for r in done if r["activations_per_token"] is not None]
    return {"concurrency": concurrency, "sent": requests, "answered_in_full": len(done),
            "failed": [r for r in results if not r["ok"]][:5], "wall_s": wall,
            "tokens": sum(r["tokens"] for r in done), "tokens_per_s": sum(r["tokens"] for r in done) / wall,
            "latency_p50_s": _pct(lat, 50), "latency_p95_s": _pct(lat, 95),
            "ttft_p50_s": _pct(ttft, 50), "ttft_p95_s": _pct(ttft, 95),
            "activations_per_token": statistics.fmean(acts) if acts else None}


def _pct(sorted_values: list[float], q: float) -> float:
    index = min(len(sorted_values) - 1, max(0, round(q / 100 * (len(sorted_values) - 1))))
    return sorted_values[index]


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    for (name, cells), color in zip(result["cells"].items(), ("tab:blue", "tab:orange")):
        xs = [c["concurrency"] for c in cells]
        ax1.plot(xs, [c["tokens_per_s"] for c in cells], marker="o", color=color, label=name)
        ax2.plot(xs, [c["latency_p50_s"] for c in cells], marker="o", color=color, label=f"{name} p50")
        ax2.plot(xs, [c["latency_p95_s"] for c in cells], marker="x", color=color, linestyle="--",
                 label=f"{name} p95")
    for ax, label in ((ax1, "generated tokens/s"), (ax2, "request latency (s)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent clients")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        ax.legend()
    s = result["settings"]
    fig.suptitle(f"allocmoe serve, {s['model']}, {s['max_tokens']} new tokens/request, "
                 f"{result['machine']['cpus']} CPUs", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="model folder (default: the built-in model)")
    parser.add_argument("--budget", default="1/2", help="the plan's budget (default 1/2)")
    parser.add_argument("--method", default="alloc-t", help="the plan's method (default alloc-t)")
    parser.add_argument("--concurrency", default="1,8,32", help="client counts (default 1,8,32)")
    parser.add_argument("--requests", type=int, default=None, help="requests per cell (default max(16, 2 x clients))")
    parser.add_argument("--max-tokens", type=int, default=64, help="new tokens per request (default 64)")
    parser.add_argument("--max-batch-size", type=int, default=32, help="server --max-batch-size (default 32)")
    parser.add_argument("--output-dir", default="docs/serve", help="where serve_load.json/.png go")
    args = parser.parse_args()
    levels = [int(c) for c in args.concurrency.split(",")]

    import torch

    from allocmoe import allocate, load_model

    model, _ = load_model(args.model)
    plan = allocate(args.budget, args.method, model=model)
    del model
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        plan_file = Path(tmp) / "half.json"
        plan.save(plan_file)
        log = open(Path(tmp) / "server.log", "w+")
        proc, base = start_server(args, plan_file, log)
        name = httpx.get(f"{base}/v1/models").json()["data"][0]["id"]
        models = {"full": name, f"{args.method} {args.budget}": f"{name}@half"}
        try:
            for model_id in models.values():                       # warm-up, not counted
                run_cell(base, model_id, 2, 4, 8)
            cells = {label: [] for label in models}
            for c in levels:
                for label, model_id in models.items():
                    n = args.requests or max(16, 2 * c)
                    cell = run_cell(base, model_id, c, n, args.max_tokens)
                    cells[label].append(cell)
                    print(f"{label:>14} x{c:<3} {cell['answered_in_full']}/{cell['sent']} answered in full, "
                          f"{cell['tokens_per_s']:7.1f} tok/s, latency p50 {cell['latency_p50_s']:.2f} s "
                          f"p95 {cell['latency_p95_s']:.2f} s, ttft p50 {cell['ttft_p50_s']:.3f} s", flush=True)
            mixed = httpx.get(f"{base}/metrics").text
        finally:
            proc.terminate()
            proc.wait(timeout=30)
    mixed_batches = next((float(line.split()[-1]) for line in mixed.splitlines()
                          if line.startswith("allocmoe_mixed_plan_batches_total")), None)
    ratios = {}
    for label, cs in cells.items():
        by = {c["concurrency"]: c["tokens_per_s"] for c in cs}
        ratios[label] = {f"x{c}_over_x1": by[c] / by[1] for c in by if 1 in by and c != 1}
    labels = list(cells)
    ratios["plan_over_full"] = {f"x{a['concurrency']}": b["tokens_per_s"] / a["tokens_per_s"]
                                for a, b in zip(cells[labels[0]], cells[labels[1]])}
    result = {"settings": {"model": args.model or "allocmoe-builtin", "plan": f"{args.method} at {args.budget}",
                           "max_tokens": args.max_tokens, "max_batch_size": args.max_batch_size,
                           "requests_per_cell": args.requests or "max(16, 2 x clients)", "stream": True,
                           "temperature": 0, "ignore_eos": True},
              "machine": {"platform": platform.platform(), "processor": platform.processor(),
                          "cpus": os.cpu_count(), "torch": torch.__version__, "python": platform.python_version()},
              "cells": cells, "ratios": ratios, "all_answered": all(c["answered_in_full"] == c["sent"]
                                                                    for cs in cells.values() for c in cs),
              "mixed_plan_batches_total": mixed_batches}
    (out / "serve_load.json").write_text(json.dumps(result, indent=2) + "\n")
    plot(result, out / "serve_load.png")
    print(json.dumps(ratios, indent=2))
    print(f"all answered in full: {result['all_answered']}; wrote {out}/serve_load.json, serve_load.png")
    if not result["all_answered"]:
        sys.exit(1)


if __name__ == "__main__":
    main()
