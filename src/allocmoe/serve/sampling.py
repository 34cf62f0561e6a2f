"""What one request asks of the decoder, and how its next token is drawn.

Each request samples with its own `torch.Generator`, seeded from `seed`, so its tokens do not
depend on which other requests share its batch. Temperature 0 is greedy (argmax).

Shape legend: V = vocabulary.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..errors import AllocMoeError


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 64        # tokens to generate at most (fewer on EOS or a stop string)
    temperature: float = 0.0        # 0 = greedy; higher flattens the next-token distribution
    top_p: float = 1.0              # nucleus: sample only from the smallest set reaching this mass
    seed: int | None = None         # makes sampling reproducible, whatever the batch
    stop: tuple[str, ...] = ()      # generation ends before the first of these strings
    ignore_eos: bool = False        # keep going past the end-of-text token (benchmarks)
    logprobs: bool = False          # record each new token's log-probability (the model's, before temperature)

    def __post_init__(self):
        if not isinstance(self.max_new_tokens, int) or isinstance(self.max_new_tokens, bool) or self.max_new_tokens < 1:
            raise AllocMoeError(f"max new tokens must be a whole number >= 1, got {self.max_new_tokens!r}; give 1 or more")
        if not (isinstance(self.temperature, (int, float)) and math.isfinite(self.temperature)
                and self.temperature >= 0):
            raise AllocMoeError(f"temperature must be a finite number >= 0, got {self.temperature!r}; give 0 for greedy, or e.g. 0.7")
        if not (isinstance(self.top_p, (int, float)) and 0 < self.top_p <= 1):
            raise AllocMoeError(f"top_p must lie in (0, 1], got {self.top_p!r}; give e.g. 0.9, or 1 for no cut")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)):
            raise AllocMoeError(f"seed must be a whole number, got {self.seed!r}; give e.g. 0")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise AllocMoeError("stop strings must be non-empty strings; drop the empty ones")

    def generator(self) -> torch.Generator | None:
        """This request's own random stream (None when greedy)."""
        if self.temperature == 0:
            return None
        seed = self.seed if self.seed is not None else int(torch.randint(0, 2**62, (1,)).item())
        return torch.Generator().manual_seed(seed % (2**63))


def next_token(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """logits [V] (one row) -> the next token id."""
    if params.temperature == 0:
        return int(logits.argmax())
    logits = logits.double()
    # in fp64, max subtracted first: a tiny temperature then sends the rest to -inf, never to inf - inf
    probs = torch.softmax((logits - logits.max()) / params.temperature, dim=-1)  # [V]
    if params.top_p < 1:
        sorted_probs, order = probs.sort(descending=True)                     # [V]
        before = sorted_probs.cumsum(-1) - sorted_probs                       # mass ranked above each token
        drop = before >= params.top_p
        drop[0] = False                           # the top one always stays (even if top_p rounds to 0 in fp32)
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
    return int(torch.multinomial(probs.cpu(), 1, generator=generator))
