"""Measure a plan's substitute: passes of the unmodified model over calibration text.

For each MoE layer and routed expert e, over the calibration tokens whose top-K_orig holds e (the
tokens the full model sends to it), read where the model's own experts module runs, so every
family's layout, activation and bias are respected:
- the mean of e's output f_e(x) (MoNE's substitute, rank 0);
- with `rank` r > 0, also a rank-r linear term: the ridge least-squares map B_e from the centred
  input to the centred output, cut to the r directions of its fitted output that carry the most
  variance (reduced-rank regression): down_e = B_e V_r [H, r], up_e = V_r^T [r, H], where V_r
  are the top r eigenvectors of B_e^T S_xx B_e. An expert seen on fewer than H tokens keeps the
  mean alone (its down/up are zero): too few tokens to fit an H x H map.
Unweighted: the plan's routing multiplies by each token's own gate weight at inference.

The fit needs each expert's input second moments: 2 x E x H x H float64 numbers per layer, so the
layers are measured in as many passes as keep that under STATS_BYTES (one pass for small models;
one layer per pass for a DeepSeek-V2-Lite-sized one).

Shape legend: T = tokens, K = K_orig, E = routed experts, H = hidden size, r = rank.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from tqdm import tqdm

from ..core.means import ExpertMeans, LinearTerm
from ..core.plan import Plan
from ..core.policies import StaticTopK
from ..core.regression import Moments
from ..errors import AllocMoeError
from ..routing.adapters import adapter_for_model
from ..routing.experts import compact_experts_forward

RIDGE = 1e-2            # ridge strength, relative to the mean input variance: keeps rare directions from blowing up
STATS_BYTES = 4 << 30   # second moments kept per pass (float64); more layers than fit take more passes


def _linear(moments: Moments, rank: int, ridge: float = RIDGE) -> LinearTerm:
    """Each expert's rank-r term from its group of `moments` (one group per expert); an expert seen on
    fewer than H tokens keeps zeros (its mean alone)."""
    num_experts, hidden = moments.sx.shape
    down = torch.zeros(num_experts, hidden, rank, dtype=torch.float64)
    up = torch.zeros(num_experts, rank, hidden, dtype=torch.float64)
    for e in range(num_experts):
        if float(moments.samples[e]) >= hidden:
            _, _, down[e], up[e] = moments.fit(rank, ridge, group=e)
    return LinearTerm(input_mean=moments.means()[0].float(), down=down.float(), up=up.float())


def _experts_call(args, kwargs) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(hidden states [T, H], top-K experts [T, K], their gate weights [T, K]) of a call to a layer's experts
    module, as a forward pre-hook sees it (positional or by name)."""
    states = args[0] if args else kwargs["hidden_states"]
    top_k_index = args[1] if len(args) > 1 else kwargs["top_k_index"]
    top_k_weights = args[2] if len(args) > 2 else kwargs.get("top_k_weights")
    return states, top_k_index, top_k_weights


def _plan_below(plan: Plan, index: int, fitted: ExpertMeans) -> Plan:
    """`plan` on the MoE layers below `index`, with the stand-ins `fitted` so far (all below it), and full K
    from `index` up: what a bottom-up fit runs while it records layer `index`."""
    full = StaticTopK(plan.k_orig)
    return replace(plan, layers={i: policy if i < index else full for i, policy in plan.layers.items()},
                   means=fitted.restricted(list(fitted.means)) if fitted.means else None, substitute=None)


def check_fit_memory(num_experts: int, hidden: int, rank: int) -> int:
    """The input moments one MoE layer's rank-`rank` fit keeps (bytes; 0 at rank 0), refused when they
    would not fit in the host's free memory. Cheap: the CLI calls it before any weights load."""
    per_layer = 2 * num_experts * hidden * hidden * 8 if rank else 0
    if per_layer:
        from ..core.memory import check_free_memory

        check_free_memory(per_layer, torch.device("cpu"), f"the substitute's rank-{rank} fit",
                          "give --substitute-rank 0 (the means alone) or free memory",
                          detail=f" of input moments per MoE layer ({num_experts} experts x {hidden} x {hidden}, "
                                 "twice, float64)")
    return per_layer


