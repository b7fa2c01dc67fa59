/*
** reduce.h — the reduction kinds and kernel signatures, shared by the op
** family (vm/ops/reduce.c) and every backend's kernels.
*/
#ifndef DM_REDUCE_H
#define DM_REDUCE_H

#include "core/ops.h"

enum { R_SUM, R_MEAN, R_MAX, R_MIN, R_ARGMAX, R_ARGMIN, R_LOGSUMEXP, R_NORM };

typedef void (*dm_reduce_k)(int kind, dm_tensor *out, dm_tensor *idx, const dm_tensor *x, double p,
                         int64_t base);
typedef void (*dm_reduce_bwd_k)(int kind, dm_tensor *gx, const dm_tensor *g, const dm_tensor *y,
                             const dm_tensor *idx, const dm_tensor *x, double p, int64_t base);
typedef void (*dm_softmax_k)(dm_tensor *y, const dm_tensor *x, int dim, int lg);
typedef void (*dm_softmax_bwd_k)(dm_tensor *gx, const dm_tensor *g, const dm_tensor *y, int dim, int lg);

/* the family's kernels by name (core/ops.h): the ops look them up, the backends register them */
DM_KERNEL_TYPE(reduce, dm_reduce_k)
DM_KERNEL_TYPE(reduce_bwd, dm_reduce_bwd_k)
DM_KERNEL_TYPE(softmax, dm_softmax_k)
DM_KERNEL_TYPE(softmax_bwd, dm_softmax_bwd_k)

#endif
