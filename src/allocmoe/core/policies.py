"""Selection policies: which of its top-K_orig experts each token of a layer keeps.

Pure torch, no model. Four policies keep a *prefix* of each token's own ranking, so they only decide
a count per token (`counts`); `prefix_mask` and `select_experts` turn counts into the (weights,
indices) a router returns. The fifth, `distinct`, chooses a set of experts per decode step first and
may keep a token's 1st and 3rd choice without its 2nd: it returns the selection itself (`select`).

Shape legend: T = tokens in the forward pass, E = routed experts, K = K_orig (the model's top-k),
B = sequences in the batch, S = positions per sequence in the pass (T = B * S), W = the widest
selection in the pass (<= K).

The policies (names as stored in plan files):
  top-k    static top-k_l: every token keeps k experts.
  alloc-t  every token keeps its top k_base; the T*(K-k_base) remaining candidates form one pool
           (per batch, or per sequence) and the global top round((k - k_base) * T) are switched on.
           Rounding rule: round half up, floor(x + 0.5), so the layer's activations are exactly
           round(k * T) whenever T*k_base is whole (always).
  top-p    the shortest prefix whose cumulative probability reaches p; at least 1, at most K.
  naee     keep expert 0; keep expert j >= 1 while w_j >= beta * w_0 (dynamic skipping).
  distinct at most M distinct experts per decode step (a step = one position of every sequence
           in the pass; see `DistinctExperts` for the exact rule).
"""

from __future__ import annotations

import functools
import math
from array import array
from dataclasses import dataclass, fields
from typing import Any, ClassVar

import torch

from ..errors import AllocMoeError


@dataclass(frozen=True)
class StaticTopK:
    k: int                                   # experts every token keeps in this layer
    name: ClassVar[str] = "top-k"

    def counts(self, cand_probs: torch.Tensor, valid: torch.Tensor, batch_size: int) -> torch.Tensor:
        return torch.full(cand_probs.shape[:1], self.k, dtype=torch.long, device=cand_probs.device)  # [T]

    def check(self, k_orig: int) -> None:
        if not (isinstance(self.k, int) and 1 <= self.k <= k_orig):
            raise AllocMoeError(f"top-k policy needs a whole k in [1, {k_orig}], got k={self.k}"
                                "; give a value in that range")


@dataclass(frozen=True)
class AllocT:
    k: float                                 # the layer's average activations per token (may be fractional)
    k_base: int = 1                          # experts every token keeps whatever the pool decides
    pool: str = "batch"                      # "batch": one pool over all tokens; "sequence": one per sequence
    name: ClassVar[str] = "alloc-t"

    def check(self, k_orig: int) -> None:
        if not 1 <= self.k <= k_orig:
            raise AllocMoeError(f"alloc-t policy needs k in [1, {k_orig}], got k={self.k}; give a value in that range")
        if not (isinstance(self.k_base, int) and 0 <= self.k_base <= self.k):
            raise AllocMoeError(f"alloc-t policy needs a whole k_base in [0, k={self.k}], got k_base={self.k_base}"
                                "; give a value in that range")
        if self.pool not in ("batch", "sequence"):
            raise AllocMoeError(f"alloc-t pool must be 'batch' or 'sequence', got {self.pool!r}; give one of those")

    def counts(self, cand_probs: torch.Tensor, valid: torch.Tensor, batch_size: int) -> torch.Tensor:
        num_tokens, k_orig = cand_probs.shape
        extra_scores = cand_probs[:, self.k_base:].masked_fill(~valid[:, None], -1.0)   # [T, K - k_base]
        if self.pool == "sequence" and batch_size > 1:
            pools = extra_scores.reshape(batch_size, -1)                                 # [B, S*(K-k_base)]
            tokens_per_pool = valid.reshape(batch_size, -1).sum(-1)                      # [B]
        else:
            pools = extra_scores.reshape(1, -1)                                          # [1, T*(K-k_base)]
            tokens_per_pool = valid.sum().reshape(1)                                     # [1]
        extra_per_pool = torch.floor((self.k - self.k_base) * tokens_per_pool.double() + 0.5).long()  # [B]
        # An upper bound on extra_per_pool from shapes alone (every slot of the pool real), so the
        # selection needs no device-to-host sync; in_budget trims it to the real budget.
        full_pool = pools.size(1) // max(1, k_orig - self.k_base)                       # tokens a pool holds
        width = expected_alloc_t_activations(self.k, self.k_base, full_pool) - self.k_base * full_pool
        chosen = torch.zeros_like(pools, dtype=torch.bool)
        if width > 0:
            top = pools.topk(width, dim=-1).indices                                      # [B, width]
            in_budget = torch.arange(width, device=pools.device)[None, :] < extra_per_pool[:, None]
            chosen.scatter_(1, top, in_budget)
        extra = chosen.reshape(num_tokens, -1).sum(-1)                                   # [T]
        return torch.where(valid, self.k_base + extra, torch.zeros_like(extra))


