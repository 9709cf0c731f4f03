// Fused CPU kernel of torch_gradstats::multi_tensor_stats: one read of every element gives its square, |x|, and
// whether it is zero, NaN or Inf (and, for the histogram overload, its binary exponent). This file (compiled for
// the baseline CPU) holds the op: input checks, the work split, the choice of instruction set and the final
// combination; the per-element kernels are in stats_kernel_impl.h, compiled once per instruction set.
//
// Instruction set. The kernels are compiled for the baseline CPU and, on x86-64, for AVX2 (+FMA, F16C) and AVX512
// (F, BW, VL, DQ, with POPCNT; a second time with GFNI and BITALG, used where the CPU has them: only the exponent
// histogram's counting differs). The op uses the one ATen's own CPU kernels use (at::get_cpu_capability(), which
// honours ATEN_CPU_CAPABILITY=default|avx2|avx512), provided the running CPU has its features, so a build made on
// any machine runs on every x86-64 CPU. cpu_kernel_capability() names the choice (AVX512 for both AVX512 builds).
// The variants add in different orders, so sumsq's last bits may differ between them (within the accuracy
// contract); counts and amax do not.
//
// Work split. Each tensor is cut into segments of kChunkElems elements from its own start, and consecutive segments
// are grouped into parallel tasks of about kChunkElems elements (near-equal work, so at::parallel_for's static split
// balances whether the list holds 5 huge tensors or 10,000 small ones). Each segment yields a Partial; a tensor's
// partials are combined in segment order afterwards, so its result is bitwise the same whatever the thread count
// and wherever it sits in the list.
//
// Flush-to-zero. torch.set_flush_denormal(True) sets FTZ/DAZ in the calling thread only, not in the OpenMP workers,
// so a kernel that inherited it would give results that depend on which thread ran which segment. The op and every
// task run with FTZ/DAZ cleared (each thread's mode is restored afterwards): subnormal inputs count as the non-zero
// values they are and their squares are summed, identically with or without flush-denormal and for any thread count.
//
// Dense tensors, permuted ones included, are read in place as a flat span (the statistics do not depend on element
// order); the others through NonDenseInputs (multi_tensor_stats.h): an expanded tensor's distinct elements once, in
// place where dense, and a contiguous copy of the rest.
#include "multi_tensor_stats.h"

#include "cpu/stats_kernel.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/Version.h>
#include <c10/util/SmallVector.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdlib>
#include <limits>
#include <string>
#include <string_view>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64)
#include <xmmintrin.h>
#endif

namespace torch_gradstats {
namespace {

using cpu::Partial;

constexpr int64_t kChunkElems = int64_t{1} << 16;  // segment and task size: 256 KiB of float32, fits in L2
constexpr unsigned kInlineTensors = 8;              // lists up to this long need no heap for the work split

struct Kernel {
  cpu::AccumulateFn fn;
  const char* name;
  const char* histogram_counting;
};

// The running CPU's features, checked directly as well: ATen trusts ATEN_CPU_CAPABILITY as given.
bool cpu_has(const char* isa) {
#if defined(TORCH_GRADSTATS_X86_KERNELS) && (defined(__GNUC__) || defined(__clang__))
  __builtin_cpu_init();
  if (std::string(isa) == "AVX512") {
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("fma") &&
           __builtin_cpu_supports("f16c") && __builtin_cpu_supports("popcnt");
  }
  if (std::string(isa) == "GFNI") {  // with AVX512: what the AVX512_GFNI kernels add
    return __builtin_cpu_supports("gfni") && __builtin_cpu_supports("avx512bitalg");
  }
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
#else
  (void)isa;
  return true;  // MSVC: ATen's cpuinfo-based decision alone
#endif
}

Kernel choose_kernel() {
#if defined(TORCH_GRADSTATS_X86_KERNELS)
  const std::string aten = at::get_cpu_capability();  // "DEFAULT", "AVX2", "AVX512", "NO AVX", ...
  if (aten == "AVX512" && cpu_has("AVX512")) {
    // The same statistics; only the exponent histogram's counting differs. TORCH_GRADSTATS_CPU_GFNI=0 keeps the
    // plain AVX512 kernel on a CPU with GFNI (to test or compare its byte compares there).
    const char* gfni = std::getenv("TORCH_GRADSTATS_CPU_GFNI");
    if (cpu_has("GFNI") && !(gfni != nullptr && std::string_view(gfni) == "0")) {
      return {&cpu::AVX512_GFNI::accumulate, "AVX512", cpu::AVX512_GFNI::histogram_counting()};
    }
    return {&cpu::AVX512::accumulate, "AVX512", cpu::AVX512::histogram_counting()};
  }
  if ((aten == "AVX512" || aten == "AVX2") && cpu_has("AVX2")) {
    return {&cpu::AVX2::accumulate, "AVX2", cpu::AVX2::histogram_counting()};
  }
#endif
  return {&cpu::DEFAULT::accumulate, "DEFAULT", cpu::DEFAULT::histogram_counting()};
}

const Kernel& kernel() {
  static const Kernel k = choose_kernel();
  return k;
}

// Clears FTZ/DAZ in this thread for its lifetime (see "Flush-to-zero" above).
class IeeeDenormals {
 public:
#if defined(__x86_64__) || defined(_M_X64)
  IeeeDenormals() : saved_(_mm_getcsr()) {
    if (saved_ & kFtzDaz) {
      _mm_setcsr(saved_ & ~kFtzDaz);
    }
  }
  ~IeeeDenormals() {
    if (saved_ & kFtzDaz) {
      _mm_setcsr(saved_);
    }
  }

