"""The vLLM plugin: `vllm serve MODEL` runs an allocmoe plan, or a plan per request.

    ALLOCMOE_PLAN=plan.json vllm serve MODEL                     # every request under plan.json
    ALLOCMOE_PLANS=half=a.json,third=b.json vllm serve MODEL     # + per request: vllm_xargs
                                                                 #   {"allocmoe_plan": "half"}

vLLM calls `register()` (entry point group `vllm.general_plugins`) in each of its processes. With
neither variable set it does nothing. Otherwise it wraps the model loader so that, once the model
is loaded, each MoE layer follows the plans:
  - one plan of static per-layer k without stand-ins (uniform, alloc-l, ascending, descending,
    lexi): each layer's `router.top_k` is set, and vLLM's own kernel runs k_l experts, traced by
    torch.compile as usual;
  - anything else (token-level policies, stand-ins, the distinct-expert budget, several plans):
    the router's `_compute_routing` is replaced by allocmoe's selection (vllm_routing.py: softmax,
    sigmoid with a correction bias, grouped top-k, as the served router does) and the layer's kernel
    call by one that runs only the kept (token, expert) pairs, adding stand-ins (vllm_experts.py).
    Alloc-T pools per request (its tokens in the step), as in allocmoe's own server; a distinct
    plan caps the experts its requests' decode tokens load per step.
For a plan per request, the model runner's `_prepare_inputs` is wrapped to note which request's
tokens are where in the step (vLLM lays them out in `input_batch.req_ids` order), and each
request's `allocmoe_plan` is checked when its SamplingParams are made (an unknown name is a 400).
A plan vLLM cannot run here (another model's, a missing file) stops vLLM with one line when it
reads the model's config, before any weight loads.

ALLOCMOE_STATS=1 counts activations per plan, pairs computed per layer and the distinct experts of
decode steps inside the plugin (`read_stats`, for tests and benchmarks; it costs a graph break per
layer on the static path).

Shape legend: T = tokens in the step, E = experts, K = the model's top-k, W = widest count in the step.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

ENV_PLAN, ENV_PLANS, ENV_STATS, ENV_KERNEL = "ALLOCMOE_PLAN", "ALLOCMOE_PLANS", "ALLOCMOE_STATS", "ALLOCMOE_KERNEL"
KERNELS = ("pairs", "weight0")   # ALLOCMOE_KERNEL: kept pairs only (default), or the weight-0 reference
XARG = "allocmoe_plan"          # the vllm_xargs / SamplingParams.extra_args key naming a request's plan
DEFAULT = "default"             # the stats name of ALLOCMOE_PLAN (or of the full model when unset)


@dataclass
class PluginConfig:
    default: Path | None                                   # ALLOCMOE_PLAN: the plan of requests naming none
    named: dict[str, Path] = field(default_factory=dict)   # ALLOCMOE_PLANS: chosen per request
    stats: bool = False                                    # ALLOCMOE_STATS=1: count activations
    weight0: bool = False                                  # ALLOCMOE_KERNEL=weight0: compute dropped slots at
                                                           # weight 0 (the reference, for tests and benchmarks)
    target: float | None = None                            # ALLOCMOE_LATENCY_TARGET_MS, in seconds: elastic
    ladder: list[str] | None = None                        # ALLOCMOE_LADDER: its plans (None: every named one)
    record: bool = False                                   # ALLOCMOE_RECORD_PLANS=1: each request's plan per step

    @classmethod
    def from_env(cls, env=os.environ) -> "PluginConfig | None":
        from ..errors import AllocMoeError
        from .vllm_elastic import ENV_LADDER, ENV_RECORD, ENV_TARGET, parse_ladder, parse_target

        default = env.get(ENV_PLAN) or None
        named = parse_named_plans(filter(None, (s.strip() for s in env.get(ENV_PLANS, "").split(","))), ENV_PLANS)
        target = parse_target(env[ENV_TARGET]) if env.get(ENV_TARGET) else None
        ladder = parse_ladder(env.get(ENV_LADDER, ""))
        if ladder is not None and target is None:
            raise AllocMoeError(f"allocmoe vLLM plugin: {ENV_LADDER} is the ladder of {ENV_TARGET}; set that "
                                f"too, or unset {ENV_LADDER}")
        if target is not None and not named:
            raise AllocMoeError(f"allocmoe vLLM plugin: {ENV_TARGET} needs a ladder of plans: give them as "
                                f"{ENV_PLANS}=NAME=PLAN.json,...")
        if default is None and not named:
            return None
        for path in ([Path(default)] if default else []) + list(named.values()):
            if not path.is_file():
                raise AllocMoeError(f"allocmoe vLLM plugin: plan file not found: {path}; check the path (give an absolute path)")
        kernel = env.get(ENV_KERNEL) or KERNELS[0]
        if kernel not in KERNELS:
            raise AllocMoeError(f"allocmoe vLLM plugin: {ENV_KERNEL}={kernel!r} is not one of {', '.join(KERNELS)}; "
                                "unset it (kept pairs only) or give weight0")
        return cls(Path(default) if default else None, named, env.get(ENV_STATS, "") not in ("", "0"),
                   kernel == "weight0", target, ladder, env.get(ENV_RECORD, "") not in ("", "0"))


def parse_named_plans(items, what: str) -> dict[str, Path]:
    """NAME=PLAN.json items (ALLOCMOE_PLANS, `allocmoe export --request-plan`): names unique, not DEFAULT."""
    from ..errors import AllocMoeError
    from ..core.plan import PLAN_NAME

    named: dict[str, Path] = {}
    for item in items:
        name, sep, path = item.partition("=")
        if not sep or not PLAN_NAME.match(name) or name == DEFAULT or name in named:
            problem = ("is not NAME=PLAN.json" if not sep else f"names {name!r} twice" if name in named
                       else f"has a name that is not allowed ({name!r})")
            raise AllocMoeError(f"{what} {item!r} {problem}; give NAME=PLAN.json with a new name of letters, "
                                f"digits, '.', '_' or '-' (not {DEFAULT!r})")
        named[name] = Path(path)
    return named


class _Step:
    """Where each request's tokens sit in the current step, and which plan each follows."""

    def __init__(self):
        self.segments: list[tuple[int, int, int]] = []     # (first token, end, plan index); [] between steps
        self.dummy = True                   # the last forward was a warm-up or dummy run, not a request's step

    def for_tokens(self, num_tokens: int) -> list[tuple[int, int, int]]:
        covered = self.segments[-1][1] if self.segments else 0
        self.dummy = covered != num_tokens
        if self.dummy:                      # warm-up and dummy runs: every token under the default, uncounted
            return [(0, num_tokens, 0)]
        return self.segments


