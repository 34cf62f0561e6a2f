"""Engine settings vLLM's CPU build needs for a model to start at all, whatever the plan.

vLLM 0.32's CPU platform gives every MLA model (DeepSeek-V2/V3) the AMX_MLA attention backend as
soon as the CPU has AMX tiles (Sapphire Rapids and later), and that backend packs its weights only in
bfloat16, float16 or int8: a float32 engine then fails while loading ("expect weight to be bfloat16,
float16, int8, ..."), with or without allocmoe. CPU_MLA, the backend the same platform picks where
there is no AMX, runs float32. Our tests and the float32 benchmark rehearsal run float32 engines, so
they ask for it by name; a user serving float32 DeepSeek on such a CPU passes
`--attention-backend CPU_MLA` to `vllm serve` for the same reason.
"""

from __future__ import annotations

import json
from pathlib import Path

MLA_MODEL_TYPES = ("deepseek_v2", "deepseek_v3")      # the families served with MLA attention


def cpu_engine_kwargs(model_dir: str | Path, dtype: str) -> dict:
    """Extra `vllm.LLM(...)` keywords for `model_dir` (an HF folder) at `dtype` on a CPU engine."""
    model_type = json.loads((Path(model_dir) / "config.json").read_text()).get("model_type")
    if model_type in MLA_MODEL_TYPES and dtype in ("float32", "fp32"):
        return {"attention_backend": "CPU_MLA"}
    return {}
