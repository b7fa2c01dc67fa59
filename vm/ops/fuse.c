/*
** fuse.c — the op "fuse" (fuse.h): a fused elementwise expression and its
** symbolic backward, the registry of fused ops, and the CPU kernel that
** evaluates their postfix programs.
**
** The CPU kernel is the oracle (and the CI path): every element is computed
** in double, whatever the dtype, and rounded once on store. It walks the
** operands (up to 8 inputs and g, up to 8 outputs: more than vm/cpu/iter.h's
** four) row by row over the merged dims, and runs each program over a chunk
** of a row at a time, so the interpretation costs little per element. The
** unary functions are elementwise.h's formulas, expanded here for double and
** stringized for the CUDA source (dm_fuse_cuda_prelude).
*/
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "core/core.h"
#include "core/autograd.h"
#include "ops/elementwise.h"
#include "ops/fuse.h"
#include "core/coalesce.h"

/* ---- the registry ------------------------------------------------------------------------ */

static dm_fused **reg;
static int n_reg, cap_reg;

static void *xcalloc(size_t n, size_t size) {
  void *p = calloc(n ? n : 1, size);
  if (!p) dm_error("dm.fuse: out of host memory");
  return p;
}

static char *xstrdup(const char *s) {
  if (!s) return NULL;
  char *d = xcalloc(strlen(s) + 1, 1);
  memcpy(d, s, strlen(s) + 1);
  return d;
}

/* checks a program's operands and stack discipline; returns its depth */
static int check_prog(const char *expr, const dm_fprog *p, int n_inputs) {
  static const int pops[DM_NFOP] = {
    [DM_FOP_INPUT] = 0, [DM_FOP_CONST] = 0, [DM_FOP_NEG] = 1, [DM_FOP_ADD] = 2, [DM_FOP_SUB] = 2,
    [DM_FOP_MUL] = 2, [DM_FOP_DIV] = 2, [DM_FOP_POW] = 1, [DM_FOP_LT] = 2, [DM_FOP_LE] = 2,
    [DM_FOP_GT] = 2, [DM_FOP_GE] = 2, [DM_FOP_EQ] = 2, [DM_FOP_NE] = 2, [DM_FOP_WHERE] = 3,
    [DM_FOP_UNARY] = 1, [DM_FOP_DUNARY] = 1};
  int sp = 0, depth = 0;
  for (int i = 0; i < p->n; i++) {
    int op = p->op[i];
    if (op < 0 || op >= DM_NFOP) dm_error("dm.fuse: '%s': bad opcode %d at %d", expr, op, i + 1);
    double a = p->arg[i];
    if (op == DM_FOP_INPUT && (a < 0 || a >= n_inputs || a != (int)a))
      dm_error("dm.fuse: '%s': input %g out of range (%d inputs)", expr, a, n_inputs);
    if ((op == DM_FOP_UNARY || op == DM_FOP_DUNARY) && (a < 0 || a >= DM_NUNARY || a != (int)a))
      dm_error("dm.fuse: '%s': unknown unary kind %g", expr, a);
    if (sp < pops[op]) dm_error("dm.fuse: '%s': the program pops an empty stack at %d", expr, i + 1);
    sp += 1 - pops[op];
    if (sp > depth) depth = sp;
  }
  if (p->n > 0 && sp != 1) dm_error("dm.fuse: '%s': the program leaves %d values", expr, sp);
  return depth;
}

static void copy_prog(dm_fprog *dst, const dm_fprog *src, int depth) {
  dst->n = src->n;
  dst->depth = depth;
  dst->op = xcalloc((size_t)src->n, sizeof *dst->op);
  dst->arg = xcalloc((size_t)src->n, sizeof *dst->arg);
  memcpy(dst->op, src->op, sizeof *dst->op * (size_t)src->n);
  memcpy(dst->arg, src->arg, sizeof *dst->arg * (size_t)src->n);
}

