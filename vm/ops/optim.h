/*
** optim.h — the optimisers' update math, over lists of tensors.
**
**   AdamW      one fused pass over every tensor of a group: bias-corrected
**              Adam with decoupled weight decay.
**   Muon       momentum (Nesterov by default), then Newton–Schulz
**              orthogonalisation of each matrix, batched: every matrix of
**              one shape (the experts of a bank [E, m, n] included) is
**              stacked into one [B, m, n] tensor and iterated with batched
**              products; the update is scaled by 0.2·sqrt(max(m, n)).
**   clipping   the global gradient norm in one pass (sum of squares over
**              the list), then one scaling pass when it exceeds the limit;
**              a non-finite norm is reported, not clipped.
**
** Parameters are contiguous float32 masters; gradients are contiguous f32
** or bf16 of the parameter's shape; optimiser state is contiguous f32. A
** NULL gradient skips its parameter (it took no part in the step).
**
** The per-step scalars (learning rate, step count) travel in a struct of
** values with, for device kernels, optional pointers into device memory: a
** kernel reads *lr_at when it is set, so a captured CUDA graph replays with
** whatever the schedule wrote there. sumsq_at, when set, is the step's sum
** of squares of every gradient (dm_clip_grads_async): a non-finite one
** skips the update there, on the device, so the NaN firewall needs no host
** read. On the CPU the pointers are read by the host before the kernels run.
*/
#ifndef DM_OPTIM_H
#define DM_OPTIM_H

#include "core/tensor.h"
#include "core/ops.h"

/* ---- the CUDA kernels' device scratch, in bytes (core/alloc.h): the kernels size
** theirs with these, and the callers hand the same to a plan ---- */

/* "sumsq" (clipping): one f64 partial a block of DM_SUMSQ_CHUNK elements of each tensor */
#define DM_SUMSQ_CHUNK 65536
static inline int64_t dm_sumsq_blocks(int64_t numel) { return (numel + DM_SUMSQ_CHUNK - 1) / DM_SUMSQ_CHUNK; }
static inline int64_t dm_sumsq_scratch(int64_t blocks) { return 8 * (blocks > 0 ? blocks : 1); }

/* "adamw" and "muon_apply": the step's f32 constants, worked out on the device */
#define DM_ADAMW_SCRATCH (4 * (int64_t)sizeof(float))
#define DM_MUON_APPLY_SCRATCH (3 * (int64_t)sizeof(float))

/* "ns_normalize" of nb matrices of per values: f64 partials over up to 64 slices of 16384
** values a matrix, then its factor (f32) */
static inline int64_t dm_ns_slices(int64_t per) {
  const int64_t n = (per + 16383) / 16384;
  return n > 64 ? 64 : n;
}
static inline int64_t dm_ns_normalize_scratch(int64_t nb, int64_t per) {
  return nb * per == 0 ? 0 : 8 * nb * dm_ns_slices(per) + 4 * nb;
}

typedef struct dm_adamw_hp {
  double lr, beta1, beta2, eps, weight_decay;
  int64_t step;               /* 1-based count of applied updates, for the bias corrections */
  const double *lr_at;        /* the tensor's memory (f64), read at run time when set */
  const int64_t *step_at;
  const double *sumsq_at;     /* a non-finite sum skips the update */
} dm_adamw_hp;

typedef enum { DM_NS_QUINTIC, DM_NS_POLAR_EXPRESS } dm_ns_coeffs;

/* Muon+ (Zhang et al., arXiv 2602.21545): the orthogonalised update l2-normalised by column, by
** row, or both (columns first) before its scale; a bit mask */
enum { DM_MUON_NORM_NONE = 0, DM_MUON_NORM_COL = 1, DM_MUON_NORM_ROW = 2 };

typedef struct dm_muon_hp {
  double lr, momentum, weight_decay;
  int normalize;              /* DM_MUON_NORM_* bits; 0: plain Muon */
  bool nesterov;              /* update = g + mu·buf after buf = mu·buf + g; else update = buf */
  int ns_steps;               /* >= 1 */
  dm_ns_coeffs coeffs;
  dm_dtype ns_dtype;          /* DM_F32 or DM_BF16: the dtype Newton–Schulz runs in */
  const double *lr_at;        /* as in dm_adamw_hp */
  const double *sumsq_at;
  /* > 0: the gradients come unclipped and the momentum pass clips them to this
  ** global norm, from sumsq_at (needed then), as dm_clip_scale would have: one
  ** pass over the largest gradients instead of two */
  double clip;
  /* the momentum buffers, when bf16, round stochastically (vm/core/sround.h) instead of to
  ** nearest, from random bits keyed by sround_salt, a member's index in its shape group, the
  ** update's 1-based count (step, or step_at's i64 when set) and the element */
  bool momentum_sround;
  uint32_t sround_salt;
  int64_t step;
  const int64_t *step_at;
  /* NULL, or one entry a parameter: NULL, or for a bank [E, m, n] an f32 [E] on its device, read
  ** when the kernels run: matrix e's update (not its decay) times scales[i][e] (an expert's update
  ** by its share of the step's rows: model.moe.update_by_load) */
  dm_tensor *const *scales;
} dm_muon_hp;

