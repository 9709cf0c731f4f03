#!/usr/bin/env bash
# Sets up ./.venv (scripts/setup_env.sh) and runs every CPU test: the libtorch-only C++ build with its ctest (built
# while the setup runs), then pytest with the compiled extension, then pytest again on the pure-PyTorch kernel
# (TORCH_GRADSTATS_FORCE_FALLBACK=1).
# Arguments go to both pytest runs (e.g. `bash scripts/test.sh -x tests/test_ops.py`).
set -euo pipefail
cd "$(dirname "$0")/.."
SECONDS=0
say() { echo "[test ${SECONDS}s] $*"; }

bash scripts/setup_env.sh --torch-only  # the venv and its torch: all the C++ build needs
PY=.venv/bin/python

# The CMake build: configured once per torch (configuring finds Torch, which takes a while); `cmake --build` is
# incremental and re-runs the configure step itself when CMakeLists.txt changes. CMake's Torch package of a CUDA
# build of torch insists on a CUDA toolkit: without one (torch>=2.6 from the default index on a machine without
# CUDA) the C++ build and ctest are skipped, loudly; pytest below still tests the same kernel.
command -v cmake >/dev/null || { say "cmake (>= 3.18) not found: install it (e.g. pip install cmake) to build the C++ tests"; exit 1; }
read -r TORCH_CUDA PREFIX < <("$PY" -c 'import torch; print(int(bool(torch.version.cuda)), torch.utils.cmake_prefix_path)')
NO_TOOLKIT="uses CUDA but I cannot find the CUDA"  # CMake's error for that case (Caffe2Config.cmake)
cmake_build() {
  if [ "$(cat build-cmake/.torch-prefix 2>/dev/null)" != "$PREFIX" ] || [ ! -f build-cmake/CMakeCache.txt ]; then
    say "== CMake configure against libtorch in $PREFIX"
    rm -rf build-cmake && mkdir build-cmake
    if cmake -S . -B build-cmake -DCMAKE_PREFIX_PATH="$PREFIX" >build-cmake/configure.log 2>&1; then
      echo "$PREFIX" >build-cmake/.torch-prefix
    elif [ "$TORCH_CUDA" = 1 ] && grep -q "$NO_TOOLKIT" build-cmake/configure.log; then
      echo "$PREFIX" >build-cmake/.torch-prefix  # remembered: the next run skips at once
    else
      cat build-cmake/configure.log
      return 1
    fi
  fi
  if ! grep -qs "$NO_TOOLKIT" build-cmake/configure.log; then
    say "== CMake build (incremental)"
    cmake --build build-cmake -j"${MAX_JOBS:-2}"
  fi
}
# It runs in the background at the lowest priority while the rest of the setup downloads and installs the
# dependencies and compiles the extension: it takes the cores those leave idle. Its output is shown once it ends.
CMAKE_LOG=$(mktemp)
( renice -n 19 -p "$BASHPID" >/dev/null 2>&1 || true; cmake_build ) >"$CMAKE_LOG" 2>&1 &
CMAKE_PID=$!
trap 'if [ -n "${CMAKE_PID:-}" ]; then pkill -P "$CMAKE_PID" 2>/dev/null; kill "$CMAKE_PID" 2>/dev/null; fi; rm -f "$CMAKE_LOG"' EXIT
bash scripts/setup_env.sh
cmake_rc=0
wait "$CMAKE_PID" || cmake_rc=$?
CMAKE_PID=
cat "$CMAKE_LOG"
[ "$cmake_rc" = 0 ] || { say "the CMake build failed (above)"; exit 1; }
if grep -qs "$NO_TOOLKIT" build-cmake/configure.log; then
  say "== CMake build and ctest SKIPPED: this torch is a CUDA build and CMake found no CUDA toolkit, which its Torch"
  say "   package requires (build-cmake/configure.log). Install the toolkit, or use the CPU build of torch (README)."
else
  say "== ctest"
  ctest --test-dir build-cmake --output-on-failure
fi

say "== pytest, compiled extension: every test but the slow and distributed ones"
"$PY" -c "import torch_gradstats as tg, sys; sys.exit(0 if tg.HAS_EXTENSION else 'extension failed to load')"
PYTEST=("$PY" -m pytest -q -p no:cacheprovider -n "${PYTEST_WORKERS:-auto}")
"${PYTEST[@]}" -m "not slow and not distributed" "$@"  # exits non-zero on a failure and on no test collected (5)

say "== pytest, pure-PyTorch fallback: the quick tests that depend on the kernel"
rc=0
TORCH_GRADSTATS_FORCE_FALLBACK=1 "${PYTEST[@]}" -m "kernel and not slow and not distributed" "$@" || rc=$?
if [ "$rc" = 5 ] && [ $# -gt 0 ]; then
  say "   (no quick kernel test among the arguments)"  # pytest's 5: nothing collected
elif [ "$rc" != 0 ]; then
  exit "$rc"
fi
say "quick tests passed (the rest of the matrix: bash scripts/test_rest.sh)"
