#!/usr/bin/env bash
# Speed of the full DeepSeek-V2-Lite shape (27 layers, random bf16 weights, ~31 GiB) on one GPU at
# budget 78 of 156 (0.5), for uniform top-3 and for Alloc-T (whose work equals alloc-moe's at the same
# budget: only which layers get it differs), beside the paper's 1.15x prefill / 1.34x decode (H100).
# Needs torch with CUDA and transformers==5.24.0 importable; allocmoe from this checkout. A machine
# whose image has an older transformers (the lent H200's had 5.17) needs transformers 5.24.0 and
# any newer requirements it lists brought as wheels, installed to a --target put first on PYTHONPATH.
# Takes about 3-4 minutes on an H200.
#
# DEVICE=cpu NUM_LAYERS=2 REPEATS=1 INPUT_LEN=64 BATCHES="1 4" bash benchmarks/gpu_deepseek_v2_lite.sh
# rehearses every step of it on a CPU (fp32, 2 layers) in about 5 minutes before a GPU is lent; its
# figures mean nothing for the GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
OUT_DIR="${OUT:-bench-gpu}"
DEVICE="${DEVICE:-cuda}" NUM_LAYERS="${NUM_LAYERS:-27}" REPEATS="${REPEATS:-5}" INPUT_LEN="${INPUT_LEN:-512}"
BATCHES="${BATCHES:-1 16}"
DTYPE=$([ "$DEVICE" = cpu ] && echo float32 || echo bfloat16)
mkdir -p "$OUT_DIR"
if [ "$DEVICE" = cuda ]; then
  python3 -c "import torch, transformers; assert torch.cuda.is_available(), 'no CUDA device'; print(torch.__version__, transformers.__version__, torch.cuda.get_device_name())"
fi
for method in uniform alloc-t; do
  for batch in $BATCHES; do
    python3 -m allocmoe bench --model synthetic:deepseek-v2-lite --budget 0.5 --method "$method" \
      --sequences "$batch" --input-len "$INPUT_LEN" --output-len 32 --repeats "$REPEATS" --device "$DEVICE" --dtype "$DTYPE" \
      --num-layers "$NUM_LAYERS" \
      --output "$OUT_DIR/dsv2lite_${method}_b${batch}.json" > /dev/null
  done
done
python3 - "$OUT_DIR" <<'PY'
import glob, json, sys
print(f"{'method':10s} {'batch':>5s} {'prefill':>8s} {'ideal':>6s} {'decode':>7s} {'ideal':>6s}   paper (H100): 1.15x prefill, 1.34x decode")
for path in sorted(glob.glob(f"{sys.argv[1]}/dsv2lite_*.json")):
    r = json.load(open(path))
    print(f"{r['plan']['method']:10s} {r['settings'].get('sequences', r['settings'].get('batch_size')):5d} {r['prefill_speedup']:7.3f}x {r['prefill_ideal_speedup']:5.2f}x "
          f"{r['decode_speedup']:6.3f}x {r['decode_ideal_speedup']:5.2f}x   {r['environment']['device']}")
PY
