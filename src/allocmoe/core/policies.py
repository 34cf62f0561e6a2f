"""Selection policies: how many of its top-K_orig experts each token of a layer keeps.

Pure torch, no model. Every policy here keeps a *prefix* of each token's own ranking, so a policy
only has to decide a count per token; `prefix_mask` and `select_experts` turn counts into the
(weights, indices) a router returns.

Shape legend: T = tokens in the forward pass, E = routed experts, K = K_orig (the model's top-k),
B = sequences in the batch, W = the widest selection in the pass (<= K).

The four policies (names as stored in plan files):
  top-k    static top-k_l: every token keeps k experts.
  alloc-t  every token keeps its top k_base; the T*(K-k_base) remaining candidates form one pool
           (per batch, or per sequence) and the global top round((k - k_base) * T) are switched on.
           Rounding rule: round half up, floor(x + 0.5), so the layer's activations are exactly
           round(k * T) whenever T*k_base is whole (always).
  top-p    the shortest prefix whose cumulative probability reaches p; at least 1, at most K.
  naee     keep expert 0; keep expert j >= 1 while w_j >= beta * w_0 (dynamic skipping).
"""

from __future__ import annotations

import math
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
            raise AllocMoeError(f"top-k policy needs a whole k in [1, {k_orig}], got k={self.k}")


@dataclass(frozen=True)
class AllocT:
    k: float                                 # the layer's average activations per token (may be fractional)
    k_base: int = 1                          # experts every token keeps whatever the pool decides
    pool: str = "batch"                      # "batch": one pool over all tokens; "sequence": one per sequence
    name: ClassVar[str] = "alloc-t"

    def check(self, k_orig: int) -> None:
        if not 1 <= self.k <= k_orig:
            raise AllocMoeError(f"alloc-t policy needs k in [1, {k_orig}], got k={self.k}")
        if not (isinstance(self.k_base, int) and 0 <= self.k_base <= self.k):
            raise AllocMoeError(f"alloc-t policy needs a whole k_base in [0, k={self.k}], got k_base={self.k_base}")
        if self.pool not in ("batch", "sequence"):
            raise AllocMoeError(f"alloc-t pool must be 'batch' or 'sequence', got {self.pool!r}")

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
            raise AllocMoeError(f"top-p policy needs p in (0, 1], got p={self.p}")

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
            raise AllocMoeError(f"naee policy needs beta >= 0, got beta={self.beta}")

    def counts(self, cand_probs: torch.Tensor, valid: torch.Tensor, batch_size: int) -> torch.Tensor:
        kept = cand_probs >= self.beta * cand_probs[:, :1]              # [T, K]
        kept[:, 0] = True
        return kept.long().cumprod(-1).sum(-1)                          # [T] length of the kept prefix


Policy = StaticTopK | AllocT | TopP | NaeeSkip
POLICIES: dict[str, type] = {cls.name: cls for cls in (StaticTopK, AllocT, TopP, NaeeSkip)}


def policy_from_dict(entry: Any, k_orig: int, where: str = "layer") -> Policy:
    """Build a policy from a plan's layer entry (a dict), refusing unknown names, fields and bad values."""
    from pydantic import TypeAdapter, ValidationError

    from .formats import LayerEntry, describe

    try:
        parsed = TypeAdapter(LayerEntry).validate_python(entry)
    except ValidationError as exc:
        raise AllocMoeError(f"{where}: {describe(exc)}") from None
    return policy_from_entry(parsed, k_orig, where)


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
    """
    num_experts = probs.size(-1)
    valid = torch.ones(probs.size(0), dtype=torch.bool, device=probs.device) if valid is None else valid
    cand_probs, cand_idx = probs.topk(k_orig, dim=-1)                    # [T, K] sorted descending
    counts = policy.counts(cand_probs, valid, batch_size)                # [T]
    width = max(int(counts.max()), 1) if counts.numel() else 1
    keep = prefix_mask(counts, width)                                    # [T, W]
    indices = torch.where(keep, cand_idx[:, :width], num_experts)        # [T, W]
    weights = torch.where(keep, cand_probs[:, :width], 0.0)              # [T, W]
    return weights, indices


def expected_alloc_t_activations(k: float, k_base: int, num_tokens: int) -> int:
    """Activations Alloc-T spends on `num_tokens` tokens: k_base*T + round_half_up((k-k_base)*T)."""
    return k_base * num_tokens + math.floor((k - k_base) * num_tokens + 0.5)
