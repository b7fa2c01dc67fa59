/*
** optim.c — AdamW, Muon and gradient clipping over lists of tensors (see
** optim.h). This file validates, groups and sequences; the element loops
** are kernels (vm/cpu/optim.c, and later kernels/ for CUDA) found in the
** kernel table, and Newton–Schulz's products are dm_matmul on 3-D stacks
** (a loop of BLAS calls on the CPU, strided-batched GEMMs on the GPU).
*/
#include <math.h>
#include "ops/optim.h"
#include "ops/matmul.h"       /* the kernel Newton-Schulz needs */
#include "core/core.h"
#include "core/alloc.h"
#include "core/cuda.h"
#include "core/code8.h"
#include "core/sround.h"

/* ---- checks (all made before anything is allocated) -------------------------------------- */

static void check_param(const char *op, int i, int n, const dm_tensor *p, const dm_tensor *first) {
  if (!p) dm_error("%s: parameter %d of %d is missing", op, i + 1, n);
  dm_check_live(p);
  char s[128];
  if (p->dtype != DM_F32)
    dm_error("%s: parameter %d of %d (shape %s) must be an f32 master, got %s", op, i + 1, n,
             dm_tensor_shape_str(p, s, sizeof s), dm_dtype_name(p->dtype));
  if (!dm_is_contiguous(p))
    dm_error("%s: parameter %d of %d (shape %s) is not contiguous", op, i + 1, n,
             dm_tensor_shape_str(p, s, sizeof s));
  if (p->device != first->device)
    dm_error("%s: parameter %d of %d is on %s but parameter 1 is on %s", op, i + 1, n,
             dm_device_name(p->device), dm_device_name(first->device));
}

/* a tensor that goes with parameter i: its shape, contiguous, on its device */
static void check_companion(const char *op, const char *role, int i, const dm_tensor *p,
                            const dm_tensor *t) {
  dm_check_live(t);
  char a[128], b[128];
  if (!dm_same_shape(p, t))
    dm_error("%s: parameter %d has shape %s but its %s has shape %s", op, i + 1,
             dm_tensor_shape_str(p, a, sizeof a), role, dm_tensor_shape_str(t, b, sizeof b));
  if (t->device != p->device)
    dm_error("%s: parameter %d is on %s but its %s is on %s", op, i + 1, dm_device_name(p->device),
             role, dm_device_name(t->device));
  if (!dm_is_contiguous(t))
    dm_error("%s: the %s of parameter %d (shape %s) is not contiguous", op, role, i + 1,
             dm_tensor_shape_str(t, a, sizeof a));
}

static void check_state_of(const char *op, const char *role, int i, const dm_tensor *p, const dm_tensor *s,
                           bool bf16_too) {
  if (!s) dm_error("%s: parameter %d has no %s", op, i + 1, role);
  check_companion(op, role, i, p, s);
  if (s->dtype != DM_F32 && !(bf16_too && s->dtype == DM_BF16))
    dm_error("%s: the %s of parameter %d must be f32%s, got %s", op, role, i + 1, bf16_too ? " or bf16" : "",
             dm_dtype_name(s->dtype));
}

static void check_state(const char *op, const char *role, int i, const dm_tensor *p, const dm_tensor *s) {
  check_state_of(op, role, i, p, s, false);
}

static void check_grad(const char *op, int i, const dm_tensor *p, const dm_tensor *g) {
  if (!g) return;
  check_companion(op, "gradient", i, p, g);
  if (g->dtype != DM_F32 && g->dtype != DM_BF16)
    dm_error("%s: the gradient of parameter %d must be f32 or bf16, got %s", op, i + 1,
             dm_dtype_name(g->dtype));
}

static void check_range(const char *op, const char *name, double v, double lo, double hi, bool hi_open) {
  if (!(v >= lo && (hi_open ? v < hi : v <= hi)))
    dm_error("%s: %s must be in [%g, %g%s, got %g", op, name, lo, hi, hi_open ? ")" : "]", v);
}

/* ---- the per-step scalars ------------------------------------------------------------------- */

/* false when sumsq_at says the step is to be skipped; on the CPU the
** pointers are read here, so the CPU kernels see plain values */
static bool resolve_adamw(dm_adamw_hp *hp, dm_device dev) {
  if (dev != DM_CPU) return true;
  if (hp->sumsq_at && !isfinite(*hp->sumsq_at)) return false;
  if (hp->lr_at) hp->lr = *hp->lr_at;
  if (hp->step_at) hp->step = *hp->step_at;
  hp->lr_at = NULL; hp->step_at = NULL; hp->sumsq_at = NULL;
  return true;
}

