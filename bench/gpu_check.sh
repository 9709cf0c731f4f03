#!/usr/bin/env bash
# The one script to run on a lent H100/H200 in a single device call (see docs/cuda.md):
#   versions -> build -> CUDA parity tests -> timing record (op vs launch floor) -> CPU tests
#   -> compute-sanitizer memcheck + racecheck -> benchmark.
# Every step runs even if an earlier one failed (its exit status is recorded); the script exits non-zero if any did.
# Output: "$OUT" (default ./gpu_check_out), at most 8 files so all of them come back from the device tool:
#   gpu_check.log (everything), test_cuda.xml, test_cpu.xml, memcheck.log, racecheck.log, bench.txt, bench.csv,
#   summary.txt (which also holds the timing record's table)
# and a copy of them under bench/results/gpu_check-<gpu>-<date>/ for committing.
# Usage on the device:  bash bench/gpu_check.sh        (TORCH_CUDA_ARCH_LIST defaults to 9.0, Hopper)
# GPU_CHECK_BUDGET_S (default 560) caps the whole run so it ends, with its summary, inside one 600 s device call:
# each step gets min(its own limit, what is left). GPU_CHECK_SKIP="test_cpu bench" skips the steps named.
set -uo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT="${OUT:-$PWD/gpu_check_out}"
mkdir -p "$OUT"
LOG="$OUT/gpu_check.log"
: >"$LOG"
export TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-9.0}"
export MAX_JOBS="${MAX_JOBS:-16}"
PY="${PYTHON:-python3}"
FAILED=()
T0=$SECONDS
STEPS="$(mktemp -d)"  # each step's own output (the sanitizer logs are copied from here)

log() { echo "[gpu_check] $*" | tee -a "$LOG"; }
# run NAME TIMEOUT CMD...: runs a step with a time limit, logs its output and duration, records failures.
BUDGET="${GPU_CHECK_BUDGET_S:-560}"
SKIP=" ${GPU_CHECK_SKIP:-} "
run() {
  local name=$1 limit=$2; shift 2
  local t=$SECONDS left=$(( BUDGET - 15 - (SECONDS - T0) ))  # 15 s kept for the summary
  if [[ "$SKIP" == *" $name "* ]]; then log "=== $name: skipped (GPU_CHECK_SKIP)"; return 0; fi
  if (( left < 10 )); then log "=== $name: not run, time budget spent"; FAILED+=("$name(no time)"); return 0; fi
  (( limit > left )) && limit=$left
  log "=== $name (limit $limit s)"
  timeout "$limit" "$@" 2>&1 | tee "$STEPS/$name.out" | tee -a "$LOG"
  local rc=${PIPESTATUS[0]}
  log "=== $name: rc=$rc in $(( SECONDS - t )) s"
  [[ $rc -eq 0 ]] || FAILED+=("$name(rc=$rc)")
  return 0
}

# 1. Versions.
run versions 60 bash -c "nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,clocks.max.mem --format=csv;
  nvcc --version | tail -n 2; $PY -c 'import sys, torch; print(\"python\", sys.version.split()[0], \"torch\", torch.__version__,
  \"cuda\", torch.version.cuda, \"device\", torch.cuda.get_device_name(0), \"capability\", torch.cuda.get_device_capability(0))'"

# 2. Build in place (the device image has the CUDA torch; no network needed).
if [[ -z "${CUDA_HOME:-}" ]]; then
  NVCC_BIN="$(dirname "$(readlink -f "$(command -v nvcc)")" 2>/dev/null || true)"
  [[ -n "$NVCC_BIN" ]] && export CUDA_HOME="$(cd "$NVCC_BIN/.." && pwd)"
fi
log "CUDA_HOME=${CUDA_HOME:-unset} TORCH_CUDA_ARCH_LIST=$TORCH_CUDA_ARCH_LIST"
rm -f torch_gradstats/_C*.so
run build 240 $PY setup.py build_ext --inplace
run registration 60 $PY -c "
import torch, torch_gradstats
assert torch_gradstats.HAS_EXTENSION, 'extension did not load'
assert torch._C._dispatch_has_kernel_for_dispatch_key('torch_gradstats::multi_tensor_stats', 'CUDA'), 'no CUDA kernel'
print('extension loaded, CUDA kernel registered')"

# 3. Tests: CUDA parity (slow ones included), then the rest of the suite.
run test_cuda 240 $PY -m pytest -q -rs -p no:cacheprovider tests/test_cuda.py --junitxml="$OUT/test_cuda.xml"

