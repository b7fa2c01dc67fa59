/*
** cases_shape.c — views and copies against index arithmetic in plain loops.
**
** The oracles never look at strides: each output element is found from its
** multi-index (or its row-major position, for the ops that keep the order
** of elements). The harness adds the non-contiguous variants, which send
** reshape and contiguous down their copying paths.
*/
#include <math.h>
#include <string.h>
#include "harness.h"

/* ---- shared -------------------------------------------------------------------------------- */

/* nd dims of awkward sizes, at most max_numel elements in all */
static void awkward_shape(h_rng *r, int nd, int64_t *shape, int64_t max_numel) {
  int64_t n = 1;
  for (int d = 0; d < nd; d++) { shape[d] = h_size(r); n *= shape[d]; }
  while (n > max_numel) {
    int big = 0;
    for (int d = 1; d < nd; d++) if (shape[d] > shape[big]) big = d;
    n /= shape[big];
    shape[big] = h_int(r, 1, 3);
    n *= shape[big];
  }
}

static dm_tensor *rand_input(h_rng *r, int nd_lo, int nd_hi, int64_t max_numel) {
  int64_t shape[DM_MAXDIM];
  int nd = (int)h_int(r, nd_lo, nd_hi);
  awkward_shape(r, nd, shape, max_numel);
  return h_randn(r, nd, shape);
}

/* the elements of x in row-major order, in a new shape */
static dm_tensor *flat_oracle(const dm_tensor *x, int nd, const int64_t *shape) {
  dm_tensor *e = h_new(DM_F64, nd, shape);
  for (int64_t f = 0; f < dm_numel(e); f++) h_set(e, f, h_get(x, f));
  return e;
}

/* out[o] = x[src(o)] over an output of the given shape */
typedef void (*source_fn)(const int64_t *o, int64_t *i, const dm_tensor *x, const dm_attrs *a);

static dm_tensor *map_oracle(const dm_tensor *x, int nd, const int64_t *shape, source_fn src,
                             const dm_attrs *a) {
  dm_tensor *e = h_new(DM_F64, nd, shape);
  int64_t o[DM_MAXDIM], i[DM_MAXDIM];
  for (int64_t f = 0; f < dm_numel(e); f++) {
    h_unravel(e, f, o);
    src(o, i, x, a);
    h_set(e, f, h_at(x, i));
  }
  return e;
}

static void random_perm(h_rng *r, int n, int64_t *perm) {
  for (int d = 0; d < n; d++) perm[d] = d;
  for (int d = n - 1; d > 0; d--) {
    int j = (int)h_int(r, 0, d);
    int64_t t = perm[d]; perm[d] = perm[j]; perm[j] = t;
  }
}

/* ---- reshape --------------------------------------------------------------------------------- */

/* a random shape of x's numel: its prime factors dealt into up to 4 dims, with size-1 dims
** sprinkled in, and (every other trial) one dim given as -1 */
static void in_reshape(h_rng *r, int t, dm_tensor **in, dm_attrs *a) {
  in[0] = rand_input(r, 1, 4, 400);
  int64_t n = dm_numel(in[0]), shape[DM_MAXDIM];
  int nd = (int)h_int(r, 1, 4);
  for (int d = 0; d < nd; d++) shape[d] = 1;
  for (int64_t p = 2; n > 1; )
    if (n % p == 0) { shape[h_int(r, 0, nd - 1)] *= p; n /= p; } else p++;
  if (nd < DM_MAXDIM && h_int(r, 0, 1)) {          /* a size-1 dim somewhere */
    int at = (int)h_int(r, 0, nd);
    memmove(shape + at + 1, shape + at, sizeof(int64_t) * (size_t)(nd - at));
    shape[at] = 1;
    nd++;
  }
  if (t % 2 == 0) shape[h_int(r, 0, nd - 1)] = -1;
  *a = dm_attrs_list(nd, shape);
}

