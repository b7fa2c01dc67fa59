/*
** vm/ops/kda.c — Kimi Delta Attention: the recurrence and its gate.
**
**   kda(q, k, v, g, beta, [S0]; chunk) -> o, S_T
**       q, k, g [B, T, H, dk], v [B, T, H, dv], beta [B, T, H], S0 [B, H, dk, dv];
**       o [B, T, H, dv] in q's dtype, S_T [B, H, dk, dv] in f32 (f64 for f64 q).
**       chunk: the recurrent backward's checkpoint interval (0: 64); it
**       changes only the backward's memory and time, never its results.
**       algo: 0 auto, 1 recurrent (step by step), 2 chunked (WY/UT, chunks
**       of 64); auto is chunked on CUDA for T >= DM_KDA_CHUNKED_MIN_T in
**       f32/bf16/f16 with dk, dv <= 64, recurrent otherwise (the CPU, f64,
**       decode-sized T). Both give the same results up to rounding.
**   kda_gate(f, [A_log], dt_bias; kind, lb) -> g
**       f [..., H*dk] or [..., H, dk], A_log [H] (one per head, as in FLA),
**       dt_bias of H*dk values ([H*dk] or [H, dk]); kind 0 bounded (the
**       default, lb default -5, lb < 0), 1 softplus; g like f, in f32 (f64
**       for f64 f), never positive.
**
** kda.h has the maths, the kernel contract and what the backward saves
** (the inputs only) and recomputes (the states, from checkpoints).
*/
#include <math.h>
#include "core/core.h"
#include "core/alloc.h"
#include "core/autograd.h"
#include "ops/kda.h"

/* t must have the shape `want`; the message names t's shape, the reference's and the expectation */
static void expect_shape(const char *op, const char *name, const dm_tensor *t, int nd, const int64_t *want,
                         const char *ref_name, const dm_tensor *ref, const char *layout) {
  bool ok = t->ndim == nd;
  for (int d = 0; ok && d < nd; d++) ok = t->shape[d] == want[d];
  if (ok) return;
  char st[128], sr[128], sw[128];
  dm_error("%s: %s has shape %s but %s has shape %s; %s must be %s = %s", op, name,
           dm_tensor_shape_str(t, st, sizeof st), ref_name, dm_tensor_shape_str(ref, sr, sizeof sr), name,
           layout, dm_shape_str(sw, sizeof sw, nd, want));
}

/* a contiguous version of each present tensor (a view when it already is) */
static void contiguous_all(int n, dm_tensor *const *in, dm_tensor **out) {
  for (int i = 0; i < n; i++) out[i] = in[i] ? dm_contiguous(in[i]) : NULL;
}

static void release_all(int n, dm_tensor **t) {
  for (int i = 0; i < n; i++) dm_release(t[i]);
}

/* new gradients, in each input's dtype and shape, for the inputs that need one */
static void new_grads(dm_ctx *c, int n, dm_device dev, dm_tensor **gr) {
  for (int i = 0; i < n; i++)
    gr[i] = dm_needs_grad(c, i) ? dm_new_grad(c, i, dev) : NULL;
}

/* ---- kda ------------------------------------------------------------------------------------ */

enum { Q, K, V, G, BETA, S0, KDA_NIN };

static dm_kda_pass_counts passes;

dm_kda_pass_counts dm_kda_passes(void) { return passes; }

static int64_t chunk_attr(const dm_attrs *a) {
  double ch = a->v[0];                /* declared with its default: dm_call fills it in */
  if (!(ch >= 0) || ch != floor(ch) || ch > 1e9)
    dm_error("kda: chunk must be a whole number >= 1 (0 for the default %d), got %g", DM_KDA_CHUNK, ch);
  return ch == 0 ? DM_KDA_CHUNK : (int64_t)ch;
}

static int algo_attr(const dm_attrs *a) {
  double al = a->v[1];
  if (al != DM_KDA_AUTO && al != DM_KDA_RECURRENT && al != DM_KDA_CHUNKED)
    dm_error("kda: algo must be one of " DM_KDA_ALGO_SPELLINGS " (0..2), got %g", al);
  return (int)al;
}

