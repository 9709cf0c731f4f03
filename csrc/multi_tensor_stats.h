// The op every layer relies on: torch_gradstats::multi_tensor_stats(Tensor[] tensors)
//   -> (Tensor sumsq, Tensor amax, Tensor counts)
// and its overload multi_tensor_stats.histogram, which returns exponent_histogram as well, from the same read.
// The schema is defined in Python (torch_gradstats/ops/op.py); each backend registers its kernel with
// TORCH_LIBRARY_IMPL in its own source file. See docs/design.md for the contract.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/core/ivalue.h>
#include <ATen/core/stack.h>

#include <tuple>
#include <utility>
#include <vector>

namespace c10 {
class OperatorHandle;
}

namespace torch_gradstats {

// sumsq float64 [N], amax float64 [N], counts int64 [N, 3] (zeros, NaNs, Infs).
using Stats = std::tuple<at::Tensor, at::Tensor, at::Tensor>;

// Column of `counts` for each class of element.
enum CountColumn : int { kZero = 0, kNan = 1, kInf = 2, kNumCounts = 3 };

// exponent_histogram, int64 [N, kHistogramBuckets]: bucket b of row i counts the finite non-zero elements of tensor
// i with floor(log2 |x|) == b + kHistogramMinExponent; a float64 value below 2^-149 counts in bucket 0, one at or
// above 2^128 in the last bucket. Zeros, NaNs and Infs are in `counts` only. (float32's range, subnormals included.)
constexpr int64_t kHistogramMinExponent = -149;
constexpr int64_t kHistogramBuckets = 277;

// The op's list of tensors, borrowed: read where the caller keeps them, no reference count touched.
// Why: for a kernel taking at::TensorList the dispatcher copies the boxed Tensor[] into a new vector, one reference
// taken and dropped per tensor, and dropping the reference of a tensor that has a Python object goes through the
// GIL: together more host time than the kernel's own work per tensor. So the kernels are registered boxed
// (boxed_kernel below) and read the dispatcher's stack in place; C++ callers pass a list or vector of tensors.
class TensorRefs {
 public:
  TensorRefs(at::TensorList tensors) : tensors_(tensors.data()), size_(tensors.size()) {}  // NOLINT: implicit
  TensorRefs(const std::vector<at::Tensor>& tensors)                                      // NOLINT: implicit
      : tensors_(tensors.data()), size_(tensors.size()) {}
  // The elements of a boxed Tensor[] (every one a tensor: the schema says so, and the dispatcher checked it).
  explicit TensorRefs(c10::ArrayRef<c10::IValue> list) : ivalues_(list.data()), size_(list.size()) {}
  // Tensors held elsewhere (by Python objects: csrc/python_module.cpp).
  explicit TensorRefs(c10::ArrayRef<const at::Tensor*> ptrs) : ptrs_(ptrs.data()), size_(ptrs.size()) {}

  size_t size() const { return size_; }
  bool empty() const { return size_ == 0; }
  const at::Tensor& operator[](size_t i) const {
    if (tensors_ != nullptr) return tensors_[i];
    return ptrs_ != nullptr ? *ptrs_[i] : ivalues_[i].toTensor();
  }

