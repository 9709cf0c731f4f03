// Fused CPU kernel of torch_gradstats::multi_tensor_stats: one read of every element gives its square, |x|, and
// whether it is zero, NaN or Inf.
//
// Work split. Each tensor is cut into segments of kChunkElems elements from its own start, and consecutive segments
// are grouped into parallel tasks of about kChunkElems elements (near-equal work, so at::parallel_for's static split
// balances whether the list holds 5 huge tensors or 10,000 small ones). Each segment yields a Partial; a tensor's
// partials are combined in segment order afterwards, so its result is bitwise the same whatever the thread count
// and wherever it sits in the list.
//
// Accumulation. Inside a segment, blocks of kBlockElems elements are summed in the accumulation type (float for
// 16/32-bit inputs, double for float64) with several independent vector accumulators, and block sums are added in
// double. A block sum that is not finite means the block holds a NaN or an Inf, or its squares overflowed float: that
// block alone is redone exactly in double, element by element, which also counts its NaNs and Infs. So the fast loop
// needs no NaN/Inf test at all, and float32 inputs up to FLT_MAX give finite sums. A float block of only tiny values
// (vanishing gradients) is summed again scaled by a power of two, so its squares do not underflow. The final NaN/Inf
// semantics of sumsq and amax are derived from the counts.
//
// Dense tensors, permuted ones included, are read in place as a flat span (the statistics do not depend on element
// order); only non-dense tensors (expanded, sliced with gaps) are copied to a contiguous buffer first.
#include "multi_tensor_stats.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

namespace torch_gradstats {
namespace {

using at::vec::Vectorized;

constexpr int64_t kChunkElems = int64_t{1} << 16;  // segment and task size: 256 KiB of float32, fits in L2
constexpr int64_t kBlockElems = 2048;  // float partial sums: 64 adds per accumulator lane, error <= ~70 ulp

// A float block whose max |x| is below 2^-40 is summed again scaled by 2^90. Below the threshold, squares of its
// elements may fall under FLT_MIN and lose precision; above it, what such elements lose is < 1e-9 of the block's
// largest square. Scaled, any float (subnormals included) squares to a normal float and 2048 squares stay < 2^111.
constexpr double kTinyThreshold = 0x1p-40;
constexpr double kTinyScale = 0x1p90;

struct Partial {
  double sumsq = 0.0;  // sum of squares of the finite elements
  double amax = 0.0;   // max |x| over the finite elements
  int64_t zeros = 0;
  int64_t nans = 0;
  int64_t infs = 0;