/* whether the call runs the chunked kernels (forward and backward decide alike) */
static bool chunked(const dm_attrs *a, const dm_tensor *q, const dm_tensor *v) {
  int al = algo_attr(a);
  if (al != DM_KDA_AUTO) return al == DM_KDA_CHUNKED;
  const bool cuda = q->device == DM_CUDA || dm_plan_card_of(q->device);     /* (a plan stands for the card) */
  return cuda && q->dtype != DM_F64 && q->shape[1] >= DM_KDA_CHUNKED_MIN_T &&
         q->shape[3] <= DM_KDA_CUDA_CHUNK_MAXD && v->shape[3] <= DM_KDA_CUDA_CHUNK_MAXD;
}

/* The CUDA kernels' scratch of a call (vm/ops/kda.h), for a plan on the meta device (core/alloc.h);
** want_dv, want_dbeta: the backward's gradients wanted */
static void plan_kda(const dm_tensor *q, const dm_tensor *v, bool ch, bool bwd, int64_t chunk, bool want_dv,
                     bool want_dbeta) {
  const dm_plan_card *card = dm_plan_card_of(q->device);
  if (!card) return;
  const int64_t B = q->shape[0], T = q->shape[1], H = q->shape[2], dk = q->shape[3], dv = v->shape[3];
  const int64_t vb = q->dtype == DM_F64 ? 8 : 4;
  if (ch && !bwd)
    dm_plan_scratch(dm_kda_chunk_tiles(B * H, T, false), "kda chunked forward tiles (kernels/kda_chunk.cu kc_front)");
  else if (ch)
    dm_plan_scratch(dm_kda_chunk_tiles(B * H, T, true) + dm_kda_chunk_spare(B * T * H, dv, want_dv, want_dbeta),
                    "kda chunked backward tiles (kernels/kda_chunk.cu kc_front)");
  else if (!bwd)
    dm_plan_scratch(dm_kda_fwd_scratch(B * H, dk, dv, vb, card->smem_optin),
                    "kda forward state (kernels/kda.cu kda_forward)");
  else
    dm_plan_scratch(dm_kda_bwd_work(B * H, T, dk, dv, chunk, vb) + dm_kda_bwd_states(B * H, dk, dv, vb, card->smem_optin),
                    "kda backward states (kernels/kda.cu kda_backward)");
}

static void kda_forward(dm_ctx *c) {
  dm_tensor *q = c->in[Q], *k = c->in[K], *v = c->in[V], *g = c->in[G], *beta = c->in[BETA], *s0 = c->in[S0];
  static const char *names[KDA_NIN] = {"q", "k", "v", "g", "beta", "initial_state"};
  for (int i = 0; i < KDA_NIN; i++) if (c->in[i]) dm_check_float("kda", names[i], c->in[i]);
  char sq[128];
  if (q->ndim != 4) dm_error("kda: q must be [B, T, H, dk], got shape %s", dm_tensor_shape_str(q, sq, sizeof sq));
  if (v->ndim != 4) dm_error("kda: v must be [B, T, H, dv], got shape %s", dm_tensor_shape_str(v, sq, sizeof sq));
  const int64_t B = q->shape[0], T = q->shape[1], H = q->shape[2], dk = q->shape[3], dv = v->shape[3];
  expect_shape("kda", "k", k, 4, q->shape, "q", q, "[B, T, H, dk]");
  expect_shape("kda", "v", v, 4, (int64_t[]){B, T, H, dv}, "q", q, "[B, T, H, dv]");
  expect_shape("kda", "g", g, 4, q->shape, "q", q, "[B, T, H, dk]");
  expect_shape("kda", "beta", beta, 3, q->shape, "q", q, "[B, T, H]");
  if (s0) expect_shape("kda", "initial_state", s0, 4, (int64_t[]){B, H, dk, dv}, "v", v, "[B, H, dk, dv]");
  dm_check_dtype_equal("kda (q and k)", q, k);
  dm_check_dtype_equal("kda (q and v)", q, v);
  chunk_attr(&c->a);
  algo_attr(&c->a);
  dm_dtype ct = q->dtype == DM_F64 ? DM_F64 : DM_F32;
  dm_tensor *in[KDA_NIN];
  contiguous_all(KDA_NIN, c->in, in);
  dm_tensor *o = dm_tensor_new(q->device, q->dtype, 4, (int64_t[]){B, T, H, dv});
  dm_tensor *sT = dm_tensor_new(q->device, ct, 4, (int64_t[]){B, H, dk, dv});
  /* DM_KERNEL caches by call site: one site per kernel name */
  const bool ch = chunked(&c->a, q, v);
  if (q->device != DM_META) {
    if (ch) passes.chunked++;
    else passes.recurrent++;
  }
  dm_kda_fwd_k fwd = ch ? DM_KERNEL(kda_chunk_fwd, q->device)
                        : DM_KERNEL(kda_fwd, q->device);
  plan_kda(q, v, ch, false, 0, true, true);
  if (fwd) fwd(o, sT, in[Q], in[K], in[V], in[G], in[BETA], in[S0]);     /* NULL on the meta device */
  for (int i = 0; i < KDA_NIN; i++) if (in[i]) dm_save(c, in[i]);   /* S0 last, when given */
  release_all(KDA_NIN, in);
  c->out[0] = o;
  c->out[1] = sT;
}

