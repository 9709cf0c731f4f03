#!/usr/bin/env bash
# Proves that the wheel works on its own: builds it once in ./.venv (scripts/setup_env.sh first), installs it into a
# fresh venv with the same torch from the same source, and runs the test suite there from a directory outside the
# repository, so that only the installed package can be imported (asserted: torch_gradstats comes from that venv's
# site-packages and its compiled extension loads).
#   CHECK_WHEEL_DIR   scratch directory (default: a new one under $TMPDIR, removed at the end)
# Arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
SECONDS=0
say() { echo "[check_wheel ${SECONDS}s] $*"; }

[ -x .venv/bin/python ] || bash scripts/setup_env.sh
PY=.venv/bin/python
if [ -n "${CHECK_WHEEL_DIR:-}" ]; then
  WORK=$CHECK_WHEEL_DIR
  rm -rf "$WORK" && mkdir -p "$WORK"
else
  WORK=$(mktemp -d "${TMPDIR:-/tmp}/torch_gradstats-wheel.XXXXXX")
  trap 'rm -rf "$WORK"' EXIT
fi

say "== building the wheel (python -m build --wheel --no-isolation, against the torch in .venv)"
"$PY" -m build --wheel --no-isolation --outdir "$WORK/dist" . >"$WORK/build.log" 2>&1 \
  || { tail -n 60 "$WORK/build.log" >&2; echo "[check_wheel] wheel build failed" >&2; exit 1; }
WHEEL=$(ls "$WORK"/dist/torch_gradstats-*.whl)
say "built $(basename "$WHEEL") ($(du -h "$WHEEL" | cut -f1))"
"$PY" - "$WHEEL" <<'EOF'
import sys, zipfile
names = zipfile.ZipFile(sys.argv[1]).namelist()
assert any(n.startswith("torch_gradstats/_C") and n.endswith(".so") for n in names), "no compiled extension in the wheel"
assert "torch_gradstats/py.typed" in names, "py.typed missing from the wheel"
assert not any(n.startswith(("tests/", "csrc/", "bench/")) for n in names), "the wheel ships more than the package"
print(f"[check_wheel]   {len(names)} files: the package, its compiled extension and py.typed")
EOF

say "== a fresh venv with the same Python and torch"
BASE_PY=$("$PY" -c 'import sys; print(sys._base_executable)')
"$BASE_PY" -m venv "$WORK/venv"
WPY="$WORK/venv/bin/python"
TORCH_VERSION=$("$PY" -c 'import torch; print(torch.__version__)')
TORCH_SOURCE=()
if [ -f .venv/.torch-source ]; then mapfile -t TORCH_SOURCE <.venv/.torch-source; fi
say "installing torch==$TORCH_VERSION (pip arguments that installed it in .venv: ${TORCH_SOURCE[*]:-none recorded})"
"$WPY" -m pip install -q --disable-pip-version-check --only-binary torch "${TORCH_SOURCE[@]}" "torch==$TORCH_VERSION"
# The test and demo extras only: the integrations' tests skip here (they ran against the editable install).
say "installing the wheel with its test and demo extras"
"$WPY" -m pip install -q --disable-pip-version-check "$WHEEL[test,demo]"

say "== the test suite against the installed wheel, from outside the repository"
mkdir "$WORK/run"
cp -r tests bench docs README.md pyproject.toml "$WORK/run/"  # the tests, the bench scripts and documents they read, pytest's settings
cd "$WORK/run"
# The check and pytest run in one process, so every test imports the module checked here. The __main__ guard
# matters: the distributed tests' spawned ranks import this file again.
cat >check_installed.py <<'EOF'
import sys
import sysconfig
from pathlib import Path

if __name__ == "__main__":
    import pytest

    import torch_gradstats as tg

    site = Path(sysconfig.get_paths()["platlib"]).resolve()
    where = Path(tg.__file__).resolve()
    assert site in where.parents, f"torch_gradstats was imported from {where}, not from the wheel in {site}"
    assert tg.HAS_EXTENSION, "the installed wheel's compiled extension does not load"
    print(f"[check_wheel]   torch_gradstats from {where.parent}; compiled extension loaded")
    # Exit 5 (no test collected) fails like a failed test.
    sys.exit(pytest.main(["-q", "-p", "no:cacheprovider", *sys.argv[1:]]))
EOF
"$WPY" check_installed.py "$@"
say "wheel OK"