static void or_reshape(dm_tensor *const *in, const dm_attrs *a, dm_tensor **expect) {
  int64_t shape[DM_MAXDIM], known = 1;
  int infer = -1;
  for (int d = 0; d < a->nlist; d++) {
    shape[d] = a->list[d];
    if (shape[d] == -1) infer = d; else known *= shape[d];
  }
  if (infer >= 0) shape[infer] = dm_numel(in[0]) / known;
  expect[0] = flat_oracle(in[0], a->nlist, shape);
}

/* merging and splitting the leading dims of a tensor whose last dim is strided stays a view */
static void in_reshape_lead(h_rng *r, int t, dm_tensor **in, dm_attrs *a) {
  int64_t shape[3] = {h_int(r, 1, 4), h_int(r, 1, 6), h_size(r)};
  in[0] = h_randn(r, 3, shape);
  *a = dm_attrs_list(2, (int64_t[]){-1, shape[2]});
}

/* ---- permute, transpose ---------------------------------------------------------------------- */

static void in_permute(h_rng *r, int t, dm_tensor **in, dm_attrs *a) {
  in[0] = rand_input(r, 1, 5, 600);
  int64_t perm[DM_MAXDIM];
  random_perm(r, in[0]->ndim, perm);
  *a = dm_attrs_list(in[0]->ndim, perm);
}

static void src_permute(const int64_t *o, int64_t *i, const dm_tensor *x, const dm_attrs *a) {
  for (int d = 0; d < x->ndim; d++) i[a->list[d]] = o[d];
}

static void or_permute(dm_tensor *const *in, const dm_attrs *a, dm_tensor **expect) {
  int64_t shape[DM_MAXDIM];
  for (int d = 0; d < in[0]->ndim; d++) shape[d] = in[0]->shape[a->list[d]];
  expect[0] = map_oracle(in[0], in[0]->ndim, shape, src_permute, a);
}

static void in_transpose(h_rng *r, int t, dm_tensor **in, dm_attrs *a) {
  in[0] = rand_input(r, 1, 4, 600);
  int nd = in[0]->ndim;
  *a = dm_attrs_of(2, (double[]){(double)h_int(r, 0, nd - 1), (double)h_int(r, 0, nd - 1)});
}

static void src_transpose(const int64_t *o, int64_t *i, const dm_tensor *x, const dm_attrs *a) {
  int d0 = (int)a->v[0], d1 = (int)a->v[1];
  memcpy(i, o, sizeof(int64_t) * (size_t)x->ndim);
  i[d0] = o[d1];
  i[d1] = o[d0];
}

static void or_transpose(dm_tensor *const *in, const dm_attrs *a, dm_tensor **expect) {
  int64_t shape[DM_MAXDIM];
  memcpy(shape, in[0]->shape, sizeof shape);
  shape[(int)a->v[0]] = in[0]->shape[(int)a->v[1]];
  shape[(int)a->v[1]] = in[0]->shape[(int)a->v[0]];
  expect[0] = map_oracle(in[0], in[0]->ndim, shape, src_transpose, a);
}

/* ---- narrow ---------------------------------------------------------------------------------- */

static void in_narrow(h_rng *r, int t, dm_tensor **in, dm_attrs *a) {
  in[0] = rand_input(r, 1, 4, 600);
  int dim = (int)h_int(r, 0, in[0]->ndim - 1);
  int64_t size = in[0]->shape[dim], start = h_int(r, 0, size - 1), len = h_int(r, 1, size - start);
  *a = dm_attrs_of(3, (double[]){dim, (double)start, (double)len});
}

static void src_narrow(const int64_t *o, int64_t *i, const dm_tensor *x, const dm_attrs *a) {
  memcpy(i, o, sizeof(int64_t) * (size_t)x->ndim);
  i[(int)a->v[0]] += (int64_t)a->v[1];
}

