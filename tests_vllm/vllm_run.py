"""Run vLLM (CPU) offline on a model folder and print what it generated, as one JSON line.

    python tests_vllm/vllm_run.py MODEL_DIR REQUESTS.json [--compile] [--hf-overrides JSON] [--tp N]
                                  [--cost-clock FIXED,PER_TOKEN]
    (plugin settings come from the environment)

REQUESTS.json: [{"prompt_ids": [...], "max_tokens": N, "plan": NAME or null, "extra": {more extra_args},
"wave": W (default 0)}, ...]; each wave's requests are sent in one `LLM.generate` call, so vLLM
batches them together, the waves one after another. Output: {"outputs": [[token ids], ...],
"request_ids": [vLLM's id of each request], "elastic": what the plugin's elastic budget saw (read_elastic),
"worker_elastic": the same from every worker,
"logprobs": [[{token id: logprob} of the 5 likeliest and the chosen token, per generated token], ...],
"stats": what the plugin counted in the worker (ALLOCMOE_STATS=1), or null, "worker_stats": the
same from every worker (one per tensor-parallel rank)}.

--tp N: tensor_parallel_size=N, one worker process per rank (vLLM CPU always runs them under its
"mp" executor). vLLM CPU's automatic thread binding puts each rank on its own NUMA node and stops
when there are fewer nodes than ranks, so unless VLLM_CPU_OMP_THREADS_BIND is set, the CPUs this
process may use are split into N '|'-separated groups, one per rank ("0|1" on 2 cores).
"""

import json
import os
import sys


def install_cost_clock(fixed: float, per_token: float) -> None:
    """The plugin's elastic clock, moved only by the model's forward passes: each costs `fixed` plus
    `per_token` x each token's plan budget / the full budget (needs the engine and worker in this process)."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from allocmoe.integrations import vllm_elastic, vllm_plugin

    now = [0.0]
    vllm_elastic.clock = lambda: now[0]
    forward = GPUModelRunner._model_forward

    def forward_with_cost(self, *args, **kwargs):
        out = forward(self, *args, **kwargs)
        state = vllm_plugin._state
        for start, end, index in state.step.segments:
            plan = state.plans[index]
            now[0] += per_token * (end - start) * (1.0 if plan is None else plan.budget / plan.full_budget)
        now[0] += fixed
        return out

    GPUModelRunner._model_forward = forward_with_cost


def main() -> None:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    # lets collective_rpc send read_stats (a function, pickled by reference) to the worker; local test only
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    # the engine in this process rather than in vLLM's engine-core process: every request is added
    # before the first step, so which requests share a step no longer depends on timing. With the
    # engine apart, the same 14 requests on the tiny DeepSeek-V2 (MLA attention) gave a first token
    # off by up to 99 in log-probability in 1-2 of 5 runs with no plan; in-process, 5 of 5 agreed.
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    model_dir, requests_file = sys.argv[1], sys.argv[2]
    compiled = "--compile" in sys.argv[3:]          # vLLM's default (torch.compile); eager starts faster
    overrides = json.loads(sys.argv[sys.argv.index("--hf-overrides") + 1]) if "--hf-overrides" in sys.argv else None
    tp = int(sys.argv[sys.argv.index("--tp") + 1]) if "--tp" in sys.argv else 1
    if tp > 1 and "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:
        cpus = sorted(os.sched_getaffinity(0))
        if len(cpus) < tp:
            sys.exit(f"--tp {tp} needs at least {tp} CPUs (one per rank); this process may use {cpus}")
        per_rank = len(cpus) // tp
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(
            ",".join(map(str, cpus[r * per_rank:(r + 1) * per_rank])) for r in range(tp))
    requests = json.load(open(requests_file))
    if "--cost-clock" in sys.argv:
        install_cost_clock(*map(float, sys.argv[sys.argv.index("--cost-clock") + 1].split(",")))
    from allocmoe.integrations.vllm_cpu import cpu_engine_kwargs

    llm = LLM(model=model_dir, dtype="float32", max_model_len=256, max_num_seqs=16, seed=0,
              enforce_eager=not compiled, hf_overrides=overrides, tensor_parallel_size=tp,
              **cpu_engine_kwargs(model_dir, "float32"))
    prompts = [TokensPrompt(prompt_token_ids=r["prompt_ids"]) for r in requests]
    params = [SamplingParams(temperature=0, max_tokens=r["max_tokens"], ignore_eos=True, logprobs=5,
                             extra_args={**({"allocmoe_plan": r["plan"]} if r.get("plan") else {}),
                                         **r.get("extra", {})} or None)
              for r in requests]
    outputs = [None] * len(requests)
    for wave in sorted({r.get("wave", 0) for r in requests}):
        index = [i for i, r in enumerate(requests) if r.get("wave", 0) == wave]
        for i, out in zip(index, llm.generate([prompts[i] for i in index], [params[i] for i in index],
                                              use_tqdm=False)):
            outputs[i] = out
    try:
        from allocmoe.integrations.vllm_plugin import read_elastic, read_stats

        worker_stats = llm.collective_rpc(read_stats)
        worker_elastic = llm.collective_rpc(read_elastic)
    except Exception as exc:          # no plugin state in the worker: report it, the test decides
        worker_stats, worker_elastic = [{"error": f"{type(exc).__name__}: {exc}"}], [None]
    logprobs = [[{str(t): p.logprob for t, p in step.items()} for step in o.outputs[0].logprobs] for o in outputs]
    print("RESULT " + json.dumps({"outputs": [list(o.outputs[0].token_ids) for o in outputs], "logprobs": logprobs,
                                  "request_ids": [o.request_id for o in outputs], "elastic": worker_elastic[0],
                                  "worker_elastic": worker_elastic,
                                  "stats": worker_stats[0], "worker_stats": worker_stats}))


if __name__ == "__main__":
    main()
