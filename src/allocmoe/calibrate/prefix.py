"""The profile's shared prefix: every cell of MoE layer i runs the decoder layers before i exactly as
the unmodified model does (all at K_orig), so their output is computed once and each cell of layer
i runs only from decoder layer d_i (layer i's index in the model) to the end.

What is held is the hidden states entering one decoder layer (one [b, S, H] tensor per calibration
batch), and while advancing one batch more: when the cells of a layer are done the states are
advanced through the unmodified model to the next layer's entry, batch by batch, each batch
replacing its own.

How a pass starts at decoder layer d without touching model code: the layers before d get an
instance `forward` that hands its input through (one already there, such as the device hook
accelerate's device_map installs, is put back after), and a forward pre-hook on layer d swaps its
input for the held states of the current batch. Everything the model derives from the input (embedding,
causal and sliding-window masks, rotary tables, per-index layer types) is computed as in a full
pass, so layer d and every layer after it see exactly what a full pass shows them. Before the first
cell relies on this, one window checks it: the logits of a pass started at d against a full pass,
with another window run between them so that state a skipped layer leaves behind is stale, as it
would be in a cell. A model where they differ, or whose decoder stack is not `model.model.layers`,
raises PrefixCacheUnsupported and the profile falls back to full passes.

Not here: which configurations to run (profile.profile_cells) and the perplexity itself
(scoring/perplexity.py, called unchanged so a cell's number is the naive one).

Work is counted in decoder-layer passes: tokens x decoder layers run.
Shape legend: b = windows in a batch, S = window length, H = hidden size, V = vocabulary.
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
from torch import nn

from ..routing.layout import model_fingerprint
from ..routing.apply import apply_plan, static_plan

CHECK_TOLERANCE = 1e-4     # relative difference of one window's logits, started at d vs a full pass


class PrefixCacheUnsupported(Exception):
    """This model cannot start a pass at a decoder layer exactly; the message says why."""


# -- the schedule, and the work it costs ------------------------------------------------------

@dataclass(frozen=True)
class Step:
    kind: str                                   # "advance" the held states, "check" them, or run a "cell"
    start: int                                  # decoder layer the pass starts at (0: the embedding, nothing held)
    stop: int                                   # decoder layer it ends before (the layer count: the whole model)
    configuration: tuple[int, ...] | None = None   # a cell's k per MoE layer


def start_position(configuration: tuple[int, ...], k_orig: int) -> int:
    """MoE position of the first layer below K_orig: the model is unmodified before it (the last
    layer when every layer is at K_orig)."""
    return next((pos for pos, k in enumerate(configuration) if k != k_orig), len(configuration) - 1)


def profile_start_layer(moe_layers: list[int], k_orig: int) -> Callable[[tuple[int, ...]], int]:
    """`start_layer` of the profile's cells (cell_schedule, profile.cell_run): the decoder layer of a
    configuration's first MoE layer below K_orig, where it first differs from the unmodified model."""
    return lambda configuration: moe_layers[start_position(configuration, k_orig)]


def cell_schedule(cells: list, start_layer: Callable[[Any], int], num_decoder_layers: int,
                  prefix_cache: bool = True) -> list[Step]:
    """The passes that run `cells`, in order; a cell first differs from the unmodified model at decoder
    layer `start_layer(cell)`. Naive: each a full pass. Cached: grouped by start (stable: the given
    order kept within a group), the held states advanced to each group's layer before its cells, one
    check before the first cell that starts past the embedding. The Alloc-L profile and the
    distinct-expert profile (distinct.py) both run through it."""
    if not prefix_cache:
        return [Step("cell", 0, num_decoder_layers, cell) for cell in cells]
    steps, held_at, checked = [], 0, False
    for cell in sorted(cells, key=start_layer):
        start = start_layer(cell)
        if start > held_at:
            steps.append(Step("advance", held_at, start))
            held_at = start
        if start > 0 and not checked:
            steps.append(Step("check", start, num_decoder_layers))
            checked = True
        steps.append(Step("cell", start, num_decoder_layers, cell))
    return steps


