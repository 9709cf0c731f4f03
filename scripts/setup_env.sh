#!/usr/bin/env bash
# Creates ./.venv with torch and builds torch_gradstats into it (editable, compiled against that torch). A second run
# with nothing changed skips the build: it checks a stamp keyed by csrc/, setup.py, pyproject.toml, the torch and
# Python versions and EXTRAS, and that the compiled extension still loads. With --torch-only it stops once the venv
# has torch and the build's tools (scripts/test.sh then starts the C++ build while the rest of the setup runs).
#   PYTHON       the interpreter that creates a new venv (default: python3; 3.10 or newer)
#   TORCH_SPEC   the torch to install when the venv has none: a pip requirement, with pip options if needed, e.g.
#                TORCH_SPEC="torch==2.14.1" or TORCH_SPEC="torch --index-url URL". Default: the CPU build
#                torch==2.13.0+cpu from pip's configured sources (a local wheel directory or mirror), else from
#                PyTorch's CPU index, else torch>=2.6 from the default index (on Linux that is the CUDA build, GBs).
#   EXTRAS       extras to install (default: dev,demo,integrations)
#   MAX_JOBS     parallel compile jobs (default: the number of cores)
# An existing .venv that already has torch keeps its torch.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${VENV:-.venv}
PYTHON=${PYTHON:-python3}
EXTRAS=${EXTRAS:-dev,demo,integrations}
CPU_TORCH="torch==2.13.0+cpu"
CPU_INDEX="https://download.pytorch.org/whl/cpu"
MAX_JOBS=${MAX_JOBS:-$(nproc 2>/dev/null || echo 2)}
export MAX_JOBS

say() { echo "[setup_env ${SECONDS}s] $*"; }
SECONDS=0  # the elapsed time in every line is counted from here
die() { echo "[setup_env] ERROR: $*" >&2; exit 1; }

# 1. The venv.
if [ ! -x "$VENV/bin/python" ]; then
  "$PYTHON" -c 'import sys' 2>/dev/null \
    || die "cannot run '$PYTHON': install Python 3.10+ or set PYTHON=/path/to/python3.11 (say)"
  "$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 10))' \
    || die "$("$PYTHON" -V 2>&1) is too old: torch_gradstats needs Python 3.10+ (set PYTHON=/path/to/python3.11, say)"
  say "creating $VENV with $("$PYTHON" -V 2>&1)"
  "$PYTHON" -m venv "$VENV" || die "'$PYTHON -m venv' failed (on Debian/Ubuntu: apt-get install python3-venv)"
fi
PY="$VENV/bin/python"
PIP=("$PY" -m pip --disable-pip-version-check)

# 2. torch. Which pip arguments installed it go to $VENV/.torch-source, so that a second venv (the wheel check in CI)
#    can install the same build from the same place.
try_torch() {  # try_torch DESCRIPTION PIP-ARGS...: one install attempt, its pip output shown as it goes
  say "installing torch: $1"
  shift
  if "${PIP[@]}" install --only-binary torch "$@"; then
    printf '%s\n' "$@" >"$VENV/.torch-source"
    return 0
  fi
  return 1
}
if "$PY" -c "import torch" 2>/dev/null; then
  [ -z "${TORCH_SPEC:-}" ] || say "TORCH_SPEC is ignored: $VENV already has torch (remove $VENV to install another)"
elif [ -n "${TORCH_SPEC:-}" ]; then
  # shellcheck disable=SC2086  # word splitting on purpose: TORCH_SPEC may carry pip options
  try_torch "TORCH_SPEC=$TORCH_SPEC" $TORCH_SPEC || die "could not install TORCH_SPEC=$TORCH_SPEC"
elif try_torch "$CPU_TORCH from pip's configured sources" "$CPU_TORCH"; then
  :
elif say "  -> not there; next: PyTorch's CPU index (a failure there falls through at once)" &&
     try_torch "$CPU_TORCH from $CPU_INDEX" --index-url "$CPU_INDEX" --retries 1 --timeout 30 "$CPU_TORCH"; then
  :
