"""The router's own time, old against new, side by side in one run (issue 36, item 2).

Times a MoE layer's patched router forward (scores, selection, weights, counts: everything a plan
adds before the experts run) and a whole decode step of the model, under one implementation of
routing/apply.py taken from git (`--baseline`, by default the merge-base with main: the code before
the router was split into pieces) and the working tree's, in interleaved rounds (ABBA order, so a
drift in the machine's speed falls on both), checks that both run the same aten operations in the
same order (then a gap in time is Python's alone), and prints each one's median time and the median of the
rounds' new / old.

Cases: decode of 1 and 8 sequences (one token each) and a 256-token prefill, under
  static     top-3 of 6 in every layer (the router's fast path)
  alloc-t    Alloc-T k = 3 (per-token counts; a single decode token takes the fast path)
  mixed      rows alternating top-2 and Alloc-T k = 3.5 (two plans in one pass; B > 1 only)
  stand-in   the static and the Alloc-T plans with random expert means (stand-ins for skipped experts)
  distinct   at most 8 distinct experts per decode step (decode of 8 only)

    python benchmarks/router_speed.py [--rounds 7] [--calls 200] [--steps 20] [--threads 1]
        [--baseline REV] [--output-json FILE]

With one thread the clock is the thread's CPU time (`--clock cpu`), so that other work on a shared
machine, which takes the CPU away between calls, does not count; the ratio is the median over rounds
of each round's new / old. The step is model(input_ids [B, 1]) without a KV cache (attention over one position), so the
router's share of it is as large as a decode step's can be on this model.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from machine import cpu_name  # noqa: E402

from allocmoe import load_model  # noqa: E402
from allocmoe.core.means import ExpertMeans  # noqa: E402
from allocmoe.core.plan import Plan  # noqa: E402
from allocmoe.core.policies import AllocT, DistinctExperts, StaticTopK  # noqa: E402
from allocmoe.integrations import vllm_routing as new_vllm  # noqa: E402
from allocmoe.routing import apply as new_apply  # noqa: E402
from allocmoe.routing.adapters import adapter_for_model  # noqa: E402
from allocmoe.routing.layout import model_fingerprint  # noqa: E402
from allocmoe.routing.substitute import layer_substitute  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def load_baseline(rev: str, module: str = "routing/apply.py"):
    """src/allocmoe/<module> as of `rev`, imported beside the working tree's (as allocmoe.routing.
    _apply_baseline for routing/apply.py), so its relative imports resolve inside the working tree."""
    text = subprocess.run(["git", "-C", REPO, "show", f"{rev}:src/allocmoe/{module}"], check=True,
                          capture_output=True, text=True).stdout
    package, name = module[:-3].rsplit("/", 1)
    path = os.path.join(tempfile.mkdtemp(prefix="router_speed_"), f"{name}_baseline.py")
    with open(path, "w") as f:
        f.write(text)
    spec = importlib.util.spec_from_file_location(f"allocmoe.{package}._{name}_baseline", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def plans_for(model, name: str, with_means: bool) -> list[Plan]:
    fingerprint = model_fingerprint(model)
    layers = fingerprint["moe_layers"]

    def plan(policy) -> Plan:
        out = Plan(model=fingerprint, layers={i: policy for i in layers}, method="bench", budget=0.0)
        if with_means:
            gen = torch.Generator().manual_seed(0)
            out.means = ExpertMeans({i: torch.randn(fingerprint["num_experts"], model.config.hidden_size,
                                                    generator=gen) * 0.01 for i in layers}, tokens=1)
        return out

    if name == "static":
        return [plan(StaticTopK(3))]
    if name == "alloc-t":
        return [plan(AllocT(3.0))]
    if name == "mixed":
        return [plan(StaticTopK(2)), plan(AllocT(3.5))]
    return [plan(DistinctExperts(8))]


CASES = [  # (label, plan kind, with means, rows, tokens per row)
    ("decode-1  static", "static", False, 1, 1), ("decode-1  alloc-t", "alloc-t", False, 1, 1),
    ("decode-1  stand-in static", "static", True, 1, 1),
    ("decode-8  static", "static", False, 8, 1), ("decode-8  alloc-t", "alloc-t", False, 8, 1),
    ("decode-8  mixed", "mixed", False, 8, 1), ("decode-8  stand-in static", "static", True, 8, 1),
    ("decode-8  stand-in alloc-t", "alloc-t", True, 8, 1), ("decode-8  distinct", "distinct", False, 8, 1),
    ("prefill-256 static", "static", False, 1, 256), ("prefill-256 alloc-t", "alloc-t", False, 1, 256),
    ("prefill-256 mixed (2x128)", "mixed", False, 2, 128), ("prefill-256 stand-in alloc-t", "alloc-t", True, 1, 256),
]


def layer_forward(module, model, plans: list[Plan], rows: int):
    """One MoE layer's router forward as `module` builds it, with its context set for `rows` rows."""
    adapter = adapter_for_model(model)
    layer = adapter.moe_layers(model)[0]
    ctx = module.RoutingContext(batch_size=rows)
    if len(plans) > 1:
        ctx.row_plans = [r % len(plans) for r in range(rows)]
    policies = [p.layers[layer.index] for p in plans]
    means = [layer_substitute(p, layer) for p in plans]
    build = getattr(module, "router_forward", None) or module._router_forward
    return build(adapter, layer, policies, adapter.k_orig(), ctx, module.LayerStats(), None, means, {})