int dm_fused_new(const char *expr, int n_in, const dm_fprog *fwd, const dm_fprog *bwd, const char *src_fwd,
                 const char *src_bwd) {
  if (n_in < 1 || n_in > DM_FUSE_MAXIN)
    dm_error("dm.fuse: '%s' has %d inputs; a fused op takes 1 to %d", expr, n_in, DM_FUSE_MAXIN);
  if (fwd->n == 0) dm_error("dm.fuse: '%s': an empty forward program", expr);
  int depth[1 + DM_FUSE_MAXIN];
  depth[0] = check_prog(expr, fwd, n_in);
  for (int i = 0; i < n_in; i++) depth[i + 1] = check_prog(expr, &bwd[i], n_in + 1);
  if (n_reg == cap_reg) {
    int cap = cap_reg ? 2 * cap_reg : 16;
    dm_fused **r = realloc(reg, sizeof *r * (size_t)cap);
    if (!r) dm_error("dm.fuse: out of host memory");
    reg = r;
    cap_reg = cap;
  }
  dm_fused *f = xcalloc(1, sizeof *f);
  f->id = n_reg;
  f->expr = xstrdup(expr);
  f->n_in = n_in;
  f->n_out[DM_FUSE_FWD] = 1;
  f->n_out[DM_FUSE_BWD] = n_in;
  copy_prog(&f->prog[DM_FUSE_FWD][0], fwd, depth[0]);
  for (int i = 0; i < n_in; i++) copy_prog(&f->prog[DM_FUSE_BWD][i], &bwd[i], depth[i + 1]);
  for (int i = 0; i < n_in; i++)                 /* the inputs the backward reads (g is input n_in) */
    for (int j = 0; j < bwd[i].n; j++)
      if (bwd[i].op[j] == DM_FOP_INPUT && bwd[i].arg[j] < n_in) f->bwd_reads |= 1u << (int)bwd[i].arg[j];
  f->source[DM_FUSE_FWD] = xstrdup(src_fwd);
  f->source[DM_FUSE_BWD] = xstrdup(src_bwd);
  reg[n_reg++] = f;
  return f->id;
}

dm_fused *dm_fused_get(int id) {
  if (id < 0 || id >= n_reg) dm_error("fuse: no fused op has id %d (make one with dm.fuse)", id);
  return reg[id];
}

/* ---- layout --------------------------------------------------------------------------------- */

void dm_fuse_layout_make(dm_fuse_layout *L, int ndim, const int64_t *shape, int nops, dm_tensor *const *t) {
  memset(L, 0, sizeof *L);
  for (int d = 0; d < ndim; d++) {
    L->shape[d] = shape[d];
    for (int k = 0; k < nops; k++) {      /* right-aligned broadcast: stride 0 where t[k] has no such dim */
      int td = t[k] ? d - (ndim - t[k]->ndim) : -1;
      L->st[k][d] = (td < 0 || t[k]->shape[td] == 1) ? 0 : t[k]->strides[td];
    }
  }
  L->ndim = dm_coalesce_layout(ndim, L->shape, nops, L->st);       /* vm/core/coalesce.h */
}

/* ---- the CPU kernel ----------------------------------------------------------------------------- */

#define CHUNK 128

static void load_row(dm_dtype dt, const char *p, int64_t st, int m, double *v) {
  switch (dt) {
  case DM_F32: for (int j = 0; j < m; j++) v[j] = *(const float *)(p + j * st); break;
  case DM_F64: for (int j = 0; j < m; j++) v[j] = *(const double *)(p + j * st); break;
  default: for (int j = 0; j < m; j++) v[j] = dm_load(dt, p + j * st); break;
  }
}

static void store_row(dm_dtype dt, char *p, int64_t st, int m, const double *v) {
  switch (dt) {
  case DM_F32: for (int j = 0; j < m; j++) *(float *)(p + j * st) = (float)v[j]; break;
  case DM_F64: for (int j = 0; j < m; j++) *(double *)(p + j * st) = v[j]; break;
  default: for (int j = 0; j < m; j++) dm_store(dt, p + j * st, v[j]); break;
  }
}

/* elementwise.h's formulas over a chunk, in double (p and q: the attribute kinds, never fused) */
#define UNARY_CASE_(ID, nm, f, df, saves, diff) \
  case DM_UNARY_##ID: for (int j = 0; j < m; j++) { double x = v[j]; v[j] = (f); } break;
#define DUNARY_CASE_(ID, nm, f, df, saves, diff) \
  case DM_UNARY_##ID: for (int j = 0; j < m; j++) { double x = v[j], y = (f); (void)y; v[j] = (df); } break;

static void unary_chunk(int kind, double *v, int m, bool derivative) {
  const double p = 0, q = 0;
  (void)p; (void)q;
  if (derivative) switch (kind) { DM_UNARY_OPS(DUNARY_CASE_) }
  else switch (kind) { DM_UNARY_OPS(UNARY_CASE_) }
}

