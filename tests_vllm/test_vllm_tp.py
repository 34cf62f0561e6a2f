"""The vLLM plugin under tensor parallelism (issue #35 item 6): tensor_parallel_size=2 on vLLM CPU
0.32.0 gives the same greedy tokens as one process, for a static per-layer plan and for a batch of
requests naming different plans, and the plugin is installed and counting in every TP worker.

vLLM CPU runs TP ranks as worker processes under its "mp" executor (gloo for the all-reduce). Its
automatic thread binding wants one NUMA node per rank and stops on a one-node machine ("Not enough
allowed NUMA nodes to bind threads of 2 local CPUWorkers"), so `vllm_run.py --tp 2` binds one
group of the allowed CPUs per rank (VLLM_CPU_OMP_THREADS_BIND="0|1" on 2 cores: one thread each).
The tiny Qwen3-MoE divides by 2 everywhere TP splits it: 2 query and 2 KV heads, dense
intermediate 96, expert intermediate 32, vocabulary 512. Six vLLM starts, about 7 minutes on 2 cores.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import tiny_models  # noqa: E402
from test_vllm_plugin import PROMPTS, assert_same_greedy, run_vllm  # noqa: E402

MAX_TOKENS = 8


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from allocmoe import allocate, load_model

    folder = tiny_models.build("qwen3_moe", tmp_path_factory.mktemp("qwen3_moe_tp") / "model")
    model, tok = load_model(folder)
    config = model.config
    for size in (config.num_attention_heads, config.num_key_value_heads, config.intermediate_size,
                 config.moe_intermediate_size, config.vocab_size):
        assert size % 2 == 0, "the tiny model's shapes must divide by the TP size"
    files = {"ascending": folder.parent / "ascending.json", "alloc-t": folder.parent / "alloc_t.json"}
    allocate(3, "ascending", model=model).save(files["ascending"])     # k = 1 in layer 0, 2 in layer 1
    allocate(0.75, "alloc-t", model=model).save(files["alloc-t"])      # 1.5 per layer, pooled per request
    prompts = [tok(p)["input_ids"] for p in PROMPTS]
    return folder, files, prompts


@pytest.fixture(scope="module")
def plain(setup, tmp_path_factory):
    """Plain vLLM (no ALLOCMOE_* variable), one process: what a plan must change."""
    folder, _, prompts = setup
    requests = [{"prompt_ids": p, "max_tokens": MAX_TOKENS} for p in prompts]
    return run_vllm(folder, requests, tmp_path_factory.mktemp("plain"))["outputs"]


def run_tp(folder, requests, tmp_path, tp, **env):
    out = run_vllm(folder, requests, tmp_path, args=("--tp", str(tp)), ALLOCMOE_STATS=1, **env)
    assert len(out["worker_stats"]) == tp, out["worker_stats"]          # one dict per TP worker
    return out


def test_a_static_per_layer_plan_gives_the_same_tokens_at_tp2_as_at_tp1(setup, plain, tmp_path):
    folder, files, prompts = setup
    requests = [{"prompt_ids": p, "max_tokens": MAX_TOKENS} for p in prompts]
    tp1 = run_tp(folder, requests, tmp_path, 1, ALLOCMOE_PLAN=files["ascending"])
    tp2 = run_tp(folder, requests, tmp_path, 2, ALLOCMOE_PLAN=files["ascending"])
    assert_same_greedy(tp2, tp1)
    assert sum(a != b for a, b in zip(tp1["outputs"], plain)) >= 1, \
        "the plan changed no output: the test could not tell it was applied"
    # each worker routes every token of the step itself (router logits are replicated across ranks)
    for stats in tp1["worker_stats"] + tp2["worker_stats"]:
        assert stats["layers"] == {"0": 1.0, "1": 2.0}                  # k per layer, in the kernel's ids
        assert stats["plans"]["default"]["per_token"] == 3.0            # the plan's budget
    assert tp2["worker_stats"][0] == tp2["worker_stats"][1] == tp1["stats"]


def test_a_plan_per_request_in_one_batch_gives_the_same_tokens_at_tp2_as_at_tp1(setup, plain, tmp_path):
    """Every prompt under the full model, the static plan and Alloc-T, all in one LLM.generate call."""
    folder, files, prompts = setup
    names = [None, "asc", "at"]
    requests = [{"prompt_ids": p, "max_tokens": MAX_TOKENS, "plan": name} for name in names for p in prompts]
    plans = f"asc={files['ascending']},at={files['alloc-t']}"
    tp1 = run_tp(folder, requests, tmp_path, 1, ALLOCMOE_PLANS=plans)
    tp2 = run_tp(folder, requests, tmp_path, 2, ALLOCMOE_PLANS=plans)
    assert_same_greedy(tp2, tp1)
    by_plan = {name: tp2["outputs"][i * len(prompts):(i + 1) * len(prompts)] for i, name in enumerate(names)}
    assert by_plan[None] == plain                                       # no plan named: the unmodified model
    assert sum(a != b for a, b in zip(by_plan["asc"] + by_plan["at"], plain * 2)) >= 1, \
        "no plan changed an output: the test could not tell they were applied"
    # Alloc-T at k = 1.5 per layer, pooled per request and step (as in test_vllm_plugin.py): a prompt of
    # T tokens spends T + floor(0.5 T + 0.5) per layer, each decode step 2 per layer (the full model's
    # k, so in 8 tokens Alloc-T may leave the greedy tokens as they are: its count shows it ran)
    expected_at = sum(2 * (len(p) + (len(p) + 1) // 2) + 2 * 2 * (MAX_TOKENS - 1) for p in prompts)
    for stats in tp1["worker_stats"] + tp2["worker_stats"]:
        assert stats["plans"]["default"]["per_token"] == 4.0
        assert stats["plans"]["asc"]["per_token"] == 3.0
        assert stats["plans"]["at"]["activations"] == expected_at
        assert stats["plans"]["at"]["tokens"] == sum(len(p) + MAX_TOKENS - 1 for p in prompts)
    assert tp2["worker_stats"][0] == tp2["worker_stats"][1] == tp1["stats"]


def test_the_elastic_budget_takes_one_rung_on_every_rank(setup, tmp_path):
    """ALLOCMOE_LATENCY_TARGET_MS at TP 2: each rank measures its own steps, but every rank routes every
    token, so all must run rank 0's rung (broadcast each step). A target of 1 microsecond, which no step
    meets, walks the ladder down to its poorest plan on any machine; both ranks must record the same plan
    for every request and step, and count the same activations."""
    folder, files, prompts = setup
    requests = [{"prompt_ids": p, "max_tokens": MAX_TOKENS} for p in prompts * 4]
    tp2 = run_tp(folder, requests, tmp_path, 2, ALLOCMOE_PLANS=f"asc={files['ascending']}",
                 ALLOCMOE_LATENCY_TARGET_MS="0.001", ALLOCMOE_RECORD_PLANS=1)
    first, second = tp2["worker_elastic"]
    assert first["plans"] == second["plans"] and len(first["plans"]) == len(requests)
    assert [s[2] for s in first["steps"]] == [s[2] for s in second["steps"]]
    assert {s[2] for s in first["steps"]} == {0, 1}                     # full first, then the ladder's plan
    assert tp2["worker_stats"][0]["plans"] == tp2["worker_stats"][1]["plans"]
    assert tp2["worker_stats"][0]["plans"]["asc"]["tokens"] > 0
