"""The elastic budget under a ramping load (issue 38): `allocmoe serve --latency-target-ms T` beside
the full model, on loopback, in one run that stops by itself.

    python benchmarks/elastic_load.py                                  # defaults below, about 20 minutes
    python benchmarks/elastic_load.py --num-layers 3 --vocab-size 102400   # the first run's model (docs/serve.md)
    python benchmarks/elastic_load.py --shape olmoe-1b-7b           # no shared experts: 1/3 cuts more of a step

The model is the DeepSeek-V2-Lite shape with random weights that `allocmoe bench` builds
(`synthetic:deepseek-v2-lite`, here with `--num-layers` of its 27 layers), saved once to a temporary
folder with the built-in tokenizer so that `allocmoe serve` can load it. By default its vocabulary is
the tokenizer's 4,096 words, not 102,400: a budget buys time only in the routed experts, which are 55%
of a decode step's multiply-adds at the full 27 layers, but 21% of the 3 layers that fit this
machine's memory when the 102,400-word output layer (0.4 GFLOP per row) is kept; 6 layers with the
small vocabulary put them back at 51% (every layer keeps the real shape). With `--vocab-size` above
the tokenizer's, the output rows past it are zeroed so generated ids decode (the work is unchanged).
`--shape olmoe-1b-7b` takes OLMoE-1B-7B's layers instead (64 experts of 1024, top-8, no shared
experts: the routed experts are 75% of a layer's multiply-adds, where DeepSeek-V2-Lite's 2 shared
experts always run). The ladder is the full model and uniform plans at 5/6, 2/3, 1/2 and 1/3 of
top-K, given as --plan files (a random model has no profile worth making).

First a plain server (no target) runs one client for `--warmup` requests; its own measured decode
step time (allocmoe_time_per_output_token_seconds on /metrics) sets T = `--target-factor` x that.
Then the elastic server (T) takes a ramp of concurrent clients (`--levels`, each held
`--level-seconds`; each client sends streaming completions back to back, and a level ends when its
requests have finished) twice per level, in turn: once with requests that opt out
(`"allocmoe": {"elastic": false}`: the full model, never stepped down) and once elastic, so the two
columns see the same machine state (this machine is shared; a server per column, one after the
other, measured the load of the hour as much as the server). Per level and server: time per output token p50/p95 over requests
((last token - first token) / (tokens - 1)), generated tokens/s, and the mean decode budget served
(measured activations per token over the full model's), side by side; a PNG plot when matplotlib
is installed. Every request must come back in full; failures are counted and printed.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

from serve_load import free_port, launch      # benchmarks/, this script's folder, is on sys.path

PROMPTS = ["The king said unto them", "Once upon a time there was a", "In the beginning of the year",
           "A man walked into the room and", "She looked at him and said", "And it came to pass that the"]
LADDER = {"b56": "5/6", "b23": "2/3", "b12": "1/2", "b13": "1/3"}


def build_folder(folder: Path, shape: str, num_layers: int, vocab_size: int) -> dict[str, Path]:
    """The synthetic model and the built-in tokenizer in `folder`; the ladder's plan files beside it."""
    import torch

    from allocmoe import allocate, load_model
    from allocmoe.measure import synthetic

    _, tok = load_model()
    if vocab_size < len(tok):
        raise SystemExit(f"--vocab-size must hold the built-in tokenizer's {len(tok)} words, got {vocab_size}")
    model = synthetic.build_synthetic(synthetic.PREFIX + shape, num_layers, overrides={"vocab_size": vocab_size})
    with torch.no_grad():
        model.lm_head.weight[len(tok):] = 0          # ids past the tokenizer never win (same work per step)
    plans = {}
    for name, budget in LADDER.items():
        plans[name] = folder / f"{name}.json"
        allocate(budget, "uniform", model=model).save(plans[name])
    model.save_pretrained(folder / "model")
    tok.save_pretrained(folder / "model")
    del model
    return plans


