// The Python module torch_gradstats._C. The kernels register themselves with the dispatcher from static
// initialisers (TORCH_LIBRARY_IMPL), and importing this module is what loads them. Its functions:
//   cpu_capability()    the instruction set the CPU kernel runs with ("AVX512", "AVX2" or "DEFAULT");
//   cuda_stats(list)    the CUDA kernel called on a list of plain CUDA tensors without the dispatcher, or None;
//   collect_grads(...)  grad_stats's walk over (name, parameter) pairs, or None.
// Compiled only by setup.py; the CMake build produces the same library without Python.
#include <Python.h>

#include <ATen/PythonTorchFunctionTLS.h>
#include <ATen/record_function.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <c10/core/impl/TorchDispatchModeTLS.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/python_variable.h>

#include <vector>

#include "multi_tensor_stats.h"

namespace {

PyObject* cpu_capability(PyObject* /*self*/, PyObject* /*args*/) {
  return PyUnicode_FromString(torch_gradstats::cpu_kernel_capability());
}

// A tensor the CUDA kernel can read exactly as the dispatcher would route it: a plain torch.Tensor (no subclass, no
// Python or functionalization key), strided, on a CUDA device.
bool plain_cuda(PyObject* obj) {
  if (!THPVariable_CheckExact(obj)) return false;
  const at::Tensor& t = THPVariable_Unpack(obj);
  const c10::DispatchKeySet keys = t.key_set();
  return t.is_cuda() && t.layout() == at::kStrided && !keys.has(c10::DispatchKey::Python) &&
         !keys.has(c10::DispatchKey::Functionalize);
}

// Why: a call through torch.ops turns the list into a boxed Tensor[] first, taking a reference to every tensor and
// dropping it afterwards through the GIL; that bookkeeping costs more host time per tensor than the kernel's own.
// Here the tensors are borrowed from the list, which the caller holds and this function never releases the GIL for.
// Anything the dispatcher would treat differently returns None, and the caller takes torch.ops: a tensor that is not
// a plain CUDA tensor, an active torch function or dispatch mode, or thread-local dispatch keys (vmap, fake
// tensors). Errors are the kernel's own (ValueError / TypeError naming the tensor's index).
PyObject* cuda_stats(PyObject* /*self*/, PyObject* list) {
  HANDLE_TH_ERRORS
  const torch_gradstats::Kernel kernel = torch_gradstats::cuda_kernel();
  if (kernel == nullptr || !PyList_CheckExact(list) || PyList_GET_SIZE(list) == 0 ||
      at::impl::torch_function_mode_enabled() || c10::impl::TorchDispatchModeTLS::any_modes_set() ||
      !(c10::impl::tls_local_dispatch_key_set().included_ - c10::default_included_set).empty()) {
    Py_RETURN_NONE;
  }
  const Py_ssize_t n = PyList_GET_SIZE(list);
  thread_local std::vector<const at::Tensor*> refs;  // reused: no allocation in steady state
  refs.resize(size_t(n));
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* obj = PyList_GET_ITEM(list, i);
    if (!plain_cuda(obj)) Py_RETURN_NONE;
    refs[size_t(i)] = &THPVariable_Unpack(obj);
  }
  RECORD_FUNCTION("torch_gradstats::multi_tensor_stats", c10::ArrayRef<const c10::IValue>{});
  auto [sumsq, amax, counts] = kernel(torch_gradstats::TensorRefs(c10::ArrayRef<const at::Tensor*>(refs)));
  return Py_BuildValue("(NNN)", THPVariable_Wrap(std::move(sumsq)), THPVariable_Wrap(std::move(amax)),
                       THPVariable_Wrap(std::move(counts)));
  END_HANDLE_TH_ERRORS
}