static void kda_backward(dm_ctx *c, dm_tensor *const *gout, dm_tensor **gin) {
  dm_tensor *in[KDA_NIN];
  for (int i = 0; i < S0; i++) in[i] = dm_saved(c, i);
  in[S0] = c->node->n_saved > S0 ? dm_saved(c, S0) : NULL;
  dm_tensor *d_o = dm_contiguous(gout[0]), *d_s = dm_contiguous(gout[1]);
  dm_tensor *gr[KDA_NIN];
  new_grads(c, KDA_NIN, d_o->device, gr);
  bool ch = chunked(&c->a, in[Q], in[V]);
  dm_kda_bwd_k bwd = ch ? DM_KERNEL(kda_chunk_bwd, d_o->device)
                        : DM_KERNEL(kda_bwd, d_o->device);
  const int64_t chunk = ch ? DM_KDA_CHUNK : chunk_attr(&c->a);
  plan_kda(in[Q], in[V], ch, true, chunk, gr[V] != NULL, gr[BETA] != NULL);
  if (bwd) bwd(gr[Q], gr[K], gr[V], gr[G], gr[BETA], gr[S0], in[Q], in[K], in[V], in[G], in[BETA], in[S0], d_o, d_s,
               chunk);                                               /* NULL on the meta device */
  dm_release(d_o);
  dm_release(d_s);
  for (int i = 0; i < KDA_NIN; i++) gin[i] = gr[i];
}

/* ---- kda_gate ------------------------------------------------------------------------------- */

enum { F, ALOG, DTB, GATE_NIN };

static void gate_attrs(const dm_attrs *a, int *kind, double *lb) {
  double k = a->v[0];                 /* both declared with their defaults: dm_call fills them in */
  *lb = a->v[1];
  if (k != DM_KDA_GATE_BOUNDED && k != DM_KDA_GATE_SOFTPLUS)
    dm_error("kda_gate: kind must be one of " DM_KDA_GATE_SPELLINGS " (0, 1), got %g", k);
  *kind = (int)k;
  if (*kind == DM_KDA_GATE_BOUNDED && !(*lb < 0 && isfinite(*lb)))
    dm_error("kda_gate: the lower bound lb must be negative and finite, got %g", *lb);
}

/* checks the shapes; returns the number of heads */
static int64_t gate_heads(const dm_tensor *f, const dm_tensor *a_log, const dm_tensor *dt_bias) {
  char sf[128], sa[128], sb[128];
  const int64_t D = dm_numel(dt_bias), nd = f->ndim;
  if (D == 0) dm_error("kda_gate: dt_bias is empty (shape %s)", dm_tensor_shape_str(dt_bias, sb, sizeof sb));
  bool flat = nd >= 1 && f->shape[nd - 1] == D;
  bool headed = !flat && nd >= 2 && f->shape[nd - 2] * f->shape[nd - 1] == D;
  if (!flat && !headed)
    dm_error("kda_gate: f of shape %s does not end in the %lld channels of dt_bias (shape %s); f must be "
             "[..., H*dk] or [..., H, dk]", dm_tensor_shape_str(f, sf, sizeof sf), (long long)D,
             dm_tensor_shape_str(dt_bias, sb, sizeof sb));
  if (!a_log) return 1;
  const int64_t H = dm_numel(a_log);
  if (a_log->ndim != 1 || H == 0 || D % H != 0 || (headed && f->shape[nd - 2] != H))
    dm_error("kda_gate: A_log of shape %s must hold one value per head of f (shape %s, dt_bias %s): [H] with "
             "H dividing the %lld channels%s", dm_tensor_shape_str(a_log, sa, sizeof sa),
             dm_tensor_shape_str(f, sf, sizeof sf), dm_tensor_shape_str(dt_bias, sb, sizeof sb), (long long)D,
             headed ? " and f [..., H, dk]" : "");
  return H;
}