class _State:
    def __init__(self, config: PluginConfig):
        from ..core.plan import Plan

        self.config = config
        self.names = [DEFAULT] + list(config.named)
        self.plans = [Plan.load(config.default) if config.default else None] + [Plan.load(p) for p in config.named.values()]
        self.step = _Step()
        self.stats: dict[str, list[int]] = {name: [0, 0] for name in self.names}   # activations, tokens
        self.layer_stats: dict[int, LayerCounts] = {}    # per MoE layer
        self.first_layer: int | None = None              # tokens are counted once per step, at this layer
        self.elastic = None                              # ALLOCMOE_LATENCY_TARGET_MS: vllm_elastic.VllmElastic
        if config.target is not None:
            from .vllm_elastic import VllmElastic, make_rungs

            self.elastic = VllmElastic(make_rungs(self.names, self.plans, config.ladder), config.target,
                                       self.names, self.plans, config.record)

    def plan_index(self, extra_args) -> int:
        name = (extra_args or {}).get(XARG)
        return 0 if name in (None, DEFAULT) else self.names.index(name)

    def named_plan(self, extra_args) -> int | None:
        """The plan a request named (None: it named none, so it is elastic under a latency target)."""
        return None if (extra_args or {}).get(XARG) is None else self.plan_index(extra_args)


_state: _State | None = None


