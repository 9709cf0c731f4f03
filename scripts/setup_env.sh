#!/usr/bin/env bash
# Creates ./.venv with torch and builds torch_gradstats into it (editable, against that torch).
#   TORCH_SPEC   the torch to install when the venv has none (default: the CPU build, torch==2.13.0+cpu)
#   EXTRAS       pip extras to install (default: dev,demo)
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${VENV:-.venv}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0+cpu}
EXTRAS=${EXTRAS:-dev,demo}

[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
PY="$VENV/bin/python"
if ! "$PY" -c "import torch" 2>/dev/null; then
  echo "== installing $TORCH_SPEC"
  "$PY" -m pip install -q "$TORCH_SPEC"
fi
echo "== building torch_gradstats against torch $("$PY" -c 'import torch; print(torch.__version__)')"
# --no-build-isolation: compile against the torch installed above, never a freshly downloaded one.
"$PY" -m pip install -q --no-build-isolation -e ".[$EXTRAS]"
