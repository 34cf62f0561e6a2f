"""apply_plan: install a plan on a live transformers model, reversibly, and count what it spends.

Installing patches two things per MoE layer, as instance attributes (the class is never edited):
  router.forward   -> score with the family adapter, let the layer's policy pick from each token's
                      top-K_orig (a prefix of it, or for `distinct` the candidates in the step's
                      chosen set), combine with the family's weights, pad with sentinel E;
  experts.forward  -> the compacted path in experts.py, which skips the sentinel slots.
A forward pre-hook on the model reads the attention mask so padding never enters the Alloc-T pool
or the counts. `PlanHandle.remove()` (or leaving the `with` block) deletes exactly these, restoring
the model bit for bit.

Several plans can be installed at once (`apply_plans`): each row of a batch is then routed by its
own plan, chosen through `handle.context.row_plans`, which is how the server batches requests with
different budgets into one forward pass. With `context.track_rows` set, each pass leaves the
activations each row spent, summed over MoE layers, in `context.row_activations`.

A plan with means (`plan.means`) also adds back what it skips (routing/substitute.py).

A pass of B rows and S positions is S decode steps of B tokens (step s = position s of every row;
in a left-padded prefill, column s). The distinct policy bounds the experts each step loads, and
the handle counts them (mean and max per layer) where it runs, or for every policy with
`context.count_steps`. `context.decode_steps` makes Alloc-T pool per step too, so a teacher-forced
[B, S] pass routes exactly as S batched decode steps would (`eval --decode-batch`).

Shape legend: T = tokens in the pass, E = routed experts, K = K_orig, W = widest selection,
B = rows (sequences) in the batch, S = tokens per row in the pass (T = B * S).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Callable

import torch
from torch import nn

from .adapters import MoEAdapter, MoELayer, adapter_for_model
from ..errors import AllocMoeError
from .experts import compact_experts_forward
from .substitute import LayerSubstitute, experts_forward, layer_substitute, substituted
from ..core.plan import Plan
from .layout import check_plan, model_fingerprint
from ..core.policies import (AllocT, DistinctExperts, Policy, StaticTopK, distinct_per_step,
                             expected_alloc_t_activations, prefix_mask, step_count)

# Called as fn(layer_index, cand_idx [T, K], cand_probs [T, K], counts [T], valid [T]) on every
# routed pass: each token's ranked candidates, their probabilities, and how many it keeps; the
# kept ones are the first counts[t]. For the distinct policy, which need not keep a prefix of the
# ranking, the kept candidates are moved to the front (in rank order, a fallback expert in slot 0).
Recorder = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]
_MARK = "_allocmoe_patched"
_SAVED = "_allocmoe_old_forward"     # under an accelerate hook: the hook's own _old_forward, put back on removal
_HANDLE = "_allocmoe_handle"        # on the model while a handle is installed: see active_handle()
_COPIED = ("this model is a copy of a model that had a plan applied (the copy keeps the plan's patches, which "
           "still route with the original's modules and count into the original's handle); copy the model "
           "before applying the plan, or clear the copy with `allocmoe.routing.apply.active_handle(copy).remove()` "
           "and apply the plan to it")


@dataclass
class RoutingContext:
    """What a router cannot see by itself: the current batch's padding mask and batch size."""
    attention_mask: torch.Tensor | None = None    # [B, S_total] 1 = real token, from the model call
    batch_size: int = 1
    recorders: list[Recorder] = field(default_factory=list)
    row_plans: list[int] | None = None            # per batch row, which installed plan routes it; None = plan 0
    track_rows: bool = False                      # fill row_activations on every pass (the server's usage)
    row_activations: torch.Tensor | None = None   # [B] activations per row, summed over the MoE layers of a pass
    count_steps: bool = False                     # count distinct experts per step under every policy
    decode_steps: bool = False                    # the [B, S] pass stands for S decode steps: Alloc-T pools per step

    def plan_rows(self) -> dict[int, list[int]]:
        """Installed plan -> the batch rows it routes in this pass."""
        if self.row_plans is None:
            return {0: list(range(self.batch_size))}
        if len(self.row_plans) != self.batch_size:
            raise AllocMoeError(f"row_plans names {len(self.row_plans)} rows for a batch of {self.batch_size}")
        groups: dict[int, list[int]] = {}
        for row, plan_index in enumerate(self.row_plans):
            groups.setdefault(plan_index, []).append(row)
        return groups

    def add_row_activations(self, counts: torch.Tensor, valid: torch.Tensor) -> None:
        per_row = (counts * valid).reshape(self.batch_size, -1).sum(-1)      # [B]
        self.row_activations = per_row if self.row_activations is None else self.row_activations + per_row

    def valid_mask(self, num_tokens: int, device) -> torch.Tensor:
        mask = self.attention_mask
        if mask is not None and mask.dim() == 2 and num_tokens % mask.size(0) == 0:
            step_len = num_tokens // mask.size(0)
            if step_len <= mask.size(1):
                # a copy even of a bool mask: the distinct policy keeps it until its counts are read
                # (one copy: `to` lays out the [B, s] column slice densely, so reshape is a view)
                return mask[:, -step_len:].to(device=device, dtype=torch.bool, copy=True).reshape(-1)   # [T]
        return torch.ones(num_tokens, dtype=torch.bool, device=device)


