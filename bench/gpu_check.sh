#!/usr/bin/env bash
# The one script to run on an H100/H200 in a single device call (see docs/cuda.md, "On a GPU"):
#   versions -> toolchain -> build -> registration -> CUDA tests (the op, then its histogram overload) -> timing
#   record -> the op with and without the histogram (bench/bench_histogram_cuda.py) -> compute-sanitizer memcheck and
#   racecheck -> CPU tests -> `python -m torch_gradstats bench --device cuda` -> bench/bench_training.py --device cuda.
# Every step runs even if an earlier one failed (its exit status is recorded); the script exits non-zero if any did.
# Steps run in that order of priority under one time budget (GPU_CHECK_BUDGET_S, default 560 s, so the summary is
# written inside a 600 s device call): each step gets min(its own limit, what is left), and steps that no longer fit
# are skipped with a note in the summary.
#
# Output, in "$OUT" (default ./gpu_check_out) and copied to bench/results/<device>/ for committing:
#   summary.txt (device, driver, torch, CUDA, commit, per-step status, timing tables), gpu_check.log (everything),
#   test_cuda.xml, test_cuda_histogram.xml, test_cuda_policies.xml, test_cuda_distributed.xml and test_cpu.xml (JUnit), memcheck.log,
#   racecheck.log, timing.txt, timing_histogram.txt, bench.txt, bench.csv, bench_training.txt.
#
# Environment:
#   TORCH_CUDA_ARCH_LIST   default: the device's compute capability (nvidia-smi), else 9.0
#   MAX_JOBS               default 16
#   CXX / CC               replaced by /usr/bin/g++ / /usr/bin/gcc when those exist and differ: a compiler driver
#                          that links its own static libstdc++ into the extension makes every C++ error message
#                          crash the process (the build step checks the library for it afterwards)
#   GPU_CHECK_COMMIT       commit to record when the tree has no .git or a stale one (default: git rev-parse, else
#                          "unknown"); the benchmarks record it too (TORCH_GRADSTATS_COMMIT)
#   GPU_CHECK_SKIP         space-separated step names to skip, e.g. "test_cpu bench_training"
#   GPU_CHECK_DRY_RUN=1    print the plan (environment, steps, limits, commands) and run nothing; also --dry-run
set -uo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
REPO="$PWD"
DRY_RUN="${GPU_CHECK_DRY_RUN:-0}"
[[ "${1:-}" == "--dry-run" ]] && DRY_RUN=1
OUT="${OUT:-$REPO/gpu_check_out}"
if [[ "$DRY_RUN" == 1 ]]; then OUT="$(mktemp -d)"; fi
mkdir -p "$OUT"
LOG="$OUT/gpu_check.log"
: >"$LOG"
PY="${PYTHON:-python3}"
FAILED=()
SKIPPED=()
T0=$SECONDS
BUDGET="${GPU_CHECK_BUDGET_S:-560}"
SKIP=" ${GPU_CHECK_SKIP:-} "
STEPS="$(mktemp -d)"  # each step's own output and the scripts it runs

log() { echo "[gpu_check] $*" | tee -a "$LOG"; }

# The package is imported from temporary directories too (sanitizer and timing cases): find the in-place build.
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
export MAX_JOBS="${MAX_JOBS:-16}"
if [[ -z "${TORCH_CUDA_ARCH_LIST:-}" ]]; then
  CAP="$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | head -n1 | tr -d ' ')"
  export TORCH_CUDA_ARCH_LIST="${CAP:-9.0}"
fi
# The system compiler, when the default one is something else (see the header).
if [[ -x /usr/bin/g++ && -x /usr/bin/gcc ]]; then
  CURRENT_CXX="$(command -v "${CXX:-c++}" 2>/dev/null || true)"
  if [[ -z "$CURRENT_CXX" || "$(readlink -f "$CURRENT_CXX")" != "$(readlink -f /usr/bin/g++)" ]]; then
    log "CXX was '${CXX:-c++}' (${CURRENT_CXX:-not found}); building with the system compiler /usr/bin/g++ instead"
    export CXX=/usr/bin/g++ CC=/usr/bin/gcc
  fi
