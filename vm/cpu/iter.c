/*
** iter.c — the strided walk behind every elementwise CPU kernel.
*/
#include <string.h>
#include "iter.h"
#include "core/coalesce.h"

/* Operand strides over the output's shape, right-aligned; broadcast dims get 0. */
static void operand_strides(dm_iter *it, int k, const dm_tensor *t) {
  size_t es = dm_dtype_size(t->dtype);
  int off = it->ndim - t->ndim;
  for (int d = 0; d < it->ndim; d++) {
    int td = d - off;
    it->stride[k][d] = (td < 0 || t->shape[td] == 1) ? 0 : t->strides[td] * (int64_t)es;
  }
  it->base[k] = (char *)dm_data(t);
}

/* the dims merged where every operand steps through them as one (vm/core/coalesce.h) */
static void coalesce(dm_iter *it) {
  it->ndim = dm_coalesce_layout(it->ndim, it->shape, it->nops, it->stride);
}

void dm_iter_init(dm_iter *it, dm_tensor *out, int nin, dm_tensor *const *ins) {
  it->nops = nin + 1;
  it->ndim = out->ndim;
  for (int d = 0; d < out->ndim; d++) it->shape[d] = out->shape[d];
  operand_strides(it, 0, out);
  for (int k = 0; k < nin; k++) operand_strides(it, k + 1, ins[k]);
  coalesce(it);
}

void dm_iter_run(dm_iter *it, dm_row_fn row, void *ud) {
  int nd = it->ndim, last = nd - 1;
  for (int d = 0; d < nd; d++) if (it->shape[d] == 0) return;
  int64_t idx[DM_MAXDIM] = {0};
  char *p[DM_ITER_MAXOPS];
  int64_t st[DM_ITER_MAXOPS];
  for (int k = 0; k < it->nops; k++) st[k] = it->stride[k][last];
  for (;;) {
    for (int k = 0; k < it->nops; k++) {
      char *q = it->base[k];
      for (int d = 0; d < last; d++) q += idx[d] * it->stride[k][d];
      p[k] = q;
    }
    row(p, st, it->shape[last], ud);
    int d = last - 1;
    while (d >= 0 && ++idx[d] == it->shape[d]) idx[d--] = 0;
    if (d < 0) break;
  }
}

void dm_iter_walk(dm_tensor *out, int nin, dm_tensor *const *ins, dm_row_fn row, void *ud) {
  dm_iter it;
  dm_iter_init(&it, out, nin, ins);
  dm_iter_run(&it, row, ud);
}

dm_tensor *dm_grad2_init(dm_grad2 *u, dm_tensor *ga, dm_tensor *gb, const char *op) {
  if (ga && gb && (!dm_same_shape(ga, gb) ||
                   memcmp(ga->strides, gb->strides, sizeof(int64_t) * (size_t)ga->ndim) != 0))
    dm_error("%s backward kernel: the two gradients must share shape and strides", op);
  dm_tensor *lead = ga ? ga : gb;
  u->want_a = ga != NULL;
  u->want_b = gb != NULL;
  u->lead_base = lead ? dm_data(lead) : NULL;
  u->other_base = ga && gb ? dm_data(gb) : NULL;
  return lead;
}
