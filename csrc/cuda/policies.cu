// CUDA kernels of the policies' ops: one block per call, on the current stream, reading the step's figures on the
// device (no host read, capturable in a CUDA graph). The block sums a history (or the warm-up norms) in a fixed
// order, then one thread runs the step logic of csrc/policies.h, the same as the CPU kernels'.
#include "policies.h"

#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <optional>

namespace torch_gradstats::policies {

namespace {

constexpr int kThreads = 256;

// The sum of every thread's value, returned to every thread (a fixed tree: the same order on every call).
__device__ double block_sum(double v, double* red) {
  red[threadIdx.x] = v;
  __syncthreads();
  for (int half = kThreads / 2; half > 0; half /= 2) {
    if (threadIdx.x < half) red[threadIdx.x] += red[threadIdx.x + half];
    __syncthreads();
  }
  const double total = red[0];
  __syncthreads();  // red is reused by the next sum
  return total;
}

__global__ void guard_kernel(double* s, int64_t window, int k, const void* grad_norm, int grad_type, const void* loss,
                             int loss_type, GuardArgs args, float* take) {
  __shared__ double red[kThreads];
  double diff_sum[kGuardSeries] = {0.0, 0.0}, dev_sq_sum[kGuardSeries] = {0.0, 0.0};
  for (int i = 0; i < k; ++i) {  // the sums over each history, shifted by its slot 0
    const double* hist = s + kGuardHist + i * window;
    const int64_t n = static_cast<int64_t>(s[kGuardCount + i]);
    const double pivot = hist[0];
    double local = 0.0;
    for (int64_t j = threadIdx.x; j < n; j += kThreads) local += hist[j] - pivot;
    diff_sum[i] = block_sum(local, red);
    const double mean_diff = diff_sum[i] / static_cast<double>(n);
    local = 0.0;
    for (int64_t j = threadIdx.x; j < n; j += kThreads) {
      const double d = (hist[j] - pivot) - mean_diff;
      local += d * d;
    }
    dev_sq_sum[i] = block_sum(local, red);
  }
  if (threadIdx.x == 0) {  // every thread has read the state: one writes it
    const double values[kGuardSeries] = {load_figure(grad_norm, grad_type), k > 1 ? load_figure(loss, loss_type) : 0.0};
    *take = guard_step(s, window, k, values, diff_sum, dev_sq_sum, args);
  }
}

__global__ void clip_kernel(double* s, int64_t warmup, const void* grad_norm, int grad_type, ClipArgs args,
                            double* threshold) {
  __shared__ double red[kThreads];
  __shared__ bool init_now;
  const double g = load_figure(grad_norm, grad_type);
  if (threadIdx.x == 0) init_now = clip_collect(s, warmup, g);
  __syncthreads();
  double warm_mean = 0.0, warm_var = 0.0;
  if (init_now) {  // the same for every thread: the warm-up's mean and population variance
    const double* warm = s + kClipWarm;
    double local = 0.0;
    for (int64_t j = threadIdx.x; j < warmup; j += kThreads) local += warm[j];
    warm_mean = block_sum(local, red) / static_cast<double>(warmup);
    local = 0.0;
    for (int64_t j = threadIdx.x; j < warmup; j += kThreads) local += (warm[j] - warm_mean) * (warm[j] - warm_mean);
    warm_var = block_sum(local, red) / static_cast<double>(warmup);
  }
  if (threadIdx.x == 0) *threshold = clip_step(s, warmup, g, init_now, warm_mean, warm_var, args);
}

__global__ void noise_kernel(double* s, const void* small_sq, int small_type, const void* big_sq, int big_type,
                             double b_small, double b_big, double ema) {
  noise_step(s, load_figure(small_sq, small_type), load_figure(big_sq, big_type), b_small, b_big, ema);
}

at::Tensor spike_guard_step_cuda(const at::Tensor& state, const at::Tensor& grad_norm,
                                 const std::optional<at::Tensor>& loss, double sigma, int64_t min_history,
                                 int64_t adopt_after, int64_t max_consecutive, bool count_skipped) {
  const int64_t window = guard_window(state);
  const int grad_type = check_figure("spike_guard_step", "grad_norm", grad_norm, state);
  const int loss_type = loss.has_value() ? check_figure("spike_guard_step", "loss", *loss, state) : kF64;
  const c10::cuda::CUDAGuard device_guard(state.device());
  at::Tensor take = at::empty({}, state.options().dtype(at::kFloat));
  const GuardArgs args{sigma, min_history, adopt_after, max_consecutive, count_skipped};
  guard_kernel<<<1, kThreads, 0, c10::cuda::getCurrentCUDAStream().stream()>>>(
      state.data_ptr<double>(), window, loss.has_value() ? 2 : 1, grad_norm.const_data_ptr(), grad_type,
      loss.has_value() ? loss->const_data_ptr() : nullptr, loss_type, args, take.data_ptr<float>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return take;
}

at::Tensor adaptive_clip_step_cuda(const at::Tensor& state, const at::Tensor& grad_norm, double alpha,
                                   double z_thresh, double clip_factor, double max_norm, bool clip_to_mean,
                                   bool skip_update_on_spike, int64_t adopt_after) {
  check_state("adaptive_clip_step", state, state.numel() > kClipWarm);
  check_adopt_after(adopt_after);
  const int grad_type = check_figure("adaptive_clip_step", "grad_norm", grad_norm, state);
  const c10::cuda::CUDAGuard device_guard(state.device());
  at::Tensor threshold = at::empty({}, state.options());
  const ClipArgs args{alpha, z_thresh, clip_factor, max_norm, clip_to_mean, skip_update_on_spike, adopt_after};
  clip_kernel<<<1, kThreads, 0, c10::cuda::getCurrentCUDAStream().stream()>>>(
      state.data_ptr<double>(), state.numel() - kClipWarm, grad_norm.const_data_ptr(), grad_type, args,
      threshold.data_ptr<double>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return threshold;
}

void noise_scale_step_cuda(const at::Tensor& state, const at::Tensor& small_sq, const at::Tensor& big_sq,
                           double b_small, double b_big, double ema) {
  check_state("noise_scale_step", state, state.numel() == kNoiseState);
  const int small_type = check_figure("noise_scale_step", "small_sq", small_sq, state);
  const int big_type = check_figure("noise_scale_step", "big_sq", big_sq, state);
  const c10::cuda::CUDAGuard device_guard(state.device());
  noise_kernel<<<1, 1, 0, c10::cuda::getCurrentCUDAStream().stream()>>>(
      state.data_ptr<double>(), small_sq.const_data_ptr(), small_type, big_sq.const_data_ptr(), big_type, b_small,
      b_big, ema);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace

TORCH_LIBRARY_IMPL(torch_gradstats, CUDA, m) {
  m.impl("spike_guard_step", TORCH_FN(spike_guard_step_cuda));
  m.impl("adaptive_clip_step", TORCH_FN(adaptive_clip_step_cuda));
  m.impl("noise_scale_step", TORCH_FN(noise_scale_step_cuda));
}

}  // namespace torch_gradstats::policies
