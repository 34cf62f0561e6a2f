"""Profiling a model whose weights do not fit in memory (ProfileConfig.max_memory): the pending
cells walk the model together, layer by layer, each decoder layer's weights read once for all of
them (calibrate/onload.py), the way llm-compressor's sequential onloading walks a model.

What is held is one stream of hidden states per cell (every calibration batch's [b, S, H] states at
the cell's current layer) and the unmodified stream (all MoE layers at K_orig) that each cell
starts from when the walk reaches the cell's layer, as the prefix cache starts it (prefix.py).
While decoder layer j is loaded every stream that has started moves through it, each under its own
k at j (K_orig before the cell's layer, k at it, 1 after), batch by batch, each batch replacing its
own. Then the output head is loaded and every cell's perplexity is computed from its stream. The
layer runs inside the model's own forward (the layers before it handed through, its input swapped
for the stream's), so masks, rotary tables and layer types are the model's, and the numbers are
the ones the whole model gives (bit for bit on CPU in tests/test_profile_memory.py).

Cells are taken in groups whose streams fit the cap beside the largest piece of weights: each
group is one walk from its first layer to the head, so each decoder layer is read once per group
that reaches it. The unmodified stream is carried from one group to the next, so only the first
walk reads the embedding. A cap that cannot hold one group of one cell is refused before any
weight is read, naming the least cap that works; a cap that holds the whole model loads it whole
and profiles as usual.

Memory planned: the cap bounds the weights, the held states and an estimate of the working memory
of a pass (activations, attention scores, logits); Python, torch and transformers themselves are
not counted (docs/profiling.md states that overhead as measured).
Shape legend: N = calibration windows, b = windows in a batch, S = window length, H = hidden size,
V = vocabulary.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import AllocMoeError
from ..scoring.perplexity import perplexity_of, summed_nll
from ..routing.apply import apply_plan, static_plan
from .onload import EMBEDDING, HEAD, RESIDENT, OnloadedModel
from .prefix import Captured, capture_before, pass_through, start_position, started_at

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_size(value: Any, what: str = "max_memory (--max-memory)") -> int:
    """Bytes from 300MiB, 2GB, 1.5GiB, 300 MiB or a plain byte count (a whole number)."""
    if isinstance(value, int) and not isinstance(value, bool):
        bytes_ = value
    else:
        match = re.fullmatch(r"\s*(\d+(?:\.\d+)?|\.\d+)\s*([a-zA-Z]*)\s*", value) if isinstance(value, str) else None
        unit = _UNITS.get(match.group(2).lower()) if match else None
        if unit is None:
            raise AllocMoeError(f"{what} {value!r} is not a size; give e.g. 300MiB")
        bytes_ = int(float(match.group(1)) * unit)
    if bytes_ < 1:
        raise AllocMoeError(f"{what} {value!r} is not a positive size; give e.g. 300MiB")
    return bytes_


def format_size(bytes_: int) -> str:
    """Rounded up, so that a minimum named this way is enough."""
    for unit, scale, step in (("GiB", 2**30, 100), ("MiB", 2**20, 10), ("KiB", 2**10, 1)):
        if bytes_ >= scale or unit == "KiB":
            return f"{math.ceil(bytes_ / scale * step) / step:g}{unit}"


# -- the memory plan -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class MemoryPlan:
    cap: int                # bytes the weights, held states and working memory may take together
    model_bytes: int        # every weight, in the dtype the profile runs in
    resident: int           # weights held throughout (final norm and other small pieces)
    working: int            # the largest piece of weights while it loads or runs, with the pass's working memory
    whole_working: int      # the same for the whole model loaded at once and profiled as usual
    stream: int             # one cell's hidden states, every calibration token [N, S, H]
    batch: int              # one batch of states [b, S, H]: held twice more while a batch moves through a layer

    def peak(self, group: int) -> int:
        """Bytes held by a walk with `group` cells at once: their streams and the unmodified one."""
        return self.resident + self.working + (group + 1) * self.stream + 2 * self.batch

    @property
    def minimum(self) -> int:
        return self.peak(1)

    @property
    def whole_peak(self) -> int:
        """The whole model loaded and profiled with the prefix cache: one stream and a batch held."""
        return self.model_bytes + self.whole_working + self.stream + 2 * self.batch

    def fits(self) -> bool:
        return self.whole_peak <= self.cap

    def group_size(self, cells: int) -> int:
        """Most cells per walk under the cap (at most `cells`)."""
        room = (self.cap - self.peak(0)) // self.stream
        return int(max(1, min(cells, room)))

    def check(self) -> None:
        if self.cap < self.minimum:
            raise AllocMoeError(
                f"max_memory (--max-memory) {format_size(self.cap)} is too small to profile this model layer by "
                f"layer: it needs at least {format_size(self.minimum)} (its largest piece of weights with its working "
                f"memory {format_size(self.working)}, small weights held throughout {format_size(self.resident)}, "
                f"two streams of hidden states {format_size(2 * self.stream)}); give at least "
                f"{format_size(self.minimum)}, or fewer --calib-tokens or a smaller --windows-per-pass")


def memory_plan(onloaded: OnloadedModel, windows: torch.Tensor, batch_size: int, cap: int) -> MemoryPlan:
    config = onloaded.model.config
    hidden = int(config.hidden_size)
    element = torch.empty((), dtype=onloaded.dtype).element_size()
    count, length = windows.shape
    batch = min(batch_size, count)
    layer_work = _layer_working_bytes(config, batch, length, element)
    head_work = _head_working_bytes(config, batch, length, element)
    pieces = onloaded.pieces

    def working(name: str, run: int) -> int:
        piece = pieces[name]
        return max(piece.load_peak, piece.nbytes + run)

    layers = [name for name in pieces if name.startswith("layer ")]
    work = max([working(name, layer_work) for name in layers] + [working(HEAD, head_work),
               working(EMBEDDING, batch * length * hidden * element)])
    model_bytes = sum(piece.nbytes for name, piece in pieces.items()
                      if name != HEAD or not _head_is_tied(onloaded))
    loading = max(piece.load_extra for piece in pieces.values())
    return MemoryPlan(cap=cap, model_bytes=model_bytes, resident=pieces[RESIDENT].nbytes, working=work,
                      whole_working=max(loading, layer_work, head_work),
                      stream=count * length * hidden * element, batch=batch * length * hidden * element)


def whole_model_facts(onloaded: OnloadedModel, plan: MemoryPlan) -> dict[str, Any]:
    """Provenance of a capped run whose model fit under the cap: read whole, once."""
    reads = onloaded.reads
    layers = [reads[f"layer {j}"] for j in range(len(onloaded.layers))]
    return {"layer_by_layer": False,
            "weight_reads": {"decoder_layers": layers, "max": max(layers, default=0), "embedding": reads[EMBEDDING],
                             "head": reads[HEAD]},
            "weight_bytes_read": onloaded.bytes_read,
            "memory": {"cap_bytes": plan.cap, "planned_peak_bytes": plan.whole_peak, "minimum_bytes": plan.minimum,
                       "model_bytes": plan.model_bytes,
                       "loaded": "whole: the model fits under the cap, so it was profiled as usual"}}


def _head_is_tied(onloaded: OnloadedModel) -> bool:
    return all(name in onloaded._ties for name in onloaded.pieces[HEAD].params)


def _layer_working_bytes(config, batch: int, length: int, element: int) -> int:
    """An estimate of one decoder layer's working memory for one batch: a few copies of the hidden
    states, the MLP's intermediate activations for every expert a token uses, and the attention
    scores [b, heads, S, S] twice over (eager attention keeps them; sdpa on CPU may not)."""
    tokens, hidden = batch * length, int(config.hidden_size)
    k = int(getattr(config, "num_experts_per_tok", 1) or 1)
    dense = int(getattr(config, "intermediate_size", 0) or 0)
    expert = int(getattr(config, "moe_intermediate_size", 0) or dense)
    shared = int(getattr(config, "shared_expert_intermediate_size", 0) or getattr(config, "shared_intermediate_size", 0)
                 or expert * int(getattr(config, "n_shared_experts", 0) or 0))
    mlp = max(dense, k * expert + shared)
    heads = int(getattr(config, "num_attention_heads", 1) or 1)
    return tokens * element * (8 * hidden + 3 * mlp) + 2 * batch * heads * length * length * 4


def _head_working_bytes(config, batch: int, length: int, element: int) -> int:
    """Logits [b, S, V] in float32 three times over (the logits, their scored copy, the log-softmax)."""
    return 3 * batch * length * int(config.vocab_size) * 4 + 2 * batch * length * int(config.hidden_size) * element


# -- the walk --------------------------------------------------------------------------------------------
class WalkRun:
    """The passes of a profiling run that reads the model layer by layer, with the work and the reads
    they cost; the same interface as cells.CellRun."""

    def __init__(self, onloaded: OnloadedModel, windows: torch.Tensor, config, fingerprint: dict[str, Any],
                 todo: list[tuple[int, ...]], plan: MemoryPlan):
        self.onloaded, self.model, self.layers = onloaded, onloaded.model, onloaded.layers
        self.windows, self.config, self.plan = windows, config, plan
        self.batches = windows.split(config.windows_per_pass)
        self.moe_layers, self.k_orig = fingerprint["moe_layers"], fingerprint["k_orig"]
        self.k_all = (self.k_orig,) * len(self.moe_layers)
        self.num_decoder_layers = len(self.layers)
        self.tokens = int(windows.numel())
        self.start = {cfg: self.moe_layers[start_position(cfg, self.k_orig)] if config.prefix_cache else 0
                      for cfg in todo}
        order = sorted(todo, key=lambda cfg: self.start[cfg])          # stable: k order kept
        size = plan.group_size(len(order))
        self.groups = [order[i:i + size] for i in range(0, len(order), size)]
        self.passes, self.naive_passes, self.peak_cache_bytes = 0, 0, 0

    # -- the schedule ----------------------------------------------------------------------------------
    def _walks(self):
        """Per group: (its cells, the layer its walk starts at, the layer the unmodified stream stops before)."""
        held_at = 0
        for index, group in enumerate(self.groups):
            later = self.groups[index + 1][0] if index + 1 < len(self.groups) else None
            until = self.start[later] if later is not None else max(self.start[cfg] for cfg in group)
            yield group, held_at, until
            held_at = until

    def planned_passes(self) -> int:
        total = 0
        for group, first, until in self._walks():
            total += self.tokens * (until - first)
            total += self.tokens * sum(self.num_decoder_layers - self.start[cfg] for cfg in group)
        return total

    # -- running it ------------------------------------------------------------------------------------
    @torch.no_grad()
    def cells(self, bar):
        """Walk each group, yielding (configuration, perplexity) as each cell's loss is computed."""
        if not self.groups:
            return
        self.onloaded.load(RESIDENT)
        unmodified: list[torch.Tensor] | None = None
        for number, (group, first, until) in enumerate(self._walks(), start=1):
            if unmodified is None:
                with self.onloaded.loaded(EMBEDDING):
                    unmodified = [self._embed(batch) for batch in self.batches]
            streams: dict[tuple[int, ...], list[torch.Tensor]] = {}
            last_group = number == len(self.groups)
            for j in range(first, self.num_decoder_layers):
                for cfg in group:
                    if self.start[cfg] == j:         # shared until it moves: a move replaces, never writes
                        streams[cfg] = list(unmodified)
                if last_group and j >= until:
                    unmodified = None                                   # no cell starts past here
                self._note_held(streams, unmodified)
                bar.set_postfix_str(f"walk {number}/{len(self.groups)}, decoder layer {j + 1}/"
                                    f"{self.num_decoder_layers}", refresh=False)
                moving = [cfg for cfg in streams]
                with self.onloaded.loaded(f"layer {j}"):
                    for cfg in moving:
                        self._through(j, streams[cfg], cfg)
                    if j < until:
                        self._through(j, unmodified, self.k_all)
                work = self.tokens * (len(moving) + (j < until))
                self.passes += work
                bar.work_done += work
            with self.onloaded.loaded(HEAD):
                for cfg in group:
                    ppl = self._perplexity(streams.pop(cfg))
                    self.naive_passes += self.tokens * self.num_decoder_layers
                    yield cfg, ppl

    def _note_held(self, streams, unmodified) -> None:
        held = {id(s): s for stream in list(streams.values()) + [unmodified or []] for s in stream}
        held_bytes = sum(s.numel() * s.element_size() for s in held.values())
        self.peak_cache_bytes = max(self.peak_cache_bytes, held_bytes + 2 * self.plan.batch)

    def _embed(self, batch: torch.Tensor) -> torch.Tensor:
        """The states entering decoder layer 0 for one batch of windows [b, S] -> [b, S, H]."""
        captured: list[torch.Tensor] = []
        with capture_before(self.model, 0, captured):
            try:
                self.model(input_ids=batch)
            except Captured:
                pass
        return captured[0]

    def _through(self, j: int, stream: list[torch.Tensor], configuration: tuple[int, ...]) -> None:
        """Move every batch of `stream` through decoder layer j under `configuration`'s k, in place."""
        with apply_plan(self.model, static_plan(self.model, list(configuration), method="profile")):
            for index, state in enumerate(stream):
                stream[index] = self._layer_output(j, state)

    def _layer_output(self, j: int, state: torch.Tensor) -> torch.Tensor:
        """[b, S, H] entering decoder layer j -> leaving it, through the model's own forward."""
        captured: list[torch.Tensor] = []

        def capture(module, args, kwargs, output):
            captured.append(output[0] if isinstance(output, tuple) else output)
            raise Captured

        hook = self.layers[j].register_forward_hook(capture, with_kwargs=True)
        try:
            with started_at(self.model, j, [state]):
                try:
                    self.model(inputs_embeds=state)
                except Captured:
                    pass
        finally:
            hook.remove()
        return captured[0]

    def _perplexity(self, stream: list[torch.Tensor]) -> float:
        """Perplexity from the states leaving the last decoder layer, scored as evaluate_perplexity scores
        a pass: every token after a window's first, the mean negative log-likelihood summed batch by batch."""
        last = self.num_decoder_layers - 1
        total_nll, total_tokens = 0.0, 0
        for state, batch in zip(stream, self.batches):
            own = self.layers[last].__dict__.get("forward")       # an instance forward (a device hook) goes back after
            self.layers[last].forward = pass_through
            try:
                with started_at(self.model, last, [state]):
                    logits = self.model(inputs_embeds=state).logits                         # [b, S, V]
            finally:
                if own is None:
                    del self.layers[last].forward
                else:
                    self.layers[last].forward = own
            nll, tokens = summed_nll(logits, batch)
            total_nll += nll
            total_tokens += tokens
        return perplexity_of(total_nll / total_tokens)

    def release(self) -> None:
        self.onloaded.release()

    def provenance(self) -> dict[str, Any]:
        reads = self.onloaded.reads
        layers = [reads[f"layer {j}"] for j in range(self.num_decoder_layers)]
        return {"prefix_cache": bool(self.config.prefix_cache), "layer_passes": self.passes,
                "naive_layer_passes": self.naive_passes, "decoder_layers": self.num_decoder_layers,
                "peak_cache_bytes": self.peak_cache_bytes, "layer_by_layer": True,
                "weight_reads": {"decoder_layers": layers, "max": max(layers, default=0),
                                 "embedding": reads[EMBEDDING], "head": reads[HEAD]},
                "weight_bytes_read": self.onloaded.bytes_read,
                "memory": {"cap_bytes": self.plan.cap, "planned_peak_bytes": self.plan.peak(
                    max((len(g) for g in self.groups), default=0)), "minimum_bytes": self.plan.minimum,
                    "model_bytes": self.plan.model_bytes, "walks": len(self.groups),
                    "cells_per_walk": [len(g) for g in self.groups]}}