static bool resolve_muon(dm_muon_hp *hp, dm_device dev) {
  if (dev != DM_CPU) return true;
  if (hp->sumsq_at && !isfinite(*hp->sumsq_at)) return false;
  if (hp->lr_at) hp->lr = *hp->lr_at;
  if (hp->step_at) hp->step = *hp->step_at;
  hp->lr_at = NULL; hp->sumsq_at = NULL; hp->step_at = NULL;
  return true;
}

/* ---- AdamW ------------------------------------------------------------------------------------ */

static void check_adamw_hp(const char *op, const dm_adamw_hp *hp) {
  check_range(op, "lr", hp->lr, 0, INFINITY, true);
  check_range(op, "beta1", hp->beta1, 0, 1, true);
  check_range(op, "beta2", hp->beta2, 0, 1, true);
  check_range(op, "eps", hp->eps, 0, INFINITY, true);
  check_range(op, "weight_decay", hp->weight_decay, 0, INFINITY, true);
  if (hp->step < 1 && !hp->step_at)
    dm_error("%s: step must be >= 1 (it counts updates from 1), got %lld", op, (long long)hp->step);
}

/* an AdamW step's settings (the device scalars read on the CPU) and its parameters and gradients
** checked; false when there is nothing to do (no parameters, or a step the firewall skips) */
static bool adamw_begin(const char *op, int n, dm_tensor *const *params, dm_tensor *const *grads, dm_adamw_hp *hp) {
  if (n > 0 && !resolve_adamw(hp, params[0]->device)) return false;
  check_adamw_hp(op, hp);
  for (int i = 0; i < n; i++) {
    check_param(op, i, n, params[i], params[0]);
    check_grad(op, i, params[i], grads[i]);
  }
  return n > 0;
}

void dm_adamw_step(int n, dm_tensor *const *params, dm_tensor *const *grads,
                   dm_tensor *const *m, dm_tensor *const *v, const dm_adamw_hp *given) {
  const char *op = "adamw";
  dm_adamw_hp hpv = *given, *hp = &hpv;
  if (!adamw_begin(op, n, params, grads, hp)) return;
  for (int i = 0; i < n; i++) {
    check_state(op, "first moment m", i, params[i], m[i]);
    check_state(op, "second moment v", i, params[i], v[i]);
  }
  if (dm_plan_card_of(params[0]->device)) dm_plan_scratch(DM_ADAMW_SCRATCH, "adamw's constants (kernels/optim.cu cuda_adamw)");
  DM_RUN(adamw, params[0]->device, n, params, grads, m, v, hp);
  for (int i = 0; i < n; i++)
    if (grads[i]) { dm_mark_written(params[i]); dm_mark_written(m[i]); dm_mark_written(v[i]); }
}

/* ---- AdamW with 8-bit moments ------------------------------------------------------------------ */

static void check_8bit(const char *op, const char *role, int i, const dm_tensor *p, const dm_tensor *codes,
                     const dm_tensor *scales) {
  char a[128];
  if (!codes || !scales) dm_error("%s: parameter %d has no %s codes or scales", op, i + 1, role);
  check_companion(op, role, i, p, codes);
  if (codes->dtype != DM_U8)
    dm_error("%s: the %s codes of parameter %d must be u8, got %s", op, role, i + 1, dm_dtype_name(codes->dtype));
  dm_check_live(scales);
  int64_t blocks = dm_code8_blocks(dm_numel(p));
  if (scales->dtype != DM_F32 || scales->ndim != 1 || scales->shape[0] != blocks || !dm_is_contiguous(scales) ||
      scales->device != p->device)
    dm_error("%s: the %s scales of parameter %d must be contiguous f32 [%lld] on %s (a block of %d elements "
             "each), got %s %s on %s", op, role, i + 1, (long long)blocks, dm_device_name(p->device), DM_CODE8_BLOCK,
             dm_dtype_name(scales->dtype), dm_tensor_shape_str(scales, a, sizeof a), dm_device_name(scales->device));
}

void dm_adamw_8bit_step(int n, dm_tensor *const *params, dm_tensor *const *grads, dm_tensor *const *m,
                      dm_tensor *const *m_scale, dm_tensor *const *r, dm_tensor *const *r_scale,
                      const dm_adamw_hp *given, uint32_t salt) {
  const char *op = "adamw_8bit";
  dm_adamw_hp hpv = *given, *hp = &hpv;
  if (!adamw_begin(op, n, params, grads, hp)) return;
  for (int i = 0; i < n; i++) {
    check_8bit(op, "first moment", i, params[i], m[i], m_scale[i]);
    check_8bit(op, "second moment's root", i, params[i], r[i], r_scale[i]);
  }
  if (dm_plan_card_of(params[0]->device)) dm_plan_scratch(DM_ADAMW_SCRATCH, "adamw's constants (kernels/optim.cu cuda_adamw_8bit)");
  DM_RUN(adamw_8bit, params[0]->device, n, params, grads, m, m_scale, r, r_scale, hp, salt);
  for (int i = 0; i < n; i++)
    if (grads[i]) {
      dm_mark_written(params[i]);
      dm_mark_written(m[i]); dm_mark_written(m_scale[i]); dm_mark_written(r[i]); dm_mark_written(r_scale[i]);
    }
}