#define BINARY_CASE_(OP, expr) \
  case DM_FOP_##OP: for (int j = 0; j < m; j++) { double x = a[j], y = b[j]; a[j] = (expr); } break;

/* one program over m elements; in[k] holds input k's chunk; the result in out */
static void run_prog(const dm_fprog *pr, double (*stk)[CHUNK], double *const *in, int m, double *out) {
  if (pr->n == 0) { for (int j = 0; j < m; j++) out[j] = 0; return; }
  int sp = 0;
  for (int i = 0; i < pr->n; i++) {
    double arg = pr->arg[i];
    double *a = sp >= 2 ? stk[sp - 2] : NULL, *b = sp >= 1 ? stk[sp - 1] : NULL;
    switch (pr->op[i]) {
    case DM_FOP_INPUT: memcpy(stk[sp++], in[(int)arg], sizeof(double) * (size_t)m); break;
    case DM_FOP_CONST: for (int j = 0; j < m; j++) stk[sp][j] = arg; sp++; break;
    case DM_FOP_NEG: for (int j = 0; j < m; j++) b[j] = -b[j]; break;
    case DM_FOP_POW: for (int j = 0; j < m; j++) b[j] = pow(b[j], arg); break;
    case DM_FOP_UNARY: unary_chunk((int)arg, b, m, false); break;
    case DM_FOP_DUNARY: unary_chunk((int)arg, b, m, true); break;
    case DM_FOP_WHERE: {
      double *c = stk[sp - 3];
      for (int j = 0; j < m; j++) c[j] = c[j] != 0 ? a[j] : b[j];
      sp -= 2;
      break;
    }
    default:
      switch (pr->op[i]) {
      BINARY_CASE_(ADD, x + y)
      BINARY_CASE_(SUB, x - y)
      BINARY_CASE_(MUL, x * y)
      BINARY_CASE_(DIV, x / y)
      BINARY_CASE_(LT, x < y)
      BINARY_CASE_(LE, x <= y)
      BINARY_CASE_(GT, x > y)
      BINARY_CASE_(GE, x >= y)
      BINARY_CASE_(EQ, x == y)
      BINARY_CASE_(NE, x != y)
      }
      sp--;
    }
  }
  memcpy(out, stk[0], sizeof(double) * (size_t)m);
}

/* operands: the outputs, then the inputs (a NULL output is skipped, a NULL input never read) */
static void cpu_fuse(dm_fused *f, int dir, dm_tensor *const *out, int n_in, dm_tensor *const *in) {
  int n_out = f->n_out[dir], nops = n_out + n_in;
  dm_tensor *lead = NULL;
  dm_tensor *ops[DM_FUSE_MAXOPS];
  for (int k = 0; k < n_out; k++) { ops[k] = out[k]; if (!lead) lead = out[k]; }
  for (int k = 0; k < n_in; k++) ops[n_out + k] = in[k];
  if (!lead || dm_numel(lead) == 0) return;
  dm_dtype dt = lead->dtype;
  int64_t es = (int64_t)dm_dtype_size(dt);
  dm_fuse_layout L;
  dm_fuse_layout_make(&L, lead->ndim, lead->shape, nops, ops);
  int depth = 1;
  for (int k = 0; k < n_out; k++) if (f->prog[dir][k].depth > depth) depth = f->prog[dir][k].depth;
  double (*stk)[CHUNK] = xcalloc((size_t)depth, sizeof *stk);
  double (*buf)[CHUNK] = xcalloc((size_t)(n_in + 1), sizeof *buf);    /* the inputs, then a result */
  double *inv[DM_FUSE_MAXOPS];
  for (int k = 0; k < n_in; k++) inv[k] = buf[k];
  int last = L.ndim - 1;
  int64_t idx[DM_MAXDIM] = {0}, len = L.shape[last];
  for (;;) {
    char *base[DM_FUSE_MAXOPS];
    for (int k = 0; k < nops; k++) {
      base[k] = ops[k] ? (char *)dm_data(ops[k]) : NULL;
      if (!base[k]) continue;
      for (int d = 0; d < last; d++) base[k] += idx[d] * L.st[k][d] * es;
    }
    for (int64_t c0 = 0; c0 < len; c0 += CHUNK) {
      int m = (int)(len - c0 < CHUNK ? len - c0 : CHUNK);
      for (int k = 0; k < n_in; k++) {
        int64_t st = L.st[n_out + k][last] * es;
        if (base[n_out + k]) load_row(dt, base[n_out + k] + c0 * st, st, m, buf[k]);
      }
      for (int k = 0; k < n_out; k++) {
        if (!base[k]) continue;
        int64_t st = L.st[k][last] * es;
        run_prog(&f->prog[dir][k], stk, inv, m, buf[n_in]);
        store_row(dt, base[k] + c0 * st, st, m, buf[n_in]);
      }
    }
    int d = last - 1;
    while (d >= 0 && ++idx[d] == L.shape[d]) idx[d--] = 0;
    if (d < 0) break;
  }
  free(stk);
  free(buf);
}