def step_layer_passes(step: Step, tokens: int, check_tokens: int) -> int:
    """Decoder-layer passes of one step: `tokens` through its layers; a check runs one window
    (`check_tokens`, the window length) in full, its reverse up to `start`, and the window from `start`."""
    if step.kind == "check":
        return check_tokens * (step.stop + step.start + step.stop - step.start)
    return tokens * (step.stop - step.start)


def layer_passes(steps: list[Step], tokens: int, check_tokens: int) -> int:
    return sum(step_layer_passes(step, tokens, check_tokens) for step in steps)


def naive_layer_passes(steps: list[Step], tokens: int, num_decoder_layers: int) -> int:
    """What the naive protocol runs for the same cells: each a full pass."""
    return tokens * num_decoder_layers * sum(step.kind == "cell" for step in steps)


# -- starting a pass at a decoder layer --------------------------------------------------------

class Captured(Exception):
    """Raised by the capture hook once it has the states it came for: the rest of the pass is not needed."""


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    base = getattr(model, "model", None)
    layers = getattr(base, "layers", None)
    expected = getattr(model.config, "num_hidden_layers", None)
    if not isinstance(layers, nn.ModuleList) or (expected is not None and len(layers) != expected):
        raise PrefixCacheUnsupported(f"{model.config.model_type}'s decoder stack is not model.model.layers")
    return layers


def _hidden_argument(args: tuple, kwargs: dict, where: int) -> torch.Tensor:
    hidden = args[0] if args else kwargs.get("hidden_states")
    if not isinstance(hidden, torch.Tensor):
        raise PrefixCacheUnsupported(f"decoder layer {where} is not called with the hidden states first")
    return hidden


def pass_through(*args, **kwargs):
    return args[0] if args else kwargs["hidden_states"]


@contextmanager
def started_at(model: nn.Module, start: int, states: list[torch.Tensor]) -> Iterator[None]:
    """Passes made inside run from decoder layer `start`, the n-th pass fed `states[n]` [b, S, H];
    all of them must be used."""
    layers = decoder_layers(model)
    if any(layer.__dict__.get("forward") is pass_through for layer in layers[:start]):
        raise PrefixCacheUnsupported("a pass is already started at a decoder layer of this model")
    # an instance forward already there (accelerate's device hook) is handed through too, and put back
    replaced = [layer.__dict__.get("forward") for layer in layers[:start]]
    fed = 0

    def feed(module, args, kwargs):
        nonlocal fed
        hidden = _hidden_argument(args, kwargs, start)
        if fed >= len(states) or states[fed].shape != hidden.shape:
            raise PrefixCacheUnsupported(f"the passes do not match the held states at decoder layer {start}")
        held = states[fed].clone()          # the layer may work in place; the held copy stays clean
        fed += 1
        return ((held,) + args[1:], kwargs) if args else (args, {**kwargs, "hidden_states": held})

    hook = layers[start].register_forward_pre_hook(feed, with_kwargs=True)
    for layer in layers[:start]:
        layer.forward = pass_through
    try:
        yield
        if fed != len(states):
            raise PrefixCacheUnsupported(f"{fed} passes used the {len(states)} batches held at decoder layer {start}")
    finally:
        hook.remove()
        for layer, forward in zip(layers[:start], replaced):
            if forward is None:
                layer.__dict__.pop("forward", None)
            else:
                layer.forward = forward


@contextmanager
def capture_before(model: nn.Module, stop: int, into: list[torch.Tensor]) -> Iterator[None]:
    """A pass made inside appends the states entering decoder layer `stop` to `into` and ends there."""
    def capture(module, args, kwargs):
        into.append(_hidden_argument(args, kwargs, stop).detach())
        raise Captured

    hook = decoder_layers(model)[stop].register_forward_pre_hook(capture, with_kwargs=True)
    try:
        yield
    finally:
        hook.remove()