def start_server(args, folder: Path, plans: dict[str, Path], target_ms: float | None, log) -> tuple:
    port = free_port()
    cmd = [sys.executable, "-m", "allocmoe.cli", "serve", "--model", str(folder / "model"), "--port", str(port),
           "--max-batch-size", str(args.max_batch_size), "--max-queue", "1024", "--log-level", "warning"]
    if target_ms is not None:
        cmd += ["--latency-target-ms", f"{target_ms:.3f}", "--record-plans"]
        for name, path in plans.items():
            cmd += ["--plan", f"{name}={path}"]
    return launch(cmd, port, log, seconds=600)


def one_request(http: httpx.Client, base: str, prompt: str, max_tokens: int, elastic: bool = True) -> dict:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    if not elastic:
        body["allocmoe"] = {"elastic": False}       # the full model, on the same server
    start = time.perf_counter()
    first = last = None
    usage = None
    with http.stream("POST", f"{base}/v1/completions", json=body) as response:
        if response.status_code != 200:
            return {"ok": False, "error": f"{response.status_code} {response.read().decode()[:200]}"}
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if event.get("choices"):
                now = time.perf_counter()
                first, last = first or now, now
            if event.get("usage"):
                usage = event["usage"]
    tokens = usage["completion_tokens"] if usage else 0
    if tokens != max_tokens or first is None:
        return {"ok": False, "error": f"{tokens} of {max_tokens} tokens"}
    spent = usage["allocmoe"]
    return {"ok": True, "tokens": tokens, "started": start, "tpot": (last - first) / max(1, tokens - 1),
            "budget": spent["decode_activations_per_token"] / spent["full_activations_per_token"],
            "plans": spent.get("plans") or []}


def run_level(base: str, clients: int, seconds: float, max_tokens: int, elastic: bool) -> dict:
    """`clients` threads, each sending requests back to back until `seconds` have passed."""
    results, lock = [], threading.Lock()
    start = time.perf_counter()
    deadline = start + seconds

    def client(i: int) -> None:
        with httpx.Client(timeout=1800) as http:
            n = 0
            while time.perf_counter() < deadline:
                try:
                    result = one_request(http, base, PROMPTS[(i + n) % len(PROMPTS)], max_tokens, elastic)
                except httpx.HTTPError as exc:
                    result = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
                n += 1
                with lock:
                    results.append(result)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    done = [r for r in results if r["ok"]]
    tpot = sorted(r["tpot"] for r in done) or [float("nan")]
    return {"clients": clients, "requests": len(results), "failed": len(results) - len(done),
            "errors": [r["error"] for r in results if not r["ok"]][:3], "wall_s": wall,
            "tokens_per_s": sum(r["tokens"] for r in done) / wall, "tpot_p50_s": pct(tpot, 50),
            "tpot_p95_s": pct(tpot, 95),
            "mean_budget": statistics.fmean(r["budget"] for r in done) if done else float("nan"),
            "passes_per_plan": passes_per_plan(done)}


def passes_per_plan(done: list[dict]) -> dict[str, int]:
    """Forward passes per plan over the level's requests (--record-plans: each request's plan per pass,
    run-length, its prefill first), so a mean budget can be read as the rungs that made it."""
    counts: dict[str, int] = {}
    for result in done:
        for name, passes in result["plans"]:
            counts[name] = counts.get(name, 0) + int(passes)
    return counts


def pct(values: list[float], q: float) -> float:
    return values[min(len(values) - 1, max(0, round(q / 100 * (len(values) - 1))))]


def decode_steps(base: str) -> tuple[float, float]:
    """(sum of seconds, count) of the server's measured decode steps (time per output token), from /metrics."""
    text = httpx.get(f"{base}/metrics").text
    found = {m.group(1): float(m.group(2)) for m in
             re.finditer(r'^allocmoe_time_per_output_token_seconds_(sum|count) (\S+)$', text, re.M)}
    return found.get("sum", 0.0), found.get("count", 0.0)


