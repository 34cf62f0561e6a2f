"""Token-level perplexity, the recipe papers quote: the text is joined, tokenised once, and cut
into non-overlapping windows of `seq_len` tokens; every token after a window's first is scored.

Not lm-eval's `wikitext` task, which reports word and byte perplexity.
Windows are batched `windows_per_pass` at a time; with a plan applied, an Alloc-T pool spans the batch.

With `decode_batch` B the windows are scored as B sequences decoded side by side: each forward
pass holds exactly B windows, and its position s across them is one decode step (the tokens one
batched decode step routes together), so a distinct-expert budget chooses its experts per step and
Alloc-T pools per step, as a served batch of B would. When the window count is not a multiple of
B, the last pass is topped up with the text's first windows, which are routed (they share the
step, as other requests would) but not scored: every window is scored once, every step holds B.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import asdict, dataclass

import torch
from tqdm import tqdm

from ..core.config import Config, check_counts, checked_config
from ..errors import AllocMoeError

MIN_TOKENS = 16


class PerplexityConfig(Config):
    """How a text is scored: its windows, how many tokens, how many windows per forward pass."""
    __config_aliases__ = {"max_tokens": "eval_tokens", "batch_size": "windows_per_pass"}    # deprecated names

    seq_len: int | None = None      # window length; None = min(2048, the model's position limit)
    eval_tokens: int | None = None  # score only the first N tokens of the text (None = all of it)
    windows_per_pass: int = 4       # windows per forward pass (also the Alloc-T pool's extent)
    progress: bool = True           # show a progress bar
    decode_batch: int | None = None  # score as this many sequences decoded side by side (replaces windows_per_pass)

    def __post_init__(self):
        check_counts(self, {"seq_len": 2, "eval_tokens": 1, "windows_per_pass": 1, "decode_batch": 1})


@dataclass
class PerplexityResult:
    perplexity: float               # exp(mean negative log-likelihood per scored token)
    nll: float                      # mean negative log-likelihood per scored token (nats)
    tokens: int                     # tokens scored
    windows: int
    seq_len: int

    def to_dict(self) -> dict:
        return asdict(self)


def default_seq_len(model) -> int:
    limit = getattr(model.config, "max_position_embeddings", None) or 2048
    return int(min(2048, limit))


def window_len(model, seq_len: int | None) -> int:
    """The window length to use: `seq_len`, refused past the model's context, or the default."""
    if seq_len is None:
        return default_seq_len(model)
    limit = getattr(model.config, "max_position_embeddings", None)
    if seq_len < 1 or (limit and seq_len > limit):
        raise AllocMoeError(f"seq_len (--seq-len) {seq_len} is outside this model's context of 1..{limit} "
                            f"positions; give {limit} or less")
    return int(seq_len)


