"""Prefill and decode latency of the unmodified model, a plan, and the model with routed experts
off, measured side by side in one run: after warm-up, the configurations take turns call by call
(each prefill, then each decode step), so a slow spell on a shared host slows them all alike.
A distinct-expert plan (at most M_l distinct experts per decode step in layer l) is timed beside
uniform top-k at the activations per token it spends, rounded to a whole k. A plan with a substitute
(stand-ins for skipped experts, routing/substitute.py) is timed beside its twin without it, the
same experts at the same activations: `substitute_cost` is their ratio, what the substitute adds.

The full model keeps its own routing but runs its experts through allocmoe's kernel, as the plans
do, so the speedup is the budget's alone (cpu_speed.py reports the kernel's gain separately).
The experts-off time is what no budget can remove (attention, routers, shared experts, dense
layers, head). The rest, t_full - t_off, is the routed experts' time, and the ideal speedup
supposes that part scales with the plan's share b of the full model's expert work:
    ideal = t_full / (t_off + b * (t_full - t_off)).
Prefill: b = measured activations per token / (L * K). Decode: b = distinct experts per step of
the plan / those of the full model (means over MoE layers and decode steps): what a memory-bound
step reads is each distinct expert's weights once, however many of the batch's tokens use it. At
batch 1 the two coincide (a token's experts are distinct).

Distinct experts and activations per token are counted in an untimed generation per
configuration with the plan handle's step counters (`count_steps`; the full model as static
top-K), over the same prompts and the same number of decode steps as the timed ones. Greedy
decoding repeats itself, so those are the timed steps; `counted_steps_match_timed` records
whether each counting run chose the same tokens as the timed one.

Prefill = one forward over the whole prompt (logits of the last position only); decode = per
generated token with the KV cache, greedy; a decode step advances every sequence of the batch by
one token. CPU timings use perf_counter; CUDA synchronises.
"""

from __future__ import annotations

import contextlib
import dataclasses
import platform
import resource
import statistics
import time
from dataclasses import dataclass
from typing import Any

import torch
from tqdm import tqdm

from ..core.budget import read_fraction_or_count, round_half_up
from ..core.config import Config, check_counts, checked_config
from ..core.memory import check_free_memory
from ..core.plan import Plan
from ..core.policies import DistinctExperts
from ..errors import AllocMoeError
from ..routing.apply import allocmoe_experts, apply_plan, distinct_plan, routed_experts_off, static_plan


class BenchConfig(Config):
    """What a benchmark times: prompt and decode lengths, sequences side by side, rounds."""
    __config_aliases__ = {"batch_size": "sequences"}     # deprecated names

    input_len: int = 256            # prompt tokens per sequence: the prefill's length
    output_len: int = 32            # decode steps timed per repeat: what a decode step's mean is taken over
    sequences: int = 1              # sequences decoded side by side (a decode step routes one token of each)
    repeats: int = 5                # timed rounds (in each, the configs take turns call by call): the medians' samples
    warmup: int = 1                 # untimed rounds first, so first-call costs stay out of the timings

    def __post_init__(self):        # types are checked by Config.__init__ before this runs
        check_counts(self, {"input_len": 1, "output_len": 1, "sequences": 1, "repeats": 1, "warmup": 0})


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _cache_of(out):
    """The KV cache of a model output (transformers 5 names it `cache`, 4.x `past_key_values`;
    5.x still answers to the old name, with a deprecation warning)."""
    return out["cache"] if "cache" in out else out.past_key_values


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