class PrefixStates:
    """The hidden states entering one decoder layer for every calibration batch, as the unmodified
    model (all MoE layers at K_orig, through allocmoe's router as in every cell) computes them."""

    def __init__(self, model: nn.Module, windows: torch.Tensor, batch_size: int):
        decoder_layers(model)                                       # refuse early, before any pass
        self.model, self.batches = model, windows.split(batch_size)
        fingerprint = model_fingerprint(model)
        self.k_all = [fingerprint["k_orig"]] * fingerprint["num_moe_layers"]
        self.held_at = 0                                            # 0: nothing held (a pass starts at the embedding)
        self.states: list[torch.Tensor] = []                        # per batch, [b, S, H]
        self.peak_bytes = 0

    def _unmodified(self):
        return apply_plan(self.model, static_plan(self.model, self.k_all, method="profile"))

    def _held_bytes(self) -> int:
        return sum(state.numel() * state.element_size() for state in self.states)

    @torch.no_grad()
    def advance(self, stop: int) -> None:
        """Move the held states to the entry of decoder layer `stop`, one batch at a time."""
        device = next(self.model.parameters()).device
        with self._unmodified():
            for index, batch in enumerate(self.batches):
                captured: list[torch.Tensor] = []
                start = started_at(self.model, self.held_at, self.states[index:index + 1]) if self.held_at \
                    else nullcontext()
                with capture_before(self.model, stop, captured), start:
                    try:
                        self.model(input_ids=batch.to(device))
                    except Captured:
                        pass
                if len(captured) != 1:
                    raise PrefixCacheUnsupported(f"a pass never reached decoder layer {stop}")
                self.peak_bytes = max(self.peak_bytes, self._held_bytes() + captured[0].numel() *
                                      captured[0].element_size())
                if self.held_at:
                    self.states[index] = captured[0]
                else:
                    self.states.append(captured[0])
        self.held_at = stop

    @torch.no_grad()
    def check(self, start: int) -> float:
        """Relative difference of the first window's logits [1, S, V], a pass started at `start` from
        the held states against a full pass; refuses the model past CHECK_TOLERANCE. Between the
        two, the reversed window runs up to `start`, so a layer that leaves state for deeper layers
        has left another window's there, as it would have for every cell."""
        if start != self.held_at:
            raise PrefixCacheUnsupported(f"states are held at decoder layer {self.held_at}, not {start}")
        window = self.batches[0][:1].to(next(self.model.parameters()).device)                # [1, S]
        try:
            with self._unmodified():
                full = self.model(input_ids=window).logits.float()
                with capture_before(self.model, start, []):
                    try:
                        self.model(input_ids=window.flip(-1))
                    except Captured:
                        pass
                with started_at(self.model, start, [self.states[0][:1]]):
                    cached = self.model(input_ids=window).logits.float()
            difference = float((cached - full).norm() / full.norm().clamp_min(1e-30))
        except PrefixCacheUnsupported:
            raise
        except Exception as exc:            # a family whose layers cannot be passed through this way
            raise PrefixCacheUnsupported(f"a pass started at decoder layer {start} failed: {exc!r}") from exc
        if not difference <= CHECK_TOLERANCE:
            raise PrefixCacheUnsupported(f"a pass started at decoder layer {start} differs from a full pass "
                                         f"(relative difference {difference:.1e})")
        return difference

    def passes_from(self, start: int):
        """Context in which evaluate_perplexity's passes (batch by batch, in order) start at `start`."""
        if start != self.held_at:
            raise PrefixCacheUnsupported(f"states are held at decoder layer {self.held_at}, not {start}")
        return started_at(self.model, start, self.states)

    def release(self) -> None:
        self.states = []