static void check_code8_host(const char *op, const dm_tensor *codes, const dm_tensor *scales, const dm_tensor *values,
                          int64_t block) {
  char a[128], b[128];
  const dm_tensor *all[3] = {codes, scales, values};
  for (int k = 0; k < 3; k++) {
    dm_check_live(all[k]);
    if (all[k]->device != DM_CPU || !dm_is_contiguous(all[k]))
      dm_error("%s: takes contiguous tensors on the CPU", op);
  }
  if (codes->dtype != DM_U8 || values->dtype != DM_F32 || scales->dtype != DM_F32)
    dm_error("%s: codes u8, values and scales f32, got %s, %s and %s", op, dm_dtype_name(codes->dtype),
             dm_dtype_name(values->dtype), dm_dtype_name(scales->dtype));
  if (block < 1) dm_error("%s: a block holds at least one value, got %lld", op, (long long)block);
  int64_t blocks = (dm_numel(values) + block - 1) / block;
  if (dm_numel(codes) != dm_numel(values) || scales->ndim != 1 || scales->shape[0] != blocks)
    dm_error("%s: %s codes and %s scales for %lld values (%lld blocks of %lld)", op,
             dm_tensor_shape_str(codes, a, sizeof a), dm_tensor_shape_str(scales, b, sizeof b),
             (long long)dm_numel(values), (long long)blocks, (long long)block);
}

void dm_code8_pack(dm_tensor *codes, dm_tensor *scales, const dm_tensor *values, bool is_signed, uint32_t salt,
                int64_t block) {
  check_code8_host("code8_pack", codes, scales, values, block);
  const float *v = dm_data(values);
  uint8_t *c = dm_data(codes);
  float *sc = dm_data(scales);
  int64_t n = dm_numel(values);
  for (int64_t b = 0; b * block < n; b++) {
    int64_t lo = b * block, hi = lo + block < n ? lo + block : n;
    float amax = 0;
    for (int64_t e = lo; e < hi; e++) amax = fmaxf(amax, fabsf(v[e]));
    sc[b] = amax;
    float inv = dm_code8_inverse(amax);
    for (int64_t e = lo; e < hi; e++) {
      uint32_t bits = dm_sround_bits(salt, 0, 0, e);
      c[e] = is_signed ? dm_code8_encode_signed(v[e] * inv, bits) : dm_code8_encode_unsigned(v[e] * inv, bits);
    }
  }
  dm_mark_written(codes);
  dm_mark_written(scales);
}

void dm_code8_unpack(dm_tensor *values, const dm_tensor *codes, const dm_tensor *scales, bool is_signed, int64_t block) {
  check_code8_host("code8_unpack", codes, scales, values, block);
  const uint8_t *c = dm_data(codes);
  const float *sc = dm_data(scales);
  float *v = dm_data(values);
  int64_t n = dm_numel(values);
  for (int64_t e = 0; e < n; e++)
    v[e] = (is_signed ? dm_code8_signed(c[e]) : dm_code8_unsigned(c[e])) * sc[e / block];
  dm_mark_written(values);
}

/* ---- Newton–Schulz ------------------------------------------------------------------------ */

/* Polar Express (arXiv 2505.16932): per-step minimax quintics for l = 1e-3;
** all but the last are divided by (1.01, 1.01^3, 1.01^5) for bf16 safety,
** and the last repeats for any further steps. */
static const double polar_express[][3] = {
  {8.28721201814563, -23.595886519098837, 17.300387312530933},
  {4.107059111542203, -2.9478499167379106, 0.5448431082926601},
  {3.9486908534822946, -2.908902115962949, 0.5518191394370137},
  {3.3184196573706015, -2.488488024314874, 0.51004894012372},
  {2.300652019954817, -1.6689039845747493, 0.4188073119525673},
  {1.891301407787398, -1.2679958271945868, 0.37680408948524835},
  {1.8750014808534479, -1.2500016453999487, 0.3750001645474248},
  {1.875, -1.25, 0.375},
};
#define N_POLAR ((int)(sizeof polar_express / sizeof polar_express[0]))

