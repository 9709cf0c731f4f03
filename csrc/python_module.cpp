// The Python module torch_gradstats._C. It defines no functions: the kernels register themselves with the
// dispatcher from static initialisers (TORCH_LIBRARY_IMPL), and importing this module is what loads them.
// Compiled only by setup.py; the CMake build produces the same library without Python.
#include <Python.h>

static struct PyModuleDef torch_gradstats_module = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};

PyMODINIT_FUNC PyInit__C(void) { return PyModule_Create(&torch_gradstats_module); }