static const dm_kernel_entry cpu_kernels[] = {DM_KERNEL_ENTRY(fuse, cpu_fuse)};
DM_REGISTER_KERNELS(DM_CPU, cpu_kernels)

/* ---- the op ---------------------------------------------------------------------------------- */

/* "dm.fuse 'EXPR'", for messages */
static const char *name_of(const dm_fused *f, char *buf, size_t n) {
  snprintf(buf, n, "dm.fuse '%s'", f->expr);
  return buf;
}

static void fuse_forward(dm_ctx *c) {
  dm_fused *f = dm_fused_get((int)c->a.v[0]);
  char name[300];
  name_of(f, name, sizeof name);
  if (c->n_in != f->n_in) dm_error("%s: takes %d inputs, got %d", name, f->n_in, c->n_in);
  dm_tensor *first = c->in[0];
  int nd = first->ndim;
  int64_t shape[DM_MAXDIM];
  memcpy(shape, first->shape, sizeof(int64_t) * (size_t)nd);
  for (int i = 0; i < c->n_in; i++) {
    char what[32];
    snprintf(what, sizeof what, "input %d", i + 1);
    dm_check_float(name, what, c->in[i]);
    dm_check_dtype_equal(name, first, c->in[i]);
    int64_t prev[DM_MAXDIM];
    memcpy(prev, shape, sizeof prev);
    nd = dm_broadcast_shape(name, nd, prev, c->in[i]->ndim, c->in[i]->shape, shape);
  }
  dm_tensor *out = dm_tensor_new(first->device, first->dtype, nd, shape);
  DM_RUN(fuse, first->device, f, DM_FUSE_FWD, &out, c->n_in, c->in);
  for (int i = 0; i < c->n_in; i++) if ((f->bwd_reads >> i) & 1) dm_save(c, c->in[i]);
  c->out[0] = out;
}

/* t summed down to shape (the backward of broadcasting); consumes t */
static dm_tensor *sum_to_owned(dm_tensor *t, int ndim, const int64_t *shape) {
  if (t->ndim == ndim && memcmp(t->shape, shape, sizeof(int64_t) * (size_t)ndim) == 0) return t;
  dm_tensor *s = dm_sum_to(t, ndim, shape);
  dm_release(t);
  return s;
}

/* every gradient at the output's shape in one kernel (inputs: the saved ones and g), then summed down */
static void fuse_backward(dm_ctx *c, dm_tensor *const *gout, dm_tensor **gin) {
  dm_fused *f = dm_fused_get((int)c->a.v[0]);
  int n = f->n_in, k = 0;
  dm_tensor *g = gout[0], *ins[DM_FUSE_MAXIN + 1] = {0}, *outs[DM_FUSE_MAXIN] = {0};
  for (int i = 0; i < n; i++) ins[i] = (f->bwd_reads >> i) & 1 ? dm_saved(c, k++) : NULL;
  ins[n] = g;
  bool any = false;
  for (int i = 0; i < n; i++)
    if (dm_needs_grad(c, i) && f->prog[DM_FUSE_BWD][i].n > 0) { outs[i] = dm_tensor_like(g); any = true; }
  if (any) DM_RUN(fuse, g->device, f, DM_FUSE_BWD, outs, n + 1, ins);
  for (int i = 0; i < n; i++) {
    if (!dm_needs_grad(c, i)) continue;
    gin[i] = outs[i] ? sum_to_owned(outs[i], dm_in_ndim(c, i), dm_in_shape(c, i))
                     : dm_zeros(g->device, dm_in_dtype(c, i), dm_in_ndim(c, i), dm_in_shape(c, i));
  }
}