 private:
  const at::Tensor* tensors_ = nullptr;
  const at::Tensor* const* ptrs_ = nullptr;
  const c10::IValue* ivalues_ = nullptr;
  size_t size_ = 0;
};

// A backend's kernel. With `histogram` non-null it also allocates *histogram and fills it (the overload).
using Kernel = Stats (*)(const TensorRefs& tensors, at::Tensor* histogram);

// Throws (ValueError / TypeError in Python) naming the index of the first tensor that breaks the input
// contract: empty list, non-floating or unsupported dtype, non-strided layout, tensors on different devices.
void check_inputs(const TensorRefs& tensors);

// Allocates the three outputs for `n` tensors on `device`.
Stats empty_stats(int64_t n, const at::Device& device);
// The histogram output for `n` tensors on `device`, zeroed (kernels add into it).
at::Tensor zero_histogram(int64_t n, const at::Device& device);

// The inputs a kernel cannot read in place as a flat span: those for which t.is_non_overlapping_and_dense() is false
// (expanded, sliced with gaps, overlapping as_strided views). A kernel reads every other tensor in place (that one
// flag is all the hot path pays) and, for these, the tensor read(t, i) returns, then calls scale(out) on its outputs:
//  * a dimension of stride 0 and size > 1 (a broadcast: expand, stride-0 as_strided) repeats the same elements, so
//    it is left out of what is read and scale() multiplies that tensor's sumsq and counts by the sizes left out (amax
//    is unchanged): x.expand(2**40) costs what x does, and nothing of its size is allocated;
//  * the rest is read in place when dense, else from a contiguous copy. A view whose elements overlap (as_strided
//    with overlapping strides) is copied too, giving every element its multiplicity, unless the copy would be both
//    larger than kMaxOverlapCopyBytes and more than twice the memory the view addresses: that is a ValueError
//    naming the tensor. A copy whose allocation fails is an error naming the tensor, its shape, dtype and the bytes.
class NonDenseInputs {
 public:
  static constexpr int64_t kMaxOverlapCopyBytes = int64_t{64} << 20;

  // What to read for tensors[i] == t; the reference stays valid until the next call of read or the end of this object.
  const at::Tensor& read(const at::Tensor& t, size_t i);
  // Multiplies sumsq[i], counts[i] and histogram row i (when given) by the repeat of every tensor that had broadcast
  // dimensions (the CPU kernel; the CUDA kernel applies repeats() in its finalize kernel instead).
  void scale(const Stats& out, const at::Tensor* histogram) const;
  // (index, repeat > 1) of each tensor read so far that had broadcast dimensions, in the order read.
  const std::vector<std::pair<int64_t, int64_t>>& repeats() const { return repeats_; }

 private:
  std::vector<at::Tensor> read_;                         // views and copies, alive until the kernel has read them
  std::vector<std::pair<int64_t, int64_t>> repeats_;     // (index, repeat > 1)
};

// A backend's kernel as the dispatcher calls it, boxed: (Tensor[] tensors) on the stack in, the outputs out: three
// for multi_tensor_stats, four for multi_tensor_stats.histogram. Register with
// torch::CppFunction::makeFromBoxedFunction<&boxed_kernel<&the_kernel, false>>() (true for the overload).
template <Kernel kKernel, bool kHistogram>
void boxed_kernel(const c10::OperatorHandle& /*op*/, torch::jit::Stack* stack) {
  at::Tensor histogram;
  Stats out = kKernel(TensorRefs(stack->back().toListRef()), kHistogram ? &histogram : nullptr);
  torch::jit::drop(*stack, 1);
  torch::jit::push(*stack, std::move(std::get<0>(out)), std::move(std::get<1>(out)), std::move(std::get<2>(out)));
  if constexpr (kHistogram) {
    torch::jit::push(*stack, std::move(histogram));
  }
}

// The fused CPU kernel (csrc/cpu/). Registered for the CPU dispatch key, both overloads.
Stats multi_tensor_stats_cpu(const TensorRefs& tensors, at::Tensor* histogram);

// The fused CUDA kernel where this build has one (csrc/cuda/ sets it while the library loads), else nullptr. Read by
// the eager Python entry point that skips the dispatcher (csrc/python_module.cpp).
Kernel cuda_kernel();
void set_cuda_kernel(Kernel kernel);

// The instruction set the CPU kernel runs with on this machine: "AVX512", "AVX2" or "DEFAULT" (the baseline).
// Follows ATen's choice, so ATEN_CPU_CAPABILITY=default (set before torch is loaded) forces the baseline.
const char* cpu_kernel_capability();
// How that kernel counts the exponent histogram (the AVX512 kernel with or without GFNI, see cpu/stats_kernel_impl.h).
const char* cpu_histogram_counting();

}  // namespace torch_gradstats
