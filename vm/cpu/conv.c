/*
** cpu/conv.c — the kernels of the causal depthwise convolution (conv.h),
** forward and backward.
**
** Every kernel takes operands of any strides. A position's row of channels
** is walked with the channel stride, f32 rows of unit stride by a copy of
** the loops specialised for them (F32_UNIT_DISPATCH); the weights are held
** transposed in double and the sums taken in double. The weights' gradient
** goes in (b, t) order into double accumulators: deterministic, no atomics.
*/
#include <stdlib.h>
#include <string.h>
#include "vec.h"
#include "rows.h"
#include "core/alloc.h"
#include "ops/conv.h"

typedef struct conv {
  dm_dtype dt;
  int64_t B, T, C, K, P, dil;
  double *wt;                   /* w transposed: wt[k * C + c] = w[c, k] */
  double *scratch;              /* the kernel's accumulators, zeros, after wt in wt's block */
} conv;

/* wt and `extra` doubles of scratch in one allocation, so that running out of memory leaks nothing */
static void conv_init(conv *v, const dm_tensor *x, const dm_tensor *w, int64_t dil, int64_t extra) {
  v->dt = x->dtype;
  v->B = x->shape[0]; v->T = x->shape[1]; v->C = x->shape[2]; v->K = w->shape[1];
  v->dil = dil;
  v->P = (v->K - 1) * dil;
  v->wt = dm_xcalloc((size_t)(v->K * v->C + extra), sizeof(double));
  v->scratch = v->wt + v->K * v->C;
  for (int64_t c = 0; c < v->C; c++)
    for (int64_t k = 0; k < v->K; k++) v->wt[k * v->C + c] = ld(w->dtype, addr(w, 2, c * v->K + k));
}

/* the row [b, t, :] of a [B, *, C] tensor, or NULL outside 0..len-1 or without the tensor */
static char *conv_row(const dm_tensor *t, int64_t b, int64_t pos) {
  if (!t || pos < 0 || pos >= t->shape[1]) return NULL;
  return (char *)dm_data(t) + (b * t->strides[0] + pos * t->strides[1]) * (int64_t)dm_dtype_size(t->dtype);
}

/* xin at position pos (-P..T-1): x's row, the cache's, or NULL (zeros) */
static const char *conv_in(const conv *v, const dm_tensor *x, const dm_tensor *cache, int64_t b, int64_t pos) {
  return pos >= 0 ? conv_row(x, b, pos) : conv_row(cache, b, v->P + pos);
}

/* acc[c] += w * src[c]; the f32 unit-stride case is inlined with its constants */
INLINE void axpy_(dm_dtype dt, int64_t s, double *acc, const double *w, const char *src, int64_t n) {
  for (int64_t c = 0; c < n; c++) acc[c] += w[c] * ld(dt, src + c * s);
}
INLINE void store_row_(dm_dtype dt, int64_t s, char *dst, const double *acc, int64_t n) {
  for (int64_t c = 0; c < n; c++) st(dt, dst + c * s, acc[c]);
}

static int64_t chan_step(const dm_tensor *t) { return t->strides[2] * (int64_t)dm_dtype_size(t->dtype); }

/* a row of xin copied into a row of dst (zeros where xin is) */
static void conv_copy_row(const conv *v, char *dst, int64_t ds, const char *src, int64_t ss) {
  for (int64_t c = 0; c < v->C; c++) st(v->dt, dst + c * ds, src ? ld(v->dt, src + c * ss) : 0);
}

