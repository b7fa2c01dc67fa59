/*
** cpu/vec.h — the helpers shared by the CPU row kernels (reduce.c, norm.c,
** xent.c, conv.c, silu_mul.c, quant.c): loads and stores of any dtype
** through double, with f32 and f64 inlined, and f32 four lanes at a time
** with GCC vector extensions (SSE2, NEON).
*/
#ifndef DM_CPU_VEC_H
#define DM_CPU_VEC_H

#include <string.h>
#include "core/tensor.h"

#define INLINE static inline __attribute__((always_inline))

INLINE double ld(dm_dtype dt, const char *p) {
  if (dt == DM_F32) return *(const float *)p;
  if (dt == DM_F64) return *(const double *)p;
  return dm_load(dt, p);
}

INLINE void st(dm_dtype dt, char *p, double v) {
  if (dt == DM_F32) *(float *)p = (float)v;
  else if (dt == DM_F64) *(double *)p = v;
  else dm_store(dt, p, v);
}

/* fn(dt, s, ...) over a row of dtype dt, s bytes apart, with a copy of fn
** specialised (by inlining its constants) for f32 rows of unit stride */
#define F32_UNIT_DISPATCH(fn, dt, s, ...) \
  ((dt) == DM_F32 && (s) == 4 ? fn(DM_F32, 4, __VA_ARGS__) : fn(dt, s, __VA_ARGS__))

/* ---- f32 four lanes at a time ------------------------------------------------------------- */

typedef float v4f __attribute__((vector_size(16)));
typedef int32_t v4i __attribute__((vector_size(16)));

/* lane-wise m ? a : b, m a comparison's result (all ones or all zeros) */
INLINE v4f sel(v4i m, v4f a, v4f b) { return (v4f)((m & (v4i)a) | (~m & (v4i)b)); }
INLINE v4f load4(const float *p) { v4f v; memcpy(&v, p, sizeof v); return v; }
INLINE void store4(float *p, v4f v) { memcpy(p, &v, sizeof v); }
INLINE double hsum4(v4f v) { return ((double)v[0] + (double)v[1]) + ((double)v[2] + (double)v[3]); }

/* exp(x) = 2^n p(r), r = x - n ln2 in [-ln2/2, ln2/2], Cephes' polynomial:
** within 1e-7 relative for x <= 88 (above, it clamps to exp(88)). Below
** -87.3 (the smallest normal result) it gives 0, -inf included; NaN stays
** NaN. Every lane is computed alone, so exp1 gives exp4's lanes exactly. */
INLINE v4f exp4(v4f x) {
  const v4f zero = {0, 0, 0, 0};
  v4i nan = x != x, under = x < -87.33654475f;
  v4f c = sel(nan | under, zero, sel(x > 88.0f, zero + 88.0f, x));
  v4f n = (c * 1.44269504088896341f + 12582912.f) - 12582912.f;     /* round to nearest */
  v4f r = (c - n * 0.693359375f) - n * -2.12194440e-4f;               /* ln2 in two parts */
  v4f p = r * 1.9875691500e-4f + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  v4i e = (__builtin_convertvector(n, v4i) + 127) << 23;           /* 2^n */
  return sel(nan, x, sel(under, zero, p * (v4f)e));
}

INLINE float exp1(float x) { return exp4((v4f){x, 0, 0, 0})[0]; }

#endif
