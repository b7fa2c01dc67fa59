/*
** vm/ops/moe.c — routed low-rank experts: routing, the sort by expert, the
** grouped expert products, the combine, the capacity mask, the counters
** and the balancing bias update. moe.h has the data layout.
**
**   moe_route(logits [N, E], bias [E] or nil; k, form) -> idx [N, k], w [N, k], counts [E]
**   moe_sort(idx [N, k]; E)                       -> perm [N*k], offsets [E+1], inv [N*k]
**   moe_experts(u [N, d], perm, offsets, Ug, Uu, cg, cu, D; k) -> y_rows [N*k, F]
**   moe_combine(y_rows [N*k, F], inv, w [N, k])   -> y [N, F]
**   moe_capacity(w, idx, inv, offsets; capacity)  -> w with overflow zeroed, drops [E]
**   moe_counters(counts [E])                      -> [busiest share, entropy, dead] f64
**   moe_balance_(bias [E], counts [E]; gamma)     -> bias, updated in place
**
** Every shape is fixed by N, k and E: nothing here reads a value back to
** the host. Index values are checked by kernels before anything is
** allocated (a device backend records a bad one and raises at its next
** synchronisation, see cuda.h). The kernels take contiguous tensors; the
** forwards make them so.
**
** moe_experts saves its inputs and, when recorded, the projections
** [x Ug[e] | x Uu[e]] of each sorted row (f32, 2r a row: 8 MB at b1): a
** backward that recomputed them read Ug and Uu once more than the floor
** counts (0.54 GB at b1, the product dx = [dag | dau] [Ug | Uu]^T reads them
** anyway).
*/
#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "core/core.h"
#include "core/alloc.h"
#include "core/autograd.h"
#include "ops/moe.h"
#include "ops/index.h"
#include "ops/quant.h"

bool dm_moe_fma_forced(void) {
  const char *s = getenv("DM_MOE_FMA");
  return s && *s && strcmp(s, "0");
}

bool dm_moe_few_off(void) {
  const char *s = getenv("DM_MOE_FEW");
  return s && strcmp(s, "0") == 0;
}

/* ---- checks ---------------------------------------------------------------------------------- */

/* the CPU kernels compute in f32 and f64; another backend may take more */
static void check_float(const char *what, const char *name, const dm_tensor *t) {
  bool ok = t->dtype == DM_F32 || t->dtype == DM_F64 || (t->device != DM_CPU && dm_dtype_is_float(t->dtype));
  if (!ok)
    dm_error("%s: %s must be f32 or f64%s, got %s", what, name, t->device == DM_CPU ? " on the CPU" : "",
             dm_dtype_name(t->dtype));
}

static void check_i64(const char *what, const char *name, const dm_tensor *t) {
  if (t->dtype != DM_I64) dm_error("%s: %s must be i64, got %s", what, name, dm_dtype_name(t->dtype));
}

static void check_ndim(const char *what, const char *name, const char *dims, const dm_tensor *t, int nd) {
  if (t->ndim != nd) {
    char s[128];
    dm_error("%s: %s must be %d-D %s, got shape %s", what, name, nd, dims, dm_tensor_shape_str(t, s, sizeof s));
  }
}

/* t must be `want` (nd dims, spelled `dims`), a shape read off ref */
static void expect_shape(const char *what, const char *name, const char *dims, const dm_tensor *t, int nd,
                         const int64_t *want, const char *ref_name, const dm_tensor *ref) {
  bool ok = t->ndim == nd;
  for (int i = 0; ok && i < nd; i++) ok = t->shape[i] == want[i];
  if (ok) return;
  char st[128], sw[128], sr[128];
  dm_error("%s: %s has shape %s, expected %s = %s from %s of shape %s", what, name,
           dm_tensor_shape_str(t, st, sizeof st), dims, dm_shape_str(sw, sizeof sw, nd, want), ref_name,
           dm_tensor_shape_str(ref, sr, sizeof sr));
}

static void check_same_dtype(const char *what, const char *name, const dm_tensor *t, const char *ref_name,
                             const dm_tensor *ref) {
  if (t->dtype != ref->dtype)
    dm_error("%s: %s is %s but %s is %s; they must match", what, name, dm_dtype_name(t->dtype), ref_name,
             dm_dtype_name(ref->dtype));
}

/* attribute i: a whole number >= lo */
static int64_t attr_int(const dm_ctx *c, int i, const char *name, int64_t lo) {
  double v = dm_attr(c, i);
  if (!(v >= (double)lo) || v != floor(v) || v > 9e15)
    dm_error("%s: %s must be a whole number of at least %lld, got %g", c->op->name, name, (long long)lo, v);
  return (int64_t)v;
}