static void or_narrow(dm_tensor *const *in, const dm_attrs *a, dm_tensor **expect) {
  int64_t shape[DM_MAXDIM];
  memcpy(shape, in[0]->shape, sizeof shape);
  shape[(int)a->v[0]] = (int64_t)a->v[2];
  expect[0] = map_oracle(in[0], in[0]->ndim, shape, src_narrow, a);
}

/* ---- expand ---------------------------------------------------------------------------------- */

/* x has some size-1 dims; the target grows them, keeps others (as -1 or their size), adds 0-2 leading dims */
static void in_expand(h_rng *r, int t, dm_tensor **in, dm_attrs *a) {
  int nd = (int)h_int(r, 1, 3), lead = (int)h_int(r, 0, 2);
  int64_t shape[DM_MAXDIM], target[DM_MAXDIM];
  awkward_shape(r, nd, shape, 40);
  for (int d = 0; d < nd; d++) if (h_int(r, 0, 1)) shape[d] = 1;
  in[0] = h_randn(r, nd, shape);
  for (int d = 0; d < lead; d++) target[d] = h_int(r, 1, 4);
  for (int d = 0; d < nd; d++)
    target[lead + d] = shape[d] == 1 ? h_int(r, 1, 5) : h_int(r, 0, 1) ? -1 : shape[d];
  *a = dm_attrs_list(lead + nd, target);
}

static void src_expand(const int64_t *o, int64_t *i, const dm_tensor *x, const dm_attrs *a) {
  int lead = a->nlist - x->ndim;
  for (int d = 0; d < x->ndim; d++) i[d] = x->shape[d] == 1 ? 0 : o[lead + d];
}

static void or_expand(dm_tensor *const *in, const dm_attrs *a, dm_tensor **expect) {
  int64_t shape[DM_MAXDIM];
  int lead = a->nlist - in[0]->ndim;
  for (int d = 0; d < a->nlist; d++) shape[d] = a->list[d] == -1 ? in[0]->shape[d - lead] : a->list[d];
  expect[0] = map_oracle(in[0], a->nlist, shape, src_expand, a);
}

/* ---- squeeze, unsqueeze ---------------------------------------------------------------------- */

/* x with several size-1 dims; dim is -1 (all), a size-1 dim, or (trial 2) a dim that is not size 1 */
static void in_squeeze(h_rng *r, int t, dm_tensor **in, dm_attrs *a) {
  int nd = (int)h_int(r, 2, 5);
  int64_t shape[DM_MAXDIM];
  awkward_shape(r, nd, shape, 300);
  for (int d = 0; d < nd; d++) if (h_int(r, 0, 2) == 0) shape[d] = 1;
  shape[h_int(r, 0, nd - 1)] = 1;
  if (t == 2) shape[0] = 3;
  in[0] = h_randn(r, nd, shape);
  int dim = -1;
  if (t == 2) dim = 0;
  else if (t % 2) do dim = (int)h_int(r, 0, nd - 1); while (shape[dim] != 1);
  *a = dm_attrs_of(1, (double[]){dim});
}

static void or_squeeze(dm_tensor *const *in, const dm_attrs *a, dm_tensor **expect) {
  int64_t shape[DM_MAXDIM];
  int n = 0, only = (int)a->v[0];
  for (int d = 0; d < in[0]->ndim; d++)
    if (!(in[0]->shape[d] == 1 && (only < 0 || only == d))) shape[n++] = in[0]->shape[d];
  expect[0] = flat_oracle(in[0], n, shape);
}

static void in_unsqueeze(h_rng *r, int t, dm_tensor **in, dm_attrs *a) {
  in[0] = rand_input(r, 1, 4, 600);
  *a = dm_attrs_of(1, (double[]){(double)h_int(r, 0, in[0]->ndim)});
}

static void or_unsqueeze(dm_tensor *const *in, const dm_attrs *a, dm_tensor **expect) {
  int64_t shape[DM_MAXDIM];
  int at = (int)a->v[0];
  for (int d = 0, s = 0; d <= in[0]->ndim; d++) shape[d] = d == at ? 1 : in[0]->shape[s++];
  expect[0] = flat_oracle(in[0], in[0]->ndim + 1, shape);
}

