// The Python module torch_gradstats._C. The kernels register themselves with the dispatcher from static
// initialisers (TORCH_LIBRARY_IMPL), and importing this module is what loads them. Its one function,
// cpu_capability(), names the instruction set the CPU kernel runs with ("AVX512", "AVX2" or "DEFAULT").
// Compiled only by setup.py; the CMake build produces the same library without Python.
#include <Python.h>

#include "multi_tensor_stats.h"

static PyObject* cpu_capability(PyObject* /*self*/, PyObject* /*args*/) {
  return PyUnicode_FromString(torch_gradstats::cpu_kernel_capability());
}

static PyMethodDef torch_gradstats_methods[] = {
    {"cpu_capability", cpu_capability, METH_NOARGS,
     "Instruction set of the CPU kernel on this machine: 'AVX512', 'AVX2' or 'DEFAULT' (follows ATen's choice, so "
     "ATEN_CPU_CAPABILITY=default forces the baseline)."},
    {nullptr, nullptr, 0, nullptr}};

static struct PyModuleDef torch_gradstats_module = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, torch_gradstats_methods};

PyMODINIT_FUNC PyInit__C(void) { return PyModule_Create(&torch_gradstats_module); }