/* BLAS takes int dims */
static void check_blas_dim(const char *what, const char *name, int64_t v) {
  if (v > INT_MAX) dm_error("%s: %s = %lld is over the int range of the BLAS products", what, name, (long long)v);
}

static void check_range(const char *what, const dm_tensor *idx, int64_t size) {
  DM_RUN(index_check, idx->device, idx, size, 0, what);
}

/* perm or inv: i64 [N * k] (rows, read off ref), values in 0 .. rows-1 */
static void check_rows_index(const char *what, const char *name, const dm_tensor *perm, int64_t rows,
                             const char *ref_name, const dm_tensor *ref) {
  check_i64(what, name, perm);
  expect_shape(what, name, "[N * k]", perm, 1, &rows, ref_name, ref);
  check_range(what, perm, rows);
}

/* offsets: i64 [E + 1] (experts read off ref when ref is given), from 0 up to rows */
static void check_offsets(const char *what, const dm_tensor *offsets, int64_t experts, int64_t rows,
                          const char *ref_name, const dm_tensor *ref) {
  check_i64(what, "offsets", offsets);
  int64_t want = experts + 1;
  if (ref) expect_shape(what, "offsets", "[E + 1]", offsets, 1, &want, ref_name, ref);
  else check_ndim(what, "offsets", "[E + 1]", offsets, 1);
  if (dm_plan_card_of(offsets->device))
    dm_plan_scratch(dm_moe_offsets_check_scratch(offsets->shape[0] - 1, dm_debug_level()),
                    "moe's offsets check (kernels/moe_route.cu cuda_check_offsets)");
  DM_RUN(moe_check_offsets, offsets->device, offsets, rows, what);
}

/* ---- moe_route ------------------------------------------------------------------------------- */

/* the form attribute (declared with its default, sigmoid) */
static int route_form(const dm_ctx *c) {
  double f = dm_attr(c, 1);
  if (f != DM_MOE_ROUTE_SIGMOID && f != DM_MOE_ROUTE_SOFTMAX)
    dm_error("moe_route: form must be one of " DM_MOE_ROUTE_SPELLINGS " (0, 1), got %g", f);
  return (int)f;
}

static void route_fwd(dm_ctx *c) {
  const char *what = "moe_route";
  dm_tensor *logits = c->in[0], *bias = c->in[1];
  check_ndim(what, "logits", "[N, E]", logits, 2);
  check_float(what, "logits", logits);
  int64_t n = logits->shape[0], e = logits->shape[1];
  if (bias) {
    expect_shape(what, "bias", "[E]", bias, 1, &e, "logits", logits);
    check_same_dtype(what, "bias", bias, "logits", logits);
  }
  int64_t k = attr_int(c, 0, "k", 1);
  if (k > e) dm_error("%s: k = %lld experts per token, but logits of shape [%lld, %lld] have only %lld",
                      what, (long long)k, (long long)n, (long long)e, (long long)e);
  int form = route_form(c);
  int64_t snk[2] = {n, k};
  dm_tensor *lg = dm_contiguous(logits), *b = bias ? dm_contiguous(bias) : NULL;
  dm_tensor *idx = dm_tensor_new(lg->device, DM_I64, 2, snk);
  dm_tensor *w = dm_tensor_new(lg->device, lg->dtype, 2, snk);
  dm_tensor *counts = dm_tensor_new(lg->device, DM_I64, 1, &e);
  if (dm_plan_card_of(lg->device) && !dm_moe_few(e, n * k))
    dm_plan_scratch(dm_bucket_counts_scratch(n * k, e), "moe_route counts (kernels/moe_route.cu bucket_counts)");
  DM_RUN(moe_route, lg->device, idx, w, counts, lg, b, form);
  dm_save(c, lg);
  dm_save(c, idx);
  dm_release(lg);
  dm_release(b);
  c->out[0] = idx;
  c->out[1] = w;
  c->out[2] = counts;
}

static void route_bwd(dm_ctx *c, dm_tensor *const *gout, dm_tensor **gin) {
  dm_tensor *gw = dm_contiguous(gout[1]);
  dm_tensor *gl = dm_new_grad(c, 0, gw->device);
  DM_RUN(moe_route_bwd, gl->device, gl, gw, dm_saved(c, 0), dm_saved(c, 1),
                                                               route_form(c));
  dm_release(gw);
  gin[0] = gl;
}

/* ---- moe_sort -------------------------------------------------------------------------------- */