fi
if [[ -z "${CUDA_HOME:-}" ]] && command -v nvcc >/dev/null; then
  # `nvcc --dryrun` names the directory the real nvcc runs from (the one on PATH may be a wrapper script).
  NVCC_BIN="$(nvcc --dryrun -x cu /dev/null 2>&1 | sed -n 's/^#\$ _HERE_=//p' | head -n1)"
  [[ -n "$NVCC_BIN" ]] || NVCC_BIN="$(dirname "$(readlink -f "$(command -v nvcc)")")"
  export CUDA_HOME="$(cd "$NVCC_BIN/.." && pwd)"
fi
COMMIT="${GPU_CHECK_COMMIT:-$(git -C "$REPO" rev-parse --short HEAD 2>/dev/null || echo unknown)}"
if [[ -z "${GPU_CHECK_COMMIT:-}" ]] && git -C "$REPO" rev-parse HEAD >/dev/null 2>&1 &&
  [[ -n "$(git -C "$REPO" status --porcelain 2>/dev/null)" ]]; then
  COMMIT="$COMMIT (with uncommitted changes)"
fi
export TORCH_GRADSTATS_COMMIT="${GPU_CHECK_COMMIT:-}"  # the benchmarks record the same commit
log "commit $COMMIT; CXX=${CXX:-default} CUDA_HOME=${CUDA_HOME:-unset} TORCH_CUDA_ARCH_LIST=$TORCH_CUDA_ARCH_LIST" \
  "MAX_JOBS=$MAX_JOBS PYTHONPATH=$PYTHONPATH budget ${BUDGET} s"

# run NAME LIMIT CMD...: a step with a time limit; logs its output and duration, records failures and skips.
run() {
  local name=$1 limit=$2; shift 2
  local t=$SECONDS left=$(( BUDGET - 15 - (SECONDS - T0) ))  # 15 s kept for the summary
  if [[ "$SKIP" == *" $name "* ]]; then log "=== $name: skipped (GPU_CHECK_SKIP)"; SKIPPED+=("$name(asked)"); return 0; fi
  if (( left < 10 )); then log "=== $name: not run, time budget spent"; SKIPPED+=("$name(no time)"); return 0; fi
  (( limit > left )) && limit=$left
  if [[ "$DRY_RUN" == 1 ]]; then log "=== $name (limit $limit s): $*"; return 0; fi
  log "=== $name (limit $limit s)"
  timeout "$limit" "$@" 2>&1 | tee "$STEPS/$name.out" | tee -a "$LOG"
  local rc=${PIPESTATUS[0]}
  log "=== $name: rc=$rc in $(( SECONDS - t )) s"
  [[ $rc -eq 0 ]] || FAILED+=("$name(rc=$rc)")
  return 0
}

# 1. Versions.
run versions 60 bash -c "nvidia-smi --query-gpu=name,driver_version,memory.total,compute_cap --format=csv;
  nvcc --version | tail -n 2; \${CXX:-c++} --version | head -n1; $PY -c 'import sys, torch; print(\"python\",
  sys.version.split()[0], \"torch\", torch.__version__, \"cuda\", torch.version.cuda, \"device\",
  torch.cuda.get_device_name(0), \"capability\", torch.cuda.get_device_capability(0))'"

# 2. Build in place, then check that the library uses the shared libstdc++ (a static copy inside it is what made
#    C++ error messages crash).
[[ "$DRY_RUN" == 1 ]] || rm -f torch_gradstats/_C*.so
run build 240 $PY setup.py build_ext --inplace
run toolchain 30 bash -c 'so=$(ls torch_gradstats/_C*.so) || exit 1
  echo "std::ostream symbols defined inside the library: $(nm -C --defined-only "$so" 2>/dev/null | grep -c "std::basic_ostream")"
  readelf -d "$so" | grep NEEDED
  readelf -d "$so" | grep -q "NEEDED.*libstdc++" || { echo "libstdc++ is linked statically into $so"; exit 1; }'
