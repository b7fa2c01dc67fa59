/*
** xent.h — cross-entropy fused with its log-softmax: the reduction's kinds,
** the device scratch and the kernel signatures shared by the op family
** (vm/ops/xent.c) and every backend's kernels (vm/cpu/xent.c,
** kernels/xent.cu); the rows' layout and the per-row lse are rows.h's.
*/
#ifndef DM_XENT_H
#define DM_XENT_H

#include "ops/rows.h"

/* ---- the CUDA kernels' device scratch, in bytes (core/alloc.h): the kernels size
** theirs with these, and the ops hand the same to a plan ---- */

/* "cross_entropy" with a reduction: one f64 partial a row */
static inline int64_t dm_ce_scratch(int64_t rows, bool reduced) { return reduced ? 8 * rows : 0; }
/* "cross_entropy_bwd" with the mean: the count of targets kept */
static inline int64_t dm_ce_bwd_scratch(bool mean) { return mean ? (int64_t)sizeof(int64_t) : 0; }
/* "cross_entropy_check", at DM_DEBUG >= 1: the first bad target's row and value */
static inline int64_t dm_ce_check_scratch(int64_t rows, int debug) {
  return debug >= 1 && rows > 0 ? 2 * (int64_t)sizeof(int64_t) : 0;
}

/* cross-entropy's reduction attribute */
enum { DM_CE_MEAN, DM_CE_SUM, DM_CE_NONE };
#define DM_CE_SPELLINGS "mean|sum|none"        /* cross_entropy's reduction, in the enum's order */

/* "cross_entropy_check": raises, naming the target, its row and the class
** count, unless every target is in 0..classes-1 or equals ignore_index
** (ignore_index -1: none) */
typedef void (*dm_ce_check_k)(const dm_tensor *targets, int64_t classes, int64_t ignore_index);
/* "cross_entropy": logits [..., V], targets [...] (i64, i32 or u8); loss is
** 0-dim (mean, sum) or targets' shape (none, 0 on ignored rows); lse [rows]
** or NULL. A mean over no rows is NaN. */
typedef void (*dm_ce_k)(dm_tensor *loss, dm_tensor *lse, const dm_tensor *logits,
                        const dm_tensor *targets, int64_t ignore_index, int reduction);
/* "cross_entropy_bwd": gx = g_row * (softmax - onehot), the softmax
** recomputed from logits and lse; g is loss's gradient */
typedef void (*dm_ce_bwd_k)(dm_tensor *gx, const dm_tensor *g, const dm_tensor *logits,
                            const dm_tensor *targets, const dm_tensor *lse, int64_t ignore_index,
                            int reduction);

/* ---- the C API (vm/ops/xent.c): an owned result, recorded when grad mode is on ---- */

/* reduction: DM_CE_MEAN, DM_CE_SUM or DM_CE_NONE; ignore_index -1: none */
dm_tensor *dm_cross_entropy(dm_tensor *logits, dm_tensor *targets, int64_t ignore_index, int reduction);

/* the family's kernels by name (core/ops.h): the ops look them up, the backends register them */
DM_KERNEL_TYPE(cross_entropy, dm_ce_k)
DM_KERNEL_TYPE(cross_entropy_bwd, dm_ce_bwd_k)
DM_KERNEL_TYPE(cross_entropy_check, dm_ce_check_k)

#endif