CLOCK = time.perf_counter


def time_calls(fn, calls: int) -> float:
    start = CLOCK()
    for _ in range(calls):
        fn()
    return (CLOCK() - start) / calls


def interleaved(run_old, run_new, rounds: int, calls: int) -> tuple[float, float, float, float]:
    """(old, new) median seconds per call over `rounds` rounds in ABBA order, the median of the
    rounds' new / old (each round's pair ran side by side) and the ratio of the fastest rounds (the
    one least moved by other load on a shared machine)."""
    old, new = [], []
    run_old(), run_new()                                                    # warm up
    for r in range(rounds):
        pair = [(old, run_old), (new, run_new)]
        for out, run in (pair if r % 2 == 0 else pair[::-1]):
            out.append(time_calls(run, calls))
    return (statistics.median(old), statistics.median(new), statistics.median(n / o for o, n in zip(old, new)),
            min(new) / min(old))


class _OpLog:
    """The aten operations a call runs, in order (a TorchDispatchMode, made on first use)."""

    def __new__(cls):
        from torch.utils._python_dispatch import TorchDispatchMode

        class Log(TorchDispatchMode):
            def __init__(self):
                super().__init__()
                self.ops: list[str] = []

            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                self.ops.append(str(func))
                return func(*args, **(kwargs or {}))

        return Log()


def same_ops(run_old, run_new) -> bool:
    """Do both run the same aten operations in the same order? Then any gap in time is Python's."""
    logs = []
    for run in (run_old, run_new):
        with _OpLog() as log:
            run()
        logs.append(log.ops)
    return logs[0] == logs[1]


def bench_layer(model, baseline, kind, with_means, rows, per_row, rounds, calls):
    plans = plans_for(model, kind, with_means)
    hidden = torch.randn(rows, per_row, model.config.hidden_size, generator=torch.Generator().manual_seed(1))
    old_fwd, new_fwd = (layer_forward(m, model, plans, rows) for m in (baseline, new_apply))
    same = [torch.equal(a, b) for a, b in zip(old_fwd(hidden), new_fwd(hidden))]     # logits, weights, index
    if not all(same):
        raise SystemExit(f"old and new routers disagree on {kind} (with means: {with_means}): {same}")
    ops = same_ops(lambda: old_fwd(hidden), lambda: new_fwd(hidden))
    return (*interleaved(lambda: old_fwd(hidden), lambda: new_fwd(hidden), rounds, calls), ops)


def bench_step(model, baseline, kind, with_means, rows, rounds, steps):
    plans = plans_for(model, kind, with_means)
    ids = torch.randint(1, model.config.vocab_size, (rows, 1), generator=torch.Generator().manual_seed(2))

    def runner(module):
        def run():
            handle = module.apply_plans(model, plans)
            if len(plans) > 1:
                handle.context.row_plans = [r % len(plans) for r in range(rows)]
            try:
                for _ in range(steps):
                    model(input_ids=ids, use_cache=False)
            finally:
                handle.remove()
        return run

    old, new, ratio, fastest = interleaved(runner(baseline), runner(new_apply), rounds, 1)
    return old / steps, new / steps, ratio, fastest


VLLM_CASES = [  # (label, plan kind, with means, requests, tokens per request)
    ("decode-8  static", "static", False, 8, 1), ("decode-8  alloc-t", "alloc-t", False, 8, 1),
    ("decode-8  mixed", "mixed", False, 8, 1), ("decode-8  stand-in alloc-t", "alloc-t", True, 8, 1),
    ("decode-8  distinct", "distinct", False, 8, 1), ("prefill-256 alloc-t", "alloc-t", False, 1, 256),
    ("prefill-256 distinct", "distinct", False, 1, 256),
]


