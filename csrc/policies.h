// The per-step logic of the policies' ops (spike_guard_step, adaptive_clip_step, noise_scale_step), shared by the
// CPU kernels (csrc/cpu/policies_cpu.cpp) and the CUDA kernels (csrc/cuda/policies.cu). Each works on the policy's
// packed float64 state, laid out as torch_gradstats/ops/policy_ops.py says (the offsets below repeat it); the sums
// over a history or the warm-up norms are the caller's (a loop on the CPU, a block reduction on CUDA). The formulas
// are those of the pure-PyTorch kernels in policy_ops.py, operation for operation.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cfloat>
#include <cmath>
#include <cstdint>

#ifdef __CUDACC__
#define TG_HD __host__ __device__
#else
#define TG_HD
#endif

namespace torch_gradstats::policies {

// SpikeGuard: counters [7], count [2], position [2], last [2, 4], trip [2, 4], history [2, window].
constexpr int64_t kGuardCounters = 0, kGuardCount = 7, kGuardPos = 9, kGuardLast = 11, kGuardTrip = 19,
                  kGuardHist = 27, kGuardSeries = 2;
enum GuardCounter { kSteps = 0, kSkipped, kConsecutive, kTripped, kTripStep, kStreak, kTripSeries };
// AdaptiveClip: count, mean, var, last [3] (threshold, coef, z), clipped steps in a row, warm-up norms [warmup].
constexpr int64_t kClipCount = 0, kClipMean = 1, kClipVar = 2, kClipLast = 3, kClipStreak = 6, kClipWarm = 7;
constexpr int64_t kNoiseState = 3;  // NoiseScale: EMA of |G|^2, EMA of tr(Sigma), weight
constexpr double kEps = 1e-6;       // ZClip's eps

// Not NaN and not +-inf (cmath's isfinite is a std:: template on the host and a builtin on the device).
TG_HD inline bool is_finite(double x) { return x >= -DBL_MAX && x <= DBL_MAX; }

// The dtype codes of a figure, read as a double wherever it lives.
enum FigureType { kF64 = 0, kF32, kF16, kBF16 };

TG_HD inline double load_figure(const void* p, int type) {
  switch (type) {
    case kF32: return static_cast<double>(*static_cast<const float*>(p));
    case kF16: return static_cast<double>(static_cast<float>(*static_cast<const c10::Half*>(p)));
    case kBF16: return static_cast<double>(static_cast<float>(*static_cast<const c10::BFloat16*>(p)));
    default: return *static_cast<const double*>(p);
  }
}

struct GuardArgs {
  double sigma;
  int64_t min_history, adopt_after, max_consecutive;  // max_consecutive 0: never trips
  bool count_skipped;
};

// One step of the guard, given each judged series' value and the sums over its history, shifted by its slot 0:
// diff_sum = sum(h - pivot), dev_sq_sum = sum((h - pivot - mean_diff)^2) with mean_diff = diff_sum / count.
// Returns 1 to take the step, 0 to skip it; updates the state in place.
TG_HD inline float guard_step(double* s, int64_t window, int k, const double* values, const double* diff_sum,
                              const double* dev_sq_sum, const GuardArgs& a) {
  double mean[kGuardSeries], stdev[kGuardSeries];
  bool finite[kGuardSeries];
  bool skip = false, all_finite = true;
  for (int i = 0; i < k; ++i) {
    const double n = s[kGuardCount + i];
    const double* hist = s + kGuardHist + i * window;
    const double mean_diff = diff_sum[i] / n;
    stdev[i] = ::sqrt(dev_sq_sum[i] / (n - 1));  // NaN for fewer than 2 values
    mean[i] = hist[0] + mean_diff;
    finite[i] = is_finite(values[i]);
    const bool spike = (values[i] - mean[i]) > a.sigma * stdev[i];
    skip = skip || (n >= static_cast<double>(a.min_history) && (spike || !finite[i]));
    all_finite = all_finite && finite[i];
  }
  const bool take = !skip;
  double* c = s + kGuardCounters;
  const double streak = take ? 0.0 : (all_finite ? c[kStreak] + 1 : c[kStreak]);
  const bool adopt = skip && all_finite && streak >= static_cast<double>(a.adopt_after);
  for (int i = 0; i < k; ++i) {
    const bool enter = a.count_skipped ? finite[i] : finite[i] && (take || adopt);
    double& count = s[kGuardCount + i];
    double& pos = s[kGuardPos + i];
    if (enter) {
      s[kGuardHist + i * window + static_cast<int64_t>(pos)] = values[i];
      pos = ::fmod(pos + 1, static_cast<double>(window));
      count = ::fmin(count + 1, static_cast<double>(window));
    }
    double* last = s + kGuardLast + 4 * i;
    last[0] = values[i];
    last[1] = mean[i];
    last[2] = stdev[i];
    last[3] = values[i] == mean[i] ? 0.0 : (values[i] - mean[i]) / stdev[i];
  }
  const double skip_f = skip ? 1.0 : 0.0;
  const double steps = c[kSteps] + 1;
  const double consecutive = (c[kConsecutive] + 1) * skip_f;
  if (a.max_consecutive > 0 && skip && consecutive >= static_cast<double>(a.max_consecutive)) {
    c[kTripped] = 1.0;
    c[kTripStep] = steps;
    c[kTripSeries] = static_cast<double>(k);
    for (int i = 0; i < kGuardSeries; ++i) {
      for (int j = 0; j < 4; ++j) {
        s[kGuardTrip + 4 * i + j] = i < k ? s[kGuardLast + 4 * i + j] : NAN;
      }
    }
  }
  c[kSteps] = steps;
  c[kSkipped] += skip_f;
  c[kConsecutive] = consecutive;
  c[kStreak] = streak;
  return take ? 1.0f : 0.0f;
}

struct ClipArgs {
  double alpha, z_thresh, clip_factor, max_norm;  // max_norm inf: none
  bool clip_to_mean, skip_update_on_spike;
  int64_t adopt_after;  // 0: never (ZClip's rule)
};

// The first half of an AdaptiveClip step: a finite norm of the warm-up enters its slot. Returns whether it completes
// the warm-up (then the caller sums the warm-up norms for clip_step).
TG_HD inline bool clip_collect(double* s, int64_t warmup, double g) {
  const double n = s[kClipCount];
  const bool collect = is_finite(g) && !(n >= static_cast<double>(warmup));
  if (collect) s[kClipWarm + static_cast<int64_t>(n)] = g;
  return collect && n + 1 == static_cast<double>(warmup);
}

// The rest of the step, given (when init_now) the warm-up norms' mean and population variance. Returns the threshold.
TG_HD inline double clip_step(double* s, int64_t warmup, double g, bool init_now, double warm_mean, double warm_var,
                              const ClipArgs& a) {
  const double n = s[kClipCount];
  const bool finite = is_finite(g);
  const bool ready = n >= static_cast<double>(warmup);
  const bool collect = finite && !ready;
  const double mean = s[kClipMean], var = s[kClipVar];
  const double stdev = ::sqrt(var);
  const double z = (g - mean) / (stdev + kEps);
  const bool spike = ready && z > a.z_thresh;
  const double clip_value = a.clip_to_mean ? mean : (mean + a.z_thresh * stdev / (z / a.z_thresh)) * a.clip_factor;
  // clamp(max=): NaN stays NaN
  const double threshold = spike ? (clip_value > a.max_norm ? a.max_norm : clip_value) : a.max_norm;
  // Clipped steps in a row (finite norms after the warm-up): a non-finite norm neither extends nor ends the streak.
  // From the adopt_after-th on, the statistics take the norm itself, so a lasting change of level is adopted.
  const bool judged = ready && finite;
  const double streak = judged ? (spike ? s[kClipStreak] + 1 : 0.0) : s[kClipStreak];
  const bool adopt = a.adopt_after > 0 && spike && judged && streak >= static_cast<double>(a.adopt_after);
  const double v = spike && !adopt ? clip_value : g;
  const double new_mean = a.alpha * mean + (1 - a.alpha) * v;
  const double new_var = a.alpha * var + (1 - a.alpha) * ((v - new_mean) * (v - new_mean));
  // A variance that would overflow float64 (a norm above ~1e154 adopted) leaves the statistics as they were.
  bool update = ready && finite && is_finite(new_var);
  if (a.skip_update_on_spike) update = update && (!spike || adopt);
  s[kClipCount] = collect ? n + 1 : n;
  s[kClipMean] = init_now ? warm_mean : (update ? new_mean : mean);
  s[kClipVar] = init_now ? warm_var : (update ? new_var : var);
  const double ratio = threshold / (g + kEps);
  s[kClipLast + 0] = threshold;
  s[kClipLast + 1] = ratio > 1.0 ? 1.0 : ratio;  // clamp(max=1): NaN stays NaN
  s[kClipLast + 2] = ready ? z : NAN;
  s[kClipStreak] = streak;
  return threshold;
}

// One NoiseScale step: the unbiased estimates of |G|^2 and tr(Sigma) folded into their EMAs (a step whose estimates
// are not finite is left out).
TG_HD inline void noise_step(double* s, double small, double big, double b_small, double b_big, double ema) {
  const double grad_sq = (b_big * big - b_small * small) / (b_big - b_small);
  const double trace = (small - big) / (1.0 / b_small - 1.0 / b_big);
  const bool ok = is_finite(grad_sq) && is_finite(trace);
  const double decay = ok ? ema : 1.0;
  const double estimates[kNoiseState] = {ok ? grad_sq : 0.0, ok ? trace : 0.0, ok ? 1.0 : 0.0};
  for (int i = 0; i < kNoiseState; ++i) s[i] = s[i] * decay + estimates[i] * (1.0 - ema);
}

// The contract every kernel checks (the fake kernel in policy_ops.py checks the same, for torch.compile).
inline void check_state(const char* op, const at::Tensor& state, bool size_ok) {
  TORCH_CHECK_VALUE(state.scalar_type() == at::kDouble && state.dim() == 1 && state.is_contiguous() && size_ok, op,
                    ": state must be the policy's packed float64 1-d state, got ", state.scalar_type(), " ",
                    state.sizes());
}

inline int check_figure(const char* op, const char* name, const at::Tensor& t, const at::Tensor& state) {
  const at::ScalarType dtype = t.scalar_type();
  TORCH_CHECK_VALUE(t.numel() == 1 && (dtype == at::kDouble || dtype == at::kFloat || dtype == at::kHalf ||
                                       dtype == at::kBFloat16),
                    op, ": ", name, " must be a one-element float16/bfloat16/float32/float64 tensor, got ", dtype, " ",
                    t.sizes());
  TORCH_CHECK_VALUE(t.device() == state.device(), op, ": ", name, " is on ", t.device(), " but the state is on ",
                    state.device());
  return dtype == at::kDouble ? kF64 : dtype == at::kFloat ? kF32 : dtype == at::kHalf ? kF16 : kBF16;
}

inline void check_adopt_after(int64_t adopt_after) {
  TORCH_CHECK_VALUE(adopt_after >= 0, "adaptive_clip_step: adopt_after must be >= 0 (0: never adopt), got ",
                    adopt_after);
}

inline int64_t guard_window(const at::Tensor& state) {
  const int64_t n = state.numel() - kGuardHist;
  check_state("spike_guard_step", state, n >= 2 * kGuardSeries && n % kGuardSeries == 0);
  return n / kGuardSeries;
}

}  // namespace torch_gradstats::policies
