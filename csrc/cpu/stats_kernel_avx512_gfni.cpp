// The CPU kernels compiled for AVX512 with GFNI and AVX512-BITALG (Ice Lake, Sapphire Rapids, Zen 4 and later): the
// AVX512 kernels, whose exponent histogram counts 16 fields per register instead of one (see stats_kernel_impl.h);
// only this file gets its compiler flags (setup.py, CMakeLists.txt).
#if defined(__x86_64__) || defined(_M_X64)
#define CPU_CAPABILITY AVX512_GFNI
#define CPU_CAPABILITY_AVX512
#include "stats_kernel_impl.h"
#endif