/* what the momentum kernel needs to round stochastically; NULL to the kernel: to nearest */
typedef struct dm_sround_key {
  uint32_t salt;
  int64_t step;               /* when step_at is NULL */
  const int64_t *step_at;     /* the parameters' device memory */
} dm_sround_key;

#define DM_MUON_MAXLIST 1024  /* tensors per dm_muon_step call */

/* p ← p·(1 − lr·wd) − lr·m̂/(sqrt(v̂) + eps), with m, v the moment estimates */
void dm_adamw_step(int n, dm_tensor *const *params, dm_tensor *const *grads,
                   dm_tensor *const *m, dm_tensor *const *v, const dm_adamw_hp *hp);

/* AdamW with 8-bit moments (vm/core/code8.h): m and r = sqrt(v) kept as codes (u8, the parameter's
** shape) with a scale a block of DM_CODE8_BLOCK elements (f32 [dm_code8_blocks(numel)]). Each step
** decodes them, takes AdamW's step in f32 (the parameter reads the moments before they are
** encoded) and encodes them again, rounding stochastically from random bits keyed by salt, the
** member (2i for m, 2i + 1 for r, i its place in the list), the update's count and the element. */
void dm_adamw_8bit_step(int n, dm_tensor *const *params, dm_tensor *const *grads, dm_tensor *const *m,
                      dm_tensor *const *m_scale, dm_tensor *const *r, dm_tensor *const *r_scale,
                      const dm_adamw_hp *hp, uint32_t salt);

/* A moment's values (f32, on the CPU) as codes and scales of blocks of `block` values (DM_CODE8_BLOCK
** for AdamW, a row for the Engram tables), and back (a checkpoint's f32 moments loaded into 8-bit
** buffers, or 8-bit ones into f32): signed for m, unsigned for r = sqrt(v). */
void dm_code8_pack(dm_tensor *codes, dm_tensor *scales, const dm_tensor *values, bool is_signed, uint32_t salt,
                int64_t block);
void dm_code8_unpack(dm_tensor *values, const dm_tensor *codes, const dm_tensor *scales, bool is_signed, int64_t block);

/* params [m, n] or banks [E, m, n]; bufs their f32 momentum, same shapes */
void dm_muon_step(int n, dm_tensor *const *params, dm_tensor *const *grads,
                  dm_tensor *const *bufs, const dm_muon_hp *hp);

/* The Newton–Schulz orthogonalisation of x [m, n] or [B, m, n] (each
** matrix on its own), as a new contiguous tensor of dtype dt (F32 or BF16)
** and x's shape: X ← X/(‖X‖_F·s + 1e-7), then per step (a, b, c):
** A = X Xᵀ, X ← aX + (bA + cA²)X, on the Gram side of the smaller dim (a
** tall matrix iterates as its transpose). s = 1.01 for Polar Express. */
dm_tensor *dm_newton_schulz(dm_tensor *x, int steps, dm_ns_coeffs coeffs, dm_dtype dt);

/* Whether an [m, n] matrix takes the Gram form of the iteration: a clearly
** rectangular one (the long side at least twice the short side s, s <= 256).
** With X_k = Q_k X_0 (X_0 Q_k when tall) and Q_k [s, s], the matrix itself
** is read twice (its Gram matrix A_0 and the final product) instead of
** three products a step, and the steps run on s x s f32 matrices:
**   Q_0 = I / (sqrt(tr A_0)·s_norm + eps)        (tr A_0 = ‖X_0‖²)
**   A_k = Q_k A_0 Q_kᵀ,  Q_{k+1} = a Q_k + (b A_k + c A_k²) Q_k
** which is the iteration above in exact arithmetic; it runs in f32 whatever
** dt asks for (the result is then rounded to dt), its products on TF32
** tensor cores when dt is bf16 (a 10-bit mantissa against bf16's 7). */
bool dm_ns_gram(int64_t m, int64_t n);

/* step i's (a, b, c), 0-based; and the normaliser's safety factor s */
void dm_ns_coefficients(dm_ns_coeffs coeffs, int step, double abc[3]);
double dm_ns_norm_factor(dm_ns_coeffs coeffs);

/* The global norm of the gradients (NULL entries skipped), before
** clipping. When max_norm > 0 and the norm is finite and above it, every
** gradient is scaled by max_norm / norm in place. *finite (may be NULL)
** is false when any element is NaN or infinite; the gradients are then
** left as they are (the step is to be skipped). */
double dm_clip_grad_norm(int n, dm_tensor *const *grads, double max_norm, bool *finite);

