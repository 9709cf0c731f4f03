#!/usr/bin/env bash
# Sets up ./.venv (scripts/setup_env.sh) and runs every CPU test: the libtorch-only C++ build with its ctest, then
# pytest with the compiled extension, then pytest again on the pure-PyTorch kernel (TORCH_GRADSTATS_FORCE_FALLBACK=1).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
PY=.venv/bin/python

echo "== CMake build against libtorch, ctest"
cmake -S . -B build-cmake -DCMAKE_PREFIX_PATH="$("$PY" -c 'import torch; print(torch.utils.cmake_prefix_path)')" >/dev/null
cmake --build build-cmake -j2 >/dev/null
ctest --test-dir build-cmake --output-on-failure

echo "== pytest, compiled extension"
"$PY" -c "import torch_gradstats as tg, sys; sys.exit(0 if tg.HAS_EXTENSION else 'extension failed to load')"
"$PY" -m pytest -q -p no:cacheprovider

echo "== pytest, pure-PyTorch fallback"
TORCH_GRADSTATS_FORCE_FALLBACK=1 "$PY" -m pytest -q -p no:cacheprovider