class LayerStats:
    """Activations and real tokens one layer has seen, and the distinct experts of its decode steps,
    kept on the device until read. The distinct policy's passes are kept as they came and summed when
    read (`folded`) or every FOLD_PASSES passes: summing each pass as it comes took about 20 small
    tensor operations per layer and decode step, 0.2 ms in a real step on CPU."""

    FOLD_PASSES = 256

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        self._passes: list[tuple[torch.Tensor, ...]] = []     # the distinct policy's, not yet summed
        self.activations = 0
        self.tokens = 0
        self.steps = 0                  # decode steps counted (holding at least one real token)
        self.distinct = 0               # distinct experts summed over those steps
        self.distinct_max = None        # the most any one step loaded
        self.chooser_tokens = 0         # real tokens routed by the distinct policy
        self.top1_outside = 0           # ... whose own top-1 expert was not in the step's chosen set

    def add_steps(self, index: torch.Tensor, valid: torch.Tensor, batch_size: int, num_experts: int) -> None:
        distinct, real = distinct_per_step(index, valid, batch_size, num_experts)      # [S], [S]
        self._add_loaded(distinct * real, real.sum())

    def _add_loaded(self, loaded: torch.Tensor, steps: torch.Tensor) -> None:
        """loaded [S]: the experts each step loaded (0 for a step without real tokens); steps: how
        many of them count."""
        most = loaded.max()
        self.steps = self.steps + steps
        self.distinct = self.distinct + loaded.sum()
        self.distinct_max = most if self.distinct_max is None else torch.maximum(self.distinct_max, most)

    def add_distinct(self, keep: torch.Tensor, valid: torch.Tensor, outside: torch.Tensor,
                     distinct: torch.Tensor) -> None:
        """A distinct-policy pass: keep [T, K] (padding keeps nothing), valid [T], outside [T] (real
        tokens whose top-1 was not chosen), distinct [S] (experts each step loaded, as the policy
        counted them while choosing: 0 for a step without real tokens, at least 1 otherwise)."""
        self._passes.append((keep, valid, outside, distinct))
        if len(self._passes) >= self.FOLD_PASSES:
            self.folded()

    def folded(self) -> "LayerStats":
        """These counts with every pending distinct-policy pass summed in."""
        if self._passes:
            keep, valid, outside, distinct = (torch.cat([p[i].reshape(-1) for p in self._passes])
                                              for i in range(4))
            self._passes = []
            self.activations = self.activations + keep.sum()
            self.tokens = self.tokens + valid.sum()
            self.add_top1(outside, valid)
            self._add_loaded(distinct, (distinct > 0).sum())     # a step with real tokens loads at least 1
        return self

    def add_top1(self, outside: torch.Tensor, routed: torch.Tensor) -> None:
        self.chooser_tokens = self.chooser_tokens + routed.sum()
        self.top1_outside = self.top1_outside + (outside & routed).sum()

    def add(self, counts: torch.Tensor, valid: torch.Tensor) -> None:
        self.activations = self.activations + (counts * valid).sum()
        self.tokens = self.tokens + valid.sum()

    def add_uniform(self, k: int, valid: torch.Tensor) -> None:
        real = valid.sum()
        self.activations = self.activations + k * real
        self.tokens = self.tokens + real


