#!/usr/bin/env bash
# Proves, on a machine without a GPU, that the CUDA kernel compiles, links and registers:
#   1. a cached venv outside the repo with the CUDA build of torch (created once, ~1 min, 5.4 GB);
#   2. CUDA_HOME = the real toolkit behind the `nvcc` on PATH, TORCH_CUDA_ARCH_LIST set (no GPU to detect);
#   3. a copy of the source tree in a cached build dir (never the in-tree build, which belongs to the CPU venv),
#      built with `setup.py build_ext --inplace` (ninja: a warm run recompiles only what changed);
#   4. imports it on this GPU-less machine and asserts the extension loaded, the op has a CUDA kernel (with a
#      negative control: the fallback-only registration must NOT count), the CPU op still matches the reference,
#      and tests/test_cuda.py collects and skips cleanly.
# Environment: TORCH_GRADSTATS_CUDA_VENV (venv path), TORCH_GRADSTATS_CUDA_BUILD_DIR (build dir),
#              TORCH_CUDA_ARCH_LIST (default 9.0 here: one arch keeps CI fast), MAX_JOBS (default 1).
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CACHE="${XDG_CACHE_HOME:-$HOME/.cache}/torch_gradstats"
VENV="${TORCH_GRADSTATS_CUDA_VENV:-$CACHE/venv-cuda}"
BUILD_DIR="${TORCH_GRADSTATS_CUDA_BUILD_DIR:-$CACHE/cuda-build-tree}"
TORCH_VERSION="2.14.1"
export TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-9.0}"
export MAX_JOBS="${MAX_JOBS:-1}"

T_START=$SECONDS
step_start=$SECONDS
step() { echo "[check_cuda_build] $*"; step_start=$SECONDS; }
done_step() { echo "[check_cuda_build]   ... $(( SECONDS - step_start )) s"; }

# 1. The CUDA venv (reused when it already holds the right torch).
step "venv: $VENV"
if ! "$VENV/bin/python" -c "import torch, sys; sys.exit(0 if torch.__version__.startswith('$TORCH_VERSION') and torch.version.cuda else 1)" 2>/dev/null; then
  echo "[check_cuda_build]   creating it (torch==$TORCH_VERSION, CUDA build, from local disk)"
  rm -rf "$VENV"
  mkdir -p "$(dirname "$VENV")"
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install -q "torch==$TORCH_VERSION" numpy ninja pytest
fi
PY="$VENV/bin/python"
"$PY" -c "import torch; print('[check_cuda_build]   torch', torch.__version__, 'CUDA', torch.version.cuda)"
done_step

# 2. The real toolkit: the `nvcc` on PATH may be a wrapper script; `nvcc --dryrun` names the directory it runs from.
step "CUDA toolkit"
if [[ -z "${CUDA_HOME:-}" || ! -x "${CUDA_HOME}/bin/nvcc" ]]; then
  command -v nvcc >/dev/null || { echo "[check_cuda_build] no nvcc on PATH and no CUDA_HOME: cannot build CUDA" >&2; exit 1; }
  NVCC_BIN="$(nvcc --dryrun -x cu /dev/null 2>&1 | sed -n 's/^#\$ _HERE_=//p' | head -n1)"
  [[ -n "$NVCC_BIN" ]] || { echo "[check_cuda_build] could not find the toolkit from 'nvcc --dryrun'" >&2; exit 1; }
  export CUDA_HOME="$(cd "$NVCC_BIN/.." && pwd)"
fi
export PATH="$CUDA_HOME/bin:$PATH"
echo "[check_cuda_build]   CUDA_HOME=$CUDA_HOME ($("$CUDA_HOME/bin/nvcc" --version | tail -n1)), TORCH_CUDA_ARCH_LIST=$TORCH_CUDA_ARCH_LIST"
done_step

