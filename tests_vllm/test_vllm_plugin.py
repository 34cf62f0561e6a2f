"""The vLLM plugin on vLLM CPU 0.32.0, run in its own venv (scripts/vllm_env.sh; .ci/run runs this).

Each case starts real vLLM (`vllm_run.py`, a subprocess, ~30 s) on a tiny random model and compares
its greedy tokens with independent expectations: plain vLLM, and allocmoe's own `generate` under
the same plan on the same model (transformers, fp32 both sides), token for token. The plugin's own
counts must equal the plan's budget, or what allocmoe's PlanHandle counts for the same request.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import tiny_models  # noqa: E402

PROMPTS = ["The king said", "And it came to pass", "Once upon a time there was"]
MAX_TOKENS = 12


def run_vllm(model_dir: Path, requests: list[dict], tmp_path: Path, compile: bool = False,
             args: tuple[str, ...] = (), expect_failure: bool = False, **env):
    """What vLLM generated and the plugin counted; with `expect_failure`, the finished process, which
    must have failed."""
    req_file = tmp_path / f"requests-{len(list(tmp_path.iterdir()))}.json"
    req_file.write_text(json.dumps(requests))
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("ALLOCMOE_")}
    full_env.update(VLLM_CPU_KVCACHE_SPACE="1", **{k: str(v) for k, v in env.items()})
    proc = subprocess.run([sys.executable, str(HERE / "vllm_run.py"), str(model_dir), str(req_file)]
                          + (["--compile"] if compile else []) + list(args),
                          capture_output=True, text=True, env=full_env, timeout=600)
    if expect_failure:
        assert proc.returncode != 0, proc.stdout[-3000:]
        return proc
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(lines[-1][len("RESULT "):])


@pytest.fixture(scope="module", params=["qwen3_moe", "olmoe"])
def setup(request, tmp_path_factory):
    from allocmoe import allocate, load_model

    folder = tiny_models.build(request.param, tmp_path_factory.mktemp(request.param) / "model")
    model, tok = load_model(folder)
    plans_dir = folder.parent
    files = {"ascending": plans_dir / "ascending.json", "alloc-t": plans_dir / "alloc_t.json",
             "uniform": plans_dir / "uniform.json"}
    allocate(3, "ascending", model=model).save(files["ascending"])        # k = 1 in layer 0, 2 in layer 1
    allocate(2, "uniform", model=model).save(files["uniform"])            # k = 1 in both
    files["full"] = plans_dir / "full.json"
    allocate(1.0, "uniform", model=model).save(files["full"])             # the full budget, as a plan file
    allocate(0.75, "alloc-t", model=model).save(files["alloc-t"])         # 1.5 per layer, pooled per request
    prompts = [tok(p)["input_ids"] for p in PROMPTS]
    return folder, model, tok, files, prompts


def reference(model, tok, prompt_ids, plan_file):
    """allocmoe's own generate: (tokens, activations per token counted by PlanHandle)."""
    from allocmoe import apply_plan, generate
    from allocmoe.routing.layout import load_plan
    from allocmoe.serve.plans import per_sequence

    plan = per_sequence(load_plan(plan_file, model)) if plan_file else None
    if plan is None:
        stream = generate(model, tok, prompt_ids, max_new_tokens=MAX_TOKENS)
        list(stream)
        return stream.token_ids, None
    with apply_plan(model, plan) as handle:
        stream = generate(model, tok, prompt_ids, max_new_tokens=MAX_TOKENS)
        list(stream)
        return stream.token_ids, handle.activations_per_token()


def compare(vllm_tokens, hf_tokens):
    """HF's generate stops at EOS and vLLM runs with ignore_eos: compare what both made."""
    assert len(hf_tokens) >= 4, "the reference stopped too early to compare"
    assert vllm_tokens[:len(hf_tokens)] == hf_tokens


# Two vLLM runs that compute the same thing in another order (the weight-0 path against kept pairs,
# TP 2 against TP 1) agree to float32 rounding, which flips a greedy choice between two tokens whose
# log-probabilities tie to that rounding (seen once in CI: one request of 14, at its seventh token).
# So, as vLLM's own tests compare runs (check_logprobs_close): the tokens must be equal up to the
# first difference, the log-probabilities along that shared prefix close, and at the difference each
# run's token must be in the other's top 5 with log-probabilities within TIE; a run that computes
# something else (a wrong weight, a dropped expert) moves them by tenths.
TIE = 0.02


