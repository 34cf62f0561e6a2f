"""The paper's analyses of a plan: does a token's expert count follow its routing entropy, and
does expert load stay close to the unmodified model's?

  * per token and layer: experts received vs the entropy of the softmax over the router's logits
    (Pearson and Spearman correlation over all (token, layer) pairs, and per layer);
  * per layer: expert load (share of activations per expert) with the plan vs the unmodified model,
    compared by Spearman correlation and Jensen-Shannon divergence (natural log);
  * the per-layer allocation: planned k and measured activations.
Writes JSON and PNG plots. Shape legend: T = tokens, E = routed experts, K = K_orig.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch

from ..routing.adapters import adapter_for_model
from ..routing.apply import apply_plan, static_plan
from ..scoring.perplexity import evaluate_perplexity
from ..core.files import atomic_write_json
from ..core.plan import Plan
from ..routing.layout import model_fingerprint


def ranks(x: torch.Tensor) -> torch.Tensor:
    """Average ranks (ties share their mean rank), 0-based."""
    order = x.argsort()
    sorted_x = x[order]
    r = torch.empty_like(x, dtype=torch.float64)
    _, inverse, counts = torch.unique(sorted_x, return_inverse=True, return_counts=True)
    starts = torch.cumsum(counts, 0) - counts
    mean_rank = (starts + (counts - 1) / 2).double()
    r[order] = mean_rank[inverse]
    return r


def pearson(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double() - a.double().mean(), b.double() - b.double().mean()
    denom = math.sqrt(float((a * a).sum()) * float((b * b).sum()))
    return float((a * b).sum()) / denom if denom > 0 else float("nan")


def spearman(a: torch.Tensor, b: torch.Tensor) -> float:
    return pearson(ranks(a), ranks(b))


def js_divergence(p: torch.Tensor, q: torch.Tensor) -> float:
    p, q = p.double() / p.sum(), q.double() / q.sum()
    m = (p + q) / 2

    def kl(x, y):
        mask = x > 0
        return float((x[mask] * (x[mask] / y[mask]).log()).sum())

    return 0.5 * kl(p, m) + 0.5 * kl(q, m)


class _Collector:
    """Per layer: expert load [E], and per token (count, routing entropy)."""

    def __init__(self, num_experts: int):
        self.num_experts = num_experts
        self.load: dict[int, torch.Tensor] = {}
        self.counts: dict[int, list[torch.Tensor]] = {}
        self.entropy: dict[int, list[torch.Tensor]] = {}
        self._pending: dict[int, torch.Tensor] = {}

    def record(self, layer, cand_idx, cand_probs, counts, valid):
        keep = torch.arange(cand_idx.size(1), device=cand_idx.device)[None, :] < counts[:, None]   # [T, K]
        chosen = cand_idx[keep & valid[:, None]]
        load = torch.bincount(chosen.cpu(), minlength=self.num_experts).double()
        self.load[layer] = self.load.get(layer, torch.zeros(self.num_experts, dtype=torch.float64)) + load
        self.counts.setdefault(layer, []).append(counts[valid].cpu())
        self._pending[layer] = valid.cpu()

    def router_hook(self, layer_index):
        def hook(module, args, output):
            logits = output[0].float()                                       # [T, E]
            p = logits.softmax(-1)
            entropy = -(p * p.clamp_min(1e-30).log()).sum(-1).cpu()           # [T]
            valid = self._pending.pop(layer_index, torch.ones_like(entropy, dtype=torch.bool))
            self.entropy.setdefault(layer_index, []).append(entropy[valid])
        return hook


def _collect(model, tokenizer, plan: Plan, windows, windows_per_pass: int, progress: bool = True) -> _Collector:
    adapter = adapter_for_model(model)
    collector = _Collector(adapter.num_experts())
    with apply_plan(model, plan) as handle:
        handle.context.recorders.append(collector.record)
        hooks = [layer.router.register_forward_hook(collector.router_hook(layer.index))
                 for layer in adapter.moe_layers(model)]
        try:
            evaluate_perplexity(model, tokenizer, "", {"windows_per_pass": windows_per_pass, "progress": progress},
                                windows=windows)
        finally:
            for h in hooks:
                h.remove()
    return collector


@torch.no_grad()
def analyze_plan(model, tokenizer, plan: Plan, windows: torch.Tensor, windows_per_pass: int = 4,
                 progress: bool = True) -> dict[str, Any]:
    """Two passes over `windows` (the full model, then the plan), each with a progress bar unless
    `progress` is False; `windows_per_pass` windows go through the model in one forward pass."""
    fingerprint = model_fingerprint(model)
    full_plan = static_plan(model, [fingerprint["k_orig"]] * fingerprint["num_moe_layers"])
    base = _collect(model, tokenizer, full_plan, windows, windows_per_pass, progress)
    cut = _collect(model, tokenizer, plan, windows, windows_per_pass, progress)
    per_layer, all_counts, all_entropy = {}, [], []
    for index in fingerprint["moe_layers"]:
        counts = torch.cat(cut.counts[index]).double()
        entropy = torch.cat(cut.entropy[index]).double()
        all_counts.append(counts)
        all_entropy.append(entropy)
        varies = counts.std() > 0
        per_layer[str(index)] = {
            "planned_k": plan.layers[index].k, "measured_k": float(counts.mean()),
            "load_spearman": spearman(cut.load[index], base.load[index]),
            "load_js_divergence": js_divergence(cut.load[index], base.load[index]),
            "experts_vs_entropy_spearman": spearman(counts, entropy) if varies else None,
        }
    counts, entropy = torch.cat(all_counts), torch.cat(all_entropy)
    varies = counts.std() > 0
    result = {
        "model": fingerprint, "plan": {"method": plan.method, "budget": plan.budget, "cost": plan.cost()},
        "tokens": int(windows.numel()),
        "experts_vs_entropy": {"pearson": pearson(counts, entropy) if varies else None,
                               "spearman": spearman(counts, entropy) if varies else None,
                               "note": None if varies else "every token gets the same count under this plan"},
        "load_spearman_range": [min(v["load_spearman"] for v in per_layer.values()),
                                max(v["load_spearman"] for v in per_layer.values())],
        "load_js_divergence_max": max(v["load_js_divergence"] for v in per_layer.values()),
        "per_layer": per_layer,
        "paper": {"experts_vs_entropy": "> 0.7", "load_spearman": "0.93-0.99", "load_js_divergence": "< 0.014"},
    }
    result["_samples"] = (counts, entropy, {i: (cut.load[i], base.load[i]) for i in fingerprint["moe_layers"]})
    return result


def write_analysis(result: dict[str, Any], out_dir: str | Path) -> list[Path]:
    """analysis.json and analysis.png into `out_dir`, both or neither (report.written_together)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from .report import save_png, written_together

    out = Path(out_dir)
    counts, entropy, loads = result.pop("_samples")
    fig = _figure(plt, result, counts, entropy, loads)
    try:
        with written_together(out) as folder:
            atomic_write_json(folder / "analysis.json", result)
            save_png(fig, folder / "analysis.png")
    finally:
        plt.close(fig)
    return [out / "analysis.json", out / "analysis.png"]