run registration 60 $PY -c "
import torch, torch_gradstats
assert torch_gradstats.HAS_EXTENSION, 'extension did not load'
assert torch._C._dispatch_has_kernel_for_dispatch_key('torch_gradstats::multi_tensor_stats', 'CUDA'), 'no CUDA kernel'
assert torch._C._dispatch_has_kernel_for_dispatch_key('torch_gradstats::multi_tensor_stats.histogram', 'CUDA'), \
    'no CUDA kernel for the histogram overload'
print('extension loaded, CUDA kernel registered; metadata cache:', torch.ops.torch_gradstats._cuda_metadata_cache_info())
try:  # a C++ error message must come back as a Python exception, not a crash
    torch.ops.torch_gradstats.multi_tensor_stats([torch.zeros(3, device='cuda'), torch.zeros(3, dtype=torch.long, device='cuda')])
except TypeError as exc:
    print('bad input raised TypeError:', str(exc).splitlines()[0])
else:
    raise SystemExit('a long tensor was accepted')"

# 3. CUDA tests (slow ones included).
run test_cuda 300 $PY -m pytest -q -rs -p no:cacheprovider tests/test_cuda.py --junitxml="$OUT/test_cuda.xml"
run test_cuda_histogram 150 $PY -m pytest -q -rs -p no:cacheprovider tests/test_cuda_histogram.py \
  --junitxml="$OUT/test_cuda_histogram.xml"
run test_cuda_policies 120 $PY -m pytest -q -rs -p no:cacheprovider tests/test_cuda_policies.py \
  --junitxml="$OUT/test_cuda_policies.xml"
run test_cuda_distributed 60 $PY -m pytest -q -rs -p no:cacheprovider tests/test_cuda_distributed.py \
  --junitxml="$OUT/test_cuda_distributed.xml"

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
    """Device time per call: one CUDA graph holding every call, replayed back to back, timed by events.

    A captured call of the op reads metadata written once at capture (a buffer the graph owns), so a replay runs
    the two kernels only, as the eager steady state (cache hit) does: this and the `kernels` column should agree."""
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
    """Sum of kernel durations per call (torch.profiler), launches per call, and the time of each kernel per call
    (the split between the op's two kernels)."""
    from torch.profiler import ProfilerActivity, profile
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for c in calls:
            c()
        torch.cuda.synchronize()
    ev = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    kernels = [e for e in ev if not e.name.lower().startswith(("memcpy", "memset"))]
    total = sum(e.time_range.end - e.time_range.start for e in kernels)
    split = {}
    for e in kernels:
        name = e.name.split("(")[0].split("<")[0][:40]
        split[name] = split.get(name, 0.0) + (e.time_range.end - e.time_range.start) / len(calls)
    others = sorted({e.name[:40] for e in ev if e not in kernels})
    names = [f"{k}: {v:.2f} us" for k, v in sorted(split.items())] + others
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
    print("note: a captured call reads metadata its graph owns (written once at capture), so device(graph) and"
          " 'kernels' (the eager steady state, a cache hit) both time the two kernels; the list gives each one's time")
EOF_TIMING
run timing 90 $PY "$TIMING"
[[ -s "$STEPS/timing.out" ]] && cp "$STEPS/timing.out" "$OUT/timing.txt"
# The op with and without the exponent histogram, device time side by side (docs/cuda.md, "The exponent histogram").
run timing_histogram 90 $PY bench/bench_histogram_cuda.py --device cuda
[[ -s "$STEPS/timing_histogram.out" ]] && cp "$STEPS/timing_histogram.out" "$OUT/timing_histogram.txt"