/* ---- contiguous, clone, cast ----------------------------------------------------------------- */

static void in_plain(h_rng *r, int t, dm_tensor **in, dm_attrs *a) {
  in[0] = rand_input(r, 0, 4, 600);
}

static void or_same(dm_tensor *const *in, const dm_attrs *a, dm_tensor **expect) {
  expect[0] = flat_oracle(in[0], in[0]->ndim, in[0]->shape);
}

static void in_cast_f64(h_rng *r, int t, dm_tensor **in, dm_attrs *a) {
  in[0] = rand_input(r, 0, 4, 600);
  *a = dm_attrs_of(1, (double[]){DM_F64});
}

/* to a narrower float dtype (f32, bf16, f16 by trial): the values rounded as dm_store rounds */
static void in_cast_narrow(h_rng *r, int t, dm_tensor **in, dm_attrs *a) {
  static const dm_dtype to[] = {DM_F32, DM_BF16, DM_F16};
  in[0] = rand_input(r, 0, 4, 600);
  *a = dm_attrs_of(1, (double[]){to[t % 3]});
}

/* float to integer (whole values, so no rounding rule is involved), or integer to float */
static void in_cast_int(h_rng *r, int t, dm_tensor **in, dm_attrs *a) {
  static const dm_dtype to[] = {DM_I32, DM_I64, DM_F64, DM_F32};
  int64_t shape[DM_MAXDIM];
  int nd = (int)h_int(r, 1, 3);
  awkward_shape(r, nd, shape, 300);
  dm_tensor *ints = h_indices(r, nd, shape, -100, 100);
  dm_dtype target = to[t % 4];
  if (dm_dtype_is_float(target)) in[0] = ints;
  else { in[0] = dm_tensor_like_dtype(ints, DM_F64); dm_copy_(in[0], ints); dm_release(ints); }
  *a = dm_attrs_of(1, (double[]){target});
}

static void or_cast(dm_tensor *const *in, const dm_attrs *a, dm_tensor **expect) {
  dm_dtype to = (dm_dtype)(int)a->v[0];
  dm_tensor *e = h_new(DM_F64, in[0]->ndim, in[0]->shape);
  char one[8];
  for (int64_t f = 0; f < dm_numel(e); f++) {
    dm_store(to, one, h_get(in[0], f));
    h_set(e, f, dm_load(to, one));
  }
  expect[0] = e;
}

/* ---- cat, stack ------------------------------------------------------------------------------- */

/* 3 inputs (4 in trial 5) that differ along dim, one of them sometimes of size 1 there */
static void in_cat(h_rng *r, int t, dm_tensor **in, dm_attrs *a) {
  int nd = (int)h_int(r, 1, 4), n = t == 5 ? 4 : 3;
  int64_t shape[DM_MAXDIM];
  awkward_shape(r, nd, shape, 200);
  int dim = (int)h_int(r, 0, nd - 1);
  for (int i = 0; i < n; i++) {
    shape[dim] = i == 1 && t % 2 ? 1 : h_size(r);
    in[i] = h_randn(r, nd, shape);
  }
  *a = dm_attrs_of(1, (double[]){dim});
}

static void or_cat(dm_tensor *const *in, const dm_attrs *a, dm_tensor **expect) {
  int dim = (int)a->v[0], n = 0;
  int64_t shape[DM_MAXDIM], o[DM_MAXDIM];
  while (n < DM_MAXIN && in[n]) n++;
  memcpy(shape, in[0]->shape, sizeof shape);
  shape[dim] = 0;
  for (int i = 0; i < n; i++) shape[dim] += in[i]->shape[dim];
  dm_tensor *e = h_new(DM_F64, in[0]->ndim, shape);
  for (int64_t f = 0; f < dm_numel(e); f++) {
    h_unravel(e, f, o);
    int i = 0;
    while (o[dim] >= in[i]->shape[dim]) o[dim] -= in[i++]->shape[dim];
    h_set(e, f, h_at(in[i], o));
  }
  expect[0] = e;
}