 private:
  static constexpr unsigned kFtzDaz = 0x8040;  // MXCSR bits 15 (flush to zero) and 6 (denormals are zero)
  unsigned saved_;
#endif
};

struct Segment {
  const char* data;  // first element
  int64_t numel;
  int64_t tensor;  // index into the input list
  c10::ScalarType dtype;
};

}  // namespace

Stats multi_tensor_stats_cpu(const TensorRefs& tensors, at::Tensor* histogram) {
  check_inputs(tensors);
  const int64_t n = static_cast<int64_t>(tensors.size());
  // Covers this thread's share of the tasks and the final combination (which compares subnormal amax values).
  [[maybe_unused]] const IeeeDenormals ieee;

  // Cut every tensor into segments of kChunkElems elements counted from its own start (so its result does not
  // depend on its place in the list), then group consecutive segments into tasks of at least kChunkElems elements
  // (the last one may be smaller); task_first[k] is task k's first segment. Dense tensors (any permutation) are read
  // in place as a flat span, others as NonDenseInputs says. The neg bit of a view can be ignored: every statistic is
  // symmetric in the sign.
  // Small vectors: a call on a short list allocates nothing here (its host time is mostly allocations).
  NonDenseInputs non_dense;  // keeps what is read of the non-dense tensors alive
  c10::SmallVector<Segment, kInlineTensors> segments;
  segments.reserve(n);
  c10::SmallVector<size_t, kInlineTensors> task_first{0};
  int64_t task_elems = 0;
  for (int64_t i = 0; i < n; ++i) {
    const at::Tensor* t = &tensors[i];
    if (!t->is_non_overlapping_and_dense()) {
      t = &non_dense.read(*t, static_cast<size_t>(i));
    }
    const int64_t numel = t->numel();
    if (numel == 0) {
      continue;
    }
    const char* data = static_cast<const char*>(t->const_data_ptr());
    const int64_t elem_size = static_cast<int64_t>(t->element_size());
    for (int64_t begin = 0; begin < numel; begin += kChunkElems) {
      const int64_t len = std::min(numel - begin, kChunkElems);
      segments.push_back({data + begin * elem_size, len, i, t->scalar_type()});
      task_elems += len;
      if (task_elems >= kChunkElems) {
        task_first.push_back(segments.size());
        task_elems = 0;
      }
    }
  }
  if (task_first.back() != segments.size()) {
    task_first.push_back(segments.size());
  }
  const int64_t num_tasks = static_cast<int64_t>(task_first.size()) - 1;

  // The histogram's rows are added into by the tasks directly; a tensor whose segments lie in several tasks
  // (split at a task boundary) gets atomic adds.
  int64_t* hist_out = nullptr;
  std::vector<bool> shared_row;
  if (histogram != nullptr) {
    *histogram = zero_histogram(n, tensors[0].device());
    hist_out = histogram->mutable_data_ptr<int64_t>();
    shared_row.resize(n);
    for (int64_t k = 1; k < num_tasks; ++k) {
      const size_t s = task_first[k];
      if (segments[s - 1].tensor == segments[s].tensor) {
        shared_row[segments[s].tensor] = true;
      }
    }
  }

  const cpu::AccumulateFn accumulate = kernel().fn;
  c10::SmallVector<Partial, kInlineTensors> partials(segments.size());
  at::parallel_for(0, num_tasks, 1, [&](int64_t task_begin, int64_t task_end) {
    [[maybe_unused]] const IeeeDenormals ieee_in_worker;
    for (size_t s = task_first[task_begin]; s < task_first[task_end]; ++s) {
      const Segment& seg = segments[s];
      cpu::HistogramRow row;
      if (hist_out != nullptr) {
        row = {hist_out + seg.tensor * kHistogramBuckets, shared_row[seg.tensor]};
      }
      partials[s] = accumulate(seg.dtype, seg.data, seg.numel, row);
    }
  });

  // Combine in segment order (deterministic), then apply the NaN/Inf semantics from the counts.
  c10::SmallVector<Partial, kInlineTensors> totals(n);
  for (size_t s = 0; s < segments.size(); ++s) {
    totals[segments[s].tensor].merge(partials[s]);
  }
  auto [sumsq, amax, counts] = empty_stats(n, tensors[0].device());
  double* sumsq_out = sumsq.mutable_data_ptr<double>();
  double* amax_out = amax.mutable_data_ptr<double>();
  int64_t* counts_out = counts.mutable_data_ptr<int64_t>();
  constexpr double nan = std::numeric_limits<double>::quiet_NaN();
  constexpr double inf = std::numeric_limits<double>::infinity();
  for (int64_t i = 0; i < n; ++i) {
    const Partial& p = totals[i];
    const double special = p.nans > 0 ? nan : inf;
    const bool nonfinite = p.nans > 0 || p.infs > 0;
    sumsq_out[i] = nonfinite ? special : p.sumsq;
    amax_out[i] = nonfinite ? special : p.amax;
    counts_out[i * kNumCounts + kZero] = p.zeros;
    counts_out[i * kNumCounts + kNan] = p.nans;
    counts_out[i * kNumCounts + kInf] = p.infs;
  }
  Stats out{std::move(sumsq), std::move(amax), std::move(counts)};
  non_dense.scale(out, histogram);
  return out;
}

const char* cpu_kernel_capability() { return kernel().name; }

const char* cpu_histogram_counting() { return kernel().histogram_counting; }

TORCH_LIBRARY_IMPL(torch_gradstats, CPU, m) {
  m.impl("multi_tensor_stats",
         torch::CppFunction::makeFromBoxedFunction<&boxed_kernel<&multi_tensor_stats_cpu, false>>());
  m.impl("multi_tensor_stats.histogram",
         torch::CppFunction::makeFromBoxedFunction<&boxed_kernel<&multi_tensor_stats_cpu, true>>());
}

}  // namespace torch_gradstats
