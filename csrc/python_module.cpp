// The Python module torch_gradstats._C. The kernels register themselves with the dispatcher from static
// initialisers (TORCH_LIBRARY_IMPL), and importing this module is what loads them. Its functions:
//   cpu_capability()    the instruction set the CPU kernel runs with ("AVX512", "AVX2" or "DEFAULT");
//   cpu_histogram_counting()  how that kernel counts the exponent histogram, in words;
//   direct_stats(list)  the CPU or CUDA kernel called on a list of plain tensors without the dispatcher, or None;
//   direct_histogram_stats(list)  the same for the histogram overload (a plain 4-tuple), or None;
//   set_stats_type(t)   the NamedTuple direct_stats returns (torch_gradstats.TensorStats);
//   collect_grads(...)  grad_stats's walk over its parameters, or None.
// Compiled only by setup.py; the CMake build produces the same library without Python.
#include <Python.h>

#include <ATen/PythonTorchFunctionTLS.h>
#include <ATen/record_function.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <c10/core/impl/TorchDispatchModeTLS.h>
#include <c10/util/SmallVector.h>
#include <c10/util/safe_numerics.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/python_variable.h>
#include <pybind11/pybind11.h>

#include <charconv>
#include <limits>

#include "multi_tensor_stats.h"

namespace {

PyObject* cpu_capability(PyObject* /*self*/, PyObject* /*args*/) {
  return PyUnicode_FromString(torch_gradstats::cpu_kernel_capability());
}

PyObject* cpu_histogram_counting(PyObject* /*self*/, PyObject* /*args*/) {
  return PyUnicode_FromString(torch_gradstats::cpu_histogram_counting());
}

// A tensor that the dispatcher would send to the kernel of its device type as it is: a plain torch.Tensor (no
// subclass), strided, whose dispatch keys are those of a dense tensor and nothing else. An allow-list: any other
// key (Python, Functionalize, ZeroTensor, a functorch wrapper, sparse, quantized, ...) changes what the op sees.
bool plain_tensor(PyObject* obj) {
  // Negative (a negated view) is served too: every statistic ignores the sign.
  static const c10::DispatchKeySet kPlain({c10::DispatchKey::Dense, c10::DispatchKey::ADInplaceOrView,
                                           c10::DispatchKey::AutogradFunctionality, c10::DispatchKey::AutocastCPU,
                                           c10::DispatchKey::AutocastCUDA, c10::DispatchKey::Negative});
  if (!THPVariable_CheckExact(obj)) return false;
  const at::Tensor& t = THPVariable_Unpack(obj);
  return t.layout() == at::kStrided &&
         (t.key_set() - kPlain).highestFunctionalityKey() == c10::DispatchKey::Undefined;
}

// The compiled kernel for a device type, or nullptr (the dispatcher decides: meta, XPU, the fallback...). The CPU and
// CUDA kernels serve both overloads, so `histogram` does not change the answer.
torch_gradstats::Kernel kernel_for(c10::DeviceType type, bool /*histogram*/) {
  switch (type) {
    case c10::DeviceType::CPU:
      return &torch_gradstats::multi_tensor_stats_cpu;
    case c10::DeviceType::CUDA:
      return torch_gradstats::cuda_kernel();
    default:
      return nullptr;
  }
}

// The items of a list at one moment, each held by a reference of its own (dropped, with the GIL held, when this
// goes out of scope): the list itself may change meanwhile. Inline for short lists: no allocation.
class ListItems {
 public:
  explicit ListItems(PyObject* list) {  // nothing here can run Python code (a __del__) and change the list
    items_.reserve(static_cast<size_t>(PyList_GET_SIZE(list)));
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(list); ++i) {
      items_.push_back(Py_NewRef(PyList_GET_ITEM(list, i)));
    }
  }
  ListItems(const ListItems&) = delete;
  ListItems& operator=(const ListItems&) = delete;
  ~ListItems() {
    for (PyObject* item : items_) Py_DECREF(item);
  }
  size_t size() const { return items_.size(); }
  PyObject* operator[](size_t i) const { return items_[i]; }

