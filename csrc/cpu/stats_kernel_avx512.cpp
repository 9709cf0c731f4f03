// The CPU kernels compiled for the AVX512 instruction set;
// only this file gets its compiler flags (setup.py, CMakeLists.txt).
#if defined(__x86_64__) || defined(_M_X64)
#define CPU_CAPABILITY AVX512
#define CPU_CAPABILITY_AVX512
#include "stats_kernel_impl.h"
#endif
