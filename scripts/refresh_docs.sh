#!/usr/bin/env bash
# Rerun every measurement docs/ quote about the built-in model (builtin-model.md, sweep.md, tasks.md, analysis.md), from the shipped model, and
# write it under docs/ and builtin/model/card.json. About 40 minutes on 2 CPU cores; needs the [eval]
# extra. Run it after retraining the model (scripts/train_builtin.py), then update those pages and the README's results table.
#
#     bash scripts/refresh_docs.sh
set -euo pipefail
cd "$(dirname "$0")/.."
work=$(mktemp -d)
tasks=allocmoe_lastword,allocmoe_cloze,allocmoe_style,allocmoe_nextword

python scripts/model_card.py | tee "$work/card.md"

time allocmoe sweep --output "$work/sweep"
cp "$work/sweep"/{results.json,results.md,quality_vs_activations.png,allocations.png} docs/sweep/

allocmoe eval --tasks "$tasks" --eval-tokens 2048 --output docs/tasks/tasks_none.json > /dev/null
# half budget (B = 18, files tasks_<method>.json) for four methods; a third (B = 12, *_b12.json) for three
for run in alloc-moe:18: alloc-l:18: uniform:18: auto:18: alloc-moe:12:_b12 uniform:12:_b12 auto:12:_b12; do
  IFS=: read -r method budget suffix <<< "$run"
  allocmoe allocate --profile "$work/sweep/profile.json" --budget "$budget" --method "$method" --output "$work/$method$budget.json"
  allocmoe eval --tasks "$tasks" --eval-tokens 2048 --plan "$work/$method$budget.json" \
    --output "docs/tasks/tasks_${method//-/}$suffix.json" > /dev/null
done

# paired, item by item: is a gap to uniform beyond noise? (none = the full model: how much there is to keep)
for run in allocmoe: allocl: auto: none: allocmoe:_b12 auto:_b12 none:_b12; do
  IFS=: read -r method suffix <<< "$run"
  a="docs/tasks/tasks_$method$suffix.json"; [ "$method" = none ] && a=docs/tasks/tasks_none.json
  allocmoe compare "$a" "docs/tasks/tasks_uniform$suffix.json" --output "docs/tasks/compare_${method}_uniform$suffix.json"
done

allocmoe analyze --plan "$work/alloc-moe18.json" --output docs
echo "done; plans and the profile are in $work"
