"""Measure directions for beating the paper's quality at a fixed budget, on the built-in model.

A research bench, not the product: the two add-ons measured here are prototyped by wrapping the
router's combine step from outside (`MoEAdapter.combine`) and a forward hook on each MoE block, so
nothing in allocmoe changes. Every choice is made on calibration text; test text is only reported.

  none         the plan as allocmoe runs it today
  renorm       the kept experts' weights rescaled to the mass of the token's original top-K
  substitute   MoNE-style (arXiv 2507.00390), per token: for each of its top-K candidates the budget
               skipped, add gate weight x that expert's mean output (measured on calibration tokens
               routed to it at full K); one [T, E] x [E, H] product per layer
  refine       substitute, with the allocation moved one activation at a time between layers while
               calibration perplexity improves (best move per round, at most --rounds rounds);
               "refine alone" does the same search without the substitute

Prints, per budget, test perplexity and the share of uniform top-k's increase that each keeps,
(ppl - ppl_full) / (ppl_uniform - ppl_full), with the calibration figure beside it.

    python benchmarks/quality_directions.py [--budgets 1/3,1/2,2/3,5/6] [--rounds 4] [--output FILE]
"""

from __future__ import annotations

import argparse
import copy
import json
import time

import torch

import allocmoe
from allocmoe.calibrate.profile import profile_sensitivity
from allocmoe.core.policies import AllocT
from allocmoe.scoring.perplexity import evaluate_perplexity, tokenize_windows
from allocmoe.routing.adapters import adapter_for_model
from allocmoe.routing.adapters.base import MoEAdapter
from machine import cpu_name


