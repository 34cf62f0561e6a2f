#!/usr/bin/env bash
# Rerun every measurement the README quotes about the built-in model, from the shipped model, and
# write it under docs/ and builtin/model/card.json. About 30 minutes on 2 CPU cores; needs the [eval]
# extra. Run it after retraining the model (scripts/train_builtin.py), then update the README tables.
#
#     bash scripts/refresh_docs.sh
set -euo pipefail
cd "$(dirname "$0")/.."
work=$(mktemp -d)
tasks=allocmoe_lastword,allocmoe_cloze,allocmoe_style,allocmoe_nextword

python scripts/model_card.py | tee "$work/card.md"

time allocmoe sweep --output-dir "$work/sweep"
cp "$work/sweep"/{results.json,results.md,quality_vs_activations.png,allocations.png} docs/sweep/

allocmoe eval --tasks "$tasks" --max-tokens 2048 --output-json docs/tasks/tasks_none.json
for method in alloc-moe alloc-l uniform; do
  allocmoe allocate --profile "$work/sweep/profile.json" --budget 0.5 --method "$method" --output "$work/$method.json"
  allocmoe eval --tasks "$tasks" --max-tokens 2048 --plan "$work/$method.json" \
    --output-json "docs/tasks/tasks_${method//-/}.json"
done

for method in allocmoe allocl; do      # paired, item by item: is the gap to uniform beyond noise?
  allocmoe compare "docs/tasks/tasks_${method}.json" docs/tasks/tasks_uniform.json \
    --output-json "docs/tasks/compare_${method}_uniform.json"
done

allocmoe analyze --plan "$work/alloc-moe.json" --output-dir docs
echo "done; plans and the profile are in $work"
