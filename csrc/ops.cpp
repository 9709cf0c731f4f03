// Dispatch glue shared by every backend: the input contract and the output allocation.
#include "multi_tensor_stats.h"

#include <ATen/ATen.h>
#include <ATen/EmptyTensor.h>
#include <c10/util/Exception.h>

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

}  // namespace torch_gradstats