def tokenize_windows(tokenizer, text: str, seq_len: int, max_tokens: int | None = None,
                     beyond: str | None = None) -> torch.Tensor:
    """Tokenise once and cut into windows: [N, seq_len] (a shorter text gives one shorter window).
    With `beyond` (the flag that set `max_tokens`, e.g. "calib_tokens (--calib-tokens)"), a
    `max_tokens` above the text's tokens is refused instead of read as "all of it"."""
    ids = tokenizer(text, add_special_tokens=False, return_attention_mask=False, verbose=False)["input_ids"]
    if beyond is not None and max_tokens is not None and max_tokens > len(ids) >= MIN_TOKENS:
        raise AllocMoeError(f"{beyond} {max_tokens} is more than the {len(ids)} tokens the text has; give "
                            f"{len(ids)} or less, or a longer text")
    if max_tokens is not None:
        ids = ids[:max_tokens]
    if len(ids) < MIN_TOKENS:
        raise AllocMoeError(f"the text is too short: {len(ids)} tokens, at least {MIN_TOKENS} are needed; "
                            "give a longer text or more tokens")
    ids = torch.tensor(ids, dtype=torch.long)
    if ids.numel() < seq_len:
        return ids[None, :]
    return ids[: ids.numel() // seq_len * seq_len].view(-1, seq_len)


def windows_digest(windows: torch.Tensor) -> str:
    """A digest of calibration windows [N, S]: their shape and token ids, the key under which the
    calibration memos (calibrate/pairs.py's tables, methods.py's expert means) keep what they measured."""
    digest = hashlib.sha256(str(tuple(windows.shape)).encode())
    digest.update(windows.cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()


DEFAULT_BATCH = 4          # the configs' default windows per pass: taken as "up to 4" on a shorter text


def check_batch_size(windows: torch.Tensor, batch_size: int, flag: str = "windows_per_pass (--windows-per-pass)") -> None:
    """Refuse a batch of more windows than the text gives (the default is read as "up to")."""
    count, length = windows.shape
    if batch_size > max(count, DEFAULT_BATCH):
        raise AllocMoeError(f"{flag} {batch_size} is more than the {count} window(s) of {length} tokens the text "
                            f"gives; give {count} or less, or a longer text")


def check_decode_batch(windows: torch.Tensor, decode_batch: int | None) -> int:
    """Windows the last pass of `decode_batch` borrows from the text's start (0 without it); refuses
    fewer windows than sequences, which would put one window beside itself in a step."""
    if decode_batch is None:
        return 0
    count, length = windows.shape
    if count < decode_batch:
        raise AllocMoeError(f"--decode-batch {decode_batch} needs at least {decode_batch} windows of {length} tokens, "
                            f"but the text gives {count}; give a longer text, a shorter --seq-len or a smaller "
                            "--decode-batch")
    return -count % decode_batch


@torch.no_grad()
def evaluate_perplexity(model, tokenizer, text: str, config: PerplexityConfig | dict | None = None,
                        windows: torch.Tensor | None = None) -> PerplexityResult:
    """Perplexity of `model` (with whatever plan is applied to it) on `text`.
    Pass pre-cut `windows` [N, S] to skip tokenisation when scoring one text many times."""
    from ..routing.apply import active_handle

    config = checked_config(PerplexityConfig, config)
    check_arguments(model, tokenizer, text, windows)
    seq_len = window_len(model, config.seq_len)
    if windows is None:
        windows = tokenize_windows(tokenizer, text, seq_len, config.eval_tokens, beyond="eval_tokens (--eval-tokens)")
    if config.decode_batch is None:
        check_batch_size(windows, config.windows_per_pass)
    fill = check_decode_batch(windows, config.decode_batch)
    rows = windows.size(0)                                                      # windows scored
    routed = torch.cat([windows, windows[:fill]]) if fill else windows          # [N + fill, S]
    device = next(model.parameters()).device
    total_nll, total_tokens = 0.0, 0
    batches = routed.split(config.decode_batch or config.windows_per_pass)
    handle = active_handle(model) if config.decode_batch else None
    if handle is not None:                  # each position of the pass is a decode step: count and pool so
        saved = handle.context.count_steps, handle.context.decode_steps
        handle.context.count_steps = handle.context.decode_steps = True
    try:
        start = 0
        for batch in tqdm(batches, desc="perplexity", unit="batch", disable=not config.progress, leave=False):
            scored = min(batch.size(0), rows - start)                            # the rest are the top-up
            start += batch.size(0)
            batch = batch.to(device)
            nll, tokens = summed_nll(model(input_ids=batch).logits[:scored], batch[:scored])
            total_nll += nll
            total_tokens += tokens
    finally:
        if handle is not None:
            handle.context.count_steps, handle.context.decode_steps = saved
    mean = total_nll / total_tokens
    return PerplexityResult(perplexity=perplexity_of(mean), nll=mean, tokens=total_tokens,
                            windows=int(windows.size(0)), seq_len=int(windows.size(1)))


def check_arguments(model, tokenizer, text, windows) -> None:
    """evaluate_perplexity's arguments at the door: a loaded model, and either pre-cut windows (a 2-D
    tensor of token ids) or a tokenizer and text."""
    from ..core.config import check_model_argument, check_tokenizer_argument
    from ..texts import check_text

    check_model_argument("evaluate_perplexity", model)
    if windows is not None:
        if not isinstance(windows, torch.Tensor) or windows.dim() != 2 or windows.dtype != torch.long \
                or windows.size(0) < 1 or windows.size(1) < 2:
            raise AllocMoeError(f"evaluate_perplexity: windows must be a [N, S] tensor of token ids (torch.long, "
                                f"N >= 1, S >= 2), got {type(windows).__name__}"
                                f"{list(windows.shape) if isinstance(windows, torch.Tensor) else ''}; give "
                                "tokenize_windows(...)'s result, or leave windows out and give the tokenizer and text")
        return
    check_tokenizer_argument("evaluate_perplexity", tokenizer)
    check_text(text, "evaluate_perplexity: text")


def summed_nll(logits: torch.Tensor, batch: torch.Tensor) -> tuple[float, int]:
    """(summed negative log-likelihood, tokens) of every token after each window's first.
    logits [b, S, V] from a pass over batch [b, S]."""
    logits = logits[:, :-1].float()                                             # [b, S-1, V]
    target = batch[:, 1:]                                                       # [b, S-1]
    nll = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), target.reshape(-1), reduction="sum")
    return float(nll), target.numel()


def perplexity_of(mean_nll: float) -> float:
    """exp(mean NLL); a diverging model can average past exp's range (> 709): infinite, not an error."""
    return math.exp(mean_nll) if mean_nll < 709 else math.inf