void dm_ns_coefficients(dm_ns_coeffs coeffs, int step, double abc[3]) {
  if (coeffs == DM_NS_QUINTIC) {
    abc[0] = 3.4445; abc[1] = -4.7750; abc[2] = 2.0315;
    return;
  }
  int i = step < N_POLAR - 1 ? step : N_POLAR - 1;
  double s = i < N_POLAR - 1 ? 1.01 : 1.0;
  abc[0] = polar_express[i][0] / s;
  abc[1] = polar_express[i][1] / (s * s * s);
  abc[2] = polar_express[i][2] / (s * s * s * s * s);
}

double dm_ns_norm_factor(dm_ns_coeffs coeffs) { return coeffs == DM_NS_POLAR_EXPRESS ? 1.01 : 1.0; }

/* Iterate on x [B, m, n] (owned; returns the owned result). A wide matrix
** works on A = X Xᵀ [m, m]: X ← aX + B X. A tall one works on the Gram
** matrix of its columns, A = Xᵀ X [n, n]: X ← aX + X B, which is the wide
** iteration on Xᵀ transposed back (B is symmetric), without moving data. */
typedef struct ns_kernels {
  dm_ns_normalize_k normalize;
  dm_ns_axpby_k axpby;
  dm_ns_gram_start_k gram_start;
} ns_kernels;

/* looked up before anything is allocated, so a device without them leaks nothing */
static ns_kernels ns_kernels_for(dm_device dev) {
  ns_kernels k = {DM_KERNEL(ns_normalize, dev), DM_KERNEL(ns_axpby, dev),
                  DM_KERNEL(ns_gram_start, dev)};
  (void)DM_KERNEL(matmul, dev);
  return k;
}

static dm_tensor *ns_iterate(dm_tensor *x, int steps, dm_ns_coeffs coeffs, const ns_kernels *k) {
  bool tall = x->shape[1] > x->shape[2];
  dm_ns_axpby_k axpby = k->axpby;
  if (dm_plan_card_of(x->device))
    dm_plan_scratch(dm_ns_normalize_scratch(x->shape[0], x->shape[1] * x->shape[2]),
                    "Newton-Schulz norm partials (kernels/optim.cu cuda_ns_normalize)");
  if (k->normalize) k->normalize(x, dm_ns_norm_factor(coeffs), 1e-7);     /* the kernels: NULL on the meta device */
  for (int s = 0; s < steps; s++) {
    double abc[3];
    dm_ns_coefficients(coeffs, s, abc);
    dm_tensor *A = tall ? dm_matmul(x, x, true, false) : dm_matmul(x, x, false, true);
    dm_tensor *B = dm_matmul(A, A, false, false);
    if (axpby) axpby(B, abc[1], A, abc[2]);            /* B = bA + cA² */
    dm_tensor *next = tall ? dm_matmul(x, B, false, false) : dm_matmul(B, x, false, false);
    if (axpby) axpby(next, abc[0], x, 1.0);            /* X ← aX + BX */
    dm_release(A);
    dm_release(B);
    dm_release(x);
    x = next;
  }
  return x;
}

bool dm_ns_gram(int64_t m, int64_t n) {
  int64_t s = m < n ? m : n, l = m < n ? n : m;
  return s >= 1 && s <= 256 && 2 * s <= l;
}

/* TF32 for a stretch of products, restored after it, or on an error
** before the previous handler unwinds. */
typedef struct tf32_guard { dm_error_handler prev; void *prev_ud; bool was; } tf32_guard;

static void tf32_unwind(const char *msg, void *ud) {
  tf32_guard *g = ud;
  dm_cuda_set_tf32(g->was);
  dm_set_error_handler(g->prev, g->prev_ud);
  if (g->prev) g->prev(msg, g->prev_ud);
}

static void tf32_begin(tf32_guard *g) {
  dm_get_error_handler(&g->prev, &g->prev_ud);
  g->was = dm_cuda_tf32();
  dm_set_error_handler(tf32_unwind, g);
  dm_cuda_set_tf32(true);
}

static void tf32_end(tf32_guard *g) {
  dm_cuda_set_tf32(g->was);
  dm_set_error_handler(g->prev, g->prev_ud);
}