class Substitution:
    """The two add-ons, switched by `mode`: expert means per layer, a combine wrapper and block hooks."""

    def __init__(self, model, windows):
        self.adapter = adapter_for_model(model)
        self.layers = self.adapter.moe_layers(model)
        self.k_orig, self.num_experts = self.adapter.k_orig(), self.adapter.num_experts()
        self.layer_of = {id(layer.router): layer.index for layer in self.layers}
        self.mode, self.pending = "none", {}
        self.means = self._expert_means(model, windows)
        self._native_combine = MoEAdapter.combine
        MoEAdapter.combine = lambda adapter, *args, **kwargs: self._combine(adapter, *args, **kwargs)
        for layer in self.layers:
            layer.block.register_forward_hook(lambda mod, args, out, i=layer.index: self._add(out, i))

    @torch.no_grad()
    def _expert_means(self, model, windows) -> dict[int, torch.Tensor]:
        """Mean output [E, H] of each expert over the calibration tokens whose top-K holds it."""
        inputs = {}
        hooks = [layer.block.register_forward_pre_hook(lambda mod, args, i=layer.index: inputs.__setitem__(i, args[0]))
                 for layer in self.layers]
        hidden = model.config.hidden_size
        sums = {layer.index: torch.zeros(self.num_experts, hidden) for layer in self.layers}
        counts = {layer.index: torch.zeros(self.num_experts) for layer in self.layers}
        for batch in windows.split(4):
            model(input_ids=batch)
            for layer in self.layers:
                h = inputs[layer.index].reshape(-1, hidden)                              # [T, H]
                top = self.adapter.score(layer.router, h).ranking.topk(self.k_orig, dim=-1).indices  # [T, K]
                experts = layer.experts
                for e in range(self.num_experts):
                    rows = (top == e).any(-1)                                            # [T]
                    if rows.any():
                        gate, up = torch.nn.functional.linear(h[rows], experts.gate_up_proj[e]).chunk(2, dim=-1)
                        out = torch.nn.functional.linear(experts.act_fn(gate) * up, experts.down_proj[e])
                        sums[layer.index][e] += out.sum(0)
                        counts[layer.index][e] += rows.sum()
        for hook in hooks:
            hook.remove()
        return {i: sums[i] / counts[i].clamp_min(1)[:, None] for i in sums}

    def _combine(self, adapter, router, scores, index, keep, renormalize=None):
        weights = self._native_combine(adapter, router, scores, index, keep, renormalize)   # [T, W]
        if self.mode == "none":
            return weights
        top = scores.ranking.topk(self.k_orig, dim=-1).indices                              # [T, K]
        in_top = torch.zeros_like(scores.gates, dtype=torch.bool).scatter_(1, top, True)    # [T, E]
        kept = torch.zeros_like(scores.gates, dtype=torch.bool).scatter_(1, index, keep)    # [T, E]
        if self.mode == "renorm":
            full = (scores.gates * in_top).sum(-1, keepdim=True)
            return weights * full / (scores.gates * kept).sum(-1, keepdim=True).clamp_min(1e-20)
        skipped = scores.gates * (in_top & ~kept)                                           # [T, E]
        self.pending[self.layer_of[id(router)]] = skipped @ self.means[self.layer_of[id(router)]]   # [T, H]
        return weights

    def _add(self, out, index):
        extra = self.pending.pop(index, None)
        return out if extra is None or self.mode != "substitute" else out + extra.view_as(out).to(out.dtype)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budgets", default="1/3,1/2,2/3,5/6")
    parser.add_argument("--rounds", type=int, default=4, help="refinement rounds at most")
    parser.add_argument("--calib-tokens", type=int, default=8192)
    parser.add_argument("--eval-tokens", type=int, default=16384)
    parser.add_argument("--output", default=None, help="also write the rows as JSON")
    args = parser.parse_args()
    torch.set_grad_enabled(False)
    torch.set_num_threads(1)
    started = time.time()
    model, tok = allocmoe.load_model()
    calib = tokenize_windows(tok, allocmoe.read_text(None, "calibration")[0], 512, args.calib_tokens)
    test = tokenize_windows(tok, allocmoe.read_text(None, "test")[0], 512, args.eval_tokens)
    print(f"# built-in model; {cpu_name()}, 1 torch thread, fp32; calibration "
          f"{calib.numel() - calib.size(0)} scored tokens, test {test.numel() - test.size(0)}; windows of 512")

    def ppl(plan, windows) -> float:
        run = lambda: evaluate_perplexity(model, tok, "", {"windows_per_pass": 4, "progress": False}, windows=windows)
        if plan is None:
            return run().perplexity
        with allocmoe.apply_plan(model, plan):
            return run().perplexity

    sub = Substitution(model, calib)
    profile = profile_sensitivity(model, tok, allocmoe.read_text(None, "calibration")[0],
                                  {"calib_tokens": args.calib_tokens, "progress": False})
    full = (ppl(None, calib), ppl(None, test))
    print(f"full: calibration {full[0]:.2f}, test {full[1]:.2f}")
    rows = []
    for budget in args.budgets.split(","):
        uniform = allocmoe.allocate(budget, "uniform", model=model, config={"progress": False})
        sub.mode = "none"
        base = (ppl(uniform, calib), ppl(uniform, test))

        def record(name, plan, mode):
            sub.mode = mode
            got = (ppl(plan, calib), ppl(plan, test))
            share = [(g - f) / (b - f) for g, f, b in zip(got, full, base)]
            rows.append({"budget": budget, "method": name, "calibration": got[0], "test": got[1],
                         "share_calibration": share[0], "share_test": share[1], "k": plan.k_text()})
            print(f"{budget:>4} {name:28} test {got[1]:8.2f} share {share[1]:6.3f}   "
                  f"(calibration {got[0]:8.2f} share {share[0]:6.3f})  [{plan.k_text()}]", flush=True)

        plan = allocmoe.allocate(budget, "alloc-moe", profile=profile, model=model, config={"progress": False})
        for method, p in (("uniform", uniform), ("alloc-moe", plan)):
            for mode in ("none", "renorm", "substitute"):
                record(f"{method} + {mode}", p, mode)
        sub.mode = "none"
        refined, evals = refine(plan, lambda p: ppl(p, calib), sub.k_orig, args.rounds)
        record(f"alloc-moe + refine alone({evals})", refined, "none")
        sub.mode = "substitute"
        refined, evals = refine(plan, lambda p: ppl(p, calib), sub.k_orig, args.rounds)
        record(f"alloc-moe + refine({evals})", refined, "substitute")
        sub.mode = "none"
    print(f"# {time.time() - started:.0f} s")
    if args.output:
        with open(args.output, "w") as f:
            json.dump({"full": {"calibration": full[0], "test": full[1]}, "rows": rows}, f, indent=2)


def refine(plan, calib_ppl, k_orig: int, rounds: int):
    """Best single move of one activation from layer a to layer b per round, while calibration improves."""
    def with_k(ks):
        out = copy.deepcopy(plan)
        out.layers = {i: AllocT(k=float(k), k_base=min(1, k), pool=plan.layers[i].pool) for i, k in ks.items()}
        return out

    ks = {i: int(round(policy.k)) for i, policy in plan.layers.items()}
    best, evals = calib_ppl(with_k(ks)), 1
    for _ in range(rounds):
        found = None
        for a in ks:
            for b in ks:
                if a != b and ks[a] > 1 and ks[b] < k_orig:
                    trial = {**ks, a: ks[a] - 1, b: ks[b] + 1}
                    got = calib_ppl(with_k(trial))
                    evals += 1
                    if got < best and (found is None or got < found[0]):
                        found = (got, trial)
        if found is None:
            break
        best, ks = found
    return with_k(ks), evals


if __name__ == "__main__":
    main()
