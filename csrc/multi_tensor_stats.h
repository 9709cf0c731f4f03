// The op every layer relies on: torch_gradstats::multi_tensor_stats(Tensor[] tensors)
//   -> (Tensor sumsq, Tensor amax, Tensor counts)
// The schema is defined in Python (torch_gradstats/ops.py); each backend registers its kernel with
// TORCH_LIBRARY_IMPL in its own source file. See docs/design.md for the contract.
#pragma once

#include <ATen/core/Tensor.h>

#include <tuple>

namespace torch_gradstats {

// sumsq float64 [N], amax float64 [N], counts int64 [N, 3] (zeros, NaNs, Infs).
using Stats = std::tuple<at::Tensor, at::Tensor, at::Tensor>;

// Column of `counts` for each class of element.
enum CountColumn : int { kZero = 0, kNan = 1, kInf = 2, kNumCounts = 3 };

// Throws (ValueError / TypeError in Python) naming the index of the first tensor that breaks the input
// contract: empty list, non-floating or unsupported dtype, non-strided layout, tensors on different devices.
void check_inputs(at::TensorList tensors);

// Allocates the three outputs for `n` tensors on `device`.
Stats empty_stats(int64_t n, const at::Device& device);

// The fused CPU kernel (csrc/cpu/). Registered for the CPU dispatch key.
Stats multi_tensor_stats_cpu(at::TensorList tensors);

// The instruction set the CPU kernel runs with on this machine: "AVX512", "AVX2" or "DEFAULT" (the baseline).
// Follows ATen's choice, so ATEN_CPU_CAPABILITY=default (set before torch is loaded) forces the baseline.
const char* cpu_kernel_capability();

}  // namespace torch_gradstats
