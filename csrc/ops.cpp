// Dispatch glue shared by every backend: the input contract and the output allocation.
#include "multi_tensor_stats.h"

#include <ATen/ATen.h>
#include <ATen/EmptyTensor.h>
#include <ATen/core/LegacyTypeDispatch.h>
#include <c10/util/Exception.h>
#include <c10/util/SmallVector.h>
#include <c10/util/safe_numerics.h>

#include <limits>
#include <new>
#include <string>

namespace torch_gradstats {

namespace {

// The storage must hold every element the view addresses: a storage freed or shrunk with
// untyped_storage().resize_() would otherwise be read out of bounds. Metadata only.
void check_storage(const at::Tensor& t, size_t i) {
  if (t.numel() == 0 || !t.has_storage() || t.device().is_meta()) {
    return;
  }
  int64_t last = t.storage_offset();
  for (int64_t d = 0; d < t.dim(); ++d) {
    last += (t.size(d) - 1) * t.stride(d);
  }
  const int64_t needed = (last + 1) * static_cast<int64_t>(t.element_size());
  const int64_t have = static_cast<int64_t>(t.storage().nbytes());
  TORCH_CHECK_VALUE(have >= needed, "multi_tensor_stats: tensors[", i, "] needs ", needed,
                    " bytes of storage but its storage holds ", have,
                    " (it was freed or resized, e.g. by untyped_storage().resize_(0)); pass a tensor with allocated "
                    "data");
}

}  // namespace

void check_inputs(const TensorRefs& tensors) {
  TORCH_CHECK_VALUE(!tensors.empty(), "multi_tensor_stats: expected at least one tensor, got an empty list");
  const at::Device device = tensors[0].device();
  for (size_t i = 0; i < tensors.size(); ++i) {
    const at::Tensor& t = tensors[i];
    TORCH_CHECK_VALUE(t.defined(), "multi_tensor_stats: tensors[", i, "] is undefined");
    TORCH_CHECK_VALUE(!t.is_nested(), "multi_tensor_stats: tensors[", i,
                      "] is a nested tensor; pass its components instead (t.unbind())");
    TORCH_CHECK_VALUE(t.layout() == at::kStrided, "multi_tensor_stats: tensors[", i, "] has layout ", t.layout(),
                      "; only strided (dense) tensors are supported, convert it with .to_dense()");
    const at::ScalarType dtype = t.scalar_type();
    TORCH_CHECK_TYPE(dtype == at::kHalf || dtype == at::kBFloat16 || dtype == at::kFloat || dtype == at::kDouble,
                     "multi_tensor_stats: tensors[", i, "] has dtype ", dtype,
                     "; expected float16, bfloat16, float32 or float64");
    TORCH_CHECK_VALUE(t.device() == device, "multi_tensor_stats: tensors[", i, "] is on ", t.device(),
                      " but tensors[0] is on ", device,
                      "; all tensors of one call must be on one device (group them by device)");
    check_storage(t, i);
  }
}

namespace {
Kernel g_cuda_kernel = nullptr;  // set once by the CUDA source's registration, while the library loads
}  // namespace

Kernel cuda_kernel() { return g_cuda_kernel; }
void set_cuda_kernel(Kernel kernel) { g_cuda_kernel = kernel; }

Stats empty_stats(int64_t n, const at::Device& device) {
  if (device.is_cpu()) {  // without the dispatcher: part of the host time that a call on a short list costs
    return {at::detail::empty_cpu({n}, at::kDouble), at::detail::empty_cpu({n}, at::kDouble),
            at::detail::empty_cpu({n, kNumCounts}, at::kLong)};
  }
  const auto f64 = at::TensorOptions().dtype(at::kDouble).device(device);
  return {at::empty({n}, f64), at::empty({n}, f64), at::empty({n, kNumCounts}, f64.dtype(at::kLong))};
}

at::Tensor zero_histogram(int64_t n, const at::Device& device) {
  return at::zeros({n, kHistogramBuckets}, at::TensorOptions().dtype(at::kLong).device(device));
}

namespace {

// "tensors[i] (shape [..], dtype .., strides [..])": how the errors about a non-dense input name it.
std::string describe(const at::Tensor& t, size_t i) {
  return c10::str("tensors[", i, "] (shape ", t.sizes(), ", dtype ", t.scalar_type(), ", strides ", t.strides(), ")");
}

}  // namespace

const at::Tensor& NonDenseInputs::read(const at::Tensor& t, size_t i) {
  if (t.numel() == 0) {
    return t;  // nothing to read
  }
  // The views and copies made here are the kernel's own: no autograd history (the direct entry point calls the
  // kernels without the dispatcher, so above the Autograd keys).
  const at::AutoDispatchBelowADInplaceOrView below_autograd;
  c10::SmallVector<int64_t, 8> sizes;
  c10::SmallVector<int64_t, 8> strides;
  int64_t repeat = 1;  // <= t.numel(): no overflow
  for (int64_t d = 0; d < t.dim(); ++d) {
    if (t.stride(d) == 0) {
      repeat *= t.size(d);
    } else if (t.size(d) != 1) {
      sizes.push_back(t.size(d));
      strides.push_back(t.stride(d));
    }
  }
  at::Tensor distinct = t;
  if (repeat != 1) {
    repeats_.emplace_back(static_cast<int64_t>(i), repeat);
    distinct = t.as_strided(sizes, strides);  // the same storage offset
    if (distinct.is_non_overlapping_and_dense()) {
      read_.push_back(std::move(distinct));
      return read_.back();
    }
  }
  // A copy. Its bytes, and those the view addresses (no overflow: check_inputs found them inside the storage).
  const auto elem_size = static_cast<int64_t>(t.element_size());
  int64_t bytes = 0;
  if (c10::mul_overflows(distinct.numel(), elem_size, &bytes)) {
    bytes = std::numeric_limits<int64_t>::max();
  }
  int64_t span = 1;
  for (size_t d = 0; d < sizes.size(); ++d) {
    span += (sizes[d] - 1) * strides[d];
  }
  const int64_t span_bytes = span * elem_size;
  TORCH_CHECK_VALUE(bytes <= kMaxOverlapCopyBytes || bytes / 2 <= span_bytes, "multi_tensor_stats: ", describe(t, i),
                    " is a view whose elements overlap in memory (as_strided with overlapping strides): reading it "
                    "would copy ", bytes, " bytes, ", bytes / span_bytes, " times the ", span_bytes,
                    " bytes it addresses. Pass a copy made on purpose (t.contiguous()), or the distinct elements "
                    "once each");
  const auto failed = [&](const char* why) {
    return c10::str("multi_tensor_stats: ", describe(t, i), " is not dense and is read from a contiguous copy: ",
                    "allocating its ", bytes, " bytes failed: ", why);
  };
  try {
    read_.push_back(distinct.contiguous());
  } catch (const c10::OutOfMemoryError& e) {
    TORCH_CHECK_WITH(OutOfMemoryError, false, failed(e.what_without_backtrace()));
  } catch (const c10::Error& e) {
    TORCH_CHECK(false, failed(e.what_without_backtrace()));
  } catch (const std::bad_alloc& e) {
    TORCH_CHECK(false, failed(e.what()));
  }
  return read_.back();
}

void NonDenseInputs::scale(const Stats& out, const at::Tensor* histogram) const {
  if (repeats_.empty()) {
    return;
  }
  const at::Tensor& sumsq = std::get<0>(out);
  const at::Tensor& counts = std::get<2>(out);
  if (sumsq.is_cpu()) {
    double* sumsq_out = sumsq.mutable_data_ptr<double>();
    int64_t* counts_out = counts.mutable_data_ptr<int64_t>();
    int64_t* hist_out = histogram != nullptr ? histogram->mutable_data_ptr<int64_t>() : nullptr;
    for (const auto& [i, repeat] : repeats_) {
      sumsq_out[i] *= static_cast<double>(repeat);  // NaN and inf stay what they are
      for (int64_t c = 0; c < kNumCounts; ++c) {
        counts_out[i * kNumCounts + c] *= repeat;  // <= the tensor's numel: no overflow
      }
      for (int64_t b = 0; hist_out != nullptr && b < kHistogramBuckets; ++b) {
        hist_out[i * kHistogramBuckets + b] *= repeat;  // likewise
      }
    }
    return;
  }
  const at::AutoDispatchBelowADInplaceOrView below_autograd;
  for (const auto& [i, repeat] : repeats_) {
    sumsq.narrow(0, i, 1).mul_(static_cast<double>(repeat));
    counts.narrow(0, i, 1).mul_(repeat);  // integer arithmetic: exact
    if (histogram != nullptr) {
      histogram->narrow(0, i, 1).mul_(repeat);
    }
  }
}

}  // namespace torch_gradstats