# 5. compute-sanitizer on a small case: unaligned views, odd lengths, empty tensors, mixed dtypes, several tiles,
#    as a short list (metadata in the kernel parameters) and as a list past the inline limit (680 tensors): a cache
#    miss (fill_metadata_kernel) and hit (metadata read from the cache's pool), and a captured call (metadata in a
#    buffer its graph owns) replayed; each with the histogram too.
CASE="$STEPS/sanitizer_case.py"
cat >"$CASE" <<'EOF_CASE'
import os
import torch, torch_gradstats
from torch_gradstats.ops.op import reference_multi_tensor_stats
dts = [torch.float16, torch.bfloat16, torch.float32, torch.float64]
base = [torch.randn(70_001, device="cuda").to(dt) for dt in dts]
ts = [b[1:] for b in base] + [b[3:10] for b in base] + [torch.empty(0, device="cuda"), torch.randn(5, 7, device="cuda").t()]
ts[0][5] = float("nan"); ts[2][0] = float("inf")
# Longer than any inline limit: one-element tensors in [0.5, 1.5) (no zeros; buckets 148 and 149), whose expected
# rows are computed at once (the per-tensor reference would launch thousands of kernels under the sanitizer).
pad = torch.rand(700, device="cuda") + 0.5
long_ts = ts + list(pad.split(1))
def expected(n):
    ref = reference_multi_tensor_stats(ts, histogram=True)
    if n == len(ts):
        return ref
    p = pad.double()
    hist = torch.zeros(len(pad), 277, dtype=torch.int64, device="cuda")
    hist[torch.arange(len(pad), device="cuda"), torch.frexp(p).exponent.long() - 1 + 149] = 1
    return (torch.cat([ref[0], p * p]), torch.cat([ref[1], p]),
            torch.cat([ref[2], torch.zeros(len(pad), 3, dtype=torch.int64, device="cuda")]), torch.cat([ref[3], hist]))
def check(got, hist=None):
    ref = expected(len(got.sumsq))
    assert torch.equal(got.counts, ref[2]) and torch.allclose(got.sumsq, ref[0], rtol=1e-5, equal_nan=True)
    assert hist is None or torch.equal(hist.exponent_histogram, ref[3])
for tensors in (ts, long_ts):
    for _ in range(2):  # the long list: a cache miss, then a hit
        check(torch_gradstats.multi_tensor_stats(tensors), torch_gradstats.multi_tensor_stats(tensors, histogram=True))
info = torch.ops.torch_gradstats._cuda_metadata_cache_info()
assert info[0] >= 1 and info[4] >= 1, f"the long list did not go through the metadata cache: {info}"
if os.environ.get("PYTORCH_NO_CUDA_MEMORY_CACHING") != "1":  # CUDA graphs need the caching allocator
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        captured = [(torch_gradstats.multi_tensor_stats(tensors),
                     torch_gradstats.multi_tensor_stats(tensors, histogram=True)) for tensors in (ts, long_ts)]
    assert torch.ops.torch_gradstats._cuda_metadata_cache_info()[6] >= 1, "no metadata buffer owned by the graph"
    ts[3][7] = float("-inf")
    g.replay()
    torch.cuda.synchronize()
    for plain, with_hist in captured:
        check(plain, with_hist)
    print("captured calls replayed")
torch.cuda.synchronize()
print("sanitizer case ok")
EOF_CASE
CS="$(command -v compute-sanitizer || echo "${CUDA_HOME:-/usr/local/cuda}/bin/compute-sanitizer")"
if [[ -x "$CS" || "$DRY_RUN" == 1 ]]; then
  # memcheck without the caching allocator, so an out-of-bounds read cannot hide inside a larger cached block;
  # racecheck with it, so the captured path runs too.
  run memcheck 120 env PYTORCH_NO_CUDA_MEMORY_CACHING=1 "$CS" --tool memcheck --error-exitcode 9 $PY "$CASE"
  run racecheck 120 "$CS" --tool racecheck --error-exitcode 9 $PY "$CASE"
  for tool in memcheck racecheck; do [[ -s "$STEPS/$tool.out" ]] && cp "$STEPS/$tool.out" "$OUT/$tool.log"; done
else
  log "compute-sanitizer not found"; FAILED+=("sanitizer(missing)")
