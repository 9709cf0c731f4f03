// The CPU kernels compiled for the DEFAULT instruction set (the baseline: no flags beyond the compiler's defaults).
#define CPU_CAPABILITY DEFAULT
#include "stats_kernel_impl.h"