def _figure(plt, result: dict[str, Any], counts, entropy, loads):
    """The three panels: experts vs entropy, per-layer allocation, expert load of the first MoE layer."""
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    groups = sorted(set(int(c) for c in counts.tolist()))
    axes[0].boxplot([entropy[counts == g].numpy() for g in groups], positions=groups)
    axes[0].set_xlabel("experts the token received")
    axes[0].set_ylabel("routing entropy (nats)")
    sp = result["experts_vs_entropy"]["spearman"]
    axes[0].set_title(f"experts vs entropy (Spearman {sp:.2f})" if sp is not None else "experts vs entropy")
    layers = list(result["per_layer"])
    axes[1].bar(range(len(layers)), [result["per_layer"][i]["planned_k"] or 0 for i in layers], alpha=0.5, label="planned k")
    axes[1].plot(range(len(layers)), [result["per_layer"][i]["measured_k"] for i in layers], "ko-", label="measured")
    axes[1].set_xticks(range(len(layers)), layers)
    axes[1].set_xlabel("MoE layer")
    axes[1].set_title("per-layer allocation")
    axes[1].legend()
    first = layers[0]
    cut, base = loads[int(first)]
    axes[2].bar(range(len(base)), (base / base.sum()).numpy(), alpha=0.5, label="unmodified")
    axes[2].bar(range(len(cut)), (cut / cut.sum()).numpy(), alpha=0.5, label="with plan")
    js = result["per_layer"][first]["load_js_divergence"]
    axes[2].set_title(f"expert load, layer {first} (JS {js:.4f})")
    axes[2].set_xlabel("expert")
    axes[2].legend()
    return fig