static void sort_fwd(dm_ctx *c) {
  const char *what = "moe_sort";
  dm_tensor *idx = c->in[0];
  check_ndim(what, "idx", "[N, k]", idx, 2);
  check_i64(what, "idx", idx);
  int64_t e = attr_int(c, 0, "E (the number of experts)", 1);
  check_range("moe_sort (expert ids)", idx, e);
  int64_t rows = dm_numel(idx), e1 = e + 1;
  dm_tensor *ix = dm_contiguous(idx);
  dm_tensor *perm = dm_tensor_new(ix->device, DM_I64, 1, &rows);
  dm_tensor *offsets = dm_tensor_new(ix->device, DM_I64, 1, &e1);
  dm_tensor *inv = dm_tensor_new(ix->device, DM_I64, 1, &rows);
  if (dm_plan_card_of(ix->device) && !dm_moe_few(e, rows))
    dm_plan_scratch(dm_bucket_sort_scratch(rows, e), "moe_sort counters (kernels/moe_route.cu cuda_sort)");
  DM_RUN(moe_sort, ix->device, perm, offsets, inv, ix);
  dm_release(ix);
  c->out[0] = perm;
  c->out[1] = offsets;
  c->out[2] = inv;
}

/* ---- moe_experts ----------------------------------------------------------------------------- */

enum { X_U, X_PERM, X_OFFSETS, X_UG, X_UU, X_CG, X_CU, X_D, X_N };
/* the fp8 banks' codes and scales (optional, after the bank): Ug's, Uu's, D's */
enum { X_QG = X_N, X_SG, X_QU, X_SU, X_QD, X_SD, X_ALL };
#define X_CODES_MASK (((1u << X_ALL) - 1) & ~((1u << X_N) - 1))

/* with fp8 codes: factor i's (X_UG, X_UU, X_D) codes u8 [E, m, nq] and scales [E, m, nq / 32] (a float
** dtype), m and n read off the factor */
static void check_codes(const char *what, dm_tensor *const *in, int factor, int codes, const char *name) {
  const dm_tensor *w = in[factor], *q = in[codes], *sc = in[codes + 1];
  if (!q || !sc) dm_error("%s: fp8 banks need the codes and scales of Ug, Uu and D: %s's are missing", what, name);
  char sq[128];
  if (q->dtype != DM_U8)
    dm_error("%s: %s's fp8 codes must be u8, got %s", what, name, dm_dtype_name(q->dtype));
  check_float(what, "an fp8 bank's scales", sc);
  int64_t m = w->shape[1], n = w->shape[2];
  int64_t wq[3] = {w->shape[0], m, dm_bank_fp8_cols(n)}, ws[3] = {w->shape[0], m, dm_bank_fp8_blocks(n)};
  snprintf(sq, sizeof sq, "%s's codes", name);
  expect_shape(what, sq, "[E, m, n rounded up to 32]", q, 3, wq, name, w);
  snprintf(sq, sizeof sq, "%s's scales", name);
  expect_shape(what, sq, "[E, m, a scale a block of 32]", sc, 3, ws, name, w);
}

/* whether input i is a factor (Ug, Uu, D): with codes it gives only its shape and dtype (a stand-in), and
** the op neither reads nor copies it */
static bool is_factor(int i) { return i == X_UG || i == X_UU || i == X_D; }

/* Whether this device's kernels read the fp8 codes at these shapes; else the op gives them copies of
** the factors decoded to the compute dtype, and says so once. */
static bool kernels_read_codes(const dm_tensor *u, int64_t rows, const dm_tensor *ug, const dm_tensor *d) {
  return u->device != DM_CPU &&
         dm_moe_fp8_shapes(u->dtype, ug->shape[0], rows, ug->shape[1], d->shape[2], ug->shape[2]);
}

/* factor w's values from its codes, in dt: what the kernels would form as they load them */
static dm_tensor *decoded(const dm_tensor *w, const dm_tensor *codes, const dm_tensor *scales) {
  int64_t n = w->shape[2];
  dm_tensor *all = dm_quant_decode((dm_tensor *)codes, (dm_tensor *)scales, DM_QUANT_FP8_E4M3, DM_BANK_FP8_BLOCK,
                                   dm_bank_fp8_cols(n));
  dm_tensor *part = dm_narrow(all, 2, 0, n), *out = dm_cast(part, w->dtype);
  dm_tensor *own = dm_contiguous(out);
  dm_release(all);
  dm_release(part);
  dm_release(out);
  return own;
}