def register() -> None:
    """vLLM's entry point: read the environment, patch the loader, runner and sampling params."""
    global _state
    from ..errors import AllocMoeError

    if _state is not None:
        return
    try:
        config = PluginConfig.from_env()
        if config is None:
            return
        state = _State(config)
    except AllocMoeError as exc:       # vLLM logs and ignores a plugin's exception: stop at the config instead
        message = str(exc)
        _check_at_config(lambda hf_config: _refuse(message))
        return
    _state = state
    from vllm.model_executor.model_loader.base_loader import BaseModelLoader
    from vllm.sampling_params import SamplingParams

    load_model = BaseModelLoader.load_model

    def load_model_with_plan(self, vllm_config, model_config, *args, **kwargs):
        model = load_model(self, vllm_config, model_config, *args, **kwargs)
        install(model, model_config.hf_config, _state)
        return model

    BaseModelLoader.load_model = load_model_with_plan

    verify = SamplingParams._verify_extra_args

    def verify_with_plan(self):
        verify(self)
        name = (self.extra_args or {}).get(XARG)
        if name is not None and name not in _state.names:
            from vllm.exceptions import VLLMValidationError

            raise VLLMValidationError(f"unknown allocmoe plan {name!r}; this server has: "
                                      f"{', '.join(_state.names)}", parameter="vllm_xargs")
        try:
            from .vllm_elastic import request_floor

            request_floor(self.extra_args, _state.plans, name is not None)
        except AllocMoeError as exc:
            from vllm.exceptions import VLLMValidationError

            raise VLLMValidationError(str(exc), parameter="vllm_xargs") from None

    SamplingParams._verify_extra_args = verify_with_plan
    _patch_runner(_state)
    _check_plans_early(_state)


def _check_plans_early(state: _State) -> None:
    """Check the plans against the model's config as soon as vLLM reads it (in the API process, before
    any worker starts or any weight loads)."""
    from ..errors import AllocMoeError

    def check(hf_config) -> None:
        layer_ids = _moe_layers_of(hf_config)
        try:
            for plan in filter(None, state.plans):
                _check_plan(plan, hf_config, layer_ids)
        except AllocMoeError as exc:
            _refuse(str(exc))

    _check_at_config(check)


def _moe_layers_of(hf_config) -> list[int] | None:
    """The MoE layers' indices from the config alone (transformers builds the model on the meta device:
    no memory, no weights), or None where it cannot (then the layers are checked once vLLM loads them)."""
    try:
        import torch
        from transformers import AutoModelForCausalLM

        from ..routing.layout import model_fingerprint

        with torch.device("meta"):
            return list(model_fingerprint(AutoModelForCausalLM.from_config(hf_config))["moe_layers"])
    except Exception:           # best effort: any family transformers cannot build here is checked later
        return None


def _check_at_config(check) -> None:
    """Run `check(hf_config)` when vLLM reads the model's config (ModelConfig, wrapped, not edited)."""
    from vllm.config.model import ModelConfig

    post_init = ModelConfig.__post_init__

    def post_init_with_check(self, *args, **kwargs):
        post_init(self, *args, **kwargs)
        check(self.hf_config)

    ModelConfig.__post_init__ = post_init_with_check


def _refuse(message: str):
    """Stop vLLM with one line: SystemExit passes through vLLM's and pydantic's handlers untouched, so
    `vllm serve` prints the message alone and exits 1 (an `LLM(...)` caller can catch SystemExit)."""
    raise SystemExit(message)