def stop(proc) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()


def plot(result: dict, path: Path) -> None:
    try:
        import matplotlib
    except ImportError:
        print("matplotlib is not installed: no plot (pip install matplotlib)")
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    steps = list(range(len(result["levels"])))
    for (name, cells), color in zip(result["cells"].items(), ("tab:gray", "tab:blue")):
        axes[0].plot(steps, [c["tpot_p95_s"] * 1000 for c in cells], marker="o", color=color, label=f"{name} p95")
        axes[0].plot(steps, [c["tpot_p50_s"] * 1000 for c in cells], marker="x", color=color, linestyle="--",
                     label=f"{name} p50")
        axes[1].plot(steps, [c["tokens_per_s"] for c in cells], marker="o", color=color, label=name)
        axes[2].plot(steps, [c["mean_budget"] for c in cells], marker="o", color=color, label=name)
    axes[0].axhline(result["target_ms"], color="tab:red", linewidth=1, label=f"T = {result['target_ms']:.0f} ms")
    for ax, label in zip(axes, ("time per output token (ms)", "generated tokens/s", "mean budget served")):
        ax.set_xticks(steps, [str(c) for c in result["levels"]])
        ax.set_xlabel("concurrent clients (in ramp order)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    s = result["settings"]
    fig.suptitle(f"allocmoe serve --latency-target-ms, {s.get('shape', 'deepseek-v2-lite')} shape ({s['num_layers']} layers, "
                 f"{s.get('vocab_size', 102400)} words, random), "
                 f"{s['max_tokens']} tokens/request, {result['machine']['cpus']} CPUs", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="deepseek-v2-lite", choices=("deepseek-v2-lite", "olmoe-1b-7b",
                        "qwen1.5-moe-a2.7b"), help="the synthetic shape `allocmoe bench` builds (default "
                        "deepseek-v2-lite; olmoe-1b-7b has no shared experts, so a budget cuts more of a step)")
    parser.add_argument("--num-layers", type=int, default=6, help="decoder layers of the shape (default 6: 1 dense "
                        "+ 5 MoE, about 12 GB in float32)")
    parser.add_argument("--vocab-size", type=int, default=4096, help="output words (default 4096, the built-in "
                        "tokenizer's; DeepSeek-V2-Lite's 102400 makes the output layer most of a shallow model's step)")
    parser.add_argument("--levels", default="1,2,3,4,8,16,32,16,8,4,3,2,1", help="concurrent clients, in ramp "
                        "order (3 is there because on 2 CPU cores even the smallest plan stops meeting T near it)")
    parser.add_argument("--level-seconds", type=float, default=20.0, help="seconds each level sends new requests "
                        "(its requests then finish; default 20: a few requests per client at low load, for the p95)")
    parser.add_argument("--max-tokens", type=int, default=24, help="new tokens per request (default 24: a prefill "
                        "between decode steps, which counts against T, is spread over more tokens)")
    parser.add_argument("--max-batch-size", type=int, default=32, help="server --max-batch-size (default 32)")
    parser.add_argument("--target-factor", type=float, default=1.3, help="T over the one-client step time (default 1.3)")
    parser.add_argument("--warmup", type=int, default=4, help="one-client requests that measure the step time")
    parser.add_argument("--output-dir", default="docs/serve", help="where elastic_load.json/.png go")
    args = parser.parse_args()
    levels = [int(c) for c in args.levels.split(",")]
    if not levels or min(levels) < 1 or args.level_seconds <= 0 or args.max_tokens < 2 or args.num_layers < 2:
        raise SystemExit("levels >= 1, --level-seconds > 0, --max-tokens >= 2, --num-layers >= 2")
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    began = time.perf_counter()
    with tempfile.TemporaryDirectory(dir=os.environ.get("TMPDIR")) as tmp:
        folder = Path(tmp)
        print(f"building the {args.shape} shape with {args.num_layers} layers, {args.vocab_size} words in {folder} ...",
              flush=True)
        plans = build_folder(folder, args.shape, args.num_layers, args.vocab_size)
        log = open(folder / "server.log", "w+")
        proc, base = start_server(args, folder, plans, None, log)
        try:
            with httpx.Client(timeout=1800) as http:
                one_request(http, base, PROMPTS[0], args.max_tokens)            # first call: not counted
                before = decode_steps(base)
                for i in range(args.warmup):
                    one_request(http, base, PROMPTS[i % len(PROMPTS)], args.max_tokens)
            after = decode_steps(base)
            step = (after[0] - before[0]) / max(1.0, after[1] - before[1])
            target_ms = args.target_factor * step * 1000
            print(f"one-client decode step {step * 1000:.1f} ms (the server's own measure); T = {target_ms:.1f} ms",
                  flush=True)
        finally:
            stop(proc)
        proc, base = start_server(args, folder, plans, target_ms, log)
        try:
            with httpx.Client(timeout=1800) as http:
                one_request(http, base, PROMPTS[0], args.max_tokens, elastic=False)   # first call: not counted
            cells = ramp(base, levels, args)
        finally:
            stop(proc)
    result = {"settings": vars(args), "levels": levels, "one_client_step_ms": step * 1000, "target_ms": target_ms,
              "cells": cells, "seconds": time.perf_counter() - began,
              "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "processor": platform.processor(),
                          "python": platform.python_version()}}
    print()
    print(table(result))
    (out / "elastic_load.json").write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {out / 'elastic_load.json'}")
    plot(result, out / "elastic_load.png")