def _static_k(policy: Policy, valid: torch.Tensor) -> int | None:
    """The k every token gets when the policy cannot vary it: static top-k, or Alloc-T on a single
    real token (decode of one sequence), where the pool rule gives k_base + round_half_up(k - k_base)."""
    if isinstance(policy, StaticTopK):
        return policy.k
    if isinstance(policy, AllocT) and valid.numel() == 1 and bool(valid[0]):
        return expected_alloc_t_activations(policy.k, policy.k_base, 1)
    return None


def _per_step_counts(policy: AllocT, cand_probs: torch.Tensor, valid: torch.Tensor, batch_size: int) -> torch.Tensor:
    """Alloc-T counts [T] as batched decoding makes them: each step (column) of the [B, S] pass is a
    pass of its own, pooling its B tokens (pool "batch") or each token alone (pool "sequence")."""
    num_tokens = cand_probs.size(0)
    num_steps = step_count(num_tokens, batch_size)
    if num_steps == 1 or num_tokens % num_steps:
        return policy.counts(cand_probs, valid, batch_size)
    order = torch.arange(num_tokens, device=valid.device).view(-1, num_steps).t().reshape(-1)   # [T] step-major
    pools = num_steps if policy.pool == "batch" else num_tokens
    counts = torch.empty(num_tokens, dtype=torch.long, device=valid.device)
    counts[order] = replace(policy, pool="sequence").counts(cand_probs[order], valid[order], pools)
    return counts


Selection = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]


def _select(policy: Policy, cand_idx: torch.Tensor, cand_probs: torch.Tensor, probs: torch.Tensor,
            valid: torch.Tensor, batch_size: int, width: int, decode_steps: bool = False) -> Selection:
    """One policy over a pass: (index [T, W], keep [T, W], counts [T], top1_outside [T] or None,
    distinct experts per step [S] or None). Prefix policies keep the first counts[t] of
    cand_idx[:, :width]; distinct returns its own index and keep (width K), which tokens' top-1
    fell outside the step's chosen set, and the experts each step loads."""
    if isinstance(policy, DistinctExperts):
        index, keep, outside, distinct = policy.select(cand_idx, cand_probs, probs, valid, batch_size)
        return index, keep, keep.sum(-1), outside, distinct
    if decode_steps and isinstance(policy, AllocT):
        counts = _per_step_counts(policy, cand_probs, valid, batch_size)
    else:
        counts = policy.counts(cand_probs, valid, batch_size)                          # [T]
    return cand_idx[:, :width], prefix_mask(counts, width), counts, None, None


def _mixed_selection(policies: list[Policy], groups: dict[int, list[int]], cand_idx: torch.Tensor,
                     cand_probs: torch.Tensor, probs: torch.Tensor, valid: torch.Tensor,
                     batch_size: int, decode_steps: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None,
                                               torch.Tensor | None]:
    """The selection [T, K] when rows follow different plans: each plan's policy decides for its own
    rows alone (its rows' tokens are its whole pool, or its steps' tokens), as if those rows had been
    the batch. Also returns top1_outside [T] and the tokens a distinct policy routed (None if none)."""
    num_tokens, k_orig = cand_idx.shape
    index, keep = cand_idx.clone(), torch.zeros_like(cand_idx, dtype=torch.bool)   # [T, K]
    counts = torch.empty(valid.shape, dtype=torch.long, device=valid.device)        # [T]
    outside = routed = None
    per_row = num_tokens // batch_size                                              # S
    for plan_index, rows in groups.items():
        tokens = _row_tokens(rows, per_row, valid.device)                              # [b*S]
        index[tokens], keep[tokens], counts[tokens], out, _ = _select(
            policies[plan_index], cand_idx[tokens], cand_probs[tokens], probs[tokens], valid[tokens], len(rows), k_orig,
            decode_steps)
        if out is not None:
            if outside is None:
                outside, routed = torch.zeros_like(valid), torch.zeros_like(valid)
            outside[tokens], routed[tokens] = out, valid[tokens]
    return index, keep, counts, outside, routed


