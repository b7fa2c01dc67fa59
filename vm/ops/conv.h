/*
** blocks.h — the model's fused building blocks: row norms (rmsnorm,
** l2norm), cross-entropy with its log-softmax, the causal depthwise
** convolution with its cache, and the SiLU-gated product. The kinds and
** kernel signatures here are shared by the op family (vm/ops/blocks.c) and
** every backend's kernels (vm/cpu/blocks.c, later kernels/blocks.cu).
**
** Layouts. The ops hand kernels tensors of any strides, except what the
** ops allocate themselves: outputs, gradients and the per-row statistics
** (rstd, lse) are contiguous. A "row" is the last dim; rows are counted
** through the leading dims in row-major order, and a statistic tensor holds
** one value per row, [rows], f64 for f64 inputs and f32 otherwise.
*/
#ifndef DM_BLOCKS_H
#define DM_BLOCKS_H

#include "core/ops.h"
#include "ops/prims.h"      /* the column sums' scratch */

/* ---- the CUDA kernels' device scratch, in bytes (core/alloc.h): the kernels size
** theirs with these, and the ops hand the same to a plan ---- */

/* The causal conv's backward by runs of DM_CONV_RUN positions (a K x C partial of the weights'
** gradient each, f64), where the grid fits: span positions, kernels up to DM_CONV_MAXK */
#define DM_CONV_RUN 32
#define DM_CONV_MAXK 8
static inline bool dm_conv_runs_fit(int64_t B, int64_t span, int64_t K) {
  return K <= DM_CONV_MAXK && B <= 65535 && (span + DM_CONV_RUN - 1) / DM_CONV_RUN <= 65535;
}
static inline int64_t dm_conv_gw_runs_scratch(int64_t B, int64_t T, int64_t C, int64_t K) {
  return 8 * B * ((T + DM_CONV_RUN - 1) / DM_CONV_RUN) * K * C;
}
/* "causal_conv1d_bwd" with the weights' gradient (x [B, T, C], w [C, K]; span: the positions the
** input gradients cover), by runs or else by column sums */
static inline int64_t dm_conv_bwd_scratch(int64_t B, int64_t T, int64_t C, int64_t K, int64_t span,
                                          int64_t sm_count) {
  if (B * C != 0 && dm_conv_runs_fit(B, span > T ? span : T, K)) return T > 0 ? dm_conv_gw_runs_scratch(B, T, C, K) : 0;
  return dm_colsum_scratch(B * T, K * C, sm_count);
}

/* "cross_entropy" with a reduction: one f64 partial a row */
static inline int64_t dm_ce_scratch(int64_t rows, bool reduced) { return reduced ? 8 * rows : 0; }
/* "cross_entropy_bwd" with the mean: the count of targets kept */
static inline int64_t dm_ce_bwd_scratch(bool mean) { return mean ? (int64_t)sizeof(int64_t) : 0; }
/* "cross_entropy_check", at DM_DEBUG >= 1: the first bad target's row and value */
static inline int64_t dm_ce_check_scratch(int64_t rows, int debug) {
  return debug >= 1 && rows > 0 ? 2 * (int64_t)sizeof(int64_t) : 0;
}

/* what divides the row's sum of squares: D (rmsnorm) or 1 (l2norm) */
enum { DM_NORM_RMS, DM_NORM_L2 };
/* cross-entropy's reduction attribute */
enum { DM_CE_MEAN, DM_CE_SUM, DM_CE_NONE };
#define DM_CE_SPELLINGS "mean|sum|none"        /* cross_entropy's reduction, in the enum's order */

/* "rownorm": y = x * rstd * gain, rstd = 1 / sqrt(sum(x^2) / div + eps) per row;
** gain [D] or NULL; rstd [rows] or NULL (not recording). */
typedef void (*dm_rownorm_k)(int kind, dm_tensor *y, dm_tensor *rstd, const dm_tensor *x,
                             const dm_tensor *gain, double eps);
/* "rownorm_bwd": gx and ggain (either NULL when not wanted) from g; ggain is
** reduced over rows in row order (deterministic) */
typedef void (*dm_rownorm_bwd_k)(int kind, dm_tensor *gx, dm_tensor *ggain, const dm_tensor *g,
                                 const dm_tensor *x, const dm_tensor *gain, const dm_tensor *rstd);

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