def ramp(base: str, levels: list[int], args) -> dict[str, list[dict]]:
    """Each level twice on the one elastic server: its full-model requests (elastic: false) and its
    elastic ones, in turn (which goes first alternates), so both see the same machine state."""
    cells: dict[str, list[dict]] = {"full": [], "elastic": []}
    for n, clients in enumerate(levels):
        for name in (("full", "elastic") if n % 2 == 0 else ("elastic", "full")):
            cell = run_level(base, clients, args.level_seconds, args.max_tokens, elastic=name == "elastic")
            cells[name].append(cell)
            print(f"{name:>8} x{clients:<3} {cell['requests'] - cell['failed']}/{cell['requests']} in full, "
                  f"TPOT p50 {cell['tpot_p50_s'] * 1000:6.1f} ms p95 {cell['tpot_p95_s'] * 1000:6.1f} ms, "
                  f"{cell['tokens_per_s']:6.1f} tok/s, budget {cell['mean_budget']:.2f}"
                  f"{'  passes ' + str(cell['passes_per_plan']) if name == 'elastic' else ''}"
                  f"{'  errors: ' + '; '.join(cell['errors']) if cell['failed'] else ''}", flush=True)
    return cells


def table(result: dict) -> str:
    t = result["target_ms"]
    lines = [f"T = {t:.1f} ms (1.3 x the one-client step of {result['one_client_step_ms']:.1f} ms); "
             "TPOT in ms; 'met' = elastic p95 <= T",
             "| clients | full TPOT p50 / p95 | elastic TPOT p50 / p95 | full tok/s | elastic tok/s | "
             "full budget | elastic budget | elastic p95 <= T |",
             "|---|---|---|---|---|---|---|---|"]
    for full, el in zip(result["cells"]["full"], result["cells"]["elastic"]):
        lines.append(f"| {full['clients']} | {full['tpot_p50_s'] * 1000:.0f} / {full['tpot_p95_s'] * 1000:.0f} | "
                     f"{el['tpot_p50_s'] * 1000:.0f} / {el['tpot_p95_s'] * 1000:.0f} | {full['tokens_per_s']:.1f} | "
                     f"{el['tokens_per_s']:.1f} | {full['mean_budget']:.2f} | {el['mean_budget']:.2f} | "
                     f"{'met' if el['tpot_p95_s'] * 1000 <= t else 'missed'} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