/* The Gram form (optim.h) on x [B, m, n] f32 (owned; returns the owned result).
** fast: the products on TF32 tensor cores (asked for bf16: TF32 keeps more). */
static dm_tensor *ns_gram_iterate(dm_tensor *x, int steps, dm_ns_coeffs coeffs, const ns_kernels *k, bool fast) {
  tf32_guard guard;
  if (fast) tf32_begin(&guard);
  bool tall = x->shape[1] > x->shape[2];
  dm_tensor *a0 = tall ? dm_matmul(x, x, true, false) : dm_matmul(x, x, false, true);
  dm_tensor *q = dm_tensor_new(x->device, DM_F32, 3, a0->shape);
  if (k->gram_start) k->gram_start(q, a0, dm_ns_norm_factor(coeffs), 1e-7);   /* NULL on the meta device */
  for (int s = 0; s < steps; s++) {
    double abc[3];
    dm_ns_coefficients(coeffs, s, abc);
    dm_tensor *t = dm_matmul(q, a0, tall, false);                 /* Q A_0, or Qᵀ A_0 when tall */
    dm_tensor *a = dm_matmul(t, q, false, !tall);                 /* A_k */
    dm_tensor *b = dm_matmul(a, a, false, false);
    if (k->axpby) k->axpby(b, abc[1], a, abc[2]);                 /* B = bA + cA² */
    dm_tensor *next = tall ? dm_matmul(q, b, false, false) : dm_matmul(b, q, false, false);
    if (k->axpby) k->axpby(next, abc[0], q, 1.0);                 /* Q ← aQ + BQ (QB when tall) */
    dm_release(t);
    dm_release(a);
    dm_release(b);
    dm_release(q);
    q = next;
  }
  dm_tensor *out = tall ? dm_matmul(x, q, false, false) : dm_matmul(q, x, false, false);
  dm_release(q);
  dm_release(a0);
  dm_release(x);
  if (fast) tf32_end(&guard);
  return out;
}

/* either form, by the matrices' shape; x [B, m, n] owned, f32 for the Gram form; dt: the
** dtype asked for (bf16 lets the Gram form's products take TF32) */
static dm_tensor *ns_run(dm_tensor *x, int steps, dm_ns_coeffs coeffs, const ns_kernels *k, dm_dtype dt) {
  if (dm_ns_gram(x->shape[1], x->shape[2])) return ns_gram_iterate(x, steps, coeffs, k, dt == DM_BF16);
  return ns_iterate(x, steps, coeffs, k);
}

static void check_ns(const char *op, int steps, dm_dtype dt) {
  if (steps < 1) dm_error("%s: Newton-Schulz steps must be >= 1, got %d", op, steps);
  if (dt != DM_F32 && dt != DM_BF16)
    dm_error("%s: Newton-Schulz runs in f32 or bf16, got %s", op, dm_dtype_name(dt));
}

/* a contiguous view of t's storage with another shape */
static dm_tensor *view_as(const dm_tensor *t, int ndim, const int64_t *shape, int64_t offset) {
  int64_t strides[DM_MAXDIM];
  dm_contiguous_strides(ndim, shape, strides);
  return dm_tensor_view(t, ndim, shape, strides, offset);
}

dm_tensor *dm_newton_schulz(dm_tensor *x, int steps, dm_ns_coeffs coeffs, dm_dtype dt) {
  dm_check_live(x);
  check_ns("newton_schulz", steps, dt);
  char s[128];
  if (x->ndim != 2 && x->ndim != 3)
    dm_error("newton_schulz: takes a matrix [m, n] or a stack [B, m, n], got shape %s",
             dm_tensor_shape_str(x, s, sizeof s));
  if (!dm_dtype_is_float(x->dtype))
    dm_error("newton_schulz: needs a float tensor, got %s", dm_dtype_name(x->dtype));
  ns_kernels k = ns_kernels_for(x->device);
  int64_t shape3[3] = {x->ndim == 3 ? x->shape[0] : 1, x->shape[x->ndim - 2], x->shape[x->ndim - 1]};
  dm_dtype work = dm_ns_gram(shape3[1], shape3[2]) ? DM_F32 : dt;
  dm_tensor *y = dm_tensor_new(x->device, work, x->ndim, x->shape);
  dm_copy_(y, x);
  dm_tensor *y3 = view_as(y, 3, shape3, 0);
  dm_release(y);
  dm_tensor *r = ns_run(y3, steps, coeffs, &k, dt);
  if (r->dtype != dt) {
    dm_tensor *c = dm_tensor_new(r->device, dt, 3, r->shape);
    dm_copy_(c, r);
    dm_release(r);
    r = c;
  }
  dm_tensor *out = view_as(r, x->ndim, x->shape, 0);
  dm_release(r);
  return out;
}

/* ---- Muon ----------------------------------------------------------------------------------- */

static bool same_matrix(const dm_tensor *a, const dm_tensor *b) {
  return a->shape[a->ndim - 2] == b->shape[b->ndim - 2] && a->shape[a->ndim - 1] == b->shape[b->ndim - 1];
}

/* The stack's row length: on CUDA a multiple of 8 elements, so that every
** row of the Newton–Schulz products starts 16-byte aligned (cuBLAS takes
** its slow unaligned kernels for b1's 5,461 columns: 4.2 ms instead of
** about 1 for the write projection); the columns added are zeros. */
static int64_t stack_pitch(dm_device dev, int64_t cols) {
  return dev == DM_CPU ? cols : (cols + 7) / 8 * 8;        /* (the meta device plans as CUDA runs) */
}