/* the bank the kernels take: x holds the op's inputs as they keep them; with codes the kernels read
** them where they can, else dec receives the decoded factors (released by the caller) */
static dm_moe_bank bank_of(dm_tensor *const *x, int64_t rows, const char *what, dm_tensor **dec) {
  dm_moe_bank b = {x[X_UG], x[X_UU], x[X_CG], x[X_CU], x[X_D], {0}, {0}, {0}};
  dec[0] = dec[1] = dec[2] = NULL;
  if (!x[X_QG]) return b;
  if (kernels_read_codes(x[X_U], rows, x[X_UG], x[X_D])) {
    b.qg = (dm_moe_q8){x[X_QG], x[X_SG]};
    b.qu = (dm_moe_q8){x[X_QU], x[X_SU]};
    b.qd = (dm_moe_q8){x[X_QD], x[X_SD]};
    return b;
  }
  static bool said;
  if (x[X_U]->device != DM_CPU && !said) {
    said = true;
    fprintf(stderr, "dormouse: %s: fp8 banks decoded to %s copies for the kernels (they read codes in bf16 at "
            "ranks 16, 32, 64, 128 and d a multiple of 8; here %s, d %lld, r %lld)\n", what,
            dm_dtype_name(x[X_U]->dtype), dm_dtype_name(x[X_U]->dtype), (long long)x[X_UG]->shape[1],
            (long long)x[X_UG]->shape[2]);
  }
  b.ug = dec[0] = decoded(x[X_UG], x[X_QG], x[X_SG]);
  b.uu = dec[1] = decoded(x[X_UU], x[X_QU], x[X_SU]);
  b.d = dec[2] = decoded(x[X_D], x[X_QD], x[X_SD]);
  return b;
}

static void experts_fwd(dm_ctx *c) {
  const char *what = "moe_experts";
  dm_tensor **in = c->in;
  dm_tensor *u = in[X_U], *ug = in[X_UG], *d = in[X_D];
  check_ndim(what, "u", "[N, d]", u, 2);
  check_ndim(what, "Ug", "[E, d, r]", ug, 3);
  check_ndim(what, "D", "[E, r, F]", d, 3);
  int64_t n = u->shape[0], dm = u->shape[1], e = ug->shape[0], r = ug->shape[2], f = d->shape[2];
  int64_t k = attr_int(c, 0, "k", 1);
  int64_t sug[3] = {e, dm, r}, sc[2] = {e, r}, sd[3] = {e, r, f};
  expect_shape(what, "Ug", "[E, d, r]", ug, 3, sug, "u", u);
  expect_shape(what, "Uu", "[E, d, r]", in[X_UU], 3, sug, "Ug", ug);
  expect_shape(what, "cg", "[E, r]", in[X_CG], 2, sc, "Ug", ug);
  expect_shape(what, "cu", "[E, r]", in[X_CU], 2, sc, "Ug", ug);
  expect_shape(what, "D", "[E, r, F]", d, 3, sd, "Ug", ug);
  static const char *names[X_N] = {"u", "perm", "offsets", "Ug", "Uu", "cg", "cu", "D"};
  check_float(what, "u", u);
  for (int i = X_UG; i < X_N; i++) check_same_dtype(what, names[i], in[i], "u", u);
  const bool q8 = in[X_QG] || in[X_SG] || in[X_QU] || in[X_SU] || in[X_QD] || in[X_SD];
  if (q8) {
    check_codes(what, in, X_UG, X_QG, "Ug");
    check_codes(what, in, X_UU, X_QU, "Uu");
    check_codes(what, in, X_D, X_QD, "D");
  }
  if (f < 1 || dm < 1 || r < 1) {
    char s1[128], s2[128];
    dm_error("%s: d, r and F must be at least 1 (u %s, D %s)", what, dm_tensor_shape_str(u, s1, sizeof s1),
             dm_tensor_shape_str(d, s2, sizeof s2));
  }
  check_blas_dim(what, "N * k", n * k);
  check_blas_dim(what, "d", dm);
  check_blas_dim(what, "F", f);
  check_rows_index(what, "perm", in[X_PERM], n * k, "u and k", u);
  check_offsets(what, in[X_OFFSETS], e, n * k, "Ug", ug);
  dm_tensor *x[X_ALL] = {0};
  for (int i = 0; i < X_ALL; i++) {
    if (i >= X_N && !q8) break;
    if (q8 && is_factor(i)) { dm_retain(in[i]); x[i] = in[i]; }      /* its shape: not read, not copied */
    else if (i >= X_N && (i - X_N) % 2 && in[i]->dtype != DM_F32) x[i] = dm_cast(in[i], DM_F32);   /* scales */
    else x[i] = dm_contiguous(in[i]);
  }
  int64_t sy[2] = {n * k, f}, sz[2] = {n * k, 2 * r};
  dm_tensor *y = dm_tensor_new(u->device, u->dtype, 2, sy);
  /* a recorded call keeps the projections: the backward then reads them instead of Ug and Uu again */
  dm_tensor *z = c->node ? dm_tensor_new(u->device, u->dtype == DM_F64 ? DM_F64 : DM_F32, 2, sz) : NULL;
  dm_tensor *dec[3];
  dm_moe_bank bank = bank_of(x, n * k, what, dec);
  /* (the plan takes the kernels' path, dm_moe_tc_path; an unaligned view, which it cannot see, would
  ** make the kernel take the FMA path's scratch) */
  if (dm_plan_card_of(u->device) && n * k > 0) {
    if (dm_moe_few_experts(e, n * k, f, r, bank.qg.codes != NULL))     /* codes the kernels read, as they ask */
      dm_plan_scratch(dm_moe_few_scratch(u->dtype == DM_F64 ? 8 : 4, n * k, dm, r),
                      "moe experts' partial projections (kernels/moe_experts.cu few_forward)");
    else
      dm_plan_scratch(dm_moe_experts_scratch(dm_moe_tc_path(u->dtype, e, n * k, dm, f, r), e, n * k, dm, f, r),
                      "moe experts hidden rows (kernels/moe_tc.cu tc_forward, moe_experts.cu experts_forward)");
  }
  DM_RUN(moe_experts, u->device, y, z, x[X_U], x[X_PERM], x[X_OFFSETS], &bank, k);
  for (int i = 0; i < 3; i++) dm_release(dec[i]);
  const int kept = q8 ? X_ALL : X_N;
  for (int i = 0; i < kept; i++) { dm_save(c, x[i]); dm_release(x[i]); }
  if (z) { dm_save(c, z); dm_release(z); }    /* last: the backward finds the codes by the count */
  c->out[0] = y;
}

