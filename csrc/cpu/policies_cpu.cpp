// CPU kernels of the policies' ops: one call reads the step's figures and updates the packed state in place
// (csrc/policies.h holds the step logic; torch_gradstats/ops/policy_ops.py the schemas and the pure-PyTorch kernels).
#include "policies.h"

#include <ATen/EmptyTensor.h>
#include <torch/library.h>

#include <optional>

namespace torch_gradstats::policies {

namespace {

double read(const at::Tensor& t, int type) { return load_figure(t.const_data_ptr(), type); }

at::Tensor spike_guard_step_cpu(const at::Tensor& state, const at::Tensor& grad_norm,
                                const std::optional<at::Tensor>& loss, double sigma, int64_t min_history,
                                int64_t adopt_after, int64_t max_consecutive, bool count_skipped) {
  const int64_t window = guard_window(state);
  double values[kGuardSeries];
  values[0] = read(grad_norm, check_figure("spike_guard_step", "grad_norm", grad_norm, state));
  const int k = loss.has_value() ? 2 : 1;
  if (loss.has_value()) values[1] = read(*loss, check_figure("spike_guard_step", "loss", *loss, state));
  double* s = state.data_ptr<double>();
  double diff_sum[kGuardSeries], dev_sq_sum[kGuardSeries];
  for (int i = 0; i < k; ++i) {  // the sums over each history, shifted by its slot 0
    const double* hist = s + kGuardHist + i * window;
    const int64_t n = static_cast<int64_t>(s[kGuardCount + i]);
    double sum = 0.0;
    for (int64_t j = 0; j < n; ++j) sum += hist[j] - hist[0];
    const double mean_diff = sum / static_cast<double>(n);
    double sq = 0.0;
    for (int64_t j = 0; j < n; ++j) {
      const double d = (hist[j] - hist[0]) - mean_diff;
      sq += d * d;
    }
    diff_sum[i] = sum;
    dev_sq_sum[i] = sq;
  }
  const GuardArgs args{sigma, min_history, adopt_after, max_consecutive, count_skipped};
  at::Tensor take = at::detail::empty_cpu(c10::IntArrayRef(), at::kFloat);
  *take.data_ptr<float>() = guard_step(s, window, k, values, diff_sum, dev_sq_sum, args);
  return take;
}

at::Tensor adaptive_clip_step_cpu(const at::Tensor& state, const at::Tensor& grad_norm, double alpha, double z_thresh,
                                  double clip_factor, double max_norm, bool clip_to_mean, bool skip_update_on_spike,
                                  int64_t adopt_after) {
  check_state("adaptive_clip_step", state, state.numel() > kClipWarm);
  check_adopt_after(adopt_after);
  const int64_t warmup = state.numel() - kClipWarm;
  const double g = read(grad_norm, check_figure("adaptive_clip_step", "grad_norm", grad_norm, state));
  double* s = state.data_ptr<double>();
  const bool init_now = clip_collect(s, warmup, g);
  double warm_mean = 0.0, warm_var = 0.0;
  if (init_now) {  // the warm-up's mean and population variance, as torch's mean() of the buffer and of its squares
    const double* warm = s + kClipWarm;
    for (int64_t j = 0; j < warmup; ++j) warm_mean += warm[j];
    warm_mean /= static_cast<double>(warmup);
    for (int64_t j = 0; j < warmup; ++j) warm_var += (warm[j] - warm_mean) * (warm[j] - warm_mean);
    warm_var /= static_cast<double>(warmup);
  }
  const ClipArgs args{alpha, z_thresh, clip_factor, max_norm, clip_to_mean, skip_update_on_spike, adopt_after};
  at::Tensor threshold = at::detail::empty_cpu(c10::IntArrayRef(), at::kDouble);
  *threshold.data_ptr<double>() = clip_step(s, warmup, g, init_now, warm_mean, warm_var, args);
  return threshold;
}

void noise_scale_step_cpu(const at::Tensor& state, const at::Tensor& small_sq, const at::Tensor& big_sq,
                          double b_small, double b_big, double ema) {
  check_state("noise_scale_step", state, state.numel() == kNoiseState);
  const double small = read(small_sq, check_figure("noise_scale_step", "small_sq", small_sq, state));
  const double big = read(big_sq, check_figure("noise_scale_step", "big_sq", big_sq, state));
  noise_step(state.data_ptr<double>(), small, big, b_small, b_big, ema);
}

}  // namespace

TORCH_LIBRARY_IMPL(torch_gradstats, CPU, m) {
  m.impl("spike_guard_step", TORCH_FN(spike_guard_step_cpu));
  m.impl("adaptive_clip_step", TORCH_FN(adaptive_clip_step_cpu));
  m.impl("noise_scale_step", TORCH_FN(noise_scale_step_cpu));
}

}  // namespace torch_gradstats::policies