@torch.no_grad()
def measure_expert_means(model, windows: torch.Tensor, batch_size: int = 4, progress: bool = False,
                         rank: int = 0, layers: list[int] | None = None, ridge: float = RIDGE) -> ExpertMeans:
    """Each expert's mean output (and with `rank` > 0 its rank-r linear term, ridge `ridge`) over the
    calibration `windows` [N, S] routed to it at full K; for the MoE layers `layers` only (None: all).
    The model runs as it is: under an installed plan (`refit_expert_means`), the recorded layers must
    be at full K there, and the layers below hand them the plan's inputs."""
    adapter = adapter_for_model(model)
    layers = [layer for layer in adapter.moe_layers(model) if layers is None or layer.index in layers]
    num_experts = adapter.num_experts()
    hidden = model.config.hidden_size
    if not isinstance(rank, int) or isinstance(rank, bool) or not 0 <= rank <= hidden:
        raise AllocMoeError(f"the substitute's rank must be a whole number from 0 to the hidden size {hidden}, got "
                            f"{rank!r}; give --substitute-rank 0..{hidden} (0: the means alone)")
    per_layer = check_fit_memory(num_experts, hidden, rank)
    per_pass = max(1, STATS_BYTES // per_layer) if per_layer else len(layers)
    groups = [layers[i:i + per_pass] for i in range(0, len(layers), per_pass)]
    moments: dict[int, Moments] = {}

    def record(index: int):
        def hook(experts, args, kwargs):
            states, top_k_index, _ = _experts_call(args, kwargs)                    # [T, H], [T, K]
            k = top_k_index.size(-1)
            pairs = top_k_index.reshape(-1, 1)                                      # [T*K, 1]
            x = states.repeat_interleave(k, dim=0)                                  # [T*K, H]
            outputs = compact_experts_forward(experts, x, pairs,
                                              torch.ones(pairs.shape, dtype=states.dtype, device=states.device))
            moments[index].add(x.double().cpu() if rank else None, outputs.double().cpu(), pairs[:, 0].cpu())
        return hook

    device = next(model.parameters()).device
    bar = tqdm(total=len(groups) * len(windows.split(batch_size)), unit="batch", disable=not progress,
               desc="expert means" + (f" + rank {rank}" if rank else ""))
    means, linear = {}, {}
    for group in groups:
        moments.update({layer.index: Moments(hidden, hidden, num_experts, second=rank > 0) for layer in group})
        hooks = [layer.experts.register_forward_pre_hook(record(layer.index), with_kwargs=True) for layer in group]
        try:
            for batch in windows.split(batch_size):
                model(input_ids=batch.to(device))
                bar.update()
        finally:
            for hook in hooks:
                hook.remove()
        for layer in group:
            means[layer.index] = moments[layer.index].means()[1].float()                  # [E, H]
            if rank:
                linear[layer.index] = _linear(moments[layer.index], rank, ridge)
            del moments[layer.index]
    bar.close()
    return ExpertMeans(means=means, tokens=int(windows.numel()), linear=linear or None)


@torch.no_grad()
def refit_expert_means(model, windows: torch.Tensor, plan: Plan, batch_size: int = 4, progress: bool = False,
                       rank: int | None = None, ridge: float = RIDGE) -> ExpertMeans:
    """Sequential calibration (as GPTQ does for quantised layers): `plan`'s stand-ins refitted layer by
    layer, bottom-up, on the inputs the already-cut layers below produce under the plan. For each MoE
    layer l that the plan gives stand-ins (its means' layers), the model runs with the plan (and the
    stand-ins refitted so far) on the MoE layers below l and full K from l up, and layer l's stand-ins
    are fitted on what its experts then receive (`measure_expert_means` for layer l alone). One
    calibration pass per layer with stand-ins. Same layers and ranks (default each layer's own in the
    plan; `rank`: that one on every layer), so the same cost: `plan.means = refit_expert_means(model,
    windows, plan)` after an allocation is chosen."""
    from ..routing.apply import apply_plan

    if plan.means is None:
        raise AllocMoeError("the plan carries no stand-ins to refit; make it with the substitute (--substitute)")
    ranks = plan.means.ranks if rank is None else {i: rank for i in plan.means.means}
    fitted = ExpertMeans(means={}, tokens=int(windows.numel()), linear={})
    for index in tqdm(sorted(plan.means.means), unit="layer", disable=not progress, desc="refit stand-ins"):
        with apply_plan(model, _plan_below(plan, index, fitted)):
            got = measure_expert_means(model, windows, batch_size, rank=ranks[index], layers=[index], ridge=ridge)
        fitted.means[index] = got.means[index]
        if ranks[index]:
            fitted.linear[index] = got.linear[index]
    fitted.linear = fitted.linear or None
    return fitted


class _Stop(Exception):
    """Raised once the layer being fitted has been recorded: the layers above it are not needed."""


@torch.no_grad()
def fit_skipped_standins(model, windows: torch.Tensor, plan: Plan, batch_size: int = 4,
                         progress: bool = False, ridge: float = RIDGE) -> ExpertMeans:
    """`plan`'s stand-ins fitted on what they stand in for (the default fit of a shipped plan's
    stand-ins, docs/quality.md "Stand-ins fitted where they stand in"). Under the plan, layer l's output
    misses sum over the slots it skips of gate x (f_e(x) - stand_in_e(x)); so each expert's stand-in is
    fitted by weighted least squares over the (token, expert) slots where the plan skips it, each
    weighted by the square of its gate weight, on the inputs the plan gives the layer: bottom-up, with
    the plan (and the stand-ins fitted so far) on the MoE layers below, as `refit_expert_means` does.
    Same layers and ranks as `plan.means`, so the same cost. An expert the plan skips on fewer than H
    slots here (too few to fit an H x H map; at rank 0 too) keeps its fit in `plan.means`.
    One pass per layer with stand-ins, each stopped at that layer."""
    from ..routing.apply import apply_plan
    from ..routing.select import candidates, choose

    if plan.means is None:
        raise AllocMoeError("the plan carries no stand-ins to fit; make it with the substitute (--substitute)")
    adapter = adapter_for_model(model)
    layers = {layer.index: layer for layer in adapter.moe_layers(model)}
    num_experts, hidden, k_orig = adapter.num_experts(), model.config.hidden_size, plan.k_orig
    check_fit_memory(num_experts, hidden, plan.means.rank)
    fitted = ExpertMeans(means={}, tokens=int(windows.numel()), linear={})
    device = next(model.parameters()).device
    for index in tqdm(sorted(plan.means.means), unit="layer", disable=not progress, desc="fit stand-ins"):
        layer, policy, rank = layers[index], plan.layers[index], plan.means.ranks[index]
        moments = Moments(hidden, hidden, num_experts, second=rank > 0)
        rows = [0]

        def record(experts, args, kwargs):
            states, top_k_index, top_k_weights = _experts_call(args, kwargs)           # [T, H], [T, K] x 2
            scores = adapter.score(layer.router, states)                                # the plan's choice here
            cand_idx, cand_probs = candidates(scores.ranking, scores.probs, k_orig)
            valid = torch.ones(states.size(0), dtype=torch.bool, device=states.device)
            choice = choose(policy, cand_idx, cand_probs, scores.probs, valid, rows[0], k_orig)
            kept = torch.zeros_like(scores.probs, dtype=torch.bool).scatter_(1, choice.index, choice.keep)  # [T, E]
            skipped = ~kept.gather(1, top_k_index)                                       # [T, K]
            token_idx, slot = skipped.nonzero(as_tuple=True)                             # [P] skipped slots
            experts_idx = top_k_index[token_idx, slot].reshape(-1, 1)                    # [P, 1]
            x = states[token_idx]                                                        # [P, H]
            outputs = compact_experts_forward(experts, x, experts_idx,
                                              torch.ones(experts_idx.shape, dtype=x.dtype, device=x.device))
            weights = top_k_weights[token_idx, slot].double() ** 2                       # [P] gate^2
            moments.add(x.double().cpu() if rank else None, outputs.double().cpu(), experts_idx[:, 0].cpu(),
                        weights.cpu())
            raise _Stop

        hook = layer.experts.register_forward_pre_hook(record, with_kwargs=True)
        try:
            with apply_plan(model, _plan_below(plan, index, fitted)):
                for batch in windows.split(batch_size):
                    rows[0] = batch.size(0)
                    try:
                        model(input_ids=batch.to(device))
                    except _Stop:
                        pass
        finally:
            hook.remove()
        fitted.means[index], term = _skipped_fit(moments, plan.means, index, rank, ridge)
        if rank:
            fitted.linear[index] = term
    fitted.linear = fitted.linear or None
    return fitted


def _skipped_fit(moments: Moments, plain: ExpertMeans, index: int, rank: int,
                 ridge: float) -> tuple[torch.Tensor, LinearTerm | None]:
    """Layer `index`'s means [E, H] (and rank-r term) from the skipped slots' `moments`; each expert with
    fewer than H samples there keeps `plain`'s."""
    hidden = moments.sy.size(1)
    enough = moments.samples >= hidden                                                   # [E]
    means = torch.where(enough[:, None], moments.means()[1].float(), plain.means[index])
    if not rank:
        return means, None
    old, new = plain.linear[index], _linear(moments, rank, ridge)     # _linear: zeros below H samples
    pick = enough[:, None, None]
    return means, LinearTerm(input_mean=torch.where(enough[:, None], new.input_mean, old.input_mean),
                             down=torch.where(pick, new.down, old.down), up=torch.where(pick, new.up, old.up))


@torch.no_grad()
def choose_standin_fit(model, windows: torch.Tensor, plan: Plan, batch_size: int = 4,
                       progress: bool = False) -> tuple[ExpertMeans, dict]:
    """The plan's stand-ins fitted the way that generalises better on this calibration text: both fits
    (the plain one and `refit_expert_means`) are made on the even windows of `windows` and scored on the
    odd ones (calibrate/crossfit.py's split, alternate windows; one fold, not both, since each fit here
    is a whole bottom-up pass); the winner is then fitted on all of them. Returns (the means, a record of the choice:
    {"chose": "plain" | "sequential", "held_out": {fit: perplexity}}). The refit won on test text
    where plans cut deep and lost at 5/6 (docs/quality.md), so it is taken only where it wins here
    (on the built-in model the held-out half still chose it at 5/6: a guard, not a cure).
    Costs two half passes per layer with stand-ins plus the final fit."""
    from ..routing.apply import apply_plan
    from ..scoring.perplexity import evaluate_perplexity

    from .crossfit import split_windows

    if plan.means is None:
        raise AllocMoeError("choosing the stand-ins' fit needs a plan with stand-ins; allocate one with the "
                            "substitute on (the default for auto, --substitute otherwise)")
    first, second = split_windows(windows)
    rank, layers, ranks = plan.means.rank, sorted(plan.means.means), plan.means.ranks   # fit at the largest, cut
    fits = {"plain": measure_expert_means(model, first, batch_size, rank=rank, layers=layers).truncated(ranks)}
    fits["sequential"] = refit_expert_means(model, first, replace(plan, means=fits["plain"]), batch_size, progress)
    held_out = {}
    for name, means in fits.items():
        with apply_plan(model, replace(plan, means=means, substitute=None)):
            held_out[name] = evaluate_perplexity(model, None, "", {"windows_per_pass": batch_size, "progress": False},
                                                 windows=second).perplexity
    chose = min(held_out, key=held_out.get)
    means = (refit_expert_means(model, windows, plan, batch_size, progress) if chose == "sequential"
             else measure_expert_means(model, windows, batch_size, rank=rank, layers=layers).truncated(ranks))
    return means, {"chose": chose, "held_out": held_out}
