/*
** matmul.h — what every backend's matrix-product kernel shares: how a
** strided matrix is read by a BLAS-style library without a copy.
*/
#ifndef DM_MATMUL_H
#define DM_MATMUL_H

#include <limits.h>
#include "core/tensor.h"
#include "core/ops.h"

/* cuBLASLt's workspace: taken from the driver once, beside the caching allocator (kernels/gemm.c);
** dormouse plan counts it on the card (core.gemm_workspace) */
#define DM_GEMM_WORKSPACE ((size_t)32 << 20)

typedef void (*dm_matmul_k)(dm_tensor *out, dm_tensor *a, dm_tensor *b, bool ta, bool tb);

/* A rows x cols matrix with element strides (sr, sc): either row-major with
** leading dim sr (*flip false) or the row-major transpose of a cols x rows
** matrix with leading dim sc (*flip true). False when neither holds (or the
** leading dim does not fit BLAS's int): the caller copies it contiguous. */
static inline bool dm_blas_layout(int64_t rows, int64_t cols, int64_t sr, int64_t sc, bool *flip, int64_t *ld) {
  int64_t rmin = rows > 1 ? rows : 1, cmin = cols > 1 ? cols : 1;
  if ((sc == 1 || cols == 1) && (rows == 1 || sr >= cmin)) {
    *flip = false;
    *ld = rows == 1 ? cmin : sr;
  } else if ((sr == 1 || rows == 1) && (cols == 1 || sc >= rmin)) {
    *flip = true;
    *ld = cols == 1 ? rmin : sc;
  } else return false;
  return *ld <= INT_MAX;
}

/* the same for the last two dims of t */
static inline bool dm_blas_layout_of(const dm_tensor *t, bool *flip, int64_t *ld) {
  int nd = t->ndim;
  return dm_blas_layout(t->shape[nd - 2], t->shape[nd - 1], t->strides[nd - 2], t->strides[nd - 1], flip, ld);
}

/* the family's kernels by name (core/ops.h): the ops look them up, the backends register them */
DM_KERNEL_TYPE(matmul, dm_matmul_k)

#endif
