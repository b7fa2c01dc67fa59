/*
** cases_fuse.c — the op "fuse" (vm/ops/fuse.h) on one fused op built here from
** its postfix programs, silu(a) * b + 0.5 * c with its hand-derived
** gradients, against plain loops in double; three inputs broadcasting.
**
** dm.fuse makes such programs from an expression (lua/dormouse/fuse.lua;
** tests/lua/fuse_spec.lua checks the parser, the derivative and the CUDA
** source). This op has no CUDA source, so `ops --device cuda` lists it as
** without a CUDA kernel; the GPU's fused kernels are checked by
** tests/gpu/fuse_graph.lua.
*/
#include <math.h>
#include <string.h>
#include "harness.h"
#include "ops/elementwise.h"
#include "ops/fuse.h"

#define TRIALS 6

#define I(k) DM_FOP_INPUT, k
#define K(v) DM_FOP_CONST, v
#define OP(o) DM_FOP_##o, 0
#define U(o, kind) DM_FOP_##o, DM_UNARY_##kind

static int fused_id(void) {
  static int id = -1;
  if (id >= 0) return id;
  /* out = silu(a) * b + 0.5 * c; g is input 3 */
  static const double fwd[] = {I(0), U(UNARY, SILU), I(1), OP(MUL), K(0.5), I(2), OP(MUL), OP(ADD)};
  static const double da[] = {I(3), I(0), U(DUNARY, SILU), OP(MUL), I(1), OP(MUL)};
  static const double db[] = {I(3), I(0), U(UNARY, SILU), OP(MUL)};
  static const double dc[] = {I(3), K(0.5), OP(MUL)};
  const double *code[4] = {fwd, da, db, dc};
  size_t len[4] = {sizeof fwd, sizeof da, sizeof db, sizeof dc};
  static int ops[4][16];
  static double args[4][16];
  dm_fprog p[4];
  for (int k = 0; k < 4; k++) {
    p[k].n = (int)(len[k] / sizeof(double) / 2);
    p[k].op = ops[k];
    p[k].arg = args[k];
    for (int i = 0; i < p[k].n; i++) { ops[k][i] = (int)code[k][2 * i]; args[k][i] = code[k][2 * i + 1]; }
  }
  id = dm_fused_new("silu(a) * b + 0.5 * c", 3, &p[0], &p[1], NULL, NULL);
  return id;
}

static int64_t size_of(h_rng *r) { return h_size(r); }

/* a [p, 1, q], b [m, 1] or [m, q], c [q] or a scalar */
static void in_fuse(h_rng *r, int k, dm_tensor **in, dm_attrs *a) {
  int64_t p = size_of(r), m = size_of(r), q = size_of(r);
  int64_t sa[3] = {p, 1, q}, sb[2] = {m, k % 2 ? q : 1}, sc[1] = {q};
  in[0] = h_randn(r, 3, sa);
  in[1] = h_randn(r, 2, sb);
  in[2] = h_randn(r, k == 2 ? 0 : 1, sc);
  double v = fused_id();
  *a = dm_attrs_of(1, &v);
}

static double at(const dm_tensor *t, int nd, const int64_t *idx) {
  int64_t ti[DM_MAXDIM];
  for (int d = 0; d < t->ndim; d++) ti[d] = t->shape[d] == 1 ? 0 : idx[d + nd - t->ndim];
  return h_at(t, ti);
}

static void ref_fuse(dm_tensor *const *in, const dm_attrs *at_, dm_tensor **ex) {
  int64_t shape[3], idx[3];
  const dm_tensor *a = in[0], *b = in[1], *c = in[2];
  shape[0] = a->shape[0];
  shape[1] = b->shape[0];
  shape[2] = a->shape[2];
  ex[0] = h_new(DM_F64, 3, shape);
  for (int64_t i = 0; i < dm_numel(ex[0]); i++) {
    h_unravel(ex[0], i, idx);
    double x = at(a, 3, idx), y = at(b, 3, idx), z = at(c, 3, idx);
    h_set(ex[0], i, x / (1 + exp(-x)) * y + 0.5 * z);
  }
}

static const dm_case cases[] = {
  {"fuse", "silu(a) * b + 0.5 * c", in_fuse, ref_fuse, TRIALS},
};
DM_REGISTER_CASES(cases)