/* member j's slice of the stack: its matrices [count, rows, pitch] */
static void stack_views(const dm_tensor *stack, int k, dm_tensor *const *p, int64_t rows, int64_t pitch,
                        dm_tensor **o) {
  int64_t at = 0;
  for (int j = 0; j < k; j++) {
    int64_t count = p[j]->ndim == 3 ? p[j]->shape[0] : 1, shape[3] = {count, rows, pitch};
    o[j] = view_as(stack, 3, shape, at);
    at += count * rows * pitch;
  }
}

/* x [B, m, n] / (its l2 norms over dim + 1e-7): dim 1 normalises each column, dim 2 each row. The
** stack's zero pad columns stay zero and add nothing to a row's norm. Takes x, returns a new tensor. */
static dm_tensor *l2_normalized(dm_tensor *x, int dim) {
  dm_tensor *sq = dm_mul(x, x), *sum = dm_sum(sq, dim, true);
  dm_tensor *norm = dm_unary("sqrt", sum), *den = dm_affine(norm, 1.0, 1e-7);
  dm_tensor *y = dm_div(x, den);
  dm_release(sq); dm_release(sum); dm_release(norm); dm_release(den); dm_release(x);
  return y;
}

/* Muon+: the orthogonalised stack normalised as hp->normalize asks (columns, then rows) */
static dm_tensor *muon_plus(dm_tensor *ortho, int normalize) {
  if (normalize & DM_MUON_NORM_COL) ortho = l2_normalized(ortho, 1);
  if (normalize & DM_MUON_NORM_ROW) ortho = l2_normalized(ortho, 2);
  return ortho;
}

/* the key of a shape group's rounding bits: the group's salt mixed with its matrices' shape
** (splitmix64's finaliser), so that member j of two groups draws other bits */
static uint32_t shape_salt(uint32_t salt, int64_t rows, int64_t cols) {
  uint64_t z = (((uint64_t)rows << 32) ^ (uint64_t)cols) + 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  z ^= z >> 31;
  return salt ^ (uint32_t)z ^ (uint32_t)(z >> 32);
}

/* One shape group (members idx[0..k)): momentum into a stack [B, m, n],
** Newton–Schulz on the stack, the scaled update from its slices. */
static void muon_group(int k, const int *idx, dm_tensor *const *params, dm_tensor *const *grads,
                       dm_tensor *const *bufs, const dm_muon_hp *hp, const double *clip_at) {
  const dm_tensor *p0 = params[idx[0]];
  dm_device dev = p0->device;
  dm_muon_momentum_k momentum = DM_KERNEL(muon_momentum, dev);
  dm_muon_apply_k apply = DM_KERNEL(muon_apply, dev);
  ns_kernels nsk = ns_kernels_for(dev);
  int64_t rows = p0->shape[p0->ndim - 2], cols = p0->shape[p0->ndim - 1], batch = 0;
  for (int j = 0; j < k; j++) batch += params[idx[j]]->ndim == 3 ? params[idx[j]]->shape[0] : 1;
  int64_t pitch = stack_pitch(dev, cols), shape[3] = {batch, rows, pitch};
  /* decided on the stack's pitch, as ns_run decides: [100, 197] pads to a Gram-form [100, 200] */
  dm_tensor *stack = dm_tensor_new(dev, dm_ns_gram(rows, pitch) ? DM_F32 : hp->ns_dtype, 3, shape);
  if (pitch > cols) {                 /* zero columns: the same orthogonalisation of the real ones */
    dm_tensor *pad = dm_narrow(stack, 2, cols, pitch - cols);
    dm_fill(pad, 0.0);
    dm_release(pad);
  }
  dm_tensor *p[k], *g[k], *b[k], *o[k], *sc[k];
  for (int j = 0; j < k; j++) {
    p[j] = params[idx[j]]; g[j] = grads[idx[j]]; b[j] = bufs[idx[j]];
    sc[j] = hp->scales ? hp->scales[idx[j]] : NULL;
  }
  stack_views(stack, k, p, rows, pitch, o);
  /* the salt tells shape groups apart: members are counted within the group */
  dm_sround_key key = {.salt = shape_salt(hp->sround_salt, rows, cols), .step = hp->step, .step_at = hp->step_at};
  if (momentum)                                           /* the kernels: NULL on the meta device */
    momentum(k, b, g, o, hp->momentum, hp->nesterov, hp->sumsq_at, clip_at, hp->clip, cols, pitch,
             hp->momentum_sround ? &key : NULL);
  for (int j = 0; j < k; j++) dm_release(o[j]);
  dm_tensor *ortho = muon_plus(ns_run(stack, hp->ns_steps, hp->coeffs, &nsk, hp->ns_dtype), hp->normalize);
  stack_views(ortho, k, p, rows, pitch, o);
  /* 0.2·sqrt(max(m, n)) brings the update's RMS to AdamW's (Moonlight) */
  if (dm_plan_card_of(dev)) dm_plan_scratch(DM_MUON_APPLY_SCRATCH, "muon's constants (kernels/optim.cu cuda_muon_apply)");
  if (apply) apply(k, p, o, sc, hp, 0.2 * sqrt((double)(rows > cols ? rows : cols)), cols, pitch);
  for (int j = 0; j < k; j++) {
    dm_release(o[j]);
    dm_mark_written(p[j]);
    dm_mark_written(b[j]);
  }
  dm_release(ortho);
}

