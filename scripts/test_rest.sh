#!/usr/bin/env bash
# The rest of the test matrix, after scripts/test.sh (CI runs both; together they run every test with the compiled
# extension and every test on the pure-PyTorch kernel):
#   1. the slow tests (compile-heavy, long runs, subprocesses) with the compiled extension, in parallel;
#   2. the distributed tests (each spawns gloo ranks) with the compiled extension, one at a time;
#   3. on the pure-PyTorch kernel (TORCH_GRADSTATS_FORCE_FALLBACK=1), every test scripts/test.sh did not run there.
# Expects the ./.venv that scripts/test.sh set up. Arguments go to every pytest run. PYTEST_WORKERS as in test.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
SECONDS=0
say() { echo "[test_rest ${SECONDS}s] $*"; }
PY=.venv/bin/python
[ -x "$PY" ] || { say "no .venv: run bash scripts/test.sh first"; exit 1; }
WORKERS=(-n "${PYTEST_WORKERS:-auto}")
PYTEST=("$PY" -m pytest -q -p no:cacheprovider)

failed=()
run() {  # run DESCRIPTION PYTEST-ARGS...: pytest's 5 (nothing collected) is a failure only without arguments
  local what=$1 rc=0
  shift
  say "== $what"
  "${PYTEST[@]}" "$@" || rc=$?
  if [ "$rc" = 5 ] && [ "$HAS_ARGS" = 1 ]; then
    say "   (no such test among the arguments)"
  elif [ "$rc" != 0 ]; then
    failed+=("$what")  # the next phases still run: one report of everything that fails
  fi
}
HAS_ARGS=$(( $# > 0 ))

run "pytest, compiled extension: the slow tests" "${WORKERS[@]}" -m "slow and not distributed" "$@"
run "pytest, compiled extension: the distributed tests" -p no:xdist -m distributed "$@"
TORCH_GRADSTATS_FORCE_FALLBACK=1 run "pytest, pure-PyTorch fallback: the tests scripts/test.sh ran on the extension only" \
  "${WORKERS[@]}" -m "not (kernel and not slow and not distributed)" "$@"
if [ ${#failed[@]} -gt 0 ]; then
  say "FAILED: $(IFS=';'; echo "${failed[*]}")"
  exit 1
fi
say "the rest of the matrix passed"
