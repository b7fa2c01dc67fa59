/*
** silu_mul.h — the SiLU-gated product y = silu(a) * b (the experts' gate):
** the kernel signatures shared by the op family (vm/ops/silu_mul.c) and
** every backend's kernels (vm/cpu/silu_mul.c, kernels/silu_mul.cu). The
** op hands the kernels a and b of any strides; y and the gradients, which it
** allocates, are contiguous.
*/
#ifndef DM_SILU_MUL_H
#define DM_SILU_MUL_H

#include "core/ops.h"

/* "silu_mul": y = silu(a) * b, a and b of one shape; "silu_mul_bwd": ga and
** gb (either NULL), contiguous when both are given */
typedef void (*dm_silu_mul_k)(dm_tensor *y, const dm_tensor *a, const dm_tensor *b);
typedef void (*dm_silu_mul_bwd_k)(dm_tensor *ga, dm_tensor *gb, const dm_tensor *g,
                                  const dm_tensor *a, const dm_tensor *b);

/* ---- the C API (vm/ops/silu_mul.c): an owned result, recorded when grad mode is on ---- */

dm_tensor *dm_silu_mul(dm_tensor *a, dm_tensor *b);

/* the family's kernels by name (core/ops.h): the ops look them up, the backends register them */
DM_KERNEL_TYPE(silu_mul, dm_silu_mul_k)
DM_KERNEL_TYPE(silu_mul_bwd, dm_silu_mul_bwd_k)

#endif