static void cpu_conv(dm_tensor *y, dm_tensor *cache_out, const dm_tensor *x, const dm_tensor *w,
                     const dm_tensor *cache, int64_t dil) {
  conv v;
  conv_init(&v, x, w, dil, x->shape[2]);
  double *acc = v.scratch;
  int64_t ys = chan_step(y), xs = chan_step(x), cs = cache ? chan_step(cache) : 0;
  for (int64_t b = 0; b < v.B; b++) {
    for (int64_t t = 0; t < v.T; t++) {
      memset(acc, 0, sizeof(double) * (size_t)v.C);
      for (int64_t k = 0; k < v.K; k++) {
        int64_t pos = t - (v.K - 1 - k) * dil;
        const char *src = conv_in(&v, x, cache, b, pos);
        if (src) F32_UNIT_DISPATCH(axpy_, v.dt, pos >= 0 ? xs : cs, acc, v.wt + k * v.C, src, v.C);
      }
      F32_UNIT_DISPATCH(store_row_, v.dt, ys, conv_row(y, b, t), acc, v.C);
    }
    for (int64_t j = 0; j < v.P; j++) {          /* the new cache: xin's last P positions */
      int64_t pos = v.T - v.P + j;
      conv_copy_row(&v, conv_row(cache_out, b, j), chan_step(cache_out), conv_in(&v, x, cache, b, pos),
                    pos >= 0 ? xs : cs);
    }
  }
  free(v.wt);
}

/* The gradient of xin at every position pos of -P..T-1 (x's rows, then the
** cache's): the outputs that read it, plus the new cache's row it became.
** gw[c, k] sums gy[b, t, c] * xin[b, t - (K-1-k) dil, c] over b and t. */
static void cpu_conv_bwd(dm_tensor *gx, dm_tensor *gw, dm_tensor *gcache, const dm_tensor *gy,
                         const dm_tensor *gcache_out, const dm_tensor *x, const dm_tensor *w,
                         const dm_tensor *cache, int64_t dil) {
  conv v;
  int64_t C = x->shape[2];
  conv_init(&v, x, w, dil, C + (gw ? w->shape[1] * C : 0));
  int64_t gys = chan_step(gy), xs = chan_step(x), cs = cache ? chan_step(cache) : 0;
  double *acc = v.scratch, *accw = gw ? acc + C : NULL;
  int64_t lo = gcache ? -v.P : 0, hi = gx ? v.T : 0;     /* the positions whose gradient is wanted */
  for (int64_t b = 0; b < v.B; b++) {
    for (int64_t pos = lo; pos < hi; pos++) {
      char *dst = pos >= 0 ? conv_row(gx, b, pos) : conv_row(gcache, b, v.P + pos);
      memset(acc, 0, sizeof(double) * (size_t)C);
      for (int64_t k = 0; k < v.K; k++) {
        const char *g = conv_row(gy, b, pos + (v.K - 1 - k) * dil);
        if (g) F32_UNIT_DISPATCH(axpy_, v.dt, gys, acc, v.wt + k * C, g, C);
      }
      const char *gc = conv_row(gcache_out, b, pos - (v.T - v.P));
      if (gc) for (int64_t c = 0; c < C; c++) acc[c] += ld(v.dt, gc + c * chan_step(gcache_out));
      F32_UNIT_DISPATCH(store_row_, v.dt, chan_step(pos >= 0 ? gx : gcache), dst, acc, C);
    }
    if (accw)
      for (int64_t t = 0; t < v.T; t++) {
        const char *g = conv_row(gy, b, t);
        for (int64_t k = 0; k < v.K; k++) {
          int64_t pos = t - (v.K - 1 - k) * dil;
          const char *src = conv_in(&v, x, cache, b, pos);
          int64_t ss = pos >= 0 ? xs : cs;
          if (src) for (int64_t c = 0; c < C; c++) accw[k * C + c] += ld(v.dt, g + c * gys) * ld(v.dt, src + c * ss);
        }
      }
  }
  if (accw)
    for (int64_t c = 0; c < C; c++)
      for (int64_t k = 0; k < v.K; k++) st(gw->dtype, addr(gw, 2, c * v.K + k), accw[k * C + c]);
  free(v.wt);
}

static const dm_kernel_entry kernels[] = {
  DM_KERNEL_ENTRY(causal_conv1d, cpu_conv),
  DM_KERNEL_ENTRY(causal_conv1d_bwd, cpu_conv_bwd),
};
DM_REGISTER_KERNELS(DM_CPU, kernels)