def _kept_first(index: torch.Tensor, keep: torch.Tensor, cand_idx: torch.Tensor, cand_probs: torch.Tensor,
                probs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """What recorders see of a selection that need not be a prefix: each token's candidates with the
    kept ones first (in rank order), so its first counts[t] are what it keeps. [T, K] each."""
    order = (~keep).long().argsort(dim=-1, stable=True)                             # [T, K] kept first
    own = torch.where(index == cand_idx, cand_probs, probs.gather(-1, index).to(cand_probs.dtype))
    return index.gather(-1, order), own.gather(-1, order)


def _router_forward(adapter: MoEAdapter, layer: MoELayer, policies: list[Policy], k_orig: int,
                    ctx: RoutingContext, stats: LayerStats, renormalize: bool | None,
                    means: list[LayerSubstitute | None], pending: dict):
    """`policies[i]` is this layer's policy under installed plan i (the list grows as plans are added);
    `means[i]` its substitute's stand-ins for skipped experts, or None. What a substitute adds is left in
    `pending["extra"]` for the experts' forward (routing/substitute.py) to add to its output."""
    router, num_experts = layer.router, adapter.num_experts()

    def forward(hidden_states: torch.Tensor, *args, **kwargs):
        hidden = hidden_states.reshape(-1, hidden_states.shape[-1])           # [T, H]
        scores = adapter.score(router, hidden)
        valid = ctx.valid_mask(hidden.size(0), hidden.device)                 # [T]
        groups = ctx.plan_rows()
        pending.pop("extra", None)
        policy = policies[next(iter(groups))] if len(groups) == 1 else None
        static_k = _static_k(policy, valid) if policy is not None and not ctx.recorders else None
        sub_means = means[next(iter(groups))] if len(groups) == 1 else None
        if static_k is not None:                                              # fast path: no per-token counts
            if static_k < k_orig and sub_means is not None:                   # + substitute for the skipped slots
                index = scores.ranking.topk(k_orig, dim=-1).indices           # [T, K]
                full = adapter.combine(router, scores, index, torch.ones_like(index, dtype=torch.bool), renormalize)
                pending["extra"] = sub_means.skipped(full[:, static_k:], index[:, static_k:], hidden)   # [T, H]
                index, weights = index[:, :static_k], full[:, :static_k]     # kept at their full-K weights
            else:
                index = scores.ranking.topk(static_k, dim=-1).indices         # [T, k]
                weights = adapter.combine(router, scores, index, torch.ones_like(index, dtype=torch.bool), renormalize)
            stats.add_uniform(static_k, valid)
            if ctx.count_steps:
                stats.add_steps(index, valid, ctx.batch_size, num_experts)
            if ctx.track_rows:
                ctx.add_row_activations(torch.full_like(valid, static_k, dtype=torch.long), valid)
            return scores.logits, weights, index
        top = scores.ranking.topk(k_orig, dim=-1)
        cand_idx = top.indices                                                # [T, K] best first
        if scores.ranking is scores.probs:                                    # ranked by probability
            cand_probs = top.values                                           # [T, K], non-increasing
        else:
            # [T, K]; made non-increasing along the ranking (the family ranks by another key, as
            # DeepSeek-V3's bias does), so every prefix policy's choice is a prefix of the ranking
            cand_probs = scores.probs.gather(-1, cand_idx).cummin(-1).values
        if policy is not None:
            # no host sync on counts: the width comes from the policy, not from the counts
            width = policy.k if isinstance(policy, StaticTopK) else k_orig
            index, keep, counts, outside, distinct = _select(policy, cand_idx, cand_probs, scores.probs, valid,
                                                             ctx.batch_size, width, ctx.decode_steps)   # [T, W]
            routed = valid if outside is not None else None
        else:
            distinct = None                                                   # steps shared by several plans
            index, keep, counts, outside, routed = _mixed_selection(policies, groups, cand_idx, cand_probs,
                                                                    scores.probs, valid, ctx.batch_size,
                                                                    ctx.decode_steps)
        if sub_means is not None:                                             # one plan, with a substitute
            weights, pending["extra"] = substituted(adapter, router, scores, cand_idx, index, keep, renormalize,
                                                    sub_means, hidden)       # [T, W], [T, H]
        else:
            weights = adapter.combine(router, scores, index, keep, renormalize)   # [T, W]
            for plan_index, rows in groups.items():                           # mixed plans: rows with a substitute
                if means[plan_index] is not None:
                    tokens = _row_tokens(rows, hidden.size(0) // ctx.batch_size, valid.device)
                    sub_w, extra = substituted(adapter, router, scores, cand_idx, index, keep, renormalize,
                                               means[plan_index], hidden, tokens)       # extra: [tokens, H]
                    weights[tokens] = sub_w[tokens].to(weights.dtype)
                    pending.setdefault("extra", extra.new_zeros(hidden.size(0), extra.size(-1)))[tokens] = extra
        chosen, index = index, index.masked_fill(~keep, num_experts)         # [T, W] sentinel E where dropped
        if distinct is not None:                                              # one distinct policy: counted as it chose
            stats.add_distinct(keep, valid, outside, distinct)
        else:
            stats.add(counts, valid)
            if outside is not None:
                stats.add_top1(outside, routed)
            if ctx.count_steps or outside is not None:
                stats.add_steps(index, valid, ctx.batch_size, num_experts)
        if ctx.track_rows:
            ctx.add_row_activations(counts, valid)
        if ctx.recorders:
            seen_idx, seen_probs = (cand_idx, cand_probs) if outside is None else \
                _kept_first(chosen, keep, cand_idx, cand_probs, scores.probs)
            for record in ctx.recorders:
                record(layer.index, seen_idx, seen_probs, counts, valid)
        return scores.logits, weights, index

    return forward


def _row_tokens(rows: list[int], per_row: int, device) -> torch.Tensor:
    """The token positions [len(rows) * S] of batch rows `rows` in a flattened [B, S] pass."""
    row_idx = torch.tensor(rows, device=device)
    return (row_idx[:, None] * per_row + torch.arange(per_row, device=device)).reshape(-1)


class PlanHandle:
    """A plan installed on a model. Use as a context manager, or call `remove()`."""

    def __init__(self, model: nn.Module, plans: list[Plan], layers: list[MoELayer], ctx: RoutingContext,
                 stats: dict[int, LayerStats], hook, policies: dict[int, list[Policy]], k_orig: int,
                 means: dict[int, list[LayerSubstitute | None]]):
        self.model, self.plans, self.context = model, plans, ctx
        self._layers, self._stats, self._hook = layers, stats, hook
        self._policies, self._k_orig, self._means = policies, k_orig, means
        self.active = True
        self._entered = False
        self._model_id = id(model)      # a copied model carries a copy of this handle, and the original's id

    @property
    def plan(self) -> Plan:
        """The first installed plan (the only one, for `apply_plan`)."""
        return self.plans[0]

    def add_plan(self, plan: Plan) -> int:
        """Install one more plan (a Plan, a plan file's path or a plan document, as for apply_plan) beside
        the others; returns its index for `context.row_plans`."""
        return self._install(plan, len(self.plans), "add_plan")

    def replace_plan(self, index: int, plan: Plan) -> None:
        """Install `plan` in slot `index`, in place of the plan there (a server's plan cache evicting one
        it made for a budget). Rows that still name `index` route by the new plan from their next pass:
        the caller replaces only a plan no running row holds."""
        if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < len(self.plans):
            raise AllocMoeError(f"replace_plan: index must be one of the installed plans' 0..{len(self.plans) - 1}, "
                                f"got {index!r}; give an index add_plan returned")
        self._install(plan, index, "replace_plan")

    def _install(self, plan, index: int, caller: str) -> int:
        """Check `plan` against this model, then put it at `index` (the end: a new slot)."""
        if not self.active:
            raise AllocMoeError("this plan handle was removed; apply the plans again")
        plan = as_plan(plan, caller)
        check_plan(plan, self.model)
        for layer in self._layers:
            plan.layers[layer.index].check(self._k_orig)
        added = {layer.index: layer_substitute(plan, layer) for layer in self._layers}
        def put(slots: list, value) -> None:       # every list holds one entry per installed plan
            if index == len(slots):
                slots.append(value)
            else:
                slots[index] = value

        for layer in self._layers:
            put(self._policies[layer.index], plan.layers[layer.index])
            put(self._means[layer.index], added[layer.index])
        put(self.plans, plan)
        return index

    def __enter__(self) -> "PlanHandle":
        if not self.active:          # entering again would silently run the unmodified model
            raise AllocMoeError("this plan handle was removed (its `with` block ended); apply the plan again: "
                                "`with apply_plan(model, plan) as handle:`")
        if self._entered:            # the inner block's end would remove the plan under the outer one
            raise AllocMoeError("this plan handle is already in a `with` block; use it in one `with` block "
                                "(leaving a nested one would remove the plan while the outer one still runs)")
        self._entered = True
        return self

    def __exit__(self, *exc) -> None:
        self._entered = False
        self.remove()

    def remove(self) -> None:
        """Restore the model exactly as it was."""
        if not self.active:
            return
        for layer in self._layers:
            for module in (layer.router, layer.experts):
                _restore_forward(module)
                module.__dict__.pop(_MARK, None)
        self._hook.remove()
        self.model.__dict__.pop(_HANDLE, None)
        self.active = False

    # -- accounting ------------------------------------------------------------------------
    def reset_counters(self) -> None:
        for stats in self._stats.values():
            stats.reset()

    def _counts(self) -> dict[int, LayerStats]:
        return {index: stats.folded() for index, stats in self._stats.items()}

    def layer_activations(self) -> dict[int, float]:
        """Measured activations per real token, per MoE layer."""
        return {index: float(s.activations) / max(float(s.tokens), 1.0) for index, s in self._counts().items()}

    def activations_per_token(self) -> float:
        """Measured activations per token summed over MoE layers: the number the budget bounds."""
        return sum(self.layer_activations().values())

    def tokens_seen(self) -> int:
        return int(max((float(s.tokens) for s in self._counts().values()), default=0))

    def layer_distinct_experts(self) -> dict[int, dict[str, float]]:
        """Distinct experts per decode step, per MoE layer that counted them (the layers a distinct
        policy runs in, or every layer with `context.count_steps`): {"mean", "max", "steps"}."""
        out = {}
        for index, s in self._counts().items():
            steps = float(s.steps)
            if steps:
                out[index] = {"mean": float(s.distinct) / steps, "max": int(s.distinct_max), "steps": int(steps)}
        return out

    def distinct_experts_per_step(self) -> float | None:
        """Mean over decode steps and counting layers of the distinct experts a step loads."""
        layers = self.layer_distinct_experts()
        return sum(v["mean"] for v in layers.values()) / len(layers) if layers else None

    def max_distinct_experts_per_step(self) -> int | None:
        """The most distinct experts any counting layer loaded in any one step."""
        return max((v["max"] for v in self.layer_distinct_experts().values()), default=None)

    def top1_outside_rate(self) -> dict[int, float]:
        """Per MoE layer where the distinct policy ran: the share of its real tokens whose own top-1
        expert fell outside the step's chosen set."""
        return {index: float(s.top1_outside) / float(s.chooser_tokens)
                for index, s in self._counts().items() if float(s.chooser_tokens)}


def apply_plan(model: nn.Module, plan: Plan, renormalize: bool | None = None) -> PlanHandle:
    """Install `plan` on `model` in place; returns a handle that restores the model on exit.

    renormalize: None keeps each family's native combine; True/False forces renormalising the kept
    weights (or not) for every layer.

    `plan` is a Plan, a plan file's path (loaded with Plan.load, so its substitute comes with it) or a
    plan document as a dict (Plan.from_dict).
    """
    return apply_plans(model, [plan], renormalize, _caller="apply_plan")


def as_plan(plan, function: str = "apply_plan") -> Plan:
    """A Plan from what the public functions accept for one: a Plan, a plan file's path, or a plan
    document (dict); anything else is refused."""
    import os

    if isinstance(plan, Plan):
        return plan
    if isinstance(plan, (str, os.PathLike)):
        return Plan.load(plan)
    if isinstance(plan, dict):
        return Plan.from_dict(plan)
    raise AllocMoeError(f"{function}: plan must be a Plan, a plan file's path or a plan document (dict), got "
                        f"{repr(plan)[:60]} ({type(plan).__name__}); make one with allocmoe.allocate or "
                        "allocmoe.static_plan, or give a path")


def apply_plans(model: nn.Module, plans: list[Plan], renormalize: bool | None = None, *,
                _caller: str = "apply_plans") -> PlanHandle:
    """Install several plans at once: row r of a batch follows plan `handle.context.row_plans[r]`
    (all rows follow plan 0 while `row_plans` is None). `handle.add_plan` installs more later.
    Each plan may be a Plan, a plan file's path or a plan document (as for apply_plan)."""
    from ..core.config import check_argument, check_model_argument

    check_model_argument(_caller, model)
    check_argument(_caller, "renormalize", renormalize, bool | None)
    if isinstance(plans, (Plan, str, dict)) or not isinstance(plans, (list, tuple)):
        raise AllocMoeError(f"{_caller}: plans must be a list of plans, got {type(plans).__name__}; give "
                            "[plan, ...] (or apply_plan(model, plan) for one)")
    if not plans:
        raise AllocMoeError("apply_plans needs at least one plan; give [plan, ...]")
    plans = [as_plan(plan, _caller) for plan in plans]
    adapter = adapter_for_model(model)
    for plan in plans:
        check_plan(plan, model)
    layers = adapter.moe_layers(model)
    installed = active_handle(model)
    if installed is not None and installed._model_id != id(model):
        raise AllocMoeError(_COPIED)
    if any(_MARK in layer.router.__dict__ for layer in layers):
        raise AllocMoeError("a plan is already applied to this model; remove its handle first (`handle.remove()` "
                            "or leave its `with` block), or install several plans together with apply_plans "
                            "or handle.add_plan")
    if any(_replaced(module) for layer in layers for module in (layer.router, layer.experts)):
        raise AllocMoeError("this model's MoE layers already run a replaced forward (inside routed_experts_off "
                            "or allocmoe_experts?); apply the plan outside that block")
    ctx = RoutingContext()
    stats = {layer.index: LayerStats() for layer in layers}
    k_orig = adapter.k_orig()
    policies = {layer.index: [plan.layers[layer.index] for plan in plans] for layer in layers}
    for layer in layers:
        for policy in policies[layer.index]:
            policy.check(k_orig)
    means = {layer.index: [layer_substitute(plan, layer) for plan in plans] for layer in layers}
    for layer in layers:
        pending: dict = {}          # the layer's substitute, handed from its router to its experts in a pass
        _set_forward(layer.router, _router_forward(adapter, layer, policies[layer.index], k_orig, ctx,
                                                   stats[layer.index], renormalize, means[layer.index], pending))
        _set_forward(layer.experts, experts_forward(layer.experts, pending))
        setattr(layer.router, _MARK, True)
        setattr(layer.experts, _MARK, True)

    def read_batch(module, args, kwargs):
        if module is not model:          # a deep copy keeps this hook and the routers bound to the original
            raise AllocMoeError(_COPIED)
        ctx.attention_mask = kwargs.get("attention_mask")
        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids is None:
            ids = kwargs.get("inputs_embeds")
        ctx.batch_size = int(ids.shape[0]) if ids is not None and ids.dim() >= 2 else 1
        ctx.row_activations = None

    hook = model.register_forward_pre_hook(read_batch, with_kwargs=True)
    handle = PlanHandle(model, list(plans), layers, ctx, stats, hook, policies, k_orig, means)
    model.__dict__[_HANDLE] = handle
    return handle


def active_handle(model: nn.Module) -> PlanHandle | None:
    """The handle of the plans installed on `model`, if any (so code handed a patched model can
    count what it spends instead of assuming the full budget)."""
    return model.__dict__.get(_HANDLE)


def static_plan(model: nn.Module, k_per_layer: dict[int, int] | list[int], method: str = "manual") -> Plan:
    """A plan of static top-k per layer: a list (or tuple) of one k per MoE layer, in MoE-layer order, or
    {MoE-layer index: k} naming every MoE layer; each k a whole number in 1..K (the model's top-k)."""
    from ..core.config import check_argument, check_model_argument

    check_model_argument("static_plan", model)
    check_argument("static_plan", "method", method, str)
    fingerprint = model_fingerprint(model)
    k_per_layer = _per_layer("static_plan", "k_per_layer", k_per_layer, fingerprint["moe_layers"], 1,
                             fingerprint["k_orig"], "the model's top-k K")
    layers = {index: StaticTopK(k) for index, k in k_per_layer.items()}
    return Plan(model=fingerprint, layers=layers, method=method, budget=float(sum(k_per_layer.values())))


def distinct_plan(model: nn.Module, max_experts: int | dict[int, int] | list[int], k_floor: int = 1,
                  method: str = "distinct") -> Plan:
    """A plan of the distinct-expert budget: at most `max_experts` distinct experts per decode step
    in each MoE layer (one number for all, a list in MoE-layer order, or {layer index: M}). Its
    budget is the full L * K_orig: the plan bounds experts per step, not activations per token."""
    from ..core.config import check_argument, check_model_argument

    check_model_argument("distinct_plan", model)
    check_argument("distinct_plan", "method", method, str)
    fingerprint = model_fingerprint(model)
    indices = fingerprint["moe_layers"]
    check_argument("distinct_plan", "k_floor", k_floor, int)
    if not 1 <= k_floor <= fingerprint["k_orig"]:
        raise AllocMoeError(f"distinct_plan: k_floor {k_floor} is outside 1..{fingerprint['k_orig']} (the model's "
                            f"top-k K); give a whole number in that range")
    if isinstance(max_experts, int) and not isinstance(max_experts, bool):
        max_experts = {index: max_experts for index in indices}
    max_experts = _per_layer("distinct_plan", "max_experts", max_experts, indices, 1, fingerprint["num_experts"],
                             "the model's experts per layer")
    layers = {index: DistinctExperts(m, k_floor) for index, m in max_experts.items()}
    for policy in layers.values():
        policy.check(fingerprint["k_orig"])
    return Plan(model=fingerprint, layers=layers, method=method,
                budget=float(fingerprint["num_moe_layers"] * fingerprint["k_orig"]))


def _per_layer(function: str, name: str, value, indices: list[int], low: int, high: int, what: str) -> dict[int, int]:
    """{MoE-layer index: whole number in low..high} from a list in MoE-layer order or a dict naming every
    MoE layer; anything else (a float, a bool, a short list, an unknown layer) is refused."""
    if isinstance(value, (list, tuple)):
        if len(value) != len(indices):
            raise AllocMoeError(f"{function}: {name} has {len(value)} entries but the model has {len(indices)} MoE "
                                f"layers {indices}; give one per MoE layer")
        value = dict(zip(indices, value))
    elif not isinstance(value, dict):
        raise AllocMoeError(f"{function}: {name} must be a list of one whole number per MoE layer or a dict "
                            f"{{layer index: number}}, got {repr(value)[:60]} ({type(value).__name__}); give "
                            f"{len(indices)} whole numbers")
    if sorted(value, key=repr) != sorted(indices, key=repr):
        raise AllocMoeError(f"{function}: {name} names layers {sorted(value, key=repr)} but the model's MoE layers "
                            f"are {indices}; give one entry for each")
    for index, k in value.items():
        if not isinstance(k, int) or isinstance(k, bool) or not low <= k <= high:
            raise AllocMoeError(f"{function}: {name} for MoE layer {index} is {k!r}; give a whole number in "
                                f"{low}..{high} ({what})")
    return dict(value)


class _experts_forward_swapped:
    """Context manager: every MoE layer's experts module runs `forward` (bound to it) until exit."""

    def __init__(self, model: nn.Module, forward):
        self._experts = [layer.experts for layer in adapter_for_model(model).moe_layers(model)]
        self._forward = forward

    def __enter__(self):
        for experts in self._experts:
            _set_forward(experts, self._forward.__get__(experts))
        return self

    def __exit__(self, *exc):
        for experts in self._experts:
            _restore_forward(experts)


def _hooked(module: nn.Module) -> bool:
    """Does accelerate's device hook (device_map, offload) wrap this module's forward?"""
    return hasattr(module, "_hf_hook") and "_old_forward" in module.__dict__


def _set_forward(module: nn.Module, forward) -> None:
    """Make `module` run `forward`. Under an accelerate hook that is the `_old_forward` the hook calls, so
    the hook still moves weights and inputs to their device around it (multi-GPU device_map, offload)."""
    if _hooked(module):
        module.__dict__.setdefault(_SAVED, module._old_forward)
        module._old_forward = forward
    else:
        module.forward = forward


def _restore_forward(module: nn.Module) -> None:
    if _SAVED in module.__dict__:
        module._old_forward = module.__dict__.pop(_SAVED)
    elif "forward" in module.__dict__ and not _hooked(module):
        del module.forward


def _replaced(module: nn.Module) -> bool:
    """Is something else (routed_experts_off, allocmoe_experts) already running in place of forward?"""
    return _SAVED in module.__dict__ or ("forward" in module.__dict__ and not _hooked(module))


def _no_routed_output(self, hidden_states, *args, **kwargs):
    return torch.zeros_like(hidden_states)


def routed_experts_off(model: nn.Module) -> _experts_forward_swapped:
    """Every MoE layer's routed experts contribute nothing (routers and shared experts still run).
    Used to time the part of a forward pass that no budget can remove."""
    return _experts_forward_swapped(model, _no_routed_output)


def allocmoe_experts(model: nn.Module) -> _experts_forward_swapped:
    """The model's own routing, with its experts run by allocmoe's kernel (as under a plan), so a
    benchmark compares budgets, not kernels."""
    return _experts_forward_swapped(model, compact_experts_forward)
