#!/usr/bin/env bash
# Rerun every CPU speed figure docs/speed.md quotes and write its JSON under docs/speed/ (about 180
# minutes on 2 cores, 13 GiB of memory). Then update docs/speed.md (and the README's at-a-glance table) from the printout.
#
#     bash benchmarks/refresh_speed.sh
#
# OUT=DIR NUM_LAYERS=2 OTHER_LAYERS=2 REPEATS=1 LENGTHS="64" bash benchmarks/refresh_speed.sh
# rehearses it in about 10 minutes (figures meaningless).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-docs/speed}" NUM_LAYERS="${NUM_LAYERS:-6}" OTHER_LAYERS="${OTHER_LAYERS:-4}"
REPEATS="${REPEATS:-5}" LENGTHS="${LENGTHS:-256 1024}"
mkdir -p "$OUT"
# DeepSeek-V2-Lite shape: uniform and Alloc-T against the full model, Alloc-T against static top-3,
# distinct experts in batched decode, and the experts kernel against transformers' grouped_mm
for len in $LENGTHS; do
  python benchmarks/cpu_speed.py --num-layers "$NUM_LAYERS" --input-len "$len" --repeats "$REPEATS" --output-len 32 \
    --output-json "$OUT/cpu_dsv2lite_${NUM_LAYERS}layers_prompt$len.json"
done
# the DeepSeek-V2-Lite shape through the CLI at half budget, uniform and Alloc-T:
# dsv2_cli NAME INPUT_LEN OUTPUT_LEN REPEATS writes cpu_dsv2lite_<layers>layers_NAME_<method>.json
dsv2_cli() {
  for method in uniform alloc-t; do
    allocmoe bench --model synthetic:deepseek-v2-lite --num-layers "$NUM_LAYERS" --budget 0.5 --method "$method" \
      --input-len "$2" --output-len "$3" --repeats "$4" \
      --output "$OUT/cpu_dsv2lite_${NUM_LAYERS}layers_$1_$method.json" > /dev/null
  done
}
# prefill alone (one decode step), more rounds: 15 at 256 tokens, 7 at 1,024 (REPEATS=5; about 35 minutes)
for run in 256:15 1024:7; do
  IFS=: read -r len rounds <<< "$run"
  dsv2_cli "prefill$len" "$len" 1 "$(( REPEATS * rounds / 5 ))"
done
# decode after 256 and 1,024 tokens once more (docs/speed.md's quiet-hour decode rows; about 13 and 25 minutes)
for len in $LENGTHS; do
  dsv2_cli "decode$len" "$len" 32 "$REPEATS"
done
# two more shapes through the CLI, 3 repeats each (docs/speed.md's second table)
for shape in olmoe:olmoe-1b-7b qwen15moe:qwen1.5-moe-a2.7b; do
  IFS=: read -r short name <<< "$shape"
  for method in uniform alloc-t; do
    allocmoe bench --model "synthetic:$name" --num-layers "$OTHER_LAYERS" --budget 0.5 --method "$method" \
      --input-len 256 --output-len 16 --repeats "$(( REPEATS < 3 ? REPEATS : 3 ))" \
      --output "$OUT/cpu_${short}_${OTHER_LAYERS}layers_prompt256_$method.json" > /dev/null
  done
done
# batched decode (batch 16) under a distinct-expert budget of half the unrestricted union, beside the
# unmodified model and uniform top-k (docs/speed.md's batched-decode table; about 15 minutes on a quiet host)
python benchmarks/distinct_speed.py --num-layers "$NUM_LAYERS" --batch-size 16 --fraction 0.5 --input-len 64 \
  --output-len 32 --repeats "$REPEATS" --output-json "$OUT/distinct_batch16.json"
# one expert's matmul time against its rows: weights-first, tokens-first, the kernel's batched slices,
# packed; then the same on weights stored transposed (gpt_oss's layout) (a few minutes each)
python benchmarks/sgemm_rows.py --max-rows 16 --packed > "$OUT/sgemm_rows_batched.txt"
python benchmarks/sgemm_rows.py --max-rows 16 --transposed > "$OUT/sgemm_rows_transposed.txt"
echo "wrote $OUT"