// grad_stats's walk over (name, parameter) pairs, without per-parameter Python: the names, the gradients that are
// not None, and their element counts, as (list[str], list[Tensor], tuple[int]). None when any pair needs the Python
// walk, which handles every input form, names errors and recognises DTensors: an item that is not a (str, tensor)
// tuple, a parameter that is neither a torch.Tensor nor a torch.nn.Parameter (a subclass may redefine .grad), a
// gradient that is not a plain tensor, or an active torch function mode. `items` is a list; nothing is changed.
PyObject* collect_grads(PyObject* /*self*/, PyObject* items) {
  HANDLE_TH_ERRORS
  if (!PyList_Check(items)) {
    PyErr_SetString(PyExc_TypeError, "collect_grads: expected a list of (name, parameter) pairs");
    return nullptr;
  }
  if (at::impl::torch_function_mode_enabled()) Py_RETURN_NONE;
  const Py_ssize_t n = PyList_GET_SIZE(items);
  PyObject* names = PyList_New(0);
  PyObject* grads = PyList_New(0);
  PyObject* numels = PyList_New(0);
  const auto done = [&](PyObject* result) {  // releases the lists unless they are in `result`
    Py_DECREF(names);
    Py_DECREF(grads);
    Py_DECREF(numels);
    return result;
  };
  if (names == nullptr || grads == nullptr || numels == nullptr) {
    Py_XDECREF(names);
    Py_XDECREF(grads);
    Py_XDECREF(numels);
    return nullptr;
  }
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* item = PyList_GET_ITEM(items, i);
    if (!PyTuple_CheckExact(item) || PyTuple_GET_SIZE(item) != 2) return done(Py_NewRef(Py_None));
    PyObject* name = PyTuple_GET_ITEM(item, 0);
    PyObject* param = PyTuple_GET_ITEM(item, 1);
    if (!PyUnicode_CheckExact(name) || !THPVariable_CheckExact(param)) {  // CheckExact: torch.Tensor or Parameter
      return done(Py_NewRef(Py_None));
    }
    const at::Tensor& grad = THPVariable_Unpack(param).grad();
    if (!grad.defined()) continue;
    PyObject* grad_obj = THPVariable_Wrap(grad);  // what `param.grad` returns
    if (grad_obj == nullptr) return done(nullptr);
    if (!THPVariable_CheckExact(grad_obj)) {
      Py_DECREF(grad_obj);
      return done(Py_NewRef(Py_None));
    }
    PyObject* numel = PyLong_FromLongLong(grad.numel());
    const bool ok = numel != nullptr && PyList_Append(names, name) == 0 && PyList_Append(grads, grad_obj) == 0 &&
                    PyList_Append(numels, numel) == 0;
    Py_DECREF(grad_obj);
    Py_XDECREF(numel);
    if (!ok) return done(nullptr);
  }
  PyObject* numel_tuple = PyList_AsTuple(numels);
  if (numel_tuple == nullptr) return done(nullptr);
  PyObject* result = PyTuple_Pack(3, names, grads, numel_tuple);
  Py_DECREF(numel_tuple);
  return done(result);
  END_HANDLE_TH_ERRORS
}

PyMethodDef methods[] = {
    {"cpu_capability", cpu_capability, METH_NOARGS,
     "Instruction set of the CPU kernel on this machine: 'AVX512', 'AVX2' or 'DEFAULT' (follows ATen's choice, so "
     "ATEN_CPU_CAPABILITY=default forces the baseline)."},
    {"cuda_stats", cuda_stats, METH_O,
     "(sumsq, amax, counts) of a list of plain CUDA tensors from the CUDA kernel, called without the dispatcher "
     "(no per-tensor reference counting); None when the list needs the dispatcher (use torch.ops then)."},
    {"collect_grads", collect_grads, METH_O,
     "collect_grads(items: list) -> (names, grads, numels) | None: the (name, parameter) pairs' "
     "gradients that are not None, walked in C++; None when a pair needs the Python walk."},
    {nullptr, nullptr, 0, nullptr}};

PyModuleDef module = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, methods};

}  // namespace

PyMODINIT_FUNC PyInit__C(void) { return PyModule_Create(&module); }