fi

# 6. CPU tests (the rest of the suite).
run test_cpu 120 $PY -m pytest -q -rs -p no:cacheprovider tests --ignore=tests/test_cuda.py \
  --ignore=tests/test_cuda_histogram.py --ignore=tests/test_cuda_policies.py \
  --ignore=tests/test_cuda_distributed.py -m "not distributed" \
  --junitxml="$OUT/test_cpu.xml"

# 7. Benchmarks: the CLI's (bounded by its own --budget-s), then the training-overhead one.
run bench 150 bash -c "$PY -m torch_gradstats bench --device cuda --no-plots --no-progress --budget-s 120 \
  --out '$STEPS/bench' > '$OUT/bench.txt' 2>&1; rc=\$?; cat '$OUT/bench.txt'; exit \$rc"
CSV="$(ls "$STEPS"/bench/*.csv 2>/dev/null | head -n1)"
[[ -n "$CSV" ]] && cp "$CSV" "$OUT/bench.csv"
run bench_training 120 bash -c "$PY bench/bench_training.py --device cuda --rounds 3 --csv '$STEPS/bench_training.csv' \
  > '$OUT/bench_training.txt' 2>&1; rc=\$?; cat '$OUT/bench_training.txt'; exit \$rc"

# 8. Summary, and a copy under bench/results/<device>/.
DEVICE="$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -n1)"
{
  echo "gpu_check $(date -u +%Y-%m-%dT%H:%M:%SZ), total $(( SECONDS - T0 )) s of a ${BUDGET} s budget"
  echo "device: ${DEVICE:-none}, driver $(nvidia-smi --query-gpu=driver_version --format=csv,noheader 2>/dev/null | head -n1)"
  echo "commit: $COMMIT"
  $PY -c 'import torch; print("torch", torch.__version__, "CUDA", torch.version.cuda)' 2>/dev/null
  echo "nvcc: $(nvcc --version 2>/dev/null | tail -n1); CXX=${CXX:-default}; TORCH_CUDA_ARCH_LIST=$TORCH_CUDA_ARCH_LIST"
  grep -E "=== .*: (rc=|skipped|not run)" "$LOG"
  for xml in "$OUT"/test_cuda.xml "$OUT"/test_cuda_histogram.xml "$OUT"/test_cuda_policies.xml \
      "$OUT"/test_cuda_distributed.xml "$OUT"/test_cpu.xml; do
    [[ -s "$xml" ]] && grep -o '<testsuite [^>]*' "$xml" | head -n1 | sed "s|<testsuite|$(basename "$xml"):|"
  done
  [[ -s "$STEPS/timing.out" ]] && { echo "--- timing (per call)"; grep -vE "^\[gpu_check\]" "$STEPS/timing.out"; }
  [[ -s "$STEPS/timing_histogram.out" ]] && { echo "--- the op with and without the histogram (device time per call)"
    grep -vE "^\[gpu_check\]" "$STEPS/timing_histogram.out"; }
  [[ ${#SKIPPED[@]} -eq 0 ]] || echo "SKIPPED: ${SKIPPED[*]}"
  if [[ ${#FAILED[@]} -eq 0 ]]; then echo "ALL STEPS THAT RAN PASSED"; else echo "FAILED: ${FAILED[*]}"; fi
} | tee "$OUT/summary.txt"
if [[ "$DRY_RUN" == 1 ]]; then
  echo "[gpu_check] dry run: nothing was run; plan and summary in $OUT"
  exit 0
fi
SLUG="$(echo "${DEVICE:-unknown_gpu}" | tr -c 'A-Za-z0-9\n' '_' | tr -s '_' | sed 's/_$//')"
DEST="bench/results/$SLUG"
mkdir -p "$DEST" && cp "$OUT"/*.log "$OUT"/*.txt "$OUT"/*.xml "$OUT"/*.csv "$DEST"/ 2>/dev/null
echo "[gpu_check] copies in $DEST"
[[ ${#FAILED[@]} -eq 0 ]]
