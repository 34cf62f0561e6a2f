"""Run vLLM (CPU) offline on a model folder and print what it generated, as one JSON line.

    python tests_vllm/vllm_run.py MODEL_DIR REQUESTS.json [--compile] [--hf-overrides JSON]
    (plugin settings come from the environment)

REQUESTS.json: [{"prompt_ids": [...], "max_tokens": N, "plan": NAME or null}, ...], all sent in one
`LLM.generate` call, so vLLM batches them together. Output: {"outputs": [[token ids], ...],
"stats": what the plugin counted in the worker (ALLOCMOE_STATS=1), or null}.
"""

import json
import os
import sys


def main() -> None:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    # lets collective_rpc send read_stats (a function, pickled by reference) to the worker; local test only
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    model_dir, requests_file = sys.argv[1], sys.argv[2]
    compiled = "--compile" in sys.argv[3:]          # vLLM's default (torch.compile); eager starts faster
    overrides = json.loads(sys.argv[sys.argv.index("--hf-overrides") + 1]) if "--hf-overrides" in sys.argv else None
    requests = json.load(open(requests_file))
    llm = LLM(model=model_dir, dtype="float32", max_model_len=256, max_num_seqs=16, seed=0,
              enforce_eager=not compiled, hf_overrides=overrides)
    prompts = [TokensPrompt(prompt_token_ids=r["prompt_ids"]) for r in requests]
    params = [SamplingParams(temperature=0, max_tokens=r["max_tokens"], ignore_eos=True,
                             extra_args={"allocmoe_plan": r["plan"]} if r.get("plan") else None)
              for r in requests]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    stats = None
    try:
        from allocmoe.integrations.vllm_plugin import read_stats

        stats = llm.collective_rpc(read_stats)[0]
    except Exception as exc:          # no plugin state in the worker: report it, the test decides
        stats = {"error": f"{type(exc).__name__}: {exc}"}
    print("RESULT " + json.dumps({"outputs": [list(o.outputs[0].token_ids) for o in outputs], "stats": stats}))


if __name__ == "__main__":
    main()