static dm_op ops[] = {
  {.name = "fuse", .doc = "a fused elementwise expression of dm.fuse over its inputs, broadcasting (id: the fused op)",
   .n_in = -1, .n_out = 1, .attrs = "id", .forward = fuse_forward, .backward = fuse_backward},
};
DM_REGISTER_OPS(ops)

dm_tensor *dm_fused_call(int id, int n, dm_tensor *const *in) {
  double v = id;
  dm_attrs a = dm_attrs_of(1, &v);
  dm_tensor *out;
  dm_call(&ops[0], n, in, &a, &out);
  return out;
}

/* ---- the CUDA prelude ------------------------------------------------------------------------------ */

#define STR_(...) #__VA_ARGS__
#define XSTR_(...) STR_(__VA_ARGS__)

/* load widens to the compute type T, store rounds to nearest even (as dm_store) */
static const char cuda_types[] =
  "#if DM_DTYPE == 0\n"
  "typedef float S; typedef float T;\n"
  "__device__ __forceinline__ T dm_ld(S v) { return v; }\n"
  "__device__ __forceinline__ S dm_st(T v) { return v; }\n"
  "#elif DM_DTYPE == 1\n"
  "typedef double S; typedef double T;\n"
  "__device__ __forceinline__ T dm_ld(S v) { return v; }\n"
  "__device__ __forceinline__ S dm_st(T v) { return v; }\n"
  "#elif DM_DTYPE == 2\n"
  "typedef unsigned short S; typedef float T;\n"
  "__device__ __forceinline__ T dm_ld(S v) { return __uint_as_float((unsigned)v << 16); }\n"
  "__device__ __forceinline__ S dm_st(T v) { S r; asm(\"cvt.rn.bf16.f32 %0, %1;\" : \"=h\"(r) : \"f\"(v)); return r; }\n"
  "#else\n"
  "typedef unsigned short S; typedef float T;\n"
  "__device__ __forceinline__ T dm_ld(S v) { T r; asm(\"cvt.f32.f16 %0, %1;\" : \"=f\"(r) : \"h\"(v)); return r; }\n"
  "__device__ __forceinline__ S dm_st(T v) { S r; asm(\"cvt.rn.f16.f32 %0, %1;\" : \"=h\"(r) : \"f\"(v)); return r; }\n"
  "#endif\n"
  /* elementwise.h's helpers, expanded; silu's derivative is a statement expression
  ** there, which NVRTC does not take, so it is a function here */
  "#define DM_SIGMOID(x) " XSTR_(DM_SIGMOID(x)) "\n"
  "#define DM_SIGN(x) " XSTR_(DM_SIGN(x)) "\n"
  "#define DM_SOFTPLUS(x) " XSTR_(DM_SOFTPLUS(x)) "\n"
  "__device__ __forceinline__ T dm_dsilu_(T x) { T s_ = DM_SIGMOID(x); return s_ * (1 + x * (1 - s_)); }\n"
  "#define DM_DSILU(x) dm_dsilu_(x)\n";

/* the kinds that take attributes (p, q) are not fused */
static bool attr_kind(int kind) {
  return kind == DM_UNARY_POW || kind == DM_UNARY_CLAMP || kind == DM_UNARY_AFFINE || kind == DM_UNARY_RDIV;
}

#define CUDA_UNARY_(ID, nm, f, df, saves, diff)                                              \
  {DM_UNARY_##ID, "__device__ __forceinline__ T dm_" nm "(T x) { return (T)(" #f "); }\n"   \
                  "__device__ __forceinline__ T dm_d_" nm "(T x, T y) { return (T)(" #df "); }\n"},
static const struct { int kind; const char *text; } cuda_unary[] = { DM_UNARY_OPS(CUDA_UNARY_) };

const char *dm_fuse_cuda_prelude(void) {
  static char *text;
  if (text) return text;
  size_t n = sizeof cuda_types;
  for (size_t i = 0; i < sizeof cuda_unary / sizeof cuda_unary[0]; i++) n += strlen(cuda_unary[i].text);
  char *t = xcalloc(n + 1, 1);
  strcpy(t, cuda_types);
  for (size_t i = 0; i < sizeof cuda_unary / sizeof cuda_unary[0]; i++)
    if (!attr_kind(cuda_unary[i].kind)) strcat(t, cuda_unary[i].text);
  text = t;
  return text;
}