 private:
  c10::SmallVector<PyObject*, 8> items_;
};

// The type direct_stats returns: torch_gradstats.TensorStats once set_stats_type has been called (ops/op.py does, on
// import), a plain tuple before. Built here rather than from a returned tuple in Python: that costs as much host time
// as a call's whole kernel on a short list.
PyTypeObject* g_stats_type = &PyTuple_Type;

// Only a NamedTuple of the three outputs is taken: tuple.__new__ fills any tuple subclass, but a C-level one (a
// struct sequence such as torch.return_types.max) frees as many items as it has fields, whatever it was given.
PyObject* set_stats_type(PyObject* /*self*/, PyObject* type) {
  bool ok = PyType_Check(type) && reinterpret_cast<PyTypeObject*>(type)->tp_base == &PyTuple_Type &&
            PyType_HasFeature(reinterpret_cast<PyTypeObject*>(type), Py_TPFLAGS_HEAPTYPE);
  if (ok) {
    PyObject* fields = PyObject_GetAttrString(type, "_fields");
    PyObject* want = Py_BuildValue("(sss)", "sumsq", "amax", "counts");
    ok = fields != nullptr && want != nullptr && PyObject_RichCompareBool(fields, want, Py_EQ) == 1;
    Py_XDECREF(fields);
    Py_XDECREF(want);
    PyErr_Clear();
  }
  if (!ok) {
    PyErr_SetString(PyExc_TypeError,
                    "set_stats_type: expected a NamedTuple class with the fields (sumsq, amax, counts)");
    return nullptr;
  }
  PyTypeObject* old = g_stats_type;
  g_stats_type = reinterpret_cast<PyTypeObject*>(Py_NewRef(type));
  if (old != &PyTuple_Type) Py_DECREF(old);
  Py_RETURN_NONE;
}

// The three outputs as a g_stats_type. The tensors are wrapped first and the tuple made from them by CPython's own
// tuple.__new__: a collection run by any of these allocations never sees a tuple with empty slots.
PyObject* wrap_stats(torch_gradstats::Stats out, at::Tensor* histogram) {
  auto& [sumsq, amax, counts] = out;
  if (histogram != nullptr) {  // a plain tuple: the Python caller names it
    return Py_BuildValue("(NNNN)", THPVariable_Wrap(std::move(sumsq)), THPVariable_Wrap(std::move(amax)),
                         THPVariable_Wrap(std::move(counts)), THPVariable_Wrap(std::move(*histogram)));
  }
  PyObject* items = Py_BuildValue("(NNN)", THPVariable_Wrap(std::move(sumsq)), THPVariable_Wrap(std::move(amax)),
                                  THPVariable_Wrap(std::move(counts)));
  if (items == nullptr || g_stats_type == &PyTuple_Type) return items;
  PyObject* args = PyTuple_Pack(1, items);
  Py_DECREF(items);
  if (args == nullptr) return nullptr;
  PyObject* result = PyTuple_Type.tp_new(g_stats_type, args, nullptr);
  Py_DECREF(args);
  return result;
}

// A CPU call runs without the GIL (other Python threads go on meanwhile) when its list is long enough to be worth
// handing the GIL over and back, and its tensors are large enough on average that holding a reference to each, which
// running without the GIL needs (below; ~30 ns a tensor, as long as reading 1 KiB), costs ~1% of reading them.
constexpr int64_t kReleaseGilElems = int64_t{1} << 16;
constexpr int64_t kReleaseGilElemsPerTensor = int64_t{1} << 14;