static void experts_bwd(dm_ctx *c, dm_tensor *const *gout, dm_tensor **gin) {
  dm_tensor *x[X_ALL] = {0};
  const int kept = c->node->n_saved - 1;      /* the inputs, then z */
  for (int i = 0; i < kept; i++) x[i] = dm_saved(c, i);
  dm_tensor *z = dm_saved(c, kept);
  dm_tensor *gy = dm_contiguous(gout[0]);
  dm_device dev = gy->device;
  dm_tensor *g[X_N] = {0};
  for (int i = X_UG; i < X_N; i++) if (dm_needs_grad(c, i)) g[i] = dm_new_grad(c, i, dev);
  int64_t k = (int64_t)c->a.v[0], rows = dm_numel(x[X_PERM]);
  dm_tensor *gx_rows = NULL;
  if (dm_needs_grad(c, X_U)) {
    int64_t s[2] = {rows, x[X_U]->shape[1]};
    gx_rows = dm_tensor_new(dev, gy->dtype, 2, s);
  }
  dm_tensor *dec[3];
  dm_moe_bank bank = bank_of(x, rows, "moe_experts backward", dec);
  dm_moe_grads grads = {g[X_UG], g[X_UU], g[X_CG], g[X_CU], g[X_D]};
  if (dm_plan_card_of(dev)) {
    const int64_t e = x[X_UG]->shape[0], dm = x[X_UG]->shape[1], r = x[X_UG]->shape[2], f = x[X_D]->shape[2];
    const bool tc = dm_moe_tc_path(x[X_U]->dtype, e, rows, dm, f, r);
    dm_plan_scratch(dm_moe_experts_bwd_scratch(tc, x[X_U]->dtype == DM_F64 ? 8 : 4, e, rows, dm, f, r, g[X_D] != NULL,
                                               g[X_UG] || g[X_UU], g[X_CG] || g[X_CU]),
                    "moe experts backward rows (kernels/moe_tc.cu tc_backward, moe_experts.cu experts_backward)");
  }
  DM_RUN(moe_experts_bwd, dev, gx_rows, &grads, gy, z, x[X_U], x[X_PERM], x[X_OFFSETS],
                                                          &bank, k);
  for (int i = 0; i < 3; i++) dm_release(dec[i]);
  dm_release(gy);
  for (int i = X_UG; i < X_N; i++) gin[i] = g[i];
  if (gx_rows) {
    /* each token sums the gradients of its k rows, gathered through the inverse permutation */
    dm_tensor *inv = dm_tensor_new(dev, DM_I64, 1, &rows);
    DM_RUN(moe_invert, dev, inv, x[X_PERM]);
    dm_tensor *gu = dm_new_grad(c, X_U, dev);
    DM_RUN(moe_combine, dev, gu, gx_rows, inv, NULL);
    dm_release(inv);
    dm_release(gx_rows);
    gin[X_U] = gu;
  }
}