def bench_vllm(model, baseline, kind, with_means, requests, per_request, rounds, calls):
    """The vLLM plugin's selection of one layer's step (integrations/vllm_routing.py: select), old and new."""
    policies = [p.layers[model_fingerprint(model)["moe_layers"][0]] for p in plans_for(model, kind, False)]
    if kind == "distinct":
        policies = [DistinctExperts(4)]                                   # below K: prompts choose too
    k_orig, num_experts = model.config.num_experts_per_tok, model.config.n_routed_experts
    logits = torch.randn(requests * per_request, num_experts, generator=torch.Generator().manual_seed(3))
    segments = [(r * per_request, (r + 1) * per_request, r % len(policies)) for r in range(requests)]
    with_means = [with_means] * len(policies)
    runs = []
    for module in (baseline, new_vllm):
        spec = module.RouterSpec(k_orig, "softmax", False)
        runs.append(lambda m=module, spec=spec: m.select(spec, logits, segments, policies, with_means))
    a, b = runs[0](), runs[1]()
    if not (torch.equal(a.ids, b.ids) and torch.equal(a.weights, b.weights) and torch.equal(a.counts, b.counts)
            and a.loaded == b.loaded):
        raise SystemExit(f"old and new vLLM selections disagree on {kind}")
    return interleaved(runs[0], runs[1], rounds, calls)


def report(results: list[dict], what: str, case: str, unit: float, old, new, ratio, fastest, ops=None) -> None:
    """Print one row (times in 1 / unit seconds) and keep it for --output-json."""
    results.append({"what": what, "case": case, "old_s": old, "new_s": new, "ratio": ratio, "fastest_ratio": fastest,
                    **({"same_ops": ops} if ops is not None else {})})
    same = "" if ops is None else ("  yes" if ops else "  NO")
    print(f"{case:34s} {old * unit:9.2f} {new * unit:9.2f} {ratio:8.3f} {fastest:8.3f}{same}")


def header(title: str, unit: str, extra: str = "") -> None:
    print(f"\n{title:34s} {'old ' + unit:>9s} {'new ' + unit:>9s} {'new/old':>8s} {'fastest':>8s}{extra}")


def run_all(model, baseline, vllm_baseline, args) -> list[dict]:
    """Every case, old against new: the router per layer, the decode step, the vLLM plugin's selection."""
    results: list[dict] = []
    header("router forward, one MoE layer", "us", "  same aten ops")
    for label, kind, with_means, rows, per_row in CASES:
        calls = args.calls if per_row == 1 else max(1, args.calls // 8)
        *times, ops = bench_layer(model, baseline, kind, with_means, rows, per_row, args.rounds, calls)
        report(results, "layer", label, 1e6, *times, ops)
    if not args.skip_steps:
        header("decode step, whole model (no cache)", "ms")
        for label, kind, with_means, rows, per_row in CASES:
            if per_row == 1:
                report(results, "step", label, 1e3, *bench_step(model, baseline, kind, with_means, rows, args.rounds,
                                                                 args.steps))
    header("vLLM plugin selection, one layer", "us")
    for label, kind, with_means, requests, per_request in VLLM_CASES:
        calls = args.calls if per_request == 1 else max(1, args.calls // 8)
        report(results, "vllm", label, 1e6, *bench_vllm(model, vllm_baseline, kind, with_means, requests, per_request,
                                                         args.rounds, calls))
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--baseline", default=None, help="git revision of the old apply.py (default: merge-base "
                                                         "of HEAD and main)")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--calls", type=int, default=200, help="router calls per round (decode; prefill: / 8)")
    parser.add_argument("--steps", type=int, default=20, help="decode steps per round")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--output-json", default=None)
    parser.add_argument("--clock", choices=["wall", "cpu"], default="cpu",
                        help="cpu (default): this thread's CPU time, which time spent descheduled on a shared "
                             "machine does not inflate; wall: perf_counter")
    parser.add_argument("--skip-steps", action="store_true", help="time the router alone (the steps take longest)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    global CLOCK
    CLOCK = time.thread_time if args.clock == "cpu" and args.threads == 1 else time.perf_counter
    rev = args.baseline or subprocess.run(["git", "-C", REPO, "merge-base", "HEAD", "main"], check=True,
                                          capture_output=True, text=True).stdout.strip()
    baseline, vllm_baseline = load_baseline(rev), load_baseline(rev, "integrations/vllm_routing.py")
    model, _ = load_model()
    print(f"machine: {cpu_name()}, torch threads {args.threads}, clock {CLOCK.__name__}; baseline at {rev[:12]}; "
          f"built-in model (E={model.config.n_routed_experts}, K={model.config.num_experts_per_tok}, "
          f"H={model.config.hidden_size}), float32, {args.rounds} interleaved rounds")
    with torch.inference_mode():
        results = run_all(model, baseline, vllm_baseline, args)
    for what in ("layer", "step", "vllm"):
        ratios = [r["ratio"] for r in results if r["what"] == what]
        fastest = [r["fastest_ratio"] for r in results if r["what"] == what]
        if ratios:
            print(f"geometric mean new/old, {what}: {statistics.geometric_mean(ratios):.3f} (median of rounds), "
                  f"{statistics.geometric_mean(fastest):.3f} (fastest rounds)")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({"machine": cpu_name(), "baseline": rev, "threads": args.threads, "rounds": args.rounds,
                       "clock": CLOCK.__name__, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