static void gate_forward(dm_ctx *c) {
  dm_tensor *f = c->in[F], *a_log = c->in[ALOG], *dt_bias = c->in[DTB];
  dm_check_float("kda_gate", "f", f);
  if (a_log) dm_check_float("kda_gate", "A_log", a_log);
  dm_check_float("kda_gate", "dt_bias", dt_bias);
  int kind;
  double lb;
  gate_attrs(&c->a, &kind, &lb);
  int64_t heads = gate_heads(f, a_log, dt_bias);
  dm_tensor *in[GATE_NIN];
  contiguous_all(GATE_NIN, c->in, in);
  dm_tensor *g = dm_tensor_new(f->device, f->dtype == DM_F64 ? DM_F64 : DM_F32, f->ndim, f->shape);
  DM_RUN(kda_gate, f->device, g, in[F], in[ALOG], in[DTB], heads, kind, lb);
  dm_save(c, in[F]);
  dm_save(c, in[DTB]);
  if (in[ALOG]) dm_save(c, in[ALOG]);
  release_all(GATE_NIN, in);
  c->out[0] = g;
}

static void gate_backward(dm_ctx *c, dm_tensor *const *gout, dm_tensor **gin) {
  dm_tensor *f = dm_saved(c, 0), *dt_bias = dm_saved(c, 1);
  dm_tensor *a_log = c->node->n_saved > 2 ? dm_saved(c, 2) : NULL;
  int kind;
  double lb;
  gate_attrs(&c->a, &kind, &lb);
  dm_tensor *dg = dm_contiguous(gout[0]);
  dm_tensor *gr[GATE_NIN];
  new_grads(c, GATE_NIN, dg->device, gr);
  if (dm_plan_card_of(dg->device) && (gr[ALOG] || gr[DTB]))
    dm_plan_scratch(dm_kda_gate_bwd_scratch(dm_numel(f) / dm_numel(dt_bias), dm_numel(dt_bias)),
                    "kda_gate's channel sums (kernels/kda.cu gate_backward)");
  DM_RUN(kda_gate_bwd, dg->device, gr[F], gr[ALOG], gr[DTB], dg, f, a_log, dt_bias,
                                                           a_log ? dm_numel(a_log) : 1, kind, lb);
  dm_release(dg);
  for (int i = 0; i < GATE_NIN; i++) gin[i] = gr[i];
}

/* ---- the table and the C API ----------------------------------------------------------------- */

static dm_op ops[] = {
  {.name = "kda", .doc = "Kimi Delta Attention (q, k, v, g, beta, [S0]) -> o, final state; recurrent or chunked",
   .n_in = KDA_NIN, .n_out = 2, .attrs = "chunk:int~0,algo=" DM_KDA_ALGO_SPELLINGS "~auto", .optional = 1u << S0,
   .forward = kda_forward, .backward = kda_backward},
  {.name = "kda_gate", .doc = "KDA log-decay gate (f, [A_log], dt_bias) -> g <= 0, bounded or softplus",
   .args = "f [..., H*dk], A_log [H], dt_bias [H*dk]", .lua = DM_LUA_FN,
   .n_in = GATE_NIN, .n_out = 1, .attrs = "kind=" DM_KDA_GATE_SPELLINGS "~bounded,lb~-5", .optional = 1u << ALOG,
   .forward = gate_forward, .backward = gate_backward},
};
DM_REGISTER_OPS(ops)

dm_tensor *dm_kda(dm_tensor *q, dm_tensor *k, dm_tensor *v, dm_tensor *g, dm_tensor *beta, dm_tensor *s0,
                  int64_t chunk, dm_tensor **s_final) {
  dm_tensor *in[KDA_NIN] = {q, k, v, g, beta, s0}, *out[2];
  dm_attrs a = dm_attrs_of(1, (double[]){chunk > 0 ? (double)chunk : 0});
  dm_call(&ops[0], KDA_NIN, in, &a, out);
  if (s_final) *s_final = out[1];
  else dm_release(out[1]);
  return out[0];
}

dm_tensor *dm_kda_gate(dm_tensor *f, dm_tensor *a_log, dm_tensor *dt_bias, int kind, double lb) {
  dm_tensor *in[GATE_NIN] = {f, a_log, dt_bias}, *out;
  dm_attrs a = dm_attrs_of(2, (double[]){kind, lb});
  dm_call(&ops[1], GATE_NIN, in, &a, &out);
  return out;
}