/* ---- bank_fp8 -------------------------------------------------------------------------------- */

static void bank_fp8_fwd(dm_ctx *c) {
  const char *what = "bank_fp8";
  dm_tensor *x = c->in[0];
  check_ndim(what, "x", "[E, m, n]", x, 3);
  check_float(what, "x", x);
  dm_dtype to = dm_attr(c, 0) == -1 ? x->dtype : dm_attr_dtype(c, 0);
  if (!dm_dtype_is_float(to) || dm_dtype_size(to) > dm_dtype_size(x->dtype))
    dm_error("%s: the values are rounded to a float dtype no wider than x's (%s) first, got %s", what,
             dm_dtype_name(x->dtype), dm_dtype_name(to));
  int64_t n = x->shape[2], sq[3] = {x->shape[0], x->shape[1], dm_bank_fp8_cols(n)},
          ss[3] = {x->shape[0], x->shape[1], dm_bank_fp8_blocks(n)};
  dm_tensor *xc = dm_contiguous(x);
  dm_tensor *codes = dm_tensor_new(x->device, DM_U8, 3, sq), *scales = dm_tensor_new(x->device, DM_F32, 3, ss);
  DM_RUN(bank_fp8, x->device, codes, scales, xc, to);
  dm_release(xc);
  c->out[0] = codes;
  c->out[1] = scales;
}

/* ---- moe_combine ----------------------------------------------------------------------------- */

static void combine_fwd(dm_ctx *c) {
  const char *what = "moe_combine";
  dm_tensor *rows = c->in[0], *inv = c->in[1], *w = c->in[2];
  check_ndim(what, "y_rows", "[N * k, F]", rows, 2);
  check_ndim(what, "w", "[N, k]", w, 2);
  check_float(what, "y_rows", rows);
  check_same_dtype(what, "w", w, "y_rows", rows);
  int64_t n = w->shape[0], k = w->shape[1], f = rows->shape[1], sr[2] = {n * k, f};
  expect_shape(what, "y_rows", "[N * k, F]", rows, 2, sr, "w", w);
  check_rows_index(what, "inv", inv, n * k, "w", w);
  dm_tensor *r = dm_contiguous(rows), *iv = dm_contiguous(inv), *wc = dm_contiguous(w);
  int64_t sy[2] = {n, f};
  dm_tensor *y = dm_tensor_new(r->device, r->dtype, 2, sy);
  DM_RUN(moe_combine, r->device, y, r, iv, wc);
  dm_save(c, r);
  dm_save(c, iv);
  dm_save(c, wc);
  dm_release(r);
  dm_release(iv);
  dm_release(wc);
  c->out[0] = y;
}

static void combine_bwd(dm_ctx *c, dm_tensor *const *gout, dm_tensor **gin) {
  dm_tensor *gy = dm_contiguous(gout[0]);
  dm_tensor *grows = dm_needs_grad(c, 0) ? dm_new_grad(c, 0, gy->device) : NULL;
  dm_tensor *gw = dm_needs_grad(c, 2) ? dm_new_grad(c, 2, gy->device) : NULL;
  DM_RUN(moe_combine_bwd, gy->device, grows, gw, gy, dm_saved(c, 0), dm_saved(c, 1),
                                                                dm_saved(c, 2));
  dm_release(gy);
  gin[0] = grows;
  gin[2] = gw;
}

/* ---- moe_capacity ---------------------------------------------------------------------------- */

static void capacity_fwd(dm_ctx *c) {
  const char *what = "moe_capacity";
  dm_tensor *w = c->in[0], *idx = c->in[1], *inv = c->in[2], *offsets = c->in[3];
  check_ndim(what, "w", "[N, k]", w, 2);
  check_float(what, "w", w);
  check_i64(what, "idx", idx);
  expect_shape(what, "idx", "[N, k]", idx, 2, w->shape, "w", w);
  check_ndim(what, "offsets", "[E + 1]", offsets, 1);
  int64_t e = offsets->shape[0] - 1, rows = dm_numel(w);
  if (e < 1) dm_error("%s: offsets must hold E + 1 >= 2 values, got %lld", what, (long long)offsets->shape[0]);
  int64_t cap = attr_int(c, 0, "capacity", 0);
  check_range("moe_capacity (expert ids)", idx, e);
  check_rows_index(what, "inv", inv, rows, "w", w);
  check_offsets(what, offsets, e, rows, NULL, NULL);
  dm_tensor *wc = dm_contiguous(w), *ix = dm_contiguous(idx), *iv = dm_contiguous(inv), *of = dm_contiguous(offsets);
  dm_tensor *out = dm_tensor_like(wc), *drops = dm_tensor_new(wc->device, DM_I64, 1, &e);
  if (dm_plan_card_of(wc->device))
    dm_plan_scratch(dm_moe_capacity_scratch(rows, e), "moe_capacity drops (kernels/moe_route.cu cuda_capacity)");
  DM_RUN(moe_capacity, wc->device, out, drops, wc, ix, iv, of, cap);
  dm_save(c, ix);
  dm_save(c, iv);
  dm_save(c, of);
  dm_release(wc);
  dm_release(ix);
  dm_release(iv);
  dm_release(of);
  c->out[0] = out;
  c->out[1] = drops;
}

