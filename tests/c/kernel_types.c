/*
** kernel_types.c — the kernel table is typed (core/ops.h): a backend's function registered under a
** kernel's name must have the type that name is declared with, or the file does not compile.
** ctest compiles this file as C (the _Generic form) and, where CUDA is built, with nvcc as C++ (the
** std::integral_constant form): as it is (it must compile) and with DM_MISMATCH = 1, 2, 3 (each must not):
**   1  a function whose pointer parameter lacks the declared const
**   2  a function of the right shape registered under another kernel's name
**   3  a name no family declares
*/
#ifdef __cplusplus
#include <type_traits>          /* DM_KERNEL_ENTRY's C++ form (the .cu files have it from kernels/common.cuh) */
extern "C" {
#endif
#include "core/ops.h"
#include "ops/moe.h"
#ifdef __cplusplus
}
#endif

static void route(dm_tensor *idx, dm_tensor *w, dm_tensor *counts, const dm_tensor *logits, const dm_tensor *bias,
                  int form) {
  (void)idx, (void)w, (void)counts, (void)logits, (void)bias, (void)form;
}

#if DM_MISMATCH == 1
static void route_unconst(dm_tensor *idx, dm_tensor *w, dm_tensor *counts, dm_tensor *logits, const dm_tensor *bias,
                          int form) {
  (void)idx, (void)w, (void)counts, (void)logits, (void)bias, (void)form;
}
#endif

static const dm_kernel_entry kernels[] = {
  DM_KERNEL_ENTRY(moe_route, route),
#if DM_MISMATCH == 1
  DM_KERNEL_ENTRY(moe_route, route_unconst),
#elif DM_MISMATCH == 2
  DM_KERNEL_ENTRY(moe_sort, route),
#elif DM_MISMATCH == 3
  DM_KERNEL_ENTRY(moe_rout, route),
#endif
};

const dm_kernel_entry *dm_kernel_types_table(void) { return kernels; }