# 3. Build a copy of the tree. `cp -p` keeps mtimes, so ninja sees unchanged sources as up to date on a warm run
#    (the objects under $BUILD_DIR/build survive; stale sources do not: the source dirs are replaced each time).
step "build in $BUILD_DIR"
mkdir -p "$BUILD_DIR"
rm -rf "$BUILD_DIR/csrc" "$BUILD_DIR/torch_gradstats" "$BUILD_DIR/tests"
cp -rp "$REPO/csrc" "$REPO/torch_gradstats" "$REPO/tests" "$REPO/setup.py" "$REPO/pyproject.toml" "$BUILD_DIR/"
[[ -f "$REPO/README.md" ]] && cp -p "$REPO/README.md" "$BUILD_DIR/"
find "$BUILD_DIR/torch_gradstats" "$BUILD_DIR/tests" \( -name '*.so' -o -name __pycache__ \) -prune -exec rm -rf {} +
if ! (cd "$BUILD_DIR" && "$PY" setup.py build_ext --inplace) >"$BUILD_DIR/build.log" 2>&1 \
    || ! ls "$BUILD_DIR"/torch_gradstats/_C*.so >/dev/null 2>&1; then
  grep -E -B2 -A6 'error|Error|FAILED' "$BUILD_DIR/build.log" | tail -n 80 >&2
  echo "[check_cuda_build] build FAILED (full log: $BUILD_DIR/build.log)" >&2
  exit 1
fi
grep -E '^\[[0-9]+/[0-9]+\]' "$BUILD_DIR/build.log" | sed -E 's/^(\[[0-9]+\/[0-9]+\]) .* -c (-c )?([^ ]+).*/\1 compiled \3/' || echo "[check_cuda_build]   nothing to recompile"
ls -la "$BUILD_DIR"/torch_gradstats/_C*.so
done_step

# 4. Import and check on this GPU-less machine.
step "import and registration checks"
cd "$BUILD_DIR"
TORCH_GRADSTATS_FORCE_FALLBACK=1 "$PY" - <<'EOF'
import torch, torch_gradstats
# Negative control: with only the CompositeExplicitAutograd fallback, the check below must say False.
assert not torch_gradstats.HAS_EXTENSION
assert not torch._C._dispatch_has_kernel_for_dispatch_key("torch_gradstats::multi_tensor_stats", "CUDA"), \
    "the CUDA-kernel check cannot fail: it counts the fallback registration"
print("[check_cuda_build]   negative control ok: fallback only -> no CUDA kernel")
EOF
"$PY" - <<'EOF'
import torch, torch_gradstats
from torch_gradstats.ops.op import reference_multi_tensor_stats
from torch_gradstats.ops._extension import EXTENSION_ERROR
assert torch_gradstats.HAS_EXTENSION, f"extension did not load: {EXTENSION_ERROR}"
op = "torch_gradstats::multi_tensor_stats"
assert torch._C._dispatch_has_kernel_for_dispatch_key(op, "CUDA"), "no CUDA kernel registered"
print("[check_cuda_build]   extension loaded; CUDA kernel registered; CPU kernel registered:",
      torch._C._dispatch_has_kernel_for_dispatch_key(op, "CPU"))
schema = str(torch.ops.torch_gradstats._cuda_metadata_cache_info.default._schema)
assert schema == "torch_gradstats::_cuda_metadata_cache_info() -> int[]", schema
print("[check_cuda_build]   debug query registered:", schema)
assert not torch.cuda.is_available()  # this check is about the build, on a machine without a GPU
g = torch.Generator().manual_seed(0)
ts = [torch.randn(n, generator=g).to(dt) for n, dt in
      [(1000, torch.float32), (17, torch.float16), (0, torch.bfloat16), (4099, torch.bfloat16), (33, torch.float64)]]
ts[0][3] = float("nan"); ts[1][0] = 0.0; ts[3][5] = float("inf")
got = torch_gradstats.multi_tensor_stats(ts)
ref = reference_multi_tensor_stats(ts)
torch.testing.assert_close(got.sumsq, ref[0], rtol=1e-5, atol=0, equal_nan=True)
torch.testing.assert_close(got.amax, ref[1], rtol=0, atol=0, equal_nan=True)
assert torch.equal(got.counts, ref[2])
print("[check_cuda_build]   CPU op matches the reference in the CUDA build")
EOF
"$PY" -m pytest -q -p no:cacheprovider tests/test_cuda.py 2>&1 | tail -n 3
done_step

echo "[check_cuda_build] OK in $(( SECONDS - T_START )) s"