@dataclass(frozen=True)
class TopP:
    p: float                                 # cumulative probability each token's experts must reach
    k: float | None = None                   # activations per token measured at calibration (informational)
    name: ClassVar[str] = "top-p"

    def check(self, k_orig: int) -> None:
        if not 0 < self.p <= 1:
            raise AllocMoeError(f"top-p policy needs p in (0, 1], got p={self.p}; give a value in that range")

    def counts(self, cand_probs: torch.Tensor, valid: torch.Tensor, batch_size: int) -> torch.Tensor:
        before = cand_probs.cumsum(-1) - cand_probs                     # [T, K] mass before each candidate
        return (before < self.p).sum(-1).clamp(min=1)                   # [T]


@dataclass(frozen=True)
class NaeeSkip:
    beta: float                              # drop expert j when w_j < beta * w_0
    k: float | None = None                   # activations per token measured at calibration (informational)
    name: ClassVar[str] = "naee"

    def check(self, k_orig: int) -> None:
        if not self.beta >= 0:
            raise AllocMoeError(f"naee policy needs beta >= 0, got beta={self.beta}; give a value in that range")

    def counts(self, cand_probs: torch.Tensor, valid: torch.Tensor, batch_size: int) -> torch.Tensor:
        kept = cand_probs >= self.beta * cand_probs[:, :1]              # [T, K]
        kept[:, 0] = True
        return kept.long().cumprod(-1).sum(-1)                          # [T] length of the kept prefix


def step_count(num_tokens: int, batch_size: int) -> int:
    """Decode steps in a [B, S] pass of T tokens (token_steps)."""
    return num_tokens // batch_size if batch_size >= 1 and num_tokens and num_tokens % batch_size == 0 else 1


def token_steps(num_tokens: int, batch_size: int, device=None) -> tuple[torch.Tensor, int]:
    """The decode step of each token of a [B, S] pass: (step [T], number of steps S).

    Token t = b * S + s belongs to step s: the tokens at the same position (column) of every
    sequence, which is what one batched decode step routes together. A pass whose T is not a
    multiple of B is one step (the conservative reading: every real step is a subset of it)."""
    steps = step_count(num_tokens, batch_size)
    return torch.arange(num_tokens, device=device) % steps, steps


