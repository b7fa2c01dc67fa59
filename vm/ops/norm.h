/*
** norm.h — the row norms rmsnorm and l2norm, one forward and one backward
** over the "rownorm" kernels, their kind choosing what divides the row's sum
** of squares; add_rmsnorm, a residual add and rmsnorm in one forward pass. The kinds and kernel signatures here are shared by the op
** family (vm/ops/norm.c) and every backend's kernels (vm/cpu/norm.c,
** kernels/norm.cu); the rows' layout and the per-row rstd are rows.h's.
*/
#ifndef DM_NORM_H
#define DM_NORM_H

#include "ops/rows.h"

/* what divides the row's sum of squares: D (rmsnorm) or 1 (l2norm) */
enum { DM_NORM_RMS, DM_NORM_L2 };

/* "rownorm": y = x * rstd * gain, rstd = 1 / sqrt(sum(x^2) / div + eps) per row;
** gain [D], or NULL: the number scale in its place; rstd [rows] or NULL (not recording). */
typedef void (*dm_rownorm_k)(int kind, dm_tensor *y, dm_tensor *rstd, const dm_tensor *x,
                             const dm_tensor *gain, double eps, double scale);
/* "rownorm_bwd": gx and ggain (either NULL when not wanted) from g; ggain is
** reduced over rows in row order (deterministic); scale as rownorm's */
typedef void (*dm_rownorm_bwd_k)(int kind, dm_tensor *gx, dm_tensor *ggain, const dm_tensor *g,
                                 const dm_tensor *x, const dm_tensor *gain, const dm_tensor *rstd, double scale);

/* "add_rownorm": a residual add and the next norm in one pass, the same bits as the add, the
** cast and rmsnorm that it replaces: s = h + y in h's dtype (y's elements converted), x = s in
** y's dtype, u = rmsnorm(x) * gain in y's dtype. h, y, s, x and u are contiguous and of one shape,
** gain [D] in y's dtype or NULL; x NULL (not kept: a pass without grad) or, when h and y share their
** dtype, s itself; rstd [rows] or NULL, as rownorm's. */
typedef void (*dm_add_rownorm_k)(dm_tensor *s, dm_tensor *x, dm_tensor *u, dm_tensor *rstd, const dm_tensor *h,
                                 const dm_tensor *y, const dm_tensor *gain, double eps);

/* "add_rownorm_bwd": the backward of add_rownorm but the gain's gradient (rownorm_bwd gives that),
** with the bits of the ops it stands for: gx = rmsnorm's gradient of x from gu, in x's dtype as
** rownorm_bwd writes it; gs = g + gx in g's dtype (s's gradient: its own and the norm's); gy = gs in
** y's dtype (NULL: not wanted). gs, gy, g and gu are contiguous; x, gain and rstd are what the
** forward saved. */
typedef void (*dm_add_rownorm_bwd_k)(dm_tensor *gs, dm_tensor *gy, const dm_tensor *g, const dm_tensor *gu,
                                     const dm_tensor *x, const dm_tensor *gain, const dm_tensor *rstd);

/* ---- the C API (vm/ops/norm.c): owned results, recorded when grad mode is on ---- */

dm_tensor *dm_rmsnorm(dm_tensor *x, dm_tensor *gain, double eps);     /* gain may be NULL */
dm_tensor *dm_l2norm(dm_tensor *x, double eps);
/* s = h + y (returned) and *u = rmsnorm(s in y's dtype) * gain (gain may be NULL) */
dm_tensor *dm_add_rmsnorm(dm_tensor *h, dm_tensor *y, dm_tensor *gain, double eps, dm_tensor **u);

/* the family's kernels by name (core/ops.h): the ops look them up, the backends register them */
DM_KERNEL_TYPE(rownorm, dm_rownorm_k)
DM_KERNEL_TYPE(rownorm_bwd, dm_rownorm_bwd_k)
DM_KERNEL_TYPE(add_rownorm, dm_add_rownorm_k)
DM_KERNEL_TYPE(add_rownorm_bwd, dm_add_rownorm_bwd_k)

#endif