def check_memory(model, config: BenchConfig, caches: int = 3) -> None:
    """Refuse, before allocating, a batch whose KV caches (one per timed configuration) and
    activations will not fit."""
    c = model.config
    param = next(model.parameters())
    elem = param.element_size()
    tokens = config.sequences * (config.input_len + config.output_len)
    per_token_kv = 2 * c.num_hidden_layers * c.hidden_size * elem * 2       # generous: K and V, MLA expanded
    peak_acts = config.sequences * config.input_len * max(c.hidden_size * 16, getattr(c, "intermediate_size", 0) * 3) * elem * 4
    need = caches * tokens * per_token_kv + peak_acts
    check_free_memory(need, param.device, f"batch {config.sequences} x {config.input_len}+{config.output_len} tokens",
                      "lower --sequences or --input-len", detail=" (an estimate) for cache and activations", share=0.9)


# -- distinct experts per decode step -----------------------------------------------------------------
def is_distinct_plan(plan: Plan) -> bool:
    """Does any layer of the plan bound the distinct experts per step?"""
    return any(isinstance(policy, DistinctExperts) for policy in plan.layers.values())


def prompt_ids(model, config: BenchConfig, seed: int = 0) -> torch.Tensor:
    """The benchmark's prompts: random token ids [B, input_len] (seed 0 is timed)."""
    device = next(model.parameters()).device
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, model.config.vocab_size, (config.sequences, config.input_len), generator=gen).to(device)


@torch.no_grad()
def count_decode(model, plan: Plan, ids: torch.Tensor, steps: int) -> dict[str, Any]:
    """Generate `steps` tokens after the prompts under `plan`, untimed, counting over the decode
    steps only (not the prefill): distinct experts per step (mean over layers and steps, the max
    any layer loaded in any step, per layer), activations per token, the tokens chosen [B, steps + 1],
    and for a distinct plan how often a token's own top-1 fell outside its step's chosen set."""
    with apply_plan(model, plan) as handle:
        handle.context.count_steps = True
        gen = Generation(model, ids, steps)
        gen.prefill()
        handle.reset_counters()
        for _ in range(steps):
            gen.step()
        outside = handle.top1_outside_rate()
        return {"distinct_experts_per_step": handle.distinct_experts_per_step(),
                "max_distinct_experts_per_step": handle.max_distinct_experts_per_step(),
                "distinct_experts_per_layer": {str(index): v for index, v in handle.layer_distinct_experts().items()},
                "activations_per_token": handle.activations_per_token(),
                "top1_outside_chosen_rate": sum(outside.values()) / len(outside) if outside else None,
                "tokens": torch.cat(gen.tokens, dim=1)}


def unrestricted_union(model, config: BenchConfig, seed: int = 1) -> dict[int, float]:
    """Per MoE layer, the mean distinct experts per decode step of unmodified top-K routing at
    config.sequences, over config.output_len decode steps after other random prompts than the
    timed ones (seed 1): the union a distinct-expert fraction is taken of."""
    from ..routing.layout import model_fingerprint

    fingerprint = model_fingerprint(model)
    full = static_plan(model, [fingerprint["k_orig"]] * fingerprint["num_moe_layers"])
    counted = count_decode(model, full, prompt_ids(model, config, seed), config.output_len)
    return {int(index): v["mean"] for index, v in counted["distinct_experts_per_layer"].items()}


def parse_max_distinct(text: str, num_experts: int) -> tuple[float | None, int | None]:
    """A distinct-expert budget as typed: "0.5", "1/2", "50%" (a fraction of the unrestricted
    union per layer) -> (fraction, None); a whole number > 1 (experts per layer and step) ->
    (None, count). Same rule as activation budgets: "/", "%" or a number <= 1 is a fraction."""
    raw = str(text).strip()
    try:
        value, is_fraction = read_fraction_or_count(raw)
    except ValueError:
        raise AllocMoeError(f"--max-distinct-experts {raw!r} is not a number; give a fraction of the unrestricted "
                            f"union (0.5, 1/2, 50%) or a count of experts per layer and step (e.g. "
                            f"{num_experts // 2} of {num_experts})") from None
    if not value > 0:
        raise AllocMoeError(f"--max-distinct-experts {raw!r} must be positive; give a fraction in (0, 1] or a "
                            f"count between 2 and {num_experts}")
    if is_fraction:
        if value > 1:
            raise AllocMoeError(f"--max-distinct-experts {raw!r} is a fraction above 1; give at most 1 (100%)")
        return value, None
    if value != int(value):
        raise AllocMoeError(f"--max-distinct-experts {raw!r} is neither a fraction <= 1 nor a whole count; give "
                            f"e.g. 0.5 or {num_experts // 2}")
    if value > num_experts:
        raise AllocMoeError(f"--max-distinct-experts {raw!r} is more than this model's {num_experts} experts per "
                            f"layer; give at most {num_experts}")
    return None, int(value)