// Why: a call through torch.ops turns the list into a boxed Tensor[] first, taking a reference to every tensor and
// dropping it afterwards through the GIL, and goes through the dispatcher's Python binding: for a short list that
// costs more host time than the kernel, and for a long one more per tensor than the kernel's own work. Here the
// tensors are read in place and the kernel of their device type is called directly. Anything the dispatcher would
// treat differently returns None, and the caller takes torch.ops: a tensor that is not a plain CPU or CUDA tensor,
// tensors of different device types, an active torch function or dispatch mode, or thread-local dispatch keys
// (vmap, fake tensors). Errors are the kernel's own (ValueError / TypeError naming the tensor's index).
// The tensors are read from a private copy of the list's items, made first: it holds every item however the caller's
// list changes (a __del__ run by the collector while this function allocates, another thread while the GIL is
// released) and nothing else can reach it. The GIL is released while the kernel runs on CUDA (its launches may wait
// for room in the queue) and on large CPU lists (kReleaseGilElems, kReleaseGilElemsPerTensor).
template <bool kHistogram>
PyObject* direct_stats(PyObject* /*self*/, PyObject* list) {
  HANDLE_TH_ERRORS
  if (!PyList_CheckExact(list) || PyList_GET_SIZE(list) == 0 || at::impl::torch_function_mode_enabled() ||
      c10::impl::TorchDispatchModeTLS::any_modes_set() ||
      !(c10::impl::tls_local_dispatch_key_set().included_ - c10::default_included_set).empty()) {
    Py_RETURN_NONE;
  }
  const ListItems items(list);
  // Per call, not reused: a call made by a __del__ while this one allocates must not overwrite it.
  c10::SmallVector<const at::Tensor*, 8> refs(items.size());
  c10::DeviceType type = c10::DeviceType::CPU;
  int64_t elems = 0;
  for (size_t i = 0; i < items.size(); ++i) {
    PyObject* obj = items[i];
    if (!plain_tensor(obj)) Py_RETURN_NONE;
    const at::Tensor& t = THPVariable_Unpack(obj);
    if (i == 0) type = t.device().type();
    if (t.device().type() != type) Py_RETURN_NONE;
    // Saturating: the sum only decides whether the GIL is released, and expanded views may add up past int64.
    if (c10::add_overflows(elems, t.numel(), &elems)) elems = std::numeric_limits<int64_t>::max();
    refs[i] = &t;
  }
  const torch_gradstats::Kernel kernel = kernel_for(type, kHistogram);
  if (kernel == nullptr) Py_RETURN_NONE;
  RECORD_FUNCTION(kHistogram ? "torch_gradstats::multi_tensor_stats.histogram" : "torch_gradstats::multi_tensor_stats",
                  c10::ArrayRef<const c10::IValue>{});
  torch_gradstats::Stats out;
  at::Tensor histogram;
  at::Tensor* histogram_out = kHistogram ? &histogram : nullptr;
  const auto n = static_cast<int64_t>(refs.size());
  if (type == c10::DeviceType::CPU && (elems < kReleaseGilElems || elems < kReleaseGilElemsPerTensor * n)) {
    out = kernel(torch_gradstats::TensorRefs(c10::ArrayRef<const at::Tensor*>(refs.data(), refs.size())),
                 histogram_out);
  } else {
    // Without the GIL the tensors are held here too, as the dispatcher's boxed list would hold them: a Python object
    // keeps its tensor, but torch.utils.swap_tensors, run by another thread meanwhile, swaps a tensor that nothing
    // else uses out of its object (and its memory may then be freed under the kernel).
    c10::SmallVector<at::Tensor, 8> held;
    held.reserve(refs.size());
    for (const at::Tensor* t : refs) held.push_back(*t);
    pybind11::gil_scoped_release no_gil;  // taken back before `held` and `items` let go of the tensors
    out = kernel(torch_gradstats::TensorRefs(at::TensorList(held.data(), held.size())), histogram_out);
  }
  return wrap_stats(std::move(out), histogram_out);
  END_HANDLE_TH_ERRORS
}

// str(i): a parameter given without a name is named by its position. (PyUnicode_FromFormat would parse a format.)
PyObject* position_name(size_t i) {
  char digits[24];
  const char* end = std::to_chars(digits, digits + sizeof(digits), i).ptr;
  return PyUnicode_FromStringAndSize(digits, end - digits);
}

