#!/usr/bin/env bash
# Rewrite constraints.txt: install allocmoe[test] in a brand-new venv with no constraints (each open
# range resolves to the newest release), then freeze it. Run the suite with the result before committing.
#   scripts/lock.sh
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="$(mktemp -d)/venv"
python3 -m venv "$VENV"
"$VENV/bin/pip" install -q -e ".[test]"
{
  awk '/^#/ {print; next} {exit}' constraints.txt
  "$VENV/bin/pip" freeze --exclude-editable | sed 's/+cpu$//' | sort -f
} > constraints.txt.new
mv constraints.txt.new constraints.txt
rm -rf "$(dirname "$VENV")"
echo "constraints.txt: $(grep -vc '^#' constraints.txt) packages pinned; now run the suite in a fresh venv"