def _patch_runner(state: _State) -> None:
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    prepare = GPUModelRunner._prepare_inputs

    def prepare_with_plans(self, scheduler_output, num_scheduled_tokens, *args, **kwargs):
        out = prepare(self, scheduler_output, num_scheduled_tokens, *args, **kwargs)
        counts = [int(n) for n in num_scheduled_tokens.tolist()]
        extra = [getattr(self.requests[r].sampling_params, "extra_args", None) for r in self.input_batch.req_ids]
        if state.elastic is not None:
            rows = [(r, n, x, state.named_plan(x)) for r, n, x in zip(self.input_batch.req_ids, counts, extra)]
            plans = state.elastic.choose(rows, _agree_across_ranks)
        else:
            plans = [state.plan_index(x) for x in extra]
        segments, start = [], 0
        for n, plan in zip(counts, plans):
            segments.append((start, start + n, plan))
            start += n
        state.step.segments = segments
        return out

    GPUModelRunner._prepare_inputs = prepare_with_plans
    execute = GPUModelRunner.execute_model

    def execute_then_forget(self, *args, **kwargs):
        try:
            return execute(self, *args, **kwargs)
        finally:            # a dummy run between steps (warm-up, capture) finds no segments: it is not counted
            state.step.segments = []

    GPUModelRunner.execute_model = execute_then_forget
    if state.elastic is not None:
        _time_steps(GPUModelRunner, state.elastic)


def _time_steps(runner_class, elastic) -> None:
    """Measure each step in the worker: from `execute_model`'s start to `sample_tokens`' end."""
    execute, sample = runner_class.execute_model, runner_class.sample_tokens

    def execute_timed(self, *args, **kwargs):
        elastic.begin()
        return execute(self, *args, **kwargs)

    def sample_timed(self, *args, **kwargs):
        out = sample(self, *args, **kwargs)
        elastic.end()
        return out

    runner_class.execute_model, runner_class.sample_tokens = execute_timed, sample_timed


def _agree_across_ranks(rung: int) -> int:
    """Tensor parallelism: every rank routes every token, so all must take one rung; rank 0's."""
    from vllm.distributed.parallel_state import get_tp_group

    group = get_tp_group()
    return rung if group.world_size == 1 else group.broadcast_object(rung, src=0)


def install(model, hf_config, state: _State) -> None:
    """Point each MoE layer's router at the plans (called once the model is loaded)."""
    from ..errors import AllocMoeError

    runners = sorted(((m.layer_id, m) for m in model.modules() if _is_moe_runner(m)), key=lambda x: x[0])
    if not runners:
        raise AllocMoeError("allocmoe vLLM plugin: found no MoE layers (MoERunner with a router) in this model")
    for plan in filter(None, state.plans):
        _check_plan(plan, hf_config, [i for i, _ in runners])
    k_orig = runners[0][1].router.top_k
    state.first_layer = runners[0][0]
    static = _static_only(state.plans)
    for index, runner in runners:
        if static:
            runner.router.top_k = state.plans[0].layers[index].k
            if state.config.stats:
                _count_static(runner.router, index, state)
                _run_opaque(runner)
        else:
            _route_by_plans(runner, index, k_orig, state)
            _run_opaque(runner)
    _log_installed(state, static, [i for i, _ in runners])


def _static_only(plans: list) -> bool:
    """One plan of static per-layer k without stand-ins: vLLM's own router at k_l does it all."""
    return (len(plans) == 1 and not plans[0].substitute
            and all(type(p).__name__ == "StaticTopK" for p in plans[0].layers.values()))


def _log_installed(state: _State, static: bool, layer_ids: list[int]) -> None:
    """One line in vLLM's log (its `vllm.*` logger) per process that installs, so users see it worked."""
    import logging

    described = []
    for name, plan in zip(state.names, state.plans):
        if plan is None:
            described.append(f"{name}: full model")
        else:
            extra = " + stand-ins" if plan.substitute else ""
            described.append(f"{name}: {plan.method} at {plan.budget:g} of {plan.full_budget} ({plan.k_text()}){extra}")
    how = "static per-layer top_k" if static else "allocmoe routing, kept pairs only"
    logging.getLogger("vllm.allocmoe").info("allocmoe plugin: %d MoE layers, %s; plans %s", len(layer_ids), how,
                                            "; ".join(described))


def _run_opaque(runner) -> None:
    """Run the layer through vLLM's own `moe_forward` custom op, as vLLM does on GPU: torch.compile
    then treats the whole MoE as one opaque call and our Python routing runs eagerly inside it (on
    CPU vLLM traces the MoE inline, and fullgraph capture refuses a function it may not trace)."""
    import torch

    runner._forward_entry = (torch.ops.vllm.moe_forward if runner._shared_experts is None
                             else torch.ops.vllm.moe_forward_shared)


