/*
** cases_xent.c — cross_entropy against plain loops in double.
**
** Values are multiples of 2^-10 (values.h). Shapes are awkward: V = 1 to
** 257 with 0..2 leading dims, targets of i64, i32 and u8, ignored rows.
*/
#include <math.h>
#include "harness.h"
#include "values.h"
#include "ops/xent.h"

static const int64_t classes[] = {256, 1, 2, 3, 5, 7, 13, 17, 31, 256, 64, 257};
static const int64_t ignores[] = {-1, 2, -100, 0};

/* logits [lead..., V] (0..2 leading dims), targets [lead...] of i64, i32 or u8 with
** about a quarter of the rows at ignore_index (when there is one), never all of them */
static void in_ce(h_rng *r, int k, dm_tensor **in, dm_attrs *a) {
  int64_t shape[DM_MAXDIM] = {8192, 256};
  int64_t v = k == PERF ? 256 : classes[k % 12], ignore = k == PERF ? -1 : ignores[k % 4];
  /* few rows at large V: finite differences of a mean over many rows lose their digits */
  int nd = k == PERF ? 2 : rows_shape(r, shape, v, v >= 64 ? 1 : 2);
  in[0] = normal(r, nd, shape, 3);
  dm_dtype tdt = k % 3 == 0 ? DM_I64 : k % 3 == 1 ? DM_I32 : ignore >= -1 ? DM_U8 : DM_I32;
  dm_tensor *t = h_new(tdt, nd - 1, shape);
  int64_t rows = dm_numel(t);
  for (int64_t i = 0; i < rows; i++) {
    bool skip = ignore != -1 && i > 0 && h_int(r, 0, 3) == 0;
    int64_t c = h_int(r, 0, v - 1);
    if (c == ignore && v > 1) c = (c + 1) % v;       /* only the chosen rows are ignored */
    h_set(t, i, (double)(skip ? ignore : c));
  }
  in[1] = t;
  double at[2] = {(double)ignore, (double)(k == PERF ? DM_CE_MEAN : k % 3)};
  *a = dm_attrs_of(2, at);
}

static void o_ce(dm_tensor *const *in, const dm_attrs *a, dm_tensor **ex) {
  const dm_tensor *x = in[0], *t = in[1];
  int64_t v = x->shape[x->ndim - 1], rows = dm_numel(t), ignore = (int64_t)a->v[0], kept = 0;
  int red = (int)a->v[1];
  dm_tensor *each = h_new(DM_F64, t->ndim, t->shape);
  double total = 0;
  for (int64_t r = 0; r < rows; r++) {
    int64_t target = (int64_t)h_get(t, r);
    if (ignore != -1 && target == ignore) continue;
    double m = -INFINITY, s = 0;
    for (int64_t j = 0; j < v; j++) m = fmax(m, h_get(x, r * v + j));
    for (int64_t j = 0; j < v; j++) s += exp(h_get(x, r * v + j) - m);
    double l = m + log(s) - h_get(x, r * v + target);
    h_set(each, r, l);
    total += l;
    kept++;
  }
  if (red == DM_CE_NONE) { ex[0] = each; return; }
  dm_release(each);
  ex[0] = h_new(DM_F64, 0, NULL);
  h_set(ex[0], 0, red == DM_CE_MEAN ? total / (double)kept : total);
}

static const dm_case cases[] = {
  {"cross_entropy", "V 1..257, ignored rows", in_ce, o_ce, .trials = 24, .perf_trial = PERF + 1},
};
DM_REGISTER_CASES(cases)