  void merge(const Partial& o) {
    sumsq += o.sumsq;
    amax = std::max(amax, o.amax);
    zeros += o.zeros;
    nans += o.nans;
    infs += o.infs;
  }
};

// Exact path: every element in double, with NaN/Inf classified. Used for blocks the fast path rejects.
template <typename scalar_t>
void accumulate_exact(const scalar_t* x, int64_t n, Partial& p) {
  for (int64_t i = 0; i < n; ++i) {
    const double v = static_cast<double>(x[i]);
    if (std::isnan(v)) {
      ++p.nans;
    } else if (std::isinf(v)) {
      ++p.infs;
    } else {
      p.sumsq += v * v;
      p.amax = std::max(p.amax, std::abs(v));
      p.zeros += (v == 0.0);
    }
  }
}

// Accumulation type and vector loads for each input dtype: two vectors of acc_t per step.
template <typename scalar_t>
struct Loader {  // float, double: load as is
  using acc_t = scalar_t;
  using Vec = Vectorized<acc_t>;
  static constexpr int64_t kStep = 2 * Vec::size();
  static void load(const scalar_t* x, Vec& a, Vec& b) {
    a = Vec::loadu(x);
    b = Vec::loadu(x + Vec::size());
  }
};

template <typename half_t>
struct ReducedLoader {  // float16, bfloat16: one 16-bit vector widened to two float vectors
  using acc_t = float;
  using Vec = Vectorized<float>;
  static constexpr int64_t kStep = Vectorized<half_t>::size();
  static_assert(kStep == 2 * Vec::size(), "a 16-bit vector must widen to exactly two float vectors");
  static void load(const half_t* x, Vec& a, Vec& b) {
    std::tie(a, b) = at::vec::convert_to_float<half_t>(Vectorized<half_t>::loadu(x));
  }
};
template <>
struct Loader<at::Half> : ReducedLoader<at::Half> {};
template <>
struct Loader<at::BFloat16> : ReducedLoader<at::BFloat16> {};

template <typename acc_t>
struct BlockSums {
  acc_t sumsq;
  acc_t amax;
  acc_t zeros;
};

// Sums of one block of at most kBlockElems elements in acc_t, no NaN/Inf test. With kScaled, every value is first
// multiplied by kTinyScale (a power of two, so exactly) to keep tiny squares out of float's subnormal range.
template <typename scalar_t, bool kScaled>
BlockSums<typename Loader<scalar_t>::acc_t> sum_block(const scalar_t* x, int64_t n) {
  using L = Loader<scalar_t>;
  using acc_t = typename L::acc_t;
  using Vec = typename L::Vec;
  const Vec zero(acc_t(0));
  const Vec scale(acc_t(kScaled ? kTinyScale : 1.0));
  // Four independent chains of each accumulator hide the FMA/add latency.
  Vec sq[4] = {zero, zero, zero, zero}, mx[4] = {zero, zero, zero, zero}, zc[4] = {zero, zero, zero, zero};
  const auto update = [&](Vec v, int k) {
    if constexpr (kScaled) {
      v = v * scale;
    }
    sq[k] = at::vec::fmadd(v, v, sq[k]);
    // clamp_min(v, m) is max(v, m) in one instruction; it need not propagate NaN, the exact path handles those.
    mx[k] = at::vec::clamp_min(v.abs(), mx[k]);
    // eq() yields 1.0 where equal (not a mask): counts stay exact in acc_t, at most kBlockElems per lane.
    zc[k] = zc[k] + v.eq(zero);
  };
  int64_t i = 0;
  for (; i + 2 * L::kStep <= n; i += 2 * L::kStep) {
    Vec v0, v1, v2, v3;
    L::load(x + i, v0, v1);
    L::load(x + i + L::kStep, v2, v3);
    update(v0, 0);
    update(v1, 1);
    update(v2, 2);
    update(v3, 3);
  }
  for (; i + L::kStep <= n; i += L::kStep) {
    Vec v0, v1;
    L::load(x + i, v0, v1);
    update(v0, 0);
    update(v1, 1);
  }
  const auto add = [](Vec u, Vec v) { return u + v; };
  const auto max = [](Vec u, Vec v) { return at::vec::clamp_min(u, v); };
  BlockSums<acc_t> r{
      at::vec::vec_reduce_all<acc_t>(add, (sq[0] + sq[1]) + (sq[2] + sq[3])),
      at::vec::vec_reduce_all<acc_t>(max, at::vec::clamp_min(at::vec::clamp_min(mx[0], mx[1]),
                                                              at::vec::clamp_min(mx[2], mx[3]))),
      at::vec::vec_reduce_all<acc_t>(add, (zc[0] + zc[1]) + (zc[2] + zc[3]))};
  for (; i < n; ++i) {
    const acc_t v = static_cast<acc_t>(x[i]) * (kScaled ? acc_t(kTinyScale) : acc_t(1));
    r.sumsq += v * v;
    r.amax = std::max(r.amax, std::abs(v));
    r.zeros += (v == acc_t(0));
  }
  return r;
}

// One block: the vector fast path, redone exactly in double if its sum is not finite (NaN, Inf or float overflow),
// or redone scaled if all its values are so small that their float squares would lose precision.
template <typename scalar_t>
void accumulate_block(const scalar_t* x, int64_t n, Partial& p) {
  using acc_t = typename Loader<scalar_t>::acc_t;
  auto r = sum_block<scalar_t, false>(x, n);
  if (!std::isfinite(r.sumsq)) {
    accumulate_exact(x, n, p);
    return;
  }
  double unscale = 1.0;
  if (std::is_same_v<acc_t, float> && r.amax > 0 && r.amax < kTinyThreshold) {
    r = sum_block<scalar_t, true>(x, n);
    unscale = 1.0 / kTinyScale;
  }
  p.sumsq += static_cast<double>(r.sumsq) * unscale * unscale;
  p.amax = std::max(p.amax, static_cast<double>(r.amax) * unscale);
  p.zeros += static_cast<int64_t>(r.zeros);
}

template <typename scalar_t>
Partial accumulate_span(const scalar_t* x, int64_t n) {
  Partial p;
  for (int64_t b = 0; b < n; b += kBlockElems) {
    accumulate_block(x + b, std::min(kBlockElems, n - b), p);
  }
  return p;
}

Partial accumulate_any(const at::Tensor& t, int64_t begin, int64_t end) {
  Partial p;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, t.scalar_type(), "multi_tensor_stats_cpu", [&] {
    p = accumulate_span(t.const_data_ptr<scalar_t>() + begin, end - begin);
  });
  return p;
}

struct Segment {
  int64_t tensor;  // index into the input list
  int64_t begin;   // element range within that tensor
  int64_t end;
};

}  // namespace

Stats multi_tensor_stats_cpu(at::TensorList tensors) {
  check_inputs(tensors);
  const int64_t n = static_cast<int64_t>(tensors.size());

  // Flat views: dense tensors in place (any permutation), others copied. The neg bit of a view can be ignored: every
  // statistic is symmetric in the sign.
  std::vector<at::Tensor> flat;
  flat.reserve(n);
  for (const at::Tensor& t : tensors) {
    flat.push_back(t.is_non_overlapping_and_dense() ? t : t.contiguous());
  }

  // Cut every tensor into segments of kChunkElems elements counted from its own start (so its result does not
  // depend on its place in the list), then group consecutive segments into tasks of at least kChunkElems elements
  // (the last one may be smaller); task_first[k] is task k's first segment.
  std::vector<Segment> segments;
  std::vector<size_t> task_first{0};
  int64_t task_elems = 0;
  for (int64_t i = 0; i < n; ++i) {
    const int64_t numel = flat[i].numel();
    for (int64_t begin = 0; begin < numel; begin += kChunkElems) {
      const int64_t end = std::min(numel, begin + kChunkElems);
      segments.push_back({i, begin, end});
      task_elems += end - begin;
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

  std::vector<Partial> partials(segments.size());
  at::parallel_for(0, num_tasks, 1, [&](int64_t task_begin, int64_t task_end) {
    for (size_t s = task_first[task_begin]; s < task_first[task_end]; ++s) {
      const Segment& seg = segments[s];
      partials[s] = accumulate_any(flat[seg.tensor], seg.begin, seg.end);
    }
  });

  // Combine in segment order (deterministic), then apply the NaN/Inf semantics from the counts.
  std::vector<Partial> totals(n);
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
  return {sumsq, amax, counts};
}

TORCH_LIBRARY_IMPL(torch_gradstats, CPU, m) { m.impl("multi_tensor_stats", &multi_tensor_stats_cpu); }

}  // namespace torch_gradstats