static void in_stack(h_rng *r, int t, dm_tensor **in, dm_attrs *a) {
  int nd = (int)h_int(r, 0, 3), n = (int)h_int(r, 1, 4);
  int64_t shape[DM_MAXDIM];
  awkward_shape(r, nd, shape, 200);
  for (int i = 0; i < n; i++) in[i] = h_randn(r, nd, shape);
  *a = dm_attrs_of(1, (double[]){(double)h_int(r, 0, nd)});
}

static void or_stack(dm_tensor *const *in, const dm_attrs *a, dm_tensor **expect) {
  int dim = (int)a->v[0], n = 0, nd = in[0]->ndim;
  int64_t shape[DM_MAXDIM], o[DM_MAXDIM], i[DM_MAXDIM];
  while (n < DM_MAXIN && in[n]) n++;
  for (int d = 0, s = 0; d <= nd; d++) shape[d] = d == dim ? n : in[0]->shape[s++];
  dm_tensor *e = h_new(DM_F64, nd + 1, shape);
  for (int64_t f = 0; f < dm_numel(e); f++) {
    h_unravel(e, f, o);
    for (int d = 0, s = 0; d <= nd; d++) if (d != dim) i[s++] = o[d];
    h_set(e, f, h_at(in[o[dim]], i));
  }
  expect[0] = e;
}

/* stand_in: x's shape, every element NaN (its gradient, a cast's, is x's: tests/lua/model_spec.lua) */
static void or_stand_in(dm_tensor *const *in, const dm_attrs *a, dm_tensor **expect) {
  (void)a;
  expect[0] = h_new(DM_F64, in[0]->ndim, in[0]->shape);
  for (int64_t i = 0; i < dm_numel(expect[0]); i++) h_set(expect[0], i, NAN);
}

static const dm_case cases[] = {
  {.op = "reshape", .label = "random factors, -1", .inputs = in_reshape, .oracle = or_reshape, .trials = 10},
  {.op = "reshape", .label = "merge leading dims", .inputs = in_reshape_lead, .oracle = or_reshape},
  {.op = "permute", .label = "random permutation", .inputs = in_permute, .oracle = or_permute},
  {.op = "transpose", .label = "random dims", .inputs = in_transpose, .oracle = or_transpose},
  {.op = "narrow", .label = "random window", .inputs = in_narrow, .oracle = or_narrow},
  {.op = "expand", .label = "size-1 dims, leading", .inputs = in_expand, .oracle = or_expand},
  {.op = "squeeze", .label = "all, one, not size 1", .inputs = in_squeeze, .oracle = or_squeeze},
  {.op = "unsqueeze", .label = "every position", .inputs = in_unsqueeze, .oracle = or_unsqueeze},
  {.op = "contiguous", .label = "any layout", .inputs = in_plain, .oracle = or_same},
  {.op = "clone", .label = "any layout", .inputs = in_plain, .oracle = or_same},
  {.op = "cast", .label = "to f64", .inputs = in_cast_f64, .oracle = or_cast},
  {.op = "cast", .label = "to f32 bf16 f16", .inputs = in_cast_narrow, .oracle = or_cast, .no_grad = true},
  {.op = "cast", .label = "float <-> int", .inputs = in_cast_int, .oracle = or_cast, .no_grad = true, .trials = 8},
  {.op = "cat", .label = "3-4 inputs", .inputs = in_cat, .oracle = or_cat},
  {.op = "stack", .label = "1-4 inputs", .inputs = in_stack, .oracle = or_stack},
  {.op = "stand_in", .label = "to f32 bf16 f16", .inputs = in_cast_narrow, .oracle = or_stand_in, .no_grad = true},
};
DM_REGISTER_CASES(cases)