def _is_moe_runner(module) -> bool:
    return type(module).__name__ == "MoERunner" and hasattr(module, "router") and hasattr(module.router, "top_k")


def _check_plan(plan, hf_config, layer_ids: list[int] | None) -> None:
    """Refuse a plan made for another model; `layer_ids` None: only what the config alone tells."""
    from ..errors import AllocMoeError

    experts = next((getattr(hf_config, n) for n in ("num_experts", "num_local_experts", "n_routed_experts")
                    if getattr(hf_config, n, None)), None)
    found = {"model_type": getattr(hf_config, "model_type", None), "num_experts": experts,
             "k_orig": getattr(hf_config, "num_experts_per_tok", None)}
    if layer_ids is not None:
        found.update(num_moe_layers=len(layer_ids), moe_layers=layer_ids)
    for key, value in found.items():
        if plan.model.get(key) is not None and value is not None and plan.model[key] != value:
            raise AllocMoeError(f"allocmoe vLLM plugin: the plan was made for another model: {key} is "
                                f"{plan.model[key]!r} in the plan but {value!r} in the served model")
    scoring = getattr(hf_config, "scoring_func", "softmax")
    if scoring not in ("softmax", "sigmoid") and not _static_only([plan]):
        raise AllocMoeError(f"allocmoe vLLM plugin: this model's router scores experts by {scoring!r}, which the "
                            "plugin cannot restate for token-level policies, stand-ins or per-request plans; "
                            "serve a single static per-layer plan instead (it only narrows vLLM's own top-k)")


def _count_static(router, index: int, state: _State) -> None:
    import torch

    compute = router._compute_routing

    @torch.compiler.disable
    def counted(hidden_states, router_logits, indices_type, *, input_ids=None):
        weights, ids = compute(hidden_states, router_logits, indices_type, input_ids=input_ids)
        state.step.for_tokens(ids.size(0))
        counts = torch.full((ids.size(0),), ids.size(1))
        _add(state, index, [(0, ids.size(0), 0)], counts, ids.numel())
        return weights, ids

    router._compute_routing = counted


def _add(state: _State, index: int, segments, counts, computed: int, loaded: list[int] | None = None) -> None:
    """Count one layer's step: activations kept per plan, pairs the kernel computed, decode-step loads
    (a warm-up or dummy run counts nothing)."""
    if state.step.dummy:
        return
    layer = state.layer_stats.setdefault(index, LayerCounts())
    for start, end, plan_index in segments:
        spent = int(counts[start:end].sum())
        state.stats[state.names[plan_index]][0] += spent
        if index == state.first_layer:
            state.stats[state.names[plan_index]][1] += end - start
        layer.kept += spent
        layer.tokens += end - start
    layer.computed += computed
    for n in loaded or ():
        layer.steps, layer.loaded, layer.loaded_max = layer.steps + 1, layer.loaded + n, max(layer.loaded_max, n)


@dataclass
class LayerCounts:
    kept: int = 0            # (token, expert) pairs the plans kept
    computed: int = 0        # pairs the kernel computed (equal to kept: no dropped pair is computed)
    tokens: int = 0
    steps: int = 0           # decode steps of a distinct-expert plan
    loaded: int = 0          # distinct experts those steps loaded, summed
    loaded_max: int = 0      # the most one of them loaded