# 3b. Timing record: device and host time per call of the op next to the launch floor (empty-ish kernels), so the
# GPU session sees scheduling overheads. Each case rotates over 4 copies of its inputs (no copy fits in L2 after
# the others), device time from CUDA-graph replays (no host launch cost), kernel time from torch.profiler.
TIMING="$STEPS/timing_case.py"
cat >"$TIMING" <<'EOF_TIMING'
import time
import torch, torch_gradstats  # noqa: F401  (registers the op)

OP = torch.ops.torch_gradstats.multi_tensor_stats.default
FUSED = torch._C._dispatch_has_kernel_for_dispatch_key("torch_gradstats::multi_tensor_stats", "CUDA")
COPIES = 4
print(f"device {torch.cuda.get_device_name(0)}, torch {torch.__version__}, CUDA {torch.version.cuda}, "
      f"kernel: {'fused CUDA' if FUSED else 'pure-PyTorch fallback'}")


def graph_us(calls, reps):
    """Device time per call: one CUDA graph holding every call, replayed back to back, timed by events."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for c in calls:
            c()  # warm-up (the op uploads its metadata here)
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for c in calls:
            c()
    g.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        g.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / (reps * len(calls))


def eager_us(calls, reps):
    """(host enqueue time per call, end-to-end time per call in a loop)."""
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    t0 = time.perf_counter()
    for _ in range(reps):
        for c in calls:
            c()
    host = (time.perf_counter() - t0) * 1e6 / (reps * len(calls))
    end.record()
    end.synchronize()
    return host, start.elapsed_time(end) * 1e3 / (reps * len(calls))


def kernel_us(calls):
    """Sum of kernel durations per call (torch.profiler), and the kernel names."""
    from torch.profiler import ProfilerActivity, profile
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for c in calls:
            c()
        torch.cuda.synchronize()
    ev = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    kernels = [e for e in ev if not e.name.lower().startswith(("memcpy", "memset"))]
    total = sum(e.time_range.end - e.time_range.start for e in kernels)
    names = sorted({e.name.split("(")[0].split("<")[0][:40] for e in ev})
    return total / len(calls), len(ev) / len(calls), names


rows = []
def measure(label, calls, launches_per_call=2, nbytes=0):
    calls[0]()
    torch.cuda.synchronize()
    t = time.perf_counter(); calls[0](); torch.cuda.synchronize(); one = time.perf_counter() - t
    reps = max(5, min(300, int(0.25 / max(one, 1e-6) / len(calls))))  # ~0.25 s per measurement
    dev = graph_us(calls, reps)
    # Eager: at most ~800 launches queued, so the host never waits for a full launch queue (~1024 entries).
    host, loop = eager_us(calls, max(2, min(reps, 800 // (len(calls) * launches_per_call))))
    try:
        kern, launches, names = kernel_us(calls)
    except Exception as exc:  # a profiler problem must not lose the other figures
        kern, launches, names = float("nan"), float("nan"), [f"profiler failed: {exc}"]
    gbs = nbytes / (dev * 1e-6) / 1e9 if nbytes else float("nan")
    rows.append((label, launches, dev, kern, host, loop, gbs))
    print(f"{label:<34} launches {launches:4.1f}  device(graph) {dev:9.2f} us  kernels {kern:9.2f} us  "
          f"host {host:9.2f} us  eager loop {loop:9.2f} us  {gbs:8.1f} GB/s  {names}", flush=True)


x = torch.zeros(1, device="cuda")
measure("floor: 1 x add_ (1 element)", [lambda: x.add_(1)], launches_per_call=1)
measure("floor: 2 x add_ (two launches)", [lambda: (x.add_(1), x.add_(1))])
if not FUSED:
    print("fused CUDA kernel not registered: op timings skipped (the fallback launches ~10 kernels per tensor)")
else:
    for count, numel in ((10_000, 1024), (5, 4 << 20)):
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            lists = [[torch.randn(numel, device="cuda").to(dtype) for _ in range(count)] for _ in range(COPIES)]
            nbytes = count * numel * lists[0][0].element_size()
            measure(f"op {count} x {numel} {str(dtype)[6:]}", [lambda ts=ts: OP(ts) for ts in lists], nbytes=nbytes)
            del lists
    floor2 = rows[1][2]
    print(f"two-launch floor (graph) {floor2:.2f} us; op device time / floor: "
          + ", ".join(f"{r[0][3:]}: {r[2] / floor2:.1f}x" for r in rows[2:]))
EOF_TIMING
run timing 90 $PY "$TIMING"
run test_cpu 120 $PY -m pytest -q -rs -p no:cacheprovider tests --ignore=tests/test_cuda.py -m "not distributed" \
  --junitxml="$OUT/test_cpu.xml"

# 4. compute-sanitizer on a small case: unaligned views, odd lengths, empty tensors, mixed dtypes, several tiles.
CASE="$STEPS/sanitizer_case.py"
cat >"$CASE" <<'EOF'
import torch, torch_gradstats
from torch_gradstats.ops import reference_multi_tensor_stats
dts = [torch.float16, torch.bfloat16, torch.float32, torch.float64]
base = [torch.randn(70_001, device="cuda").to(dt) for dt in dts]
ts = [b[1:] for b in base] + [b[3:10] for b in base] + [torch.empty(0, device="cuda"), torch.randn(5, 7, device="cuda").t()]
ts[0][5] = float("nan"); ts[2][0] = float("inf")
for _ in range(2):
    got = torch_gradstats.multi_tensor_stats(ts)
ref = reference_multi_tensor_stats(ts)
assert torch.equal(got.counts, ref[2]) and torch.allclose(got.sumsq, ref[0], rtol=1e-5, equal_nan=True)
torch.cuda.synchronize()
print("sanitizer case ok")
EOF
if command -v compute-sanitizer >/dev/null || [[ -x "${CUDA_HOME:-/usr/local/cuda}/bin/compute-sanitizer" ]]; then
  CS="$(command -v compute-sanitizer || echo "${CUDA_HOME:-/usr/local/cuda}/bin/compute-sanitizer")"
  # No caching allocator under memcheck, so an out-of-bounds read cannot hide inside a larger cached block.
  for tool in memcheck racecheck; do
    run "$tool" 120 env PYTORCH_NO_CUDA_MEMORY_CACHING=1 "$CS" --tool "$tool" --error-exitcode 9 $PY "$CASE"
    cp "$STEPS/$tool.out" "$OUT/$tool.log"
  done
else
  log "compute-sanitizer not found"; FAILED+=("sanitizer(missing)")
fi

# 5. Benchmark, if the CLI has it (written separately): stdout to bench.txt, its first CSV to bench.csv.
if $PY -m torch_gradstats bench --help >/dev/null 2>&1; then
  ARGS=""
  $PY -m torch_gradstats bench --help 2>/dev/null | grep -q -- "--device" && ARGS="--device cuda --no-plots --no-progress --out $STEPS/bench"
  run bench 150 bash -c "set -o pipefail; $PY -m torch_gradstats bench $ARGS 2>&1 | tee '$OUT/bench.txt'"
  CSV="$(ls "$STEPS"/bench/*.csv 2>/dev/null | head -n1)"
  [[ -n "$CSV" ]] && cp "$CSV" "$OUT/bench.csv"
else
  log "no 'python -m torch_gradstats bench' yet: benchmark skipped" | tee "$OUT/bench.txt"
fi

# 6. Summary and a copy for bench/results/.
{
  echo "gpu_check $(date -u +%Y-%m-%dT%H:%M:%SZ) total $(( SECONDS - T0 )) s"
  grep -E "^(NVIDIA|name|python|Cuda compilation|Build cuda)|^[A-Z].*, [0-9.]+, " "$LOG" | head -n 6
  grep -E "=== .*: rc=" "$LOG"
  [[ -s "$STEPS/timing.out" ]] && { echo "--- timing (per call)"; grep -vE "^\[gpu_check\]" "$STEPS/timing.out"; }
  if [[ ${#FAILED[@]} -eq 0 ]]; then echo "ALL STEPS PASSED"; else echo "FAILED: ${FAILED[*]}"; fi
} | tee "$OUT/summary.txt"
GPU="$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -n1 | tr -c 'A-Za-z0-9\n' '_' | tr -s '_')"
DEST="bench/results/gpu_check-${GPU:-gpu}-$(date -u +%Y%m%d-%H%M)"
mkdir -p "$DEST" && cp "$OUT"/*.log "$OUT"/*.txt "$OUT"/*.xml "$OUT"/*.csv "$DEST"/ 2>/dev/null
echo "[gpu_check] copies in $DEST"
[[ ${#FAILED[@]} -eq 0 ]]