def assert_same_greedy(a: dict, b: dict) -> None:
    """`a` and `b` (run_vllm results for the same requests) chose the same tokens up to ties."""
    for i, (ta, tb, la, lb) in enumerate(zip(a["outputs"], b["outputs"], a["logprobs"], b["logprobs"])):
        for j, (x, y) in enumerate(zip(ta, tb)):
            top_a, top_b = la[j], lb[j]
            if x == y:
                assert abs(top_a[str(x)] - top_b[str(x)]) < TIE, f"request {i} token {j}: {top_a} vs {top_b}"
                continue
            where = f"request {i} differs at token {j}: {ta} vs {tb} ({top_a} vs {top_b})"
            assert str(y) in top_a and str(x) in top_b, where
            assert abs(top_a[str(x)] - top_a[str(y)]) < TIE and abs(top_b[str(x)] - top_b[str(y)]) < TIE, where
            break
    assert len(a["outputs"]) == len(b["outputs"])


def test_plain_vllm_equals_transformers_and_a_static_plan_equals_allocmoe_generate(setup, tmp_path):
    folder, model, tok, files, prompts = setup
    requests = [{"prompt_ids": p, "max_tokens": MAX_TOKENS} for p in prompts]
    plain = run_vllm(folder, requests, tmp_path)
    static = run_vllm(folder, requests, tmp_path, ALLOCMOE_PLAN=files["ascending"], ALLOCMOE_STATS=1)
    # vLLM's default mode: torch.compile traces the MoE with the plan's top_k inline (no stats wrapper)
    compiled = run_vllm(folder, requests, tmp_path, compile=True, ALLOCMOE_PLAN=files["ascending"])
    assert compiled["outputs"] == static["outputs"]
    assert plain["stats"] == {}                             # no ALLOCMOE_* set: the plugin does nothing
    differs = 0
    for i, prompt in enumerate(prompts):
        compare(plain["outputs"][i], reference(model, tok, prompt, None)[0])
        compare(static["outputs"][i], reference(model, tok, prompt, files["ascending"])[0])
        differs += static["outputs"][i] != plain["outputs"][i]
    assert differs >= 1, "the plan changed no output: the test could not tell it was applied"
    assert static["stats"]["layers"] == {"0": 1.0, "1": 2.0}          # k per layer, counted in the kernel's ids
    assert static["stats"]["plans"]["default"]["per_token"] == 3.0     # the plan's budget


def test_a_plan_per_request_in_one_batch_each_equal_to_its_plan_alone(setup, tmp_path):
    """Full, static per-layer and Alloc-T requests in one LLM.generate call (one vLLM batch), under
    torch.compile (vLLM's default; the plugin runs such layers through vLLM's opaque MoE op)."""
    folder, model, tok, files, prompts = setup
    names = [None, "asc", "at", "full"]
    requests = [{"prompt_ids": p, "max_tokens": MAX_TOKENS, "plan": names[i % 4]}
                for i, p in enumerate(prompts * 3)]
    mixed = run_vllm(folder, requests, tmp_path, compile=True, ALLOCMOE_STATS=1,
                     ALLOCMOE_PLANS=f"asc={files['ascending']},at={files['alloc-t']},full={files['full']}")
    # a full-budget plan gives the unmodified model's tokens (which test 1 shows are plain vLLM's)
    plan_files = {None: None, "asc": files["ascending"], "at": files["alloc-t"], "full": None}
    for request, out in zip(requests, mixed["outputs"]):
        compare(out, reference(model, tok, request["prompt_ids"], plan_files[request["plan"]])[0])
    plans = mixed["stats"]["plans"]
    assert plans["default"]["per_token"] == 4.0                         # no plan named: the full model
    assert plans["asc"]["per_token"] == 3.0 and plans["full"]["per_token"] == 4.0
    # Alloc-T at k = 1.5 per layer, pooled per request and step: a prompt of T tokens (one step) spends
    # T + floor(0.5 T + 0.5) per layer; each decode step (one token) floor(1.5 + 0.5) = 2 per layer
    at = [r for r in requests if r["plan"] == "at"]
    expected = sum(2 * (len(r["prompt_ids"]) + (len(r["prompt_ids"]) + 1) // 2) + 2 * 2 * (MAX_TOKENS - 1) for r in at)
    assert plans["at"]["activations"] == expected
    assert plans["at"]["tokens"] == sum(len(r["prompt_ids"]) + MAX_TOKENS - 1 for r in at)


def test_the_exported_global_k_runs_in_plain_vllm_as_the_plan_does_in_allocmoe(setup, tmp_path):
    """`allocmoe export --format vllm-global`: its --hf-overrides, given to vLLM without the plugin."""
    from allocmoe.integrations.export import export_plan

    folder, model, tok, files, prompts = setup
    command = export_plan("vllm-global", {None: files["uniform"]}, model=str(folder)).command
    overrides = command[command.index("--hf-overrides") + 1]
    requests = [{"prompt_ids": p, "max_tokens": MAX_TOKENS} for p in prompts]
    out = run_vllm(folder, requests, tmp_path, args=("--hf-overrides", overrides))
    assert out["stats"] == {}                                           # the plugin stayed out
    for prompt, tokens in zip(prompts, out["outputs"]):
        compare(tokens, reference(model, tok, prompt, files["uniform"])[0])
