/*
** cpu/silu_mul.c — the kernels of the SiLU-gated product (silu_mul.h),
** forward and backward.
**
** Operands of any strides and shapes walk through dm_iter_walk (iter.h);
** f32 runs of unit stride take four-lane loops (GCC vector extensions), the
** others one element at a time, in double for f64 and in float otherwise.
*/
#include <tgmath.h>
#include "iter.h"
#include "vec.h"
#include "ops/silu_mul.h"
#include "ops/elementwise.h"

/* the formulas in terms of s = sigmoid(a), for scalars of any float type and for v4f lanes */
#define SM_Y(a, b, s) ((a) * (s) * (b))
#define SM_GA(g, a, b, s) ((g) * (b) * ((s) * (1 + (a) * (1 - (s)))))
#define SM_GB(g, a, s) ((g) * (a) * (s))

INLINE v4f sigmoid4(v4f a) { return 1 / (1 + exp4(-a)); }    /* exp4 clamps: 0 and 1 at the ends */

static void silu_mul_f32(float *y, const float *a, const float *b, int64_t n) {
  int64_t i = 0;
  for (; i + 4 <= n; i += 4) {
    v4f va = load4(a + i), s = sigmoid4(va);
    store4(y + i, SM_Y(va, load4(b + i), s));
  }
  for (; i < n; i++) { float s = DM_SIGMOID(a[i]); y[i] = SM_Y(a[i], b[i], s); }
}

/* p: y, a, b */
static void silu_mul_row(char **p, const int64_t *st_, int64_t n, void *ud) {
  dm_dtype dt = *(const dm_dtype *)ud;
  if (dt == DM_F32 && st_[0] == 4 && st_[1] == 4 && st_[2] == 4) {
    silu_mul_f32((float *)p[0], (const float *)p[1], (const float *)p[2], n);
    return;
  }
  for (int64_t i = 0; i < n; i++) {
    const char *pa = p[1] + i * st_[1], *pb = p[2] + i * st_[2];
    char *py = p[0] + i * st_[0];
    if (dt == DM_F64) {
      double a = *(const double *)pa, s = DM_SIGMOID(a);
      *(double *)py = SM_Y(a, *(const double *)pb, s);
    } else {                                   /* f32, bf16, f16 compute in float */
      float a = (float)ld(dt, pa), s = DM_SIGMOID(a);
      st(dt, py, SM_Y(a, (float)ld(dt, pb), s));
    }
  }
}

static void cpu_silu_mul(dm_tensor *y, const dm_tensor *a, const dm_tensor *b) {
  dm_tensor *in[2] = {(dm_tensor *)a, (dm_tensor *)b};
  dm_dtype dt = y->dtype;
  dm_iter_walk(y, 2, in, silu_mul_row, &dt);
}

typedef struct bwd_args { dm_dtype dt; dm_grad2 g2; } bwd_args;

static void silu_mul_bwd_f32(float *ga, float *gb, const float *g, const float *a, const float *b, int64_t n) {
  int64_t i = 0;
  for (; i + 4 <= n; i += 4) {
    v4f vg = load4(g + i), va = load4(a + i), vb = load4(b + i), s = sigmoid4(va);
    if (ga) store4(ga + i, SM_GA(vg, va, vb, s));
    if (gb) store4(gb + i, SM_GB(vg, va, s));
  }
  for (; i < n; i++) {
    float s = DM_SIGMOID(a[i]);
    if (ga) ga[i] = SM_GA(g[i], a[i], b[i], s);
    if (gb) gb[i] = SM_GB(g[i], a[i], s);
  }
}

/* p: the lead gradient, g, a, b */
static void silu_mul_bwd_row(char **p, const int64_t *st_, int64_t n, void *ud) {
  const bwd_args *u = ud;
  char *pa, *pb;
  dm_grad2_at(&u->g2, p[0], &pa, &pb);
  dm_dtype dt = u->dt;
  if (dt == DM_F32 && st_[0] == 4 && st_[1] == 4 && st_[2] == 4 && st_[3] == 4) {
    silu_mul_bwd_f32((float *)pa, (float *)pb, (const float *)p[1], (const float *)p[2], (const float *)p[3], n);
    return;
  }
  for (int64_t i = 0; i < n; i++) {
    const char *pg = p[1] + i * st_[1], *px = p[2] + i * st_[2], *py = p[3] + i * st_[3];
    int64_t o = i * st_[0];
    if (dt == DM_F64) {
      double g = *(const double *)pg, a = *(const double *)px, b = *(const double *)py, s = DM_SIGMOID(a);
      if (pa) *(double *)(pa + o) = SM_GA(g, a, b, s);
      if (pb) *(double *)(pb + o) = SM_GB(g, a, s);
    } else {
      float g = (float)ld(dt, pg), a = (float)ld(dt, px), b = (float)ld(dt, py), s = DM_SIGMOID(a);
      if (pa) st(dt, pa + o, SM_GA(g, a, b, s));
      if (pb) st(dt, pb + o, SM_GB(g, a, s));
    }
  }
}

static void cpu_silu_mul_bwd(dm_tensor *ga, dm_tensor *gb, const dm_tensor *g, const dm_tensor *a,
                             const dm_tensor *b) {
  bwd_args u;
  dm_tensor *lead = dm_grad2_init(&u.g2, ga, gb, "silu_mul");
  if (!lead) return;
  u.dt = lead->dtype;
  dm_tensor *in[3] = {(dm_tensor *)g, (dm_tensor *)a, (dm_tensor *)b};
  dm_iter_walk(lead, 3, in, silu_mul_bwd_row, &u);
}

static const dm_kernel_entry kernels[] = {
  DM_KERNEL_ENTRY(silu_mul, cpu_silu_mul),
  DM_KERNEL_ENTRY(silu_mul_bwd, cpu_silu_mul_bwd),
};
DM_REGISTER_KERNELS(DM_CPU, kernels)