// grad_stats's walk over its parameters, without per-parameter Python: the names, the gradients that are not None,
// and their element counts, as (list[str], list[Tensor], tuple[int]). Items are (name, parameter) pairs or
// parameters alone, named by their position as the Python walk names them. None when any item needs the Python
// walk, which handles every input form, names errors and recognises DTensors: an item that is neither a
// (str, tensor) tuple nor a tensor, a parameter that is neither a torch.Tensor nor a torch.nn.Parameter (a subclass
// may redefine .grad), a gradient that is not a plain tensor, or an active torch function mode. `items` is a list;
// nothing is changed. Its items are held from the start: a __del__ run by an allocation here may change the list.
PyObject* collect_grads(PyObject* /*self*/, PyObject* items) {
  HANDLE_TH_ERRORS
  if (!PyList_Check(items)) {
    PyErr_SetString(PyExc_TypeError, "collect_grads: expected a list of parameters or (name, parameter) pairs");
    return nullptr;
  }
  if (at::impl::torch_function_mode_enabled()) Py_RETURN_NONE;
  const ListItems held(items);
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
  for (size_t i = 0; i < held.size(); ++i) {
    PyObject* param = held[i];
    PyObject* name = nullptr;  // borrowed from the pair (which `held` keeps); none for a parameter alone
    if (PyTuple_CheckExact(param)) {
      if (PyTuple_GET_SIZE(param) != 2 || !PyUnicode_CheckExact(PyTuple_GET_ITEM(param, 0))) {
        return done(Py_NewRef(Py_None));
      }
      name = PyTuple_GET_ITEM(param, 0);
      param = PyTuple_GET_ITEM(param, 1);
    }
    if (!THPVariable_CheckExact(param)) return done(Py_NewRef(Py_None));  // exact: torch.Tensor or Parameter
    const at::Tensor grad = THPVariable_Unpack(param).grad();  // a reference of its own: .grad may be reassigned
    if (!grad.defined()) continue;
    PyObject* grad_obj = THPVariable_Wrap(grad);  // what `param.grad` returns
    if (grad_obj == nullptr) return done(nullptr);
    if (!THPVariable_CheckExact(grad_obj)) {
      Py_DECREF(grad_obj);
      return done(Py_NewRef(Py_None));
    }
    PyObject* name_obj = name != nullptr ? Py_NewRef(name) : position_name(i);
    PyObject* numel = PyLong_FromLongLong(grad.numel());
    const bool ok = name_obj != nullptr && numel != nullptr && PyList_Append(names, name_obj) == 0 &&
                    PyList_Append(grads, grad_obj) == 0 && PyList_Append(numels, numel) == 0;
    Py_DECREF(grad_obj);
    Py_XDECREF(name_obj);
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
    {"cpu_histogram_counting", cpu_histogram_counting, METH_NOARGS,
     "How the CPU kernel counts the exponent histogram, in words: 16 fields at once where the CPU has GFNI and "
     "AVX512-BITALG (unless TORCH_GRADSTATS_CPU_GFNI=0), else 8 at a time bit-sliced, or a table in the baseline "
     "kernel."},
    {"direct_stats", direct_stats<false>, METH_O,
     "(sumsq, amax, counts) of a list of plain CPU or CUDA tensors from the compiled kernel of their device type, "
     "called without the dispatcher; None when the list needs the dispatcher (use torch.ops then)."},
    {"direct_histogram_stats", direct_stats<true>, METH_O,
     "(sumsq, amax, counts, exponent_histogram) as a tuple, like direct_stats, for the histogram overload."},
    {"set_stats_type", set_stats_type, METH_O,
     "set_stats_type(type): the NamedTuple (torch_gradstats.TensorStats) direct_stats returns its results as."},
    {"collect_grads", collect_grads, METH_O,
     "collect_grads(items: list) -> (names, grads, numels) | None: the gradients that are not None of a list of "
     "parameters or (name, parameter) pairs, walked in C++; None when an item needs the Python walk."},
    {nullptr, nullptr, 0, nullptr}};

PyModuleDef module = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, methods};

}  // namespace

PyMODINIT_FUNC PyInit__C(void) { return PyModule_Create(&module); }