/* a bank's update scales: f32 [E], contiguous, on its device */
static void check_scales(const dm_tensor *p, const dm_tensor *s, int i, int n) {
  char a[128], b[128];
  dm_check_live(s);
  if (p->ndim != 3 || s->ndim != 1 || s->shape[0] != p->shape[0] || s->dtype != DM_F32 || !dm_is_contiguous(s) ||
      s->device != p->device)
    dm_error("muon: the update scales of parameter %d of %d are %s %s on %s; a bank %s on %s takes f32 [E] on its "
             "device", i + 1, n, dm_dtype_name(s->dtype), dm_tensor_shape_str(s, a, sizeof a), dm_device_name(s->device),
             dm_tensor_shape_str(p, b, sizeof b), dm_device_name(p->device));
}

static void check_muon(int n, dm_tensor *const *params, dm_tensor *const *grads,
                       dm_tensor *const *bufs, const dm_muon_hp *hp) {
  const char *op = "muon";
  check_range(op, "lr", hp->lr, 0, INFINITY, true);
  check_range(op, "momentum", hp->momentum, 0, 1, true);
  check_range(op, "weight_decay", hp->weight_decay, 0, INFINITY, true);
  check_range(op, "clip", hp->clip, 0, INFINITY, true);
  if (hp->clip > 0 && !hp->sumsq_at) dm_error("muon: clip %g needs the gradients' sum of squares (sumsq_at)", hp->clip);
  check_ns(op, hp->ns_steps, hp->ns_dtype);
  if (hp->coeffs != DM_NS_QUINTIC && hp->coeffs != DM_NS_POLAR_EXPRESS)
    dm_error("muon: unknown Newton-Schulz coefficients %d", (int)hp->coeffs);
  if (hp->momentum_sround && hp->step < 1 && !hp->step_at)
    dm_error("muon: stochastic rounding needs the update's count (step >= 1 or step_at), got step %lld",
             (long long)hp->step);
  if (n > DM_MUON_MAXLIST) dm_error("muon: at most %d tensors per call, got %d", DM_MUON_MAXLIST, n);
  for (int i = 0; i < n; i++) {
    check_param(op, i, n, params[i], params[0]);
    char s[128];
    if (params[i]->ndim != 2 && params[i]->ndim != 3)
      dm_error("muon: parameter %d has shape %s; Muon takes matrices [m, n] and banks [E, m, n]",
               i + 1, dm_tensor_shape_str(params[i], s, sizeof s));
    check_grad(op, i, params[i], grads[i]);
    check_state_of(op, "momentum buffer", i, params[i], bufs[i], true);
    if (hp->scales && hp->scales[i]) check_scales(params[i], hp->scales[i], i, n);
  }
}

void dm_muon_step(int n, dm_tensor *const *params, dm_tensor *const *grads,
                  dm_tensor *const *bufs, const dm_muon_hp *given) {
  dm_muon_hp hpv = *given, *hp = &hpv;
  check_muon(n, params, grads, bufs, hp);
  const double *clip_at = hp->clip > 0 ? hp->sumsq_at : NULL;   /* kept: resolve_muon drops sumsq_at on the CPU */
  if (n > 0 && !resolve_muon(hp, params[0]->device)) return;
  int idx[n > 0 ? n : 1];
  for (int i = 0; i < n; i++) {
    if (!grads[i]) continue;
    bool seen = false;                 /* an earlier member of its shape led the group */
    for (int j = 0; j < i && !seen; j++) seen = grads[j] && same_matrix(params[j], params[i]);
    if (seen) continue;
    int k = 0;
    for (int j = i; j < n; j++)
      if (grads[j] && same_matrix(params[j], params[i])) idx[k++] = j;
    muon_group(k, idx, params, grads, bufs, hp, clip_at);
  }
}

/* ---- clipping ------------------------------------------------------------------------------- */

