/*
** conv.h — the causal depthwise convolution with its cache: the device
** scratch and the kernel signatures shared by the op family
** (vm/ops/conv.c) and every backend's kernels (vm/cpu/conv.c,
** kernels/conv.cu).
**
** Layouts. The op hands kernels x, w and the cache of any strides; what it
** allocates itself (y, the new cache, the gradients) is contiguous.
*/
#ifndef DM_CONV_H
#define DM_CONV_H

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

/* ---- the C API (vm/ops/conv.c): owned results, recorded when grad mode is on ---- */

/* cache may be NULL; *cache_out (when cache_out is not NULL) receives the new cache */
dm_tensor *dm_causal_conv1d(dm_tensor *x, dm_tensor *w, dm_tensor *cache, int64_t dilation,
                            dm_tensor **cache_out);

/* the family's kernels by name (core/ops.h): the ops look them up, the backends register them */
DM_KERNEL_TYPE(causal_conv1d, dm_conv_k)
DM_KERNEL_TYPE(causal_conv1d_bwd, dm_conv_bwd_k)
DM_KERNEL_TYPE(causal_conv1d_silu, dm_conv_k)
DM_KERNEL_TYPE(causal_conv1d_silu_dz, dm_conv_silu_dz_k)

#endif