@dataclass(frozen=True)
class DistinctExperts:
    """At most `max_experts` (M) distinct experts per decode step in this layer.

    What a memory-bound decode step costs is the experts it loads: the union over the batch, not
    the activations per token. For each step (token_steps) and its real tokens, each holding its
    ranked top-K candidates:
      1. Floor. f = the largest value <= k_floor for which the union of every token's top-f
         candidates has at most M experts; those experts are chosen first, so every token keeps its
         top f. When even the tokens' top-1 experts are more than M distinct experts, f = 0: the
         top-1 experts still go first, and the M of them with the largest summed score are chosen.
      2. Fill. The rest of the M slots go to the other candidates by summed score: the sum, over
         the step's tokens that hold the expert among their top-K, of its routing probability
         (in float32, token by token). Ties go to the lower expert index. Experts no token holds
         are never chosen, so a step chooses min(M, distinct candidates) experts.
      3. Keep. Every token keeps those of its top-K candidates that were chosen, and at least one:
         a token none of whose candidates was chosen (possible only when f = 0) keeps the chosen
         expert its router gives the highest probability.
    So a step never loads more than M experts, a token keeps between 1 and K, and with M >= E (or
    M >= the step's distinct candidates) every token keeps its top-K: the unmodified model.
    """
    max_experts: int                         # M: distinct experts one decode step may load in this layer
    k_floor: int = 1                         # each token's top experts chosen before any others (reduced if needed)
    k: float | None = None                   # activations per token, measured or expected (informational)
    name: ClassVar[str] = "distinct"

    def check(self, k_orig: int) -> None:
        if not (isinstance(self.max_experts, int) and not isinstance(self.max_experts, bool) and self.max_experts >= 1):
            raise AllocMoeError(f"distinct policy needs a whole max_experts >= 1, got max_experts={self.max_experts}"
                                "; give a value in that range")
        if not (isinstance(self.k_floor, int) and 1 <= self.k_floor <= k_orig):
            raise AllocMoeError(f"distinct policy needs a whole k_floor in [1, {k_orig}], got k_floor={self.k_floor}"
                                "; give a value in that range")
        if self.k is not None and not 1 <= self.k <= k_orig:
            raise AllocMoeError(f"distinct policy's k (informational) must lie in [1, {k_orig}], got k={self.k}"
                                "; give a value in that range")

    def select(self, cand_idx: torch.Tensor, cand_probs: torch.Tensor, probs: torch.Tensor, valid: torch.Tensor,
               batch_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """-> (index [T, K] expert ids, keep [T, K], top1_outside [T], distinct [S]): each token's
        candidates with slot 0 replaced by its fallback expert where none was chosen; top1_outside
        marks the real tokens whose own top-1 was not chosen; distinct counts the experts each step
        loads. Off the CPU, no device-to-host sync.

        It runs in every MoE layer of every decode step, where each small tensor operation costs
        several times its cost in a loop (the experts' matmuls leave the caches cold): about 0.37 ms
        per layer for the ~30 operations below at batch 16 on CPU. So a small pass on CPU is chosen
        on Python lists instead (`_select_on_host`, about 0.2 ms there), with the same float32 sums
        in the same order, hence the same choice."""
        num_tokens, k_orig = cand_idx.shape
        num_experts = probs.size(-1)
        device = cand_idx.device
        if device.type == "cpu" and 0 < num_tokens * k_orig <= HOST_SELECT_MAX_SLOTS:
            return _select_on_host(self, cand_idx, cand_probs, probs, valid, batch_size)
        num_steps = step_count(num_tokens, batch_size)
        slot = cand_idx                                                                     # [T, K] into [S*E]
        if num_steps > 1:
            slot = (torch.arange(num_tokens, device=device) % num_steps)[:, None] * num_experts + cand_idx
        tier = self._tier(slot, valid, num_steps, num_experts)                              # [S, E] 2, 1 or 0
        weight = cand_probs.float() * valid[:, None]                                        # [T, K] padding adds 0
        score = torch.zeros(num_steps * num_experts, dtype=torch.float32, device=device)
        score = score.index_add_(0, slot.reshape(-1), weight.reshape(-1)).view(num_steps, num_experts)   # [S, E]
        chosen = _top_by_key(tier, score, self.max_experts) & (tier > 0)                    # [S, E]
        keep = chosen.view(-1)[slot] & valid[:, None]                                       # [T, K]
        outside = valid & ~keep[:, 0]                                                       # [T]
        index = cand_idx
        # a token none of whose candidates was chosen has its top-1 outside; a host check costs
        # nothing on CPU (and spares the fallback in nearly every step), a sync elsewhere
        if device.type != "cpu" or bool(outside.any()):
            stranded = outside & ~keep.any(-1)                                              # [T] nothing chosen
            step = slot[:, 0] // num_experts                                                # [T]
            fallback = probs.float().masked_fill(~chosen.index_select(0, step), float("-inf")).argmax(-1)   # [T]
            index = cand_idx.clone()
            index[:, 0] = torch.where(stranded, fallback, cand_idx[:, 0])
            keep[:, 0] |= stranded
        return index, keep, outside, chosen.sum(-1)

    def _tier(self, slot: torch.Tensor, valid: torch.Tensor, num_steps: int, num_experts: int) -> torch.Tensor:
        """[S, E]: 2 for the experts chosen first (the floor), 1 for the step's other candidates,
        0 for experts no real token of the step holds. slot [T, K] (step * E + expert), valid [T]."""
        k_orig = slot.size(1)
        if self.k_floor == 1:                # the floor is every real token's top-1
            per_slot = _first_and_rest(k_orig, slot.device) * valid[:, None]                # [T, K] 2, 1, .., 1
            tier = torch.zeros(num_steps * num_experts, dtype=torch.long, device=slot.device)
            return tier.scatter_reduce_(0, slot.reshape(-1), per_slot.reshape(-1), "amax").view(num_steps, -1)
        rank = torch.arange(k_orig, device=slot.device).expand_as(slot)                    # [T, K]
        rank = torch.where(valid[:, None], rank, k_orig)                                    # padding holds nothing
        best_rank = torch.full((num_steps * num_experts,), k_orig, dtype=torch.long, device=slot.device)
        best_rank = best_rank.scatter_reduce_(0, slot.reshape(-1), rank.reshape(-1), "amin").view(num_steps, -1)
        floors = torch.arange(1, self.k_floor + 1, device=slot.device)                      # [F]
        union = (best_rank[:, :, None] < floors).sum(1)                                     # [S, F] union of top-f
        floor = (union <= self.max_experts).sum(-1, keepdim=True).clamp(min=1)              # [S, 1] (unions nest)
        # max(f, 1), f the largest floor <= k_floor whose union fits in M: when not even the top-1s
        # fit, they still go first
        return (best_rank < floor).long() + (best_rank < k_orig).long()


@functools.lru_cache(maxsize=32)
def _first_and_rest(k_orig: int, device: torch.device) -> torch.Tensor:
    """[K] = (2, 1, ..., 1): a token's top-1 is in the floor, its other candidates are not (cached:
    a constant built once per K and device instead of once per layer and step)."""
    return torch.ones(k_orig, dtype=torch.long, device=device).index_fill_(0, torch.tensor([0], device=device), 2)


@functools.lru_cache(maxsize=32)
def _expert_ids(num_experts: int, device: torch.device) -> torch.Tensor:
    return torch.arange(num_experts, device=device)                                         # [E] (cached, as above)


# Passes of at most this many (token, candidate) slots are chosen on Python lists on CPU: a decode
# step of batch 16 and K 6 has 96; Python's cost grows with the slots, the tensor path's hardly.
HOST_SELECT_MAX_SLOTS = 1024


def _select_on_host(policy: DistinctExperts, cand_idx: torch.Tensor, cand_probs: torch.Tensor, probs: torch.Tensor,
                    valid: torch.Tensor, batch_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """DistinctExperts.select on CPU lists, the rule step by step: the same result, bit for bit.
    Summed scores are float32 (an array('f') rounds each sum as a float32 add does: a float64 add
    of two float32s rounded to float32 is the float32 add) and added in token order, as the
    tensor path's index_add_ adds them."""
    num_tokens, k_orig = cand_idx.shape
    num_experts = probs.size(-1)
    num_steps = step_count(num_tokens, batch_size)
    cand, cand_p, real = cand_idx.tolist(), cand_probs.float().tolist(), valid.tolist()
    keep, outside = bytearray(num_tokens * k_orig), bytearray(num_tokens)     # bools, for torch.frombuffer
    distinct, stranded = [0] * num_steps, []
    for s in range(num_steps):
        tokens = [t for t in range(s, num_tokens, num_steps) if real[t]]     # token t = b * S + s
        held = {e for t in tokens for e in cand[t]}
        chosen = held
        if len(held) > policy.max_experts:
            score = array("f", bytes(4 * num_experts))                          # [E] float32 zeros
            for t in tokens:
                for e, p in zip(cand[t], cand_p[t]):
                    score[e] += p
            first = {cand[t][0] for t in tokens}                               # the top-1s go first even if they do not fit
            for f in range(2, policy.k_floor + 1):
                wider = {e for t in tokens for e in cand[t][:f]}
                if len(wider) > policy.max_experts:
                    break
                first = wider
            chosen = set(sorted(held, key=lambda e: (e not in first, -score[e], e))[:policy.max_experts])
        distinct[s] = len(chosen)
        for t in tokens:
            kept = bytes(e in chosen for e in cand[t])
            keep[t * k_orig:(t + 1) * k_orig] = kept
            if not kept[0]:
                outside[t] = 1
                if not any(kept):
                    stranded.append((t, chosen))
    index, keep_t = cand_idx, torch.frombuffer(keep, dtype=torch.bool).view(num_tokens, k_orig)
    if stranded:                                      # each keeps the chosen expert its router likes best
        index = cand_idx.clone()
        for t, chosen in stranded:
            row = probs[t].tolist()
            index[t, 0] = max(chosen, key=lambda e: (row[e], -e))
            keep_t[t, 0] = True
    return index, keep_t, torch.frombuffer(outside, dtype=torch.bool), torch.tensor(distinct)


def _top_by_key(tier: torch.Tensor, score: torch.Tensor, count: int) -> torch.Tensor:
    """bool [S, E]: each step's `count` best experts, ordered by tier, then by summed score, then by
    the lower expert index. One exact integer key per expert: a non-negative float32's bits order
    as the float does, so key = ((tier << 31) + bits(score)) * E - expert orders (tier, score,
    -expert) lexicographically and is unique within a step; the step's top `count` keys are then
    those >= its count-th largest (one topk, no sort)."""
    num_experts = score.size(-1)
    key = ((tier << 31) + score.view(torch.int32).long()) * num_experts - _expert_ids(num_experts, score.device)
    kth = key.topk(min(count, num_experts), dim=-1).values[:, -1:]                          # [S, 1]
    return key >= kth


Policy = StaticTopK | AllocT | TopP | NaeeSkip | DistinctExperts
PREFIX_POLICIES = (StaticTopK, AllocT, TopP, NaeeSkip)     # decide a count per token (`counts`)
POLICIES: dict[str, type] = {cls.name: cls for cls in (*PREFIX_POLICIES, DistinctExperts)}


def policy_from_entry(entry: Any, k_orig: int, where: str = "layer") -> Policy:
    """A validated layer entry (core/formats.py) -> its policy, checked against this model's K_orig."""
    cls = POLICIES[entry.policy]
    args = {f.name: getattr(entry, f.name) for f in fields(cls) if hasattr(entry, f.name)}
    policy = cls(**args)
    policy.check(k_orig)
    return policy


def policy_to_dict(policy: Policy) -> dict[str, Any]:
    out: dict[str, Any] = {"k": policy.k} if getattr(policy, "k", None) is not None else {}
    out["policy"] = policy.name
    out.update({f.name: getattr(policy, f.name) for f in fields(policy) if f.name != "k"})
    return out


def prefix_mask(counts: torch.Tensor, width: int) -> torch.Tensor:
    """counts [T] -> bool [T, width], True for the first counts[t] slots of each row."""
    return torch.arange(width, device=counts.device)[None, :] < counts[:, None]


def select_experts(probs: torch.Tensor, policy: Policy, k_orig: int, valid: torch.Tensor | None = None,
                   batch_size: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference selection on a probability table: probs [T, E] -> (weights [T, W], indices [T, W]).

    Unselected slots hold index E (a sentinel the compacted experts path skips) and weight 0.
    Weights are the raw probabilities (no renormalisation); model adapters apply each family's own.
    `batch_size` B reads the T tokens as [B, S]: Alloc-T's per-sequence pools, distinct's steps.
    """
    num_experts = probs.size(-1)
    valid = torch.ones(probs.size(0), dtype=torch.bool, device=probs.device) if valid is None else valid
    cand_probs, cand_idx = probs.topk(k_orig, dim=-1)                    # [T, K] sorted descending
    if isinstance(policy, DistinctExperts):
        index, keep, _, _ = policy.select(cand_idx, cand_probs, probs, valid, batch_size)   # [T, K]
        return probs.gather(-1, index) * keep, index.masked_fill(~keep, num_experts)
    counts = policy.counts(cand_probs, valid, batch_size)                # [T]
    width = max(int(counts.max()), 1) if counts.numel() else 1
    keep = prefix_mask(counts, width)                                    # [T, W]
    indices = torch.where(keep, cand_idx[:, :width], num_experts)        # [T, W]
    weights = torch.where(keep, cand_probs[:, :width], 0.0)              # [T, W]
    return weights, indices


def distinct_per_step(index: torch.Tensor, valid: torch.Tensor, batch_size: int,
                      num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Distinct experts each decode step loads: index [T, W] (E = unselected), valid [T] ->
    (distinct [S], real [S]: the steps holding at least one real token). No host sync."""
    step, num_steps = token_steps(index.size(0), batch_size, index.device)               # [T]
    index = torch.where(valid[:, None], index, num_experts).clamp(max=num_experts)       # [T, W]
    hits = torch.zeros(num_steps * (num_experts + 1), dtype=torch.bool, device=index.device)
    hits[(step[:, None] * (num_experts + 1) + index).reshape(-1)] = True
    distinct = hits.view(num_steps, num_experts + 1)[:, :num_experts].sum(-1)             # [S]
    real = torch.zeros(num_steps, dtype=torch.long, device=index.device).index_add_(0, step, valid.long()) > 0
    return distinct, real


def expected_alloc_t_activations(k: float, k_base: int, num_tokens: int) -> int:
    """Activations Alloc-T spends on `num_tokens` tokens: k_base*T + round_half_up((k-k_base)*T)."""
    return k_base * num_tokens + math.floor((k - k_base) * num_tokens + 0.5)