/* the list's first gradient (NULL when none), after checking them all */
/* the sums of squares' partials, for a plan on the meta device (core/alloc.h) */
static void plan_sumsq(dm_device dev, int n, dm_tensor *const *grads) {
  if (!dm_plan_card_of(dev)) return;
  int64_t blocks = 0;
  for (int i = 0; i < n; i++) if (grads[i]) blocks += dm_sumsq_blocks(dm_numel(grads[i]));
  dm_plan_scratch(dm_sumsq_scratch(blocks), "clipping's partial sums (kernels/optim.cu cuda_sumsq)");
}

static const dm_tensor *check_clip(const char *op, int n, dm_tensor *const *grads, double max_norm) {
  if (!(max_norm >= 0)) dm_error("%s: max_norm must be >= 0 (0 = no clipping), got %g", op, max_norm);
  const dm_tensor *first = NULL;
  for (int i = 0; i < n; i++) {
    const dm_tensor *g = grads[i];
    if (!g) continue;
    dm_check_live(g);
    if (!first) first = g;
    char s[128];
    if (!dm_dtype_is_float(g->dtype))
      dm_error("%s: gradient %d must be a float tensor, got %s", op, i + 1, dm_dtype_name(g->dtype));
    if (!dm_is_contiguous(g))
      dm_error("%s: gradient %d (shape %s) is not contiguous", op, i + 1, dm_tensor_shape_str(g, s, sizeof s));
    if (g->device != first->device)
      dm_error("%s: gradient %d is on %s but the first is on %s", op, i + 1, dm_device_name(g->device),
               dm_device_name(first->device));
  }
  return first;
}

void dm_clip_scale(int n, dm_tensor *const *grads, double max_norm, const dm_tensor *sumsq) {
  const dm_tensor *first = check_clip("clip_scale", n, grads, max_norm);
  if (!first || max_norm == 0) return;
  dm_check_scalar("clip_scale", "the sum of squares", sumsq, DM_F64, first->device);
  DM_RUN(clip_scale, first->device, n, grads, sumsq, max_norm);
  for (int i = 0; i < n; i++) if (grads[i]) dm_mark_written(grads[i]);
}

void dm_clip_grads_async(int n, dm_tensor *const *grads, double max_norm, dm_tensor *sumsq) {
  const dm_tensor *first = check_clip("clip_grads_async", n, grads, max_norm);
  dm_device dev = first ? first->device : sumsq->device;
  dm_check_scalar("clip_grads_async", "the sum of squares", sumsq, DM_F64, dev);
  if (!first) { dm_fill(sumsq, 0.0); return; }
  plan_sumsq(dev, n, grads);
  DM_RUN(sumsq, dev, n, grads, sumsq);
  if (max_norm > 0) {
    DM_RUN(clip_scale, dev, n, grads, sumsq, max_norm);
    for (int i = 0; i < n; i++) if (grads[i]) dm_mark_written(grads[i]);
  }
  dm_mark_written(sumsq);
}

void dm_optim_tick(dm_tensor *step, const dm_tensor *sumsq) {
  dm_check_scalar("optim_tick", "the step count", step, DM_I64, step->device);
  dm_check_scalar("optim_tick", "the sum of squares", sumsq, DM_F64, step->device);
  DM_RUN(optim_tick, step->device, step, sumsq);
  dm_mark_written(step);
}

double dm_clip_grad_norm(int n, dm_tensor *const *grads, double max_norm, bool *finite) {
  const dm_tensor *first = check_clip("clip_grad_norm", n, grads, max_norm);
  if (finite) *finite = true;
  if (!first) return 0.0;
  dm_device dev = first->device;
  dm_sumsq_k sum = DM_KERNEL(sumsq, dev);
  dm_clip_scale_k scale = DM_KERNEL(clip_scale, dev);
  dm_tensor *sumsq = dm_tensor_new(dev, DM_F64, 1, (int64_t[]){1});
  plan_sumsq(dev, n, grads);
  if (sum) sum(n, grads, sumsq);                          /* the kernels: NULL on the meta device */
  dm_tensor *host = dev == DM_CPU ? (dm_retain(sumsq), sumsq) : dm_to_device(sumsq, DM_CPU);
  double norm = sqrt(*(double *)dm_data(host));
  dm_release(host);
  if (finite) *finite = isfinite(norm);
  /* the kernel decides from the device-side sum itself (no host read on the GPU) */
  if (max_norm > 0) {
    if (scale) scale(n, grads, sumsq, max_norm);
    if (isfinite(norm) && norm > max_norm)
      for (int i = 0; i < n; i++) if (grads[i]) dm_mark_written(grads[i]);
  }
  dm_release(sumsq);
  return norm;
}
