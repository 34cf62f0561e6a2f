"""Prefill and decode latency of the unmodified model, a plan, and the model with routed experts
off, measured side by side in one run: after warm-up, the three take turns call by call (each
prefill, then each decode step), so a slow spell on a shared host slows all three alike.

The full model keeps its own routing but runs its experts through allocmoe's kernel, as the plan
does, so the speedup is the budget's alone (cpu_speed.py reports the kernel's gain separately).
The experts-off time is what no budget can remove (attention, routers, shared experts, head);
from it the ideal speedup at the plan's measured budget fraction b is
    t_full / (t_off + b * (t_full - t_off)).
Prefill = one forward over the whole prompt (logits of the last position only); decode = per
generated token with the KV cache, greedy. CPU timings use perf_counter; CUDA synchronises.
"""

from __future__ import annotations

import contextlib
import platform
import resource
import statistics
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch
from tqdm import tqdm

from ..routing.apply import allocmoe_experts, apply_plan, routed_experts_off
from ..errors import AllocMoeError


@dataclass
class BenchConfig:
    input_len: int = 256            # prompt tokens per sequence
    output_len: int = 32            # decode steps timed per repeat
    batch_size: int = 1             # sequences per batch
    repeats: int = 5                # timed rounds (in each, the configs take turns call by call)
    warmup: int = 1                 # untimed rounds first

    def __post_init__(self):
        for name, value in asdict(self).items():
            low = 0 if name == "warmup" else 1
            if not isinstance(value, int) or value < low:
                raise AllocMoeError(f"{name.replace('_', '-')} must be a whole number >= {low}, got {value!r}")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _cache_of(out):
    """The KV cache of a model output (transformers 5 names it `cache`, 4.x `past_key_values`;
    5.x still answers to the old name, with a deprecation warning)."""
    return out["cache"] if "cache" in out else out.past_key_values


