#!/usr/bin/env bash
# Sets up ./.venv (scripts/setup_env.sh) and runs the demo: a small model trained with per-step gradient stats.
# Arguments go to `python -m torch_gradstats demo` (e.g. --steps 200 --inject-nan 20 --out runs/demo).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
echo "== python -m torch_gradstats info"
.venv/bin/python -m torch_gradstats info
echo "== python -m torch_gradstats demo $*"
.venv/bin/python -m torch_gradstats demo "$@"