elif say "  -> no CPU build reachable; falling back to torch>=2.6 from the default index (on Linux: the CUDA build)" &&
     try_torch "torch>=2.6 from the default index" "torch>=2.6"; then
  :
else
  die "no torch could be installed: set TORCH_SPEC (see https://pytorch.org/get-started/locally/) or put a venv with torch at $VENV"
fi
TORCH_VERSION=$("$PY" -c 'import torch; print(torch.__version__)' 2>/dev/null)  # (numpy may not be there yet)

# The build needs [build-system] requires in the venv (Python 3.12+ venvs come without setuptools).
if ! "$PY" -c "
from importlib.metadata import version
import sys
sys.exit(int(version('setuptools').split('.')[0]) < 64 or not version('wheel'))" 2>/dev/null; then
  say "installing setuptools and wheel (needed by the build)"
  "${PIP[@]}" install "setuptools>=64" wheel
fi
if [ "${1:-}" = "--torch-only" ]; then
  say "torch $TORCH_VERSION is in $VENV (--torch-only: the package is not installed yet)"
  exit 0
fi

# 3. Skip the build when nothing it depends on changed and the installed extension loads (-I: never the cwd's copy).
build_key() {
  {
    echo "torch $TORCH_VERSION; $("$PY" -V 2>&1); extras $EXTRAS"
    cat setup.py pyproject.toml
    find csrc -type f | LC_ALL=C sort | xargs sha256sum
  } | sha256sum | cut -c1-16
}
STAMP="$VENV/.torch_gradstats-build"
KEY=$(build_key)
if [ "$(cat "$STAMP" 2>/dev/null)" = "$KEY" ] && "$PY" -I -c "
import sys, torch_gradstats as tg
sys.exit(0 if tg.HAS_EXTENSION and tg.__file__.startswith('$PWD/') else 1)" 2>/dev/null; then
  say "torch_gradstats is up to date (torch $TORCH_VERSION, build $KEY): nothing to build"
  exit 0
fi
rm -f "$STAMP"

# 4. Install the extras and build. --no-build-isolation compiles against the torch above, never a freshly downloaded
#    one. The build log goes to $VENV/build.log; pip's and the compiler's progress is shown as it goes.
say "installing torch_gradstats[$EXTRAS] (editable) and compiling its extension against torch $TORCH_VERSION, MAX_JOBS=$MAX_JOBS"
set +e
"${PIP[@]}" install -v --no-build-isolation -e ".[$EXTRAS]" 2>&1 | tee "$VENV/build.log" | grep --line-buffered -E \
  '^ *(Collecting|Installing collected|Successfully installed|Building editable|building [^ ]+ extension|Created wheel|ERROR|\[[0-9]+/[0-9]+\] |[^ ]*g\+\+ .* -shared )' \
  | sed -u -E 's/^ +//; s/^building .* extension$/compiling the extension (ninja names each file as it finishes: about a minute on 2 cores)/; s/^(\[[0-9]+\/[0-9]+\]) .* -c (-c )?([^ ]+).*/\1 compiling \3/; s/^[^ ]*g\+\+ .* -shared .* -o ([^ ]+).*/linking \1/; s/ sha256=.*//' \
  | while IFS= read -r line; do say "  $line"; done
pip_status=${PIPESTATUS[0]}
set -e
if [ "$pip_status" != 0 ]; then
  tail -n 60 "$VENV/build.log" >&2
  die "install/build failed (full log: $VENV/build.log)"
fi
"$PY" -I -c "
import torch_gradstats as tg
from torch_gradstats.ops._extension import EXTENSION_ERROR
assert tg.HAS_EXTENSION, f'built, but the extension does not load: {EXTENSION_ERROR}'
" || die "see above (build log: $VENV/build.log)"
echo "$KEY" >"$STAMP"
say "done: torch_gradstats built against torch $TORCH_VERSION and loads"
