"""The router a plan installs in one MoE layer: a short dispatcher over named pieces.

`router_forward` builds the layer's new `router.forward`. Each pass it

  scores    the family adapter's scores of the layer's tokens;
  selects   static: one k for every token, no per-token counts (`static_route`, the fast path);
            otherwise the pass's candidates (select.candidates) and one policy's choice over them
            (select.choose) or, when rows follow different plans, each plan's over its rows
            (select.choose_rows);
  weighs    the family's combine weights of what was kept (`weigh`), or under a plan with means the
            kept experts at their full-K weights plus what stand-ins add for the skipped ones
            (`weigh_rows` for mixed plans; routing/substitute.py);
  counts    activations, real tokens and distinct experts per step into the layer's LayerStats,
            activations per row into the context (`count`, `count_static`), and hands each recorder
            the candidates it kept (`record`);

and returns (logits, weights [T, W], index [T, W]) with sentinel E in every dropped slot, which the
compacted experts path (experts.py) skips. What stand-ins add is left in the layer's `pending` dict
for the experts' forward to add to their output. RoutingContext holds what a router cannot see by
itself (the batch's mask and rows, which plan routes which row); apply.py installs all this.

Shape legend: T = tokens in the pass, H = hidden size, E = routed experts, K = K_orig, W = widest
selection, B = rows (sequences) in the batch, S = tokens per row in the pass (T = B * S).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from ..core.policies import Policy, StaticTopK, distinct_per_step
from ..errors import AllocMoeError
from .adapters import MoEAdapter, MoELayer
from .select import Choice, candidates, choose, choose_rows, kept_first, row_tokens, static_k
from .substitute import LayerSubstitute, substituted

# Called as fn(layer_index, cand_idx [T, K], cand_probs [T, K], counts [T], valid [T]) on every
# routed pass: each token's ranked candidates, their probabilities, and how many it keeps; the
# kept ones are the first counts[t]. For the distinct policy, which need not keep a prefix of the
# ranking, the kept candidates are moved to the front (in rank order, a fallback expert in slot 0).
Recorder = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]


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



def router_forward(adapter: MoEAdapter, layer: MoELayer, policies: list[Policy], k_orig: int,
                   ctx: RoutingContext, stats: LayerStats, renormalize: bool | None,
                   means: list[LayerSubstitute | None], pending: dict):
    """The layer's router forward: `policies[i]` is this layer's policy under installed plan i (the
    list grows as plans are added), `means[i]` its substitute's stand-ins for skipped experts, or
    None. What a substitute adds is left in `pending["extra"]` for the experts' forward
    (routing/substitute.py) to add to its output."""
    router, num_experts = layer.router, adapter.num_experts()

    def forward(hidden_states: torch.Tensor, *args, **kwargs):
        hidden = hidden_states.reshape(-1, hidden_states.shape[-1])           # [T, H]
        scores = adapter.score(router, hidden)                                # [T, E] each
        valid = ctx.valid_mask(hidden.size(0), hidden.device)                 # [T]
        groups = ctx.plan_rows()
        pending.pop("extra", None)
        plan = next(iter(groups)) if len(groups) == 1 else None              # the one plan routing the pass
        k = static_k(policies[plan], valid) if plan is not None and not ctx.recorders else None
        if k is not None:                                                     # fast path: no per-token counts
            index, weights, extra = static_route(adapter, router, scores, k, k_orig, renormalize, means[plan], hidden)
            count_static(stats, ctx, k, index, valid, num_experts)
        else:
            cand_idx, cand_probs = candidates(scores.ranking, scores.probs, k_orig)         # [T, K] each
            if plan is not None:
                policy = policies[plan]
                # no host sync on counts: the width comes from the policy, not from the counts
                width = policy.k if isinstance(policy, StaticTopK) else k_orig
                choice = choose(policy, cand_idx, cand_probs, scores.probs, valid, ctx.batch_size, width,
                                ctx.decode_steps)                                          # [T, W]
                weights, extra = weigh(adapter, router, scores, cand_idx, choice, renormalize, means[plan], hidden)
            else:
                choice = choose_rows(policies, groups, cand_idx, cand_probs, scores.probs, valid, ctx.batch_size,
                                     ctx.decode_steps)                                     # [T, K]
                weights, extra = weigh_rows(adapter, router, scores, cand_idx, choice, renormalize, means, groups,
                                            hidden, ctx.batch_size)
            index = choice.index.masked_fill(~choice.keep, num_experts)     # [T, W] sentinel E where dropped
            count(stats, ctx, choice, index, valid, num_experts)
            if ctx.recorders:
                record(ctx.recorders, layer.index, choice, cand_idx, cand_probs, scores.probs, valid)
        if extra is not None:
            pending["extra"] = extra                                          # [T, H]
        return scores.logits, weights, index

    return forward


# -- select + weigh, static ------------------------------------------------------------------------
def static_route(adapter: MoEAdapter, router, scores, k: int, k_orig: int, renormalize: bool | None,
                 stand_ins: LayerSubstitute | None, hidden: torch.Tensor):
    """Every token keeps its top k: -> (index [T, k], weights [T, k], extra [T, H] or None). With
    stand-ins (and k < K) the kept experts keep their full-K weights and the skipped K - k slots
    add their stand-ins (`extra`). hidden [T, H]."""
    if k < k_orig and stand_ins is not None:
        index = scores.ranking.topk(k_orig, dim=-1).indices                   # [T, K]
        full = adapter.combine(router, scores, index, torch.ones_like(index, dtype=torch.bool), renormalize)
        extra = stand_ins.skipped(full[:, k:], index[:, k:], hidden)         # [T, H]
        return index[:, :k], full[:, :k], extra                              # kept at their full-K weights
    index = scores.ranking.topk(k, dim=-1).indices                            # [T, k]
    return index, adapter.combine(router, scores, index, torch.ones_like(index, dtype=torch.bool), renormalize), None


# -- weigh -----------------------------------------------------------------------------------------
def weigh(adapter: MoEAdapter, router, scores, cand_idx: torch.Tensor, choice: Choice, renormalize: bool | None,
          stand_ins: LayerSubstitute | None, hidden: torch.Tensor):
    """One plan's weights of what it kept: -> (weights [T, W], extra [T, H] or None). The family's
    combine over the kept slots, or with stand-ins the kept experts at their full-K weights and what
    the skipped candidates add. cand_idx [T, K], hidden [T, H]."""
    if stand_ins is not None:
        return substituted(adapter, router, scores, cand_idx, choice.index, choice.keep, renormalize, stand_ins,
                           hidden)
    return adapter.combine(router, scores, choice.index, choice.keep, renormalize), None


def weigh_rows(adapter: MoEAdapter, router, scores, cand_idx: torch.Tensor, choice: Choice,
               renormalize: bool | None, means: list[LayerSubstitute | None], groups: dict[int, list[int]],
               hidden: torch.Tensor, batch_size: int):
    """Mixed plans' weights: the family's combine [T, K], then for the rows of each plan with
    stand-ins (`means[plan index]`) its full-K weights, and what its skipped candidates add in
    `extra` [T, H] (zero on other rows; None when no plan has stand-ins)."""
    weights = adapter.combine(router, scores, choice.index, choice.keep, renormalize)       # [T, K]
    extra = None
    for plan_index, rows in groups.items():
        if means[plan_index] is not None:
            tokens = row_tokens(rows, hidden.size(0) // batch_size, hidden.device)         # [b*S]
            sub_w, part = substituted(adapter, router, scores, cand_idx, choice.index, choice.keep, renormalize,
                                      means[plan_index], hidden, tokens)                   # part: [b*S, H]
            weights[tokens] = sub_w[tokens].to(weights.dtype)
            if extra is None:
                extra = part.new_zeros(hidden.size(0), part.size(-1))
            extra[tokens] = part
    return weights, extra


# -- count -----------------------------------------------------------------------------------------
def count_static(stats: LayerStats, ctx: RoutingContext, k: int, index: torch.Tensor, valid: torch.Tensor,
                 num_experts: int) -> None:
    """Count a static pass (every real token kept k): index [T, k], valid [T]."""
    stats.add_uniform(k, valid)
    if ctx.count_steps:
        stats.add_steps(index, valid, ctx.batch_size, num_experts)
    if ctx.track_rows:
        ctx.add_row_activations(torch.full_like(valid, k, dtype=torch.long), valid)


def count(stats: LayerStats, ctx: RoutingContext, choice: Choice, index: torch.Tensor, valid: torch.Tensor,
          num_experts: int) -> None:
    """Count a pass: choice (its counts [T]; distinct's outside, routed [T] and distinct [S]), index
    [T, W] with sentinel E where dropped, valid [T]. One distinct policy's pass is kept as it counted
    its steps while choosing; otherwise the steps are counted here where asked or where distinct ran."""
    if choice.distinct is not None:
        stats.add_distinct(choice.keep, valid, choice.outside, choice.distinct)
    else:
        stats.add(choice.counts, valid)
        if choice.outside is not None:
            stats.add_top1(choice.outside, choice.routed)
        if ctx.count_steps or choice.outside is not None:
            stats.add_steps(index, valid, ctx.batch_size, num_experts)
    if ctx.track_rows:
        ctx.add_row_activations(choice.counts, valid)


def record(recorders: list[Recorder], layer_index: int, choice: Choice, cand_idx: torch.Tensor,
           cand_probs: torch.Tensor, probs: torch.Tensor, valid: torch.Tensor) -> None:
    """Hand each recorder the pass (see Recorder): cand_idx, cand_probs [T, K], probs [T, E], valid
    [T]. A distinct selection, not a prefix, is shown kept first (select.kept_first)."""
    if choice.outside is None:
        seen_idx, seen_probs = cand_idx, cand_probs
    else:
        seen_idx, seen_probs = kept_first(choice.index, choice.keep, cand_idx, cand_probs, probs)
    for recorder in recorders:
        recorder(layer_index, seen_idx, seen_probs, choice.counts, valid)