/* the kept assignments pass their gradient, the dropped ones get 0: the same mask */
static void capacity_bwd(dm_ctx *c, dm_tensor *const *gout, dm_tensor **gin) {
  dm_tensor *g = dm_contiguous(gout[0]), *gw = dm_new_grad(c, 0, g->device);
  DM_RUN(moe_capacity, g->device, gw, NULL, g, dm_saved(c, 0), dm_saved(c, 1),
                                                          dm_saved(c, 2), (int64_t)c->a.v[0]);
  dm_release(g);
  gin[0] = gw;
}

/* ---- counters and balancing ------------------------------------------------------------------ */

static void counters_fwd(dm_ctx *c) {
  dm_tensor *counts = c->in[0];
  check_ndim("moe_counters", "counts", "[E]", counts, 1);
  check_i64("moe_counters", "counts", counts);
  int64_t three = 3;
  dm_tensor *cc = dm_contiguous(counts), *stats = dm_tensor_new(cc->device, DM_F64, 1, &three);
  DM_RUN(moe_counters, cc->device, stats, cc);
  dm_release(cc);
  c->out[0] = stats;
}

static void balance_fwd(dm_ctx *c) {
  const char *what = "moe_balance_";
  dm_tensor *bias = c->in[0], *counts = c->in[1];
  check_ndim(what, "bias", "[E]", bias, 1);
  check_float(what, "bias", bias);
  check_i64(what, "counts", counts);
  expect_shape(what, "counts", "[E]", counts, 1, bias->shape, "bias", bias);
  if (bias->requires_grad && dm_grad_enabled())
    dm_error("%s: in-place update of a bias that requires grad; the balancing bias takes no gradient", what);
  dm_tensor *b = dm_contiguous(bias), *cc = dm_contiguous(counts);
  DM_RUN(moe_balance, b->device, b, cc, c->a.v[0]);
  if (b != bias && b->storage != bias->storage) dm_copy_(bias, b);   /* a strided bias: write back */
  dm_release(b);
  dm_release(cc);
  dm_mark_written(bias);
  dm_retain(bias);
  c->out[0] = bias;
}

static dm_op ops[] = {
  {.name = "moe_route",
   .doc = "top-k of sigmoid(logits [N, E]) + bias [E] (form softmax: of logits + bias, gates a softmax over the "
          "k): idx [N, k] i64 (0-based), gates w [N, k], counts [E] i64",
   .args = "logits [N, E], bias [E]", .lua = DM_LUA_FN,
   .n_in = 2, .n_out = 3, .attrs = "k:int,form=" DM_MOE_ROUTE_SPELLINGS "~sigmoid", .optional = 1u << 1, .nondiff = 1u << 1,
   .forward = route_fwd, .backward = route_bwd},
  {.name = "moe_sort", .doc = "assignments idx [N, k] sorted by expert: perm [N*k], offsets [E+1], inv [N*k] (i64)",
   .args = "idx [N, k]", .lua = DM_LUA_FN, .n_in = 1, .n_out = 3, .attrs = "E:int", .nondiff = 1, .forward = sort_fwd},
  {.name = "moe_experts",
   .doc = "low-rank gated experts on the sorted rows: (silu(u Ug[e] * cg[e]) * (u Uu[e] * cu[e])) D[e] -> [N*k, F]",
   .n_in = X_ALL, .n_out = 1, .attrs = "k:int", .optional = X_CODES_MASK,
   .nondiff = (1u << X_PERM) | (1u << X_OFFSETS) | X_CODES_MASK, .forward = experts_fwd, .backward = experts_bwd},
  {.name = "bank_fp8",
   .doc = "an fp8 bank (ops/moe.h): E4M3 codes [E, m, nq] and f32 scales [E, m, nq / 32] of x's values in dtype "
          "(absent: x's)",
   .args = "x [E, m, n]", .lua = DM_LUA_FN, .n_in = 1, .n_out = 2, .attrs = "dtype:dtype~-1", .nondiff = 1,
   .forward = bank_fp8_fwd},
  {.name = "moe_combine", .doc = "y [N, F] = sum over a token's k assignments of w * y_rows[inv] (no atomics)",
   .args = "y_rows [N * k, F], inv [N * k], w [N, k]", .lua = DM_LUA_FN, .n_in = 3, .n_out = 1, .attrs = "", .nondiff = 1u << 1, .forward = combine_fwd, .backward = combine_bwd},
  {.name = "moe_capacity",
   .doc = "gates w [N, k] with assignments past an expert's capacity zeroed, and the drops per expert [E] i64",
   .n_in = 4, .n_out = 2, .attrs = "capacity:int", .nondiff = 0xe, .forward = capacity_fwd, .backward = capacity_bwd},
  {.name = "moe_counters", .doc = "from counts [E]: [busiest expert's share, load entropy (nats), dead experts] f64",
   .n_in = 1, .n_out = 1, .attrs = "", .nondiff = 1, .forward = counters_fwd},
  {.name = "moe_balance_", .doc = "bias += gamma * sign(mean(counts) - counts) in place (loss-free balancing)",
   .args = "bias [E], counts [E]", .lua = DM_LUA_FN, .n_in = 2, .n_out = 1, .attrs = "gamma", .nondiff = 3,
   .forward = balance_fwd},
};
DM_REGISTER_OPS(ops)

