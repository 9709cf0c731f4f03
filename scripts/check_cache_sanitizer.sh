#!/usr/bin/env bash
# The metadata cache's bookkeeping (csrc/cuda/metadata_cache.h) under ThreadSanitizer: its ctest,
# tests/cpp/test_metadata_cache.cpp, compiled directly (header-only: no CUDA, no torch, no CMake) with
# -fsanitize=thread and run with fewer iterations (TSan slows it ~10x). A few seconds; any data race fails it.
# Environment: CXX (default g++), CACHE_SANITIZER (default thread; address also works), CACHE_SANITIZER_ITERATIONS.
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CXX="${CXX:-g++}"
SANITIZER="${CACHE_SANITIZER:-thread}"
ITERATIONS="${CACHE_SANITIZER_ITERATIONS:-20000}"
OUT_DIR="$(mktemp -d)"
trap 'rm -rf "$OUT_DIR"' EXIT
command -v "$CXX" >/dev/null || { echo "[check_cache_sanitizer] no C++ compiler ($CXX)" >&2; exit 1; }
SECONDS=0
"$CXX" -std=c++20 -O1 -g -fno-omit-frame-pointer -fsanitize="$SANITIZER" -pthread -I"$REPO/csrc" \
  "$REPO/tests/cpp/test_metadata_cache.cpp" -o "$OUT_DIR/test_metadata_cache"
echo "[check_cache_sanitizer] built with -fsanitize=$SANITIZER in ${SECONDS} s"
# halt_on_error: the first report fails the run (TSan's exit code is 66 when it reported anything).
TSAN_OPTIONS="halt_on_error=1 ${TSAN_OPTIONS:-}" ASAN_OPTIONS="halt_on_error=1 ${ASAN_OPTIONS:-}" \
  "$OUT_DIR/test_metadata_cache" "$ITERATIONS"
echo "[check_cache_sanitizer] OK in ${SECONDS} s"