def free_memory_bytes(device: torch.device) -> int:
    """Memory still free on `device`: the CUDA allocator's view, or the host's available pages."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    import os

    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


class Generation:
    """One prompt batch generated greedily with the KV cache, a call at a time, each call timed.

    Several configurations of one model can take turns call by call (each its own cache), so a
    contention spike on a shared host lands on all of them rather than on whichever ran then.
    """

    def __init__(self, model, ids: torch.Tensor, output_len: int):
        self.model, self.ids = model, ids
        batch, prompt = ids.shape
        self.mask = torch.ones(batch, prompt + output_len, dtype=torch.long, device=ids.device)   # [B, S + N]
        self.length = prompt                     # tokens in the cache once prefilled
        self.cache, self.next_ids = None, None
        self.tokens: list[torch.Tensor] = []     # [B, 1] per call: the greedy choices, for checks

    def _timed(self, **inputs) -> float:
        device = self.ids.device
        _sync(device)
        t0 = time.perf_counter()
        out = self.model(use_cache=True, logits_to_keep=1, **inputs)
        self.next_ids = out.logits[:, -1:].argmax(-1)                       # [B, 1]
        _sync(device)
        seconds = time.perf_counter() - t0
        self.cache = _cache_of(out)
        self.tokens.append(self.next_ids)
        return seconds

    @torch.no_grad()
    def prefill(self) -> float:
        """Seconds for one forward over the whole prompt."""
        return self._timed(input_ids=self.ids)

    @torch.no_grad()
    def step(self) -> float:
        """Seconds for one decode step: the last token in, the next one out."""
        self.length += 1
        return self._timed(input_ids=self.next_ids, cache=self.cache, attention_mask=self.mask[:, : self.length])


def _summary(samples: list[float]) -> dict[str, float]:
    ordered = sorted(samples)
    return {"median": statistics.median(ordered), "min": ordered[0], "max": ordered[-1],
            "iqr": (ordered[(3 * len(ordered)) // 4] - ordered[len(ordered) // 4]) if len(ordered) > 1 else 0.0}


def ideal_speedup(t_full: float, t_off: float, fraction: float) -> float:
    """Full time over the time if the budget-dependent part (full minus experts off) scaled with b."""
    return t_full / (t_off + fraction * (t_full - t_off))


def share_of_ideal_gain(t_full: float, t_plan: float, t_off: float, fraction: float) -> float | None:
    """(speedup - 1) / (ideal - 1): 1.0 when the plan saves all the budget allows; None without a gain to share."""
    ideal = ideal_speedup(t_full, t_off, fraction)
    return (t_full / t_plan - 1) / (ideal - 1) if ideal > 1 else None


def _kernel_of(model, device: torch.device) -> str:
    from ..routing.adapters import adapter_for_model
    from ..routing.experts import experts_kernel_name

    experts = adapter_for_model(model).moe_layers(model)[0].experts
    probe = torch.empty(1, model.config.hidden_size, dtype=next(model.parameters()).dtype, device=device)
    return experts_kernel_name(experts, probe)


def check_memory(model, config: BenchConfig) -> None:
    """Refuse, before allocating, a batch whose KV cache and activations will not fit."""
    c = model.config
    param = next(model.parameters())
    elem = param.element_size()
    tokens = config.batch_size * (config.input_len + config.output_len)
    per_token_kv = 2 * c.num_hidden_layers * c.hidden_size * elem * 2       # generous: K and V, MLA expanded
    peak_acts = config.batch_size * config.input_len * max(c.hidden_size * 16, getattr(c, "intermediate_size", 0) * 3) * elem * 4
    need = 3 * tokens * per_token_kv + peak_acts                            # full, plan and off: a cache each
    free = free_memory_bytes(param.device)
    if need > free * 0.9:
        raise AllocMoeError(f"batch {config.batch_size} x {config.input_len}+{config.output_len} tokens needs about "
                            f"{need / 2**30:.1f} GiB for cache and activations but {free / 2**30:.1f} GiB is free; "
                            "lower --batch-size or --input-len")


def _distinct_experts(model, plan, ids, steps: int) -> float:
    """Mean over decode steps and MoE layers of distinct routed experts used by the batch."""
    seen: list[int] = []

    def record(layer, cand_idx, cand_probs, counts, valid):
        keep = torch.arange(cand_idx.size(1), device=cand_idx.device)[None, :] < counts[:, None]
        seen.append(int(cand_idx[keep & valid[:, None]].unique().numel()))

    with apply_plan(model, plan) as handle:
        handle.context.recorders.append(record)
        gen = Generation(model, ids, steps)
        gen.prefill()
        seen.clear()                                  # decode steps only
        for _ in range(steps):
            gen.step()
    return sum(seen) / max(len(seen), 1)


def benchmark(model, plan, config: BenchConfig | None = None, synthetic: bool = False,
              progress: bool = True) -> dict[str, Any]:
    """Time full / plan / experts-off side by side; returns the JSON-ready result."""
    from .. import __version__
    from ..routing.apply import static_plan
    from ..core.plan import model_fingerprint

    config = config or BenchConfig()
    check_memory(model, config)
    device = next(model.parameters()).device
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (config.batch_size, config.input_len), generator=gen).to(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)

    spent = {"activations": 0.0, "tokens": 0}     # the plan's, over every call it ran

    @contextlib.contextmanager
    def configured(name):
        if name == "full":
            with allocmoe_experts(model):
                yield
        elif name == "off":
            with routed_experts_off(model):
                yield
        else:
            with apply_plan(model, plan) as handle:
                yield
                tokens = handle.tokens_seen()
                spent["activations"] += handle.activations_per_token() * tokens
                spent["tokens"] += tokens

    def take_turns(order, call) -> dict[str, float]:
        seconds = {}
        for name in order:
            with configured(name):
                seconds[name] = call(name)
        return seconds

    samples: dict[str, dict[str, list[float]]] = {n: {"prefill": [], "decode": []} for n in ("full", "plan", "off")}
    rounds = config.warmup + config.repeats
    # one tick per call of all three (a prefill or a decode step): time left is right within a round too
    with tqdm(total=rounds * (1 + config.output_len), desc="bench", unit="step", disable=not progress) as bar:
        for r in range(rounds):
            bar.set_postfix_str(f"round {r + 1}/{rounds}{' (warm-up)' if r < config.warmup else ''}")
            # The three configurations take turns call by call (prefill, then each decode step), in an
            # order that alternates between rounds, so drift on a shared host falls on all three alike.
            order = ("full", "plan", "off") if r % 2 == 0 else ("off", "plan", "full")
            gens = {name: Generation(model, ids, config.output_len) for name in order}
            prefill = take_turns(order, lambda name: gens[name].prefill())
            bar.update(1)
            decode = dict.fromkeys(order, 0.0)
            for _ in range(config.output_len):
                for name, seconds in take_turns(order, lambda name: gens[name].step()).items():
                    decode[name] += seconds / config.output_len
                bar.update(1)
            if r >= config.warmup:
                for name in order:
                    samples[name]["prefill"].append(prefill[name])
                    samples[name]["decode"].append(decode[name])

    fingerprint = model_fingerprint(model)
    full_budget = fingerprint["num_moe_layers"] * fingerprint["k_orig"]
    measured = spent["activations"] / max(spent["tokens"], 1)
    fraction = measured / full_budget
    timings = {n: {phase: _summary(v) for phase, v in phases.items()} for n, phases in samples.items()}
    result: dict[str, Any] = {"model": fingerprint, "synthetic": synthetic,
                              "plan": {"method": plan.method, "budget": plan.budget},
                              "measured_activations_per_token": measured, "budget_fraction": fraction,
                              "settings": asdict(config),
                              "experts_kernel": f"allocmoe {_kernel_of(model, device)}, for full and plan alike"}
    for phase in ("prefill", "decode"):
        t_full, t_plan, t_off = (timings[n][phase]["median"] for n in ("full", "plan", "off"))
        ideal = ideal_speedup(t_full, t_off, fraction)
        result[f"{phase}_speedup"] = t_full / t_plan
        result[f"{phase}_ideal_speedup"] = ideal
        result[f"{phase}_fraction_of_ideal"] = share_of_ideal_gain(t_full, t_plan, t_off, fraction)
        # the same, from each round's own three timings (drift between rounds cancels), median over rounds
        per_round = [share_of_ideal_gain(f, p, o, fraction) for f, p, o in
                     zip(*(samples[n][phase] for n in ("full", "plan", "off")))]
        per_round = [x for x in per_round if x is not None]
        result[f"{phase}_fraction_of_ideal_paired"] = statistics.median(per_round) if per_round else None
    for name, phases in timings.items():
        for phase, summary in phases.items():
            summary["samples"] = samples[name][phase]
    result["timings_seconds"] = timings
    if config.batch_size > 1:
        full_plan = static_plan(model, [fingerprint["k_orig"]] * fingerprint["num_moe_layers"])
        steps = min(config.output_len, 8)
        result["distinct_experts_per_decode_step"] = {"full": _distinct_experts(model, full_plan, ids, steps),
                                                      "plan": _distinct_experts(model, plan, ids, steps),
                                                      "num_experts": fingerprint["num_experts"]}
    result["peak_memory_bytes"] = (torch.cuda.max_memory_allocated(device) if device.type == "cuda"
                                   else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
    result["environment"] = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu ({platform.processor() or platform.machine()})",
        "dtype": str(next(model.parameters()).dtype).removeprefix("torch."), "threads": torch.get_num_threads(),
        "torch": torch.__version__, "transformers": __import__("transformers").__version__, "allocmoe": __version__,
        "python": platform.python_version()}
    if synthetic:
        result["note"] = "synthetic model with random weights: timings are real, quality numbers are meaningless"
    return result