/* The same without reading anything back: sumsq (one f64 element on the
** gradients' device) receives the sum of squares, and the scaling decides
** on the device. Then dm_optim_tick adds 1 to step (one i64 element) when
** that sum is finite: the count of applied updates, AdamW's t. */
/* grads *= max_norm / norm where norm = sqrt(*sumsq) is finite and above max_norm
** (what dm_clip_grads_async does after its sum; the sum may cover more gradients) */
void dm_clip_scale(int n, dm_tensor *const *grads, double max_norm, const dm_tensor *sumsq);
void dm_clip_grads_async(int n, dm_tensor *const *grads, double max_norm, dm_tensor *sumsq);
void dm_optim_tick(dm_tensor *step, const dm_tensor *sumsq);

/* ---- kernels (registered per device; CUDA ones take the same signatures) ----
** Every tensor is contiguous and the lists are checked by the core. */
typedef void (*dm_adamw_k)(int n, dm_tensor *const *p, dm_tensor *const *g, dm_tensor *const *m,
                           dm_tensor *const *v, const dm_adamw_hp *hp);              /* "adamw" */
/* m, r: u8 codes; m_scale, r_scale: f32 block scales (dm_adamw_8bit_step) */
typedef void (*dm_adamw_8bit_k)(int n, dm_tensor *const *p, dm_tensor *const *g, dm_tensor *const *m,
                              dm_tensor *const *m_scale, dm_tensor *const *r, dm_tensor *const *r_scale,
                              const dm_adamw_hp *hp, uint32_t salt);                 /* "adamw_8bit" */
/* out (one f64 element) = the sum of squares of every element (NULL entries skipped) */
typedef void (*dm_sumsq_k)(int n, dm_tensor *const *x, dm_tensor *out);              /* "sumsq" */
/* x *= max_norm / sqrt(*sumsq) when that norm is finite and above max_norm */
typedef void (*dm_clip_scale_k)(int n, dm_tensor *const *x, const dm_tensor *sumsq,
                                double max_norm);                                     /* "clip_scale" */
/* buf = mu·buf + g; out (F32 or BF16) = nesterov ? g + mu·buf : buf; nothing
** when sumsq_at (device memory, or NULL) holds a non-finite sum */
/* out[i] holds the rows of buf[i]'s matrices `pitch` elements apart (cols of them used):
** element e of buf[i] is out[i]'s (e / cols) * pitch + e % cols; the same for o in apply */
/* clip_at, clip: each gradient taken as dm_clip_scale(clip, *clip_at) would leave it (clip_at NULL: as it is) */
/* sround (or NULL): a bf16 buf rounds stochastically, buf[i] as member i */
typedef void (*dm_muon_momentum_k)(int n, dm_tensor *const *buf, dm_tensor *const *g,
                                   dm_tensor *const *out, double mu, bool nesterov,
                                   const double *sumsq_at, const double *clip_at, double clip,
                                   int64_t cols, int64_t pitch,
                                   const dm_sround_key *sround);                     /* "muon_momentum" */
/* step (i64 [1]) += 1 when sumsq (f64 [1]) is finite */
typedef void (*dm_optim_tick_k)(dm_tensor *step, const dm_tensor *sumsq);           /* "optim_tick" */
/* each matrix of x [B, m, n]: x_b /= (‖x_b‖_F·mult + eps) */
typedef void (*dm_ns_normalize_k)(dm_tensor *x, double mult, double eps);            /* "ns_normalize" */
/* q [B, s, s] = I / (sqrt(trace(a_b))·mult + eps) for each matrix a_b of a [B, s, s] (f32) */
typedef void (*dm_ns_gram_start_k)(dm_tensor *q, const dm_tensor *a, double mult, double eps); /* "ns_gram_start" */
/* y = alpha·x + beta·y (same shape and dtype) */
typedef void (*dm_ns_axpby_k)(dm_tensor *y, double alpha, const dm_tensor *x, double beta); /* "ns_axpby" */
/* p = p·(1 − lr·wd) − lr·scale·s·o, s = s_i[e] for matrix e of p_i when s_i (f32 [E]) is given, else 1 */
typedef void (*dm_muon_apply_k)(int n, dm_tensor *const *p, dm_tensor *const *o, dm_tensor *const *s,
                                const dm_muon_hp *hp, double scale, int64_t cols, int64_t pitch);  /* "muon_apply" */

/* the family's kernels by name (core/ops.h): the ops look them up, the backends register them */
DM_KERNEL_TYPE(adamw, dm_adamw_k)
DM_KERNEL_TYPE(adamw_8bit, dm_adamw_8bit_k)
DM_KERNEL_TYPE(clip_scale, dm_clip_scale_k)
DM_KERNEL_TYPE(muon_apply, dm_muon_apply_k)
DM_KERNEL_TYPE(muon_momentum, dm_muon_momentum_k)
DM_KERNEL_TYPE(ns_axpby, dm_ns_axpby_k)
DM_KERNEL_TYPE(ns_gram_start, dm_ns_gram_start_k)
DM_KERNEL_TYPE(ns_normalize, dm_ns_normalize_k)
DM_KERNEL_TYPE(optim_tick, dm_optim_tick_k)
DM_KERNEL_TYPE(sumsq, dm_sumsq_k)

#endif
