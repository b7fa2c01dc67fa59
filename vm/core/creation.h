/*
** creation.h — the core's own kernels (vm/core/creation.c's fill, arange, random numbers and copies),
** which every backend registers (vm/cpu/creation.c, kernels/copy.cu).
*/
#ifndef DM_CREATION_H
#define DM_CREATION_H

#include "core/ops.h"

typedef void (*dm_fill_k)(dm_tensor *t, double v);                              /* every element v */
typedef void (*dm_copy_k)(dm_tensor *dst, const dm_tensor *src);                /* dst = src, any strides */
typedef void (*dm_arange_k)(dm_tensor *t, double start, double step);
typedef void (*dm_philox_k)(dm_tensor *t, uint64_t seed, uint64_t offset, bool normal);   /* core/philox.h */

DM_KERNEL_TYPE(fill, dm_fill_k)
DM_KERNEL_TYPE(copy, dm_copy_k)
DM_KERNEL_TYPE(copy_cross, dm_copy_k)          /* between the host and a device */
DM_KERNEL_TYPE(arange, dm_arange_k)
DM_KERNEL_TYPE(philox, dm_philox_k)

#endif