def _route_by_plans(runner, index: int, k_orig: int, state: _State) -> None:
    """Route the layer by allocmoe's selection and run only the kept pairs (vllm_routing, vllm_experts)."""
    import torch

    from ..core.policies import StaticTopK
    from ..errors import AllocMoeError
    from ..routing.substitute import fold_substitute
    from .vllm_experts import run_kept
    from .vllm_routing import RouterSpec, all_full, select

    router, experts = runner.router, runner.routed_experts
    if getattr(experts.quant_method, "is_monolithic", False):
        raise AllocMoeError(f"allocmoe vLLM plugin: layer {index}'s MoE kernel ({type(experts.quant_method).__name__}) "
                            "routes inside itself, so allocmoe's selection cannot reach it; serve a single static "
                            "per-layer plan instead, or a kernel that takes the router's choice (the default ones)")
    spec = RouterSpec.of(router, k_orig, index)
    policies = [p.layers[index] if p else StaticTopK(k_orig) for p in state.plans]     # no default plan: full
    device = next((p.device for p in experts.parameters()), torch.device("cpu"))
    substitutes = [fold_substitute(p, index, device) if p else None for p in state.plans]
    with_means = [s is not None for s in substitutes]
    native, kernel_call = router._compute_routing, experts.forward_modular
    pending: dict = {}

    @torch.compiler.disable
    def routed(hidden_states, router_logits, indices_type, *, input_ids=None):
        segments = state.step.for_tokens(router_logits.size(0))
        selection = select(spec, router_logits, segments, policies, with_means)
        pending.clear()
        if all_full(selection, k_orig):
            if state.config.stats:
                _add(state, index, segments, selection.counts, selection.counts.numel() * k_orig, selection.loaded)
            return native(hidden_states, router_logits, indices_type, input_ids=input_ids)   # vLLM's own, bit for bit
        pending.update(selection=selection, segments=segments, tokens=router_logits.size(0))
        return selection.weights, selection.ids

    def kernel(x, weights, ids, shared_experts, shared_experts_input):
        return kernel_call(x, weights, ids, shared_experts=shared_experts, shared_experts_input=shared_experts_input)

    @torch.compiler.disable
    def forward_modular(x, topk_weights, topk_ids, shared_experts=None, shared_experts_input=None):
        selection = pending.pop("selection", None)
        if selection is None or x.size(0) != pending.get("tokens"):
            return kernel(x, topk_weights, topk_ids, shared_experts, shared_experts_input)
        segments = pending["segments"]
        stand_ins = {}
        for start, end, plan_index in segments:
            if substitutes[plan_index] is not None:
                stand_ins.setdefault(plan_index, ([], substitutes[plan_index]))[0].extend(range(start, end))
        out, computed = run_kept(kernel, x, selection, stand_ins, shared_experts, shared_experts_input,
                                 state.config.weight0)
        if state.config.stats:
            _add(state, index, segments, selection.counts, computed, selection.loaded)
        return out

    router._compute_routing = routed
    experts.forward_modular = forward_modular


def read_elastic(worker=None) -> dict:
    """The elastic budget in this process (ALLOCMOE_LATENCY_TARGET_MS): {"target" (seconds), "rungs"
    ([name, activations per token], richest first), "steps" ([tokens, requests, rung, predicted seconds or
    None, measured seconds, learnt from] per measured step, the latest 4096), "plans" (ALLOCMOE_RECORD_PLANS=1: vLLM's
    request id -> [[plan name, steps], ...], run-length, the first prompt step first)}; {} without a
    target. Call through `LLM.collective_rpc(read_elastic)` to read a worker's."""
    if _state is None or _state.elastic is None:
        return {}
    return _state.elastic.report()


def read_stats(worker=None) -> dict:
    """What this process counted: {"plans": {name: {activations (summed over MoE layers), tokens,
    per_token}}, "layers": {index: activations per token}, "computed": {index: pairs the kernel
    computed}, "kept": {index: pairs the plans kept}, "distinct": {index: {steps, mean, max}} (decode
    steps of distinct-expert plans: experts loaded)}. Call through `LLM.collective_rpc(read_stats)`
    to read a worker's."""
    if _state is None:
        return {}
    plans = {name: {"activations": a, "tokens": t, "per_token": a / t if t else None}
             for name, (a, t) in _state.stats.items()}
    layers = sorted(_state.layer_stats.items())
    return {"plans": plans,
            "layers": {str(i): c.kept / c.tokens if c.tokens else None for i, c in layers},
            "computed": {str(i): c.computed for i, c in layers},
            "kept": {str(i): c.kept for i, c in layers},
            "distinct": {str(i): {"steps": c.steps, "mean": c.loaded / c.steps, "max": c.loaded_max}
                         for i, c in layers if c.steps}}