/* "causal_conv1d": x [B, T, C], w [C, K], cache [B, P, C] or NULL (zeros),
** P = (K-1) * dilation:
**   y[b,t,c] = sum_k w[c,k] * xin[b, t - (K-1-k) * dilation, c]
** where xin is the cache followed by x (positions -P..T-1); cache_out
** [B, P, C] receives xin's last P positions. */
typedef void (*dm_conv_k)(dm_tensor *y, dm_tensor *cache_out, const dm_tensor *x,
                          const dm_tensor *w, const dm_tensor *cache, int64_t dilation);
/* "causal_conv1d_bwd": gx, gw, gcache (each NULL when not wanted; gcache
** only with a cache) from gy and gcache_out */
typedef void (*dm_conv_bwd_k)(dm_tensor *gx, dm_tensor *gw, dm_tensor *gcache, const dm_tensor *gy,
                              const dm_tensor *gcache_out, const dm_tensor *x, const dm_tensor *w,
                              const dm_tensor *cache, int64_t dilation);
/* Optional, where a backend fuses the SiLU of causal_conv1d(..., silu = 1)
** (without them the op composes the convolution and the elementwise SiLU):
** "causal_conv1d_silu", a dm_conv_k giving y = silu of the sum, and
** "causal_conv1d_silu_dz": gz = gy · silu'(z), z the convolution run again. */
typedef void (*dm_conv_silu_dz_k)(dm_tensor *gz, const dm_tensor *gy, const dm_tensor *x, const dm_tensor *w,
                                  const dm_tensor *cache, int64_t dilation);

/* "silu_mul": y = silu(a) * b, a and b of one shape; "silu_mul_bwd": ga and
** gb (either NULL), contiguous when both are given */
typedef void (*dm_silu_mul_k)(dm_tensor *y, const dm_tensor *a, const dm_tensor *b);
typedef void (*dm_silu_mul_bwd_k)(dm_tensor *ga, dm_tensor *gb, const dm_tensor *g,
                                  const dm_tensor *a, const dm_tensor *b);

/* ---- the C API (vm/ops/blocks.c): owned results, recorded when grad mode is on ---- */

dm_tensor *dm_rmsnorm(dm_tensor *x, dm_tensor *gain, double eps);     /* gain may be NULL */
dm_tensor *dm_l2norm(dm_tensor *x, double eps);
/* reduction: DM_CE_MEAN, DM_CE_SUM or DM_CE_NONE; ignore_index -1: none */
dm_tensor *dm_cross_entropy(dm_tensor *logits, dm_tensor *targets, int64_t ignore_index, int reduction);
/* cache may be NULL; *cache_out (when cache_out is not NULL) receives the new cache */
dm_tensor *dm_causal_conv1d(dm_tensor *x, dm_tensor *w, dm_tensor *cache, int64_t dilation,
                            dm_tensor **cache_out);
dm_tensor *dm_silu_mul(dm_tensor *a, dm_tensor *b);

/* the family's kernels by name (core/ops.h): the ops look them up, the backends register them */
DM_KERNEL_TYPE(causal_conv1d, dm_conv_k)
DM_KERNEL_TYPE(causal_conv1d_bwd, dm_conv_bwd_k)
DM_KERNEL_TYPE(causal_conv1d_silu, dm_conv_k)
DM_KERNEL_TYPE(causal_conv1d_silu_dz, dm_conv_silu_dz_k)
DM_KERNEL_TYPE(cross_entropy, dm_ce_k)
DM_KERNEL_TYPE(cross_entropy_bwd, dm_ce_bwd_k)
DM_KERNEL_TYPE(cross_entropy_check, dm_ce_check_k)
DM_KERNEL_TYPE(rownorm, dm_rownorm_k)
DM_KERNEL_TYPE(rownorm_bwd, dm_rownorm_bwd_k)
DM_KERNEL_TYPE(silu_mul, dm_silu_mul_k)
DM_KERNEL_TYPE(silu_mul_bwd, dm_silu_mul_bwd_k)

#endif