/* ---- the C API ------------------------------------------------------------------------------- */

static void call(const char *name, int n, dm_tensor *const *in, const dm_attrs *a, dm_tensor **out) {
  dm_call(dm_op_get(name), n, in, a, out);
}

void dm_moe_route(dm_tensor *logits, dm_tensor *bias, int64_t k, int form, dm_tensor **idx, dm_tensor **w,
                  dm_tensor **counts) {
  dm_tensor *in[2] = {logits, bias}, *out[3];
  dm_attrs a = dm_attrs_of(2, (double[]){(double)k, (double)form});
  call("moe_route", 2, in, &a, out);
  *idx = out[0];
  *w = out[1];
  *counts = out[2];
}

void dm_moe_sort(dm_tensor *idx, int64_t experts, dm_tensor **perm, dm_tensor **offsets, dm_tensor **inv) {
  dm_tensor *out[3];
  dm_attrs a = dm_attrs_of(1, (double[]){(double)experts});
  call("moe_sort", 1, &idx, &a, out);
  *perm = out[0];
  *offsets = out[1];
  *inv = out[2];
}

dm_tensor *dm_moe_experts(dm_tensor *u, dm_tensor *perm, dm_tensor *offsets, dm_tensor *ug, dm_tensor *uu,
                          dm_tensor *cg, dm_tensor *cu, dm_tensor *d, int64_t k) {
  dm_tensor *in[X_ALL] = {u, perm, offsets, ug, uu, cg, cu, d}, *y;     /* no fp8 codes */
  dm_attrs a = dm_attrs_of(1, (double[]){(double)k});
  call("moe_experts", X_ALL, in, &a, &y);
  return y;
}

dm_tensor *dm_moe_combine(dm_tensor *y_rows, dm_tensor *inv, dm_tensor *w) {
  dm_tensor *in[3] = {y_rows, inv, w}, *y;
  call("moe_combine", 3, in, NULL, &y);
  return y;
}

dm_tensor *dm_moe_capacity(dm_tensor *w, dm_tensor *idx, dm_tensor *inv, dm_tensor *offsets, int64_t capacity,
                           dm_tensor **drops) {
  dm_tensor *in[4] = {w, idx, inv, offsets}, *out[2];
  dm_attrs a = dm_attrs_of(1, (double[]){(double)capacity});
  call("moe_capacity", 4, in, &a, out);
  if (drops) *drops = out[1];
  else dm_release(out[1]);
  return out[0];
}

void dm_moe_balance_(dm_tensor *bias, dm_tensor *counts, double gamma) {
  dm_tensor *in[2] = {bias, counts}, *out;
  dm_attrs a = dm_attrs_of(1, &gamma);
  call("moe_balance_", 2, in, &a, &out);
  dm_release(out);
}

dm_moe_stats dm_moe_counters(const dm_tensor *counts) {
  dm_tensor *in = (dm_tensor *)counts, *stats;
  call("moe_counters", 1, &in, NULL, &stats);
  dm_tensor *host = stats->device == DM_CPU ? stats : dm_to_device(stats, DM_CPU);
  const double *v = dm_data(host);
  dm_moe_stats s = {v[0], v[1], (int64_t)v[2]};
  if (host != stats) dm_release(host);
  dm_release(stats);
  return s;
}