def distinct_plan_for(model, config: BenchConfig, fraction: float | None = None,
                      count: int | None = None) -> tuple[Plan, dict[int, float] | None]:
    """A distinct-expert plan at `count` experts per layer and step, or at `fraction` of each
    layer's unrestricted union at config.sequences (unrestricted_union): M_l = max(1,
    round_half_up(fraction * union_l)). Returns the plan and the union (None for a count)."""
    if (fraction is None) == (count is None):
        raise AllocMoeError("give the distinct-expert budget as a fraction or as a count, not both or neither")
    if count is not None:
        return distinct_plan(model, count), None
    union = unrestricted_union(model, config)
    return distinct_plan(model, {index: max(1, round_half_up(fraction * u)) for index, u in union.items()}), union


# -- the benchmark ------------------------------------------------------------------------------------
def benchmark(model, plan, config: BenchConfig | dict | None = None, synthetic: bool = False,
              progress: bool = True, uniform_beside: bool | None = None) -> dict[str, Any]:
    """Time full / plan / experts off side by side (and, beside a distinct-expert plan or with
    `uniform_beside`, uniform top-k at the activations per decoded token the plan spends, rounded
    to a whole k); returns the JSON-ready result."""
    from ..routing.layout import model_fingerprint

    config = checked_config(BenchConfig, config)
    fingerprint = model_fingerprint(model)
    if uniform_beside is None:
        uniform_beside = is_distinct_plan(plan)
    twin = plan.means is not None
    check_memory(model, config, caches=3 + uniform_beside + twin)
    device = next(model.parameters()).device
    ids = prompt_ids(model, config)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    lineup = _lineup(model, plan, ids, config, fingerprint, uniform_beside, twin)
    rounds = _timed_rounds(model, ids, lineup, config, progress)
    result = _summarise(plan, config, fingerprint, lineup, rounds, synthetic)
    result["experts_kernel"] = f"allocmoe {_kernel_of(model, device)}, for full and plans alike"
    result["peak_memory_bytes"] = (torch.cuda.max_memory_allocated(device) if device.type == "cuda"
                                   else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
    result["environment"] = _environment(model, device)
    if synthetic:
        result["note"] = "synthetic model with random weights: timings are real, quality numbers are meaningless"
    return result


@dataclass
class _Lineup:
    """The configurations a benchmark times, in order, and what each loads and spends per decode step."""
    names: list[str]                    # "full", "plan", ["twin"], ["uniform"], "off"
    plans: dict[str, Plan]              # the plan of each configuration that has one (not "off")
    counted: dict[str, dict[str, Any]]  # count_decode's untimed counts per configuration (not "off")
    uniform_k: int | None               # uniform's whole k, when it is timed beside the plan


def _lineup(model, plan: Plan, ids: torch.Tensor, config: BenchConfig, fingerprint: dict[str, Any],
            uniform_beside: bool, twin: bool) -> _Lineup:
    """The configurations to time, each counted untimed first over the same prompts and decode steps as
    the timed ones: uniform top-k at the plan's activations beside it if asked, the plan's twin without
    its substitute when it has one."""
    num_layers, k_orig = fingerprint["num_moe_layers"], fingerprint["k_orig"]
    plans = {"full": static_plan(model, [k_orig] * num_layers, method="full"), "plan": plan}
    counted = {"plan": count_decode(model, plan, ids, config.output_len)}
    uniform_k = None
    if uniform_beside:
        uniform_k = min(k_orig, max(1, round_half_up(counted["plan"]["activations_per_token"] / num_layers)))
        plans["uniform"] = static_plan(model, [uniform_k] * num_layers, method="uniform")
        counted["uniform"] = count_decode(model, plans["uniform"], ids, config.output_len)
    if twin:                                  # the same experts without the substitute
        plans["twin"] = dataclasses.replace(plan, means=None, substitute=None)
        counted["twin"] = count_decode(model, plans["twin"], ids, config.output_len)
    counted["full"] = count_decode(model, plans["full"], ids, config.output_len)
    names = ["full", "plan", *(["twin"] if twin else []), *(["uniform"] if uniform_beside else []), "off"]
    return _Lineup(names, plans, counted, uniform_k)


@dataclass
class _Rounds:
    """What the timed rounds measured."""
    samples: dict[str, dict[str, list[float]]]   # configuration -> "prefill" / "decode" -> seconds per round
    tokens: dict[str, torch.Tensor]              # configuration -> the tokens its last round chose [B, steps + 1]
    activations_per_token: float                 # the plan's, measured over every call it ran
    cost_per_token: float | None = None          # the same with its stand-ins' activation-equivalents added


def _timed_rounds(model, ids: torch.Tensor, lineup: _Lineup, config: BenchConfig, progress: bool) -> _Rounds:
    """Warm-up and timed rounds; in each, the configurations take turns call by call (prefill, then each
    decode step), in an order that reverses between rounds, so drift on a shared host falls on all alike."""
    spent = {"activations": 0.0, "cost": 0.0, "tokens": 0}     # the plan's, over every call it ran

    @contextlib.contextmanager
    def configured(name):
        if name == "full":
            with allocmoe_experts(model):
                yield
        elif name == "off":
            with routed_experts_off(model):
                yield
        else:
            with apply_plan(model, lineup.plans[name]) as handle:
                yield
                if name == "plan":
                    tokens = handle.tokens_seen()
                    spent["activations"] += handle.activations_per_token() * tokens
                    cost = lineup.plans[name].measured_cost(handle.layer_activations())
                    spent["cost"] = None if cost is None or spent["cost"] is None else spent["cost"] + cost * tokens
                    spent["tokens"] += tokens

    def take_turns(order, call) -> dict[str, float]:
        seconds = {}
        for name in order:
            with configured(name):
                seconds[name] = call(name)
        return seconds

    names = lineup.names
    samples: dict[str, dict[str, list[float]]] = {n: {"prefill": [], "decode": []} for n in names}
    rounds = config.warmup + config.repeats
    # one tick per call of all configurations (a prefill or a decode step): time left is right within a round too
    with tqdm(total=rounds * (1 + config.output_len), desc="bench", unit="step", disable=not progress) as bar:
        for r in range(rounds):
            bar.set_postfix_str(f"round {r + 1}/{rounds}{' (warm-up)' if r < config.warmup else ''}")
            order = names if r % 2 == 0 else names[::-1]
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
    return _Rounds(samples, {name: torch.cat(gens[name].tokens, dim=1) for name in names},
                   spent["activations"] / max(spent["tokens"], 1),
                   None if spent["cost"] is None else spent["cost"] / max(spent["tokens"], 1))


def _summarise(plan: Plan, config: BenchConfig, fingerprint: dict[str, Any], lineup: _Lineup, rounds: _Rounds,
               synthetic: bool) -> dict[str, Any]:
    """The JSON-ready result of the timed rounds: speedups against the ideal per phase, a row per
    configuration, the substitute's cost, the timings with their samples."""
    num_layers, k_orig = fingerprint["num_moe_layers"], fingerprint["k_orig"]
    counted, samples = lineup.counted, rounds.samples
    measured = rounds.activations_per_token
    fraction = measured / (num_layers * k_orig)
    d_full = counted["full"]["distinct_experts_per_step"]
    decode_fraction = {name: counted[name]["distinct_experts_per_step"] / d_full for name in counted}
    timings = {n: {phase: _summary(v) for phase, v in phases.items()} for n, phases in samples.items()}
    result: dict[str, Any] = {"model": fingerprint, "synthetic": synthetic,
                              "plan": {"method": plan.method, "budget": plan.budget, "cost": plan.cost(),
                                       "max_distinct_experts": {str(i): p.max_experts for i, p in plan.layers.items()
                                                                if isinstance(p, DistinctExperts)} or None},
                              "measured_activations_per_token": measured, "budget_fraction": fraction,
                              "measured_cost_per_token": rounds.cost_per_token,
                              "decode_fraction": decode_fraction["plan"],
                              "settings": config.model_dump(),
                              "experts_kernel": None,
                              "ideal": {"formula": "t_full / (t_off + b * (t_full - t_off))",
                                        "prefill_b": "measured activations per token / (L * K)",
                                        "decode_b": "distinct experts per decode step, plan / full (means over "
                                                    "MoE layers and steps)"}}
    fractions = {"prefill": {"plan": fraction}, "decode": decode_fraction}
    for phase in ("prefill", "decode"):
        t_full, t_plan, t_off = (timings[n][phase]["median"] for n in ("full", "plan", "off"))
        b = fractions[phase]["plan"]
        result[f"{phase}_speedup"] = t_full / t_plan
        result[f"{phase}_ideal_speedup"] = ideal_speedup(t_full, t_off, b)
        result[f"{phase}_fraction_of_ideal"] = share_of_ideal_gain(t_full, t_plan, t_off, b)
        result[f"{phase}_fraction_of_ideal_paired"] = _paired_share(samples, phase, "plan", b)
    result["configurations"] = {name: _configuration_row(name, lineup, rounds, timings, decode_fraction, config,
                                                         k_orig) for name in lineup.names}
    if "twin" in lineup.names:
        result["substitute_cost"] = {
            phase: {"ratio": timings["plan"][phase]["median"] / timings["twin"][phase]["median"],
                    "ratio_paired": statistics.median(p / t for p, t in zip(samples["plan"][phase],
                                                                             samples["twin"][phase])),
                    "rank": plan.means.rank,            # the largest; per layer in "ranks"
                    "ranks": {str(i): r for i, r in sorted(plan.means.ranks.items())}}
            for phase in ("prefill", "decode")}
    for name, phases in timings.items():
        for phase, summary in phases.items():
            summary["samples"] = samples[name][phase]
    result["timings_seconds"] = timings
    result["distinct_experts_per_decode_step"] = {"full": d_full, "plan": counted["plan"]["distinct_experts_per_step"],
                                                  "num_experts": fingerprint["num_experts"]}
    return result


def _configuration_row(name: str, lineup: _Lineup, rounds: _Rounds, timings, decode_fraction: dict[str, float],
                       config: BenchConfig, k_orig: int) -> dict[str, Any]:
    """One configuration's row of the side-by-side decode table (format_table)."""
    t_full, t_off = timings["full"]["decode"]["median"], timings["off"]["decode"]["median"]
    t = timings[name]["decode"]["median"]
    row: dict[str, Any] = {"label": _label(name, lineup.plans.get(name), k_orig),
                           **({"k": lineup.uniform_k} if name == "uniform" else {}),
                           "decode_step_ms": 1000 * t, "decode_tokens_per_second": config.sequences / t,
                           "prefill_seconds": timings[name]["prefill"]["median"], "decode_speedup": t_full / t}
    if name in lineup.counted:
        c = lineup.counted[name]
        row.update({key: c[key] for key in ("activations_per_token", "distinct_experts_per_step",
                                             "max_distinct_experts_per_step", "distinct_experts_per_layer")})
        if c["top1_outside_chosen_rate"] is not None:
            row["top1_outside_chosen_rate"] = c["top1_outside_chosen_rate"]
        row["counted_steps_match_timed"] = bool(torch.equal(c["tokens"], rounds.tokens[name]))
        if name != "full":
            b = decode_fraction[name]
            row["decode_ideal_speedup"] = ideal_speedup(t_full, t_off, b)
            row["decode_share_of_ideal_gain"] = share_of_ideal_gain(t_full, t, t_off, b)
            row["decode_share_of_ideal_gain_paired"] = _paired_share(rounds.samples, "decode", name, b)
    return row


def _environment(model, device: torch.device) -> dict[str, Any]:
    """Where the timings were taken: device, dtype, threads and library versions."""
    from ..version import __version__

    return {"device": torch.cuda.get_device_name(device) if device.type == "cuda"
            else f"cpu ({platform.processor() or platform.machine()})",
            "dtype": str(next(model.parameters()).dtype).removeprefix("torch."), "threads": torch.get_num_threads(),
            "torch": torch.__version__, "transformers": __import__("transformers").__version__,
            "allocmoe": __version__, "python": platform.python_version()}


def _paired_share(samples, phase: str, name: str, fraction: float) -> float | None:
    """Each round's share of the ideal gain from its own timings (drift between rounds cancels),
    median over rounds; None when no round had a gain to share."""
    shares = [share_of_ideal_gain(f, p, o, fraction) for f, p, o in
              zip(samples["full"][phase], samples[name][phase], samples["off"][phase])]
    shares = [x for x in shares if x is not None]
    return statistics.median(shares) if shares else None


def _label(name: str, plan: Plan | None, k_orig: int) -> str:
    if name == "full":
        return f"unmodified (top-{k_orig})"
    if name == "off":
        return "routed experts off"
    if name == "uniform":
        return f"uniform top-{next(iter(plan.layers.values())).k}"
    if name == "twin":
        return f"{plan.method} (budget {plan.budget:g}) without its substitute"
    if is_distinct_plan(plan):
        ms = sorted({p.max_experts for p in plan.layers.values() if isinstance(p, DistinctExperts)})
        return f"{plan.method} (M {ms[0]}" + (f"-{ms[-1]})" if len(ms) > 1 else ")")
    return f"{plan.method} (budget {plan.budget:g})" + (" with its substitute" if plan.means is not None else "")


def format_table(result: dict[str, Any]) -> str:
    """The side-by-side decode table of a result, as Markdown."""
    s = result["settings"]
    num_experts = result["model"]["num_experts"]
    lines = [f"batch {s.get('sequences', s.get('batch_size'))}, prompt {s['input_len']}, {s['output_len']} decode steps, "
             f"{s['repeats']} timed rounds (medians); distinct experts of {num_experts} per layer",
             "",
             "| configuration | activations/token | distinct experts/step (max) | step ms | decode tok/s | speedup "
             "| ideal | share of ideal gain (paired) |",
             "|---|---|---|---|---|---|---|---|"]
    for row in result["configurations"].values():
        distinct = (f"{row['distinct_experts_per_step']:.1f} ({row['max_distinct_experts_per_step']})"
                    if "distinct_experts_per_step" in row else "")
        acts = f"{row['activations_per_token']:.2f}" if "activations_per_token" in row else ""
        ideal = f"{row['decode_ideal_speedup']:.3f}x" if "decode_ideal_speedup" in row else ""
        share = ""
        if row.get("decode_share_of_ideal_gain") is not None:
            paired = row["decode_share_of_ideal_gain_paired"]
            share = f"{row['decode_share_of_ideal_gain']:.0%}" + (f" ({paired:.0%})" if paired is not None else "")
        lines.append(f"| {row['label']} | {acts} | {distinct} | {row['decode_step_ms']:.1f} | "
                     f"{row['decode_tokens_per_second']:.2f} | {row['decode_speedup']:.3f}x | {ideal} | {share} |")
    return "\n".join(lines)
