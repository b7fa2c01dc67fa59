/*
** moe.h — the routed-expert family's data layout and kernel signatures,
** shared by the ops (vm/ops/moe.c) and every backend's kernels.
**
** N tokens each pick k of E experts. Assignment a = t * k + j is token t's
** j-th choice; there are always exactly N * k of them, whatever the
** routing, so every buffer has a static shape and nothing waits for the
** host. The layout, all index tensors i64 and 0-based (expert ids are
** values, like byte ids):
**
**   idx     [N, k]    expert of each assignment, best first
**   w       [N, k]    its gate (sigmoid scores renormalised over the k)
**   counts  [E]       assignments per expert
**   perm    [N * k]   perm[p] = the assignment at sorted position p: sorted
**                     by expert, stable (ascending a within an expert)
**   offsets [E + 1]   expert e owns sorted positions offsets[e] ..
**                     offsets[e+1] - 1; offsets[0] = 0, offsets[E] = N * k
**   inv     [N * k]   inv[a] = the sorted position of assignment a
**   y_rows  [N * k, F] expert outputs in sorted order
**
** An expert e is a low-rank gated unit of rank r: for the input row x [d],
**   z_g = (x Ug[e]) * cg[e],  z_u = (x Uu[e]) * cu[e]     Ug, Uu: [E, d, r]; cg, cu: [E, r]
**   y   = (silu(z_g) * z_u) D[e]                           D: [E, r, F]
**
** Kernels take contiguous tensors (the ops make them so) of one float dtype
** and i64 indices. A kernel reads the per-expert offsets from the device's
** memory, never from the host. Every output row or weight slice is written
** exactly once, sums run in a fixed order, and nothing uses atomics: the
** results are the same bits on every run.
*/
#ifndef DM_MOE_H
#define DM_MOE_H

#include "core/ops.h"
#include "ops/prims.h"      /* the bucket sort's scratch */

/* The CUDA expert kernels' sizes that their scratch follows (kernels/moe_tc.cu, moe_experts.cu; the
** planner reads them): rows a tile, row tiles a unit at most, the chunks of F and d the streaming kernels
** take, and the ranks the tensor-core kernels take (DM_MOE_TC_RANK(r)). */
#define DM_MOE_TC_TM 32
#define DM_MOE_TC_GT 32
#define DM_MOE_TC_FS 128
#define DM_MOE_TC_DS 64
#define DM_MOE_TC_RANK(r) ((r) == 16 || (r) == 32 || (r) == 64 || (r) == 128)

/* ---- the CUDA kernels' device scratch, in bytes (core/alloc.h): the kernels size
** theirs with these, and the ops hand the same to a plan. e experts, rows assignments
** (N x k), d, F and r the bank's sizes. ---- */

/* bucket_counts (moe_route's counts, moe_capacity's drops): the offsets and the sort */
static inline int64_t dm_bucket_offsets_scratch(int64_t nb) { return 8 * (nb + 1); }
static inline int64_t dm_bucket_counts_scratch(int64_t n, int64_t nb) {
  return dm_bucket_offsets_scratch(nb) + dm_bucket_sort_scratch(n, nb);
}

/* make_tiles: each expert's first tile of tm rows, and the map from tile to expert */
static inline int64_t dm_moe_tiles_scratch(int64_t e, int64_t rows, int64_t tm) {
  return 8 * (e + 1 + (rows + tm - 1) / tm + e);
}

/* the FMA kernels' rows a tile, by rank */
static inline int dm_moe_fma_tile_rows(int64_t r) { return r <= 64 ? 16 : r <= 256 ? 4 : 1; }

/* tc_plan: the streaming kernels' units over nch chunks, and with psize > 0 partial slots of
** psize floats. An expert's groups are 1, or ceil(t / TC_GT) for t > TC_GT tiles, so the
** groups are at most e + (rows / TC_TM + e) / TC_GT, and a group's units at most nch; an
** expert of more than S = TC_GT TC_TM rows has fewer than 2 n / S groups, so the slots are
** under 2 rows / S. */
static inline int64_t dm_moe_tc_units(int64_t e, int64_t rows, int64_t nch) {
  return (e + (rows / DM_MOE_TC_TM + e) / DM_MOE_TC_GT + 1) * nch;
}
static inline int64_t dm_moe_tc_slots(int64_t rows, int64_t psize) {
  return psize > 0 ? 2 * rows / (DM_MOE_TC_GT * DM_MOE_TC_TM) : 0;
}
/* the units' integers (first, map, slot, smap), 16-byte aligned, before the slots' floats */
static inline int64_t dm_moe_tc_units_head(int64_t e, int64_t rows, int64_t nch, int64_t psize) {
  return (8 * (2 * (e + 1) + dm_moe_tc_units(e, rows, nch) + dm_moe_tc_slots(rows, psize)) + 15) / 16 * 16;
}
static inline int64_t dm_moe_tc_units_scratch(int64_t e, int64_t rows, int64_t nch, int64_t psize) {
  return dm_moe_tc_units_head(e, rows, nch, psize) + 4 * dm_moe_tc_slots(rows, psize) * psize;
}

/* whether the tensor-core expert kernels take these shapes (the CUDA call also wants its
** pointers 16-byte aligned): bf16 or f16, a rank of DM_MOE_TC_RANK, d a multiple of 8, grids
** and 32-bit places that fit */
static inline bool dm_moe_tc_shapes(dm_dtype t, int64_t e, int64_t rows, int64_t d, int64_t f, int64_t r) {
  if (t != DM_BF16 && t != DM_F16) return false;
  if (!DM_MOE_TC_RANK(r) || d % 8 || e > INT32_MAX) return false;
  const int64_t fch = (f + DM_MOE_TC_FS - 1) / DM_MOE_TC_FS, dch = (d + DM_MOE_TC_DS - 1) / DM_MOE_TC_DS;
  if (fch > 65535 || dch > 65535) return false;
  if ((r > DM_MOE_TC_TM ? r : DM_MOE_TC_TM) * f >= INT32_MAX / 2) return false;     /* run_stream's places */
  return dm_moe_tc_units(e, rows, fch > dch ? fch : dch) < INT32_MAX;                /* tc_plan's units, ints */
}

/* DM_MOE_FMA set (and not "0") in the environment: the FMA kernels even where the tensor cores fit */
bool dm_moe_fma_forced(void);

/* The path the expert kernels take, their pointers aside: the tensor-core kernels at these shapes
** unless DM_MOE_FMA forces the FMA ones (the CUDA call also wants the tensors 16-byte aligned, which
** the planner, charging the scratch, cannot see). One rule for the kernels and the plan. */
static inline bool dm_moe_tc_path(dm_dtype t, int64_t e, int64_t rows, int64_t d, int64_t f, int64_t r) {
  return dm_moe_tc_shapes(t, e, rows, d, f, r) && !dm_moe_fma_forced();
}

/* A few rows against many experts (decoding: a stream's byte is k rows among E experts): at most
** DM_MOE_FEW_ROWS assignments and at most one for DM_MOE_FEW_RATIO experts. The tiled kernels' grid, tiles
** and plan run over every expert, which there costs more than the rows' work, so moe_route counts, moe_sort
** sorts and moe_experts computes a row a block instead (kernels/moe_experts.cu "a few rows", moe_route.cu
** few_sort); experts of rank over DM_MOE_FEW_RANK, and fp8 banks the kernels read, keep the tiled kernels.
** One rule for the kernels and the plan. */
#define DM_MOE_FEW_ROWS 256
#define DM_MOE_FEW_RATIO 8
#define DM_MOE_FEW_RANK 128
#define DM_MOE_FEW_THREADS 256                 /* a block's threads, and the columns of F a block writes */
/* DM_MOE_FEW=0 in the environment: the tiled kernels and the bucket sort at every size (for comparison) */
bool dm_moe_few_off(void);
static inline bool dm_moe_few(int64_t e, int64_t rows) {
  return rows > 0 && rows <= DM_MOE_FEW_ROWS && rows * DM_MOE_FEW_RATIO <= e && !dm_moe_few_off();
}
static inline bool dm_moe_few_experts(int64_t e, int64_t rows, int64_t f, int64_t r, bool fp8) {
  return dm_moe_few(e, rows) && r <= DM_MOE_FEW_RANK && !fp8 &&
         (f + DM_MOE_FEW_THREADS - 1) / DM_MOE_FEW_THREADS <= 65535;
}
/* the few-rows forward's slices of d a row: blocks enough to fill a card (DM_MOE_FEW_BLOCKS over the rows),
** slices of at least DM_MOE_FEW_SLICE elements */
#define DM_MOE_FEW_BLOCKS 256
#define DM_MOE_FEW_SLICE 32
static inline int64_t dm_moe_few_slices(int64_t rows, int64_t d) {
  int64_t want = (DM_MOE_FEW_BLOCKS + rows - 1) / rows, most = (d + DM_MOE_FEW_SLICE - 1) / DM_MOE_FEW_SLICE;
  return want < most ? want : most;
}
/* its scratch: a row's partial projections [slices, 2r] in the compute type (cb bytes) */
static inline int64_t dm_moe_few_scratch(int64_t cb, int64_t rows, int64_t d, int64_t r) {
  return cb * rows * dm_moe_few_slices(rows, d) * 2 * r;
}

/* the tensor-core kernels' rows: the forward's hidden rows (16-bit, rows x r); the backward's
** three 16-bit and two f32 rows of r; the backward's sums of cg's and cu's gradients by tile */
static inline int64_t dm_moe_tc_fwd_rows(int64_t rows, int64_t r) { return 2 * rows * r; }
static inline int64_t dm_moe_tc_bwd_rows(int64_t rows, int64_t r) { return (2 * 3 + 4 * 2) * rows * r; }
static inline int64_t dm_moe_tc_tile_sums(int64_t e, int64_t rows, int64_t r) {
  return 4 * ((rows + DM_MOE_TC_TM - 1) / DM_MOE_TC_TM + e) * 2 * r;
}

/* "moe_experts": the tensor-core forward holds the hidden rows (16-bit, rows x r), the tiles
** and the units over F; the FMA forward its tiles */
static inline int64_t dm_moe_experts_scratch(bool tc, int64_t e, int64_t rows, int64_t d, int64_t f, int64_t r) {
  (void)d;
  if (!tc) return dm_moe_tiles_scratch(e, rows, dm_moe_fma_tile_rows(r));
  return dm_moe_tc_fwd_rows(rows, r) + dm_moe_tiles_scratch(e, rows, DM_MOE_TC_TM) +
         dm_moe_tc_units_scratch(e, rows, (f + DM_MOE_TC_FS - 1) / DM_MOE_TC_FS, 0);
}

/* "moe_experts_bwd" on the FMA path: five values a row and rank (vb bytes each) */
static inline int64_t dm_moe_fma_bwd_rows(int64_t vb, int64_t rows, int64_t r) { return 5 * vb * rows * r; }

/* "moe_experts_bwd": the tensor-core backward holds three 16-bit and two f32 rows of r, the
** tiles, and in turn the units of D's gradient, of Ug's and Uu's, and the tiles' sums of cg's
** and cu's; the FMA backward five rows of r in the compute type (vb bytes) and its tiles */
static inline int64_t dm_moe_experts_bwd_scratch(bool tc, int64_t vb, int64_t e, int64_t rows, int64_t d,
                                                 int64_t f, int64_t r, bool want_d, bool want_u, bool want_c) {
  if (!tc) return dm_moe_fma_bwd_rows(vb, rows, r) + dm_moe_tiles_scratch(e, rows, dm_moe_fma_tile_rows(r));
  int64_t most = 0, n;
  n = want_d ? dm_moe_tc_units_scratch(e, rows, (f + DM_MOE_TC_FS - 1) / DM_MOE_TC_FS, r * f) : 0;
  most = n > most ? n : most;
  n = want_u ? dm_moe_tc_units_scratch(e, rows, (d + DM_MOE_TC_DS - 1) / DM_MOE_TC_DS, d * 2 * r) : 0;
  most = n > most ? n : most;
  n = want_c && e * r > 0 ? dm_moe_tc_tile_sums(e, rows, r) : 0;
  most = n > most ? n : most;
  return dm_moe_tc_bwd_rows(rows, r) + dm_moe_tiles_scratch(e, rows, DM_MOE_TC_TM) + most;
}

/* "moe_check_offsets" of E experts, at DM_DEBUG >= 1: the first bad offset and its neighbours */
static inline int64_t dm_moe_offsets_check_scratch(int64_t e, int debug) {
  return e >= 0 && debug >= 1 ? 4 * (int64_t)sizeof(int64_t) : 0;
}

/* "moe_capacity" with its drops counted: a key an assignment, then the counts over e + 1 buckets */
static inline int64_t dm_moe_capacity_keys(int64_t rows) { return 8 * (rows > 0 ? rows : 1); }
static inline int64_t dm_moe_capacity_counts(int64_t e) { return 8 * (e + 1); }
static inline int64_t dm_moe_capacity_scratch(int64_t rows, int64_t e) {
  return dm_moe_capacity_keys(rows) + dm_moe_capacity_counts(e) + dm_bucket_counts_scratch(rows, e + 1);
}

/* ---- fp8 banks (model.moe.fp8): the factors a training step's expert kernels read as E4M3 codes ----
**
** A factor W [E, m, n] (Ug, Uu: m = d, n = r; D: m = r, n = F) is held as codes u8 [E, m, nq] and
** scales f32 [E, m, nq / 32], nq = n rounded up to a block of 32: every row starts on a 16-byte
** boundary, so the kernels load whole chunks. Block b of a row holds elements 32 b .. 32 b + 31 under
** the scale amax / 448 of the values there (the padding codes are zeros), each element the E4M3 code of
** x / s (vm/ops/quant.h's fp8_e4m3 at block 32), x being W's value rounded to the compute dtype first:
** the kernels' weights, code x scale rounded to the compute dtype, are then quantize's values of the
** compute copy, bit for bit (model.moe.qat = fp8_e4m3 from the first step computes the same). */
#define DM_BANK_FP8_BLOCK 32
static inline int64_t dm_bank_fp8_cols(int64_t n) { return (n + DM_BANK_FP8_BLOCK - 1) / DM_BANK_FP8_BLOCK * DM_BANK_FP8_BLOCK; }
static inline int64_t dm_bank_fp8_blocks(int64_t n) { return dm_bank_fp8_cols(n) / DM_BANK_FP8_BLOCK; }

/* "bank_fp8": codes [E, m, nq] and scales [E, m, nq / 32] of x [E, m, n] (contiguous) as round_to
** holds its values (a float dtype no wider than x's) */
typedef void (*dm_bank_fp8_k)(dm_tensor *codes, dm_tensor *scales, const dm_tensor *x, dm_dtype round_to);

/* whether the CUDA expert kernels read fp8 banks at these shapes (else the op decodes them to
** copies in the compute dtype, and says so once): the tensor-core kernels' shapes, in bf16 */
static inline bool dm_moe_fp8_shapes(dm_dtype t, int64_t e, int64_t rows, int64_t d, int64_t f, int64_t r) {
  return t == DM_BF16 && dm_moe_tc_path(t, e, rows, d, f, r);
}

/* a factor's fp8 form: NULL members when the bank is in the compute dtype */
typedef struct dm_moe_q8 { const dm_tensor *codes, *scales; } dm_moe_q8;

/* The expert weights, and their gradients (a NULL member is not wanted). With fp8 codes (qg, qu,
** qd given) a kernel reads them instead of ug, uu and d, which then only give the shapes. */
typedef struct dm_moe_bank { const dm_tensor *ug, *uu, *cg, *cu, *d; dm_moe_q8 qg, qu, qd; } dm_moe_bank;
typedef struct dm_moe_grads { dm_tensor *ug, *uu, *cg, *cu, *d; } dm_moe_grads;

/* moe_route's forms, in the order of the attribute's spellings */
enum { DM_MOE_ROUTE_SIGMOID, DM_MOE_ROUTE_SOFTMAX };
#define DM_MOE_ROUTE_SPELLINGS "sigmoid|softmax"

/* "moe_route", form sigmoid: s = sigmoid(logits); idx = the k largest s + bias
** per row (ties to the lower expert id), best first; w = s[idx] / sum(s[idx]).
** Form softmax: idx = the k largest logits + bias (the bias in logit units);
** w = softmax over the k chosen logits. counts[e] = how many rows picked e.
** bias may be NULL (zeros). */
typedef void (*dm_moe_route_k)(dm_tensor *idx, dm_tensor *w, dm_tensor *counts, const dm_tensor *logits,
                               const dm_tensor *bias, int form);
/* "moe_route_bwd": glogits [N, E] from gw [N, k]; zero off the chosen
** experts (the gates are recomputed from logits) */
typedef void (*dm_moe_route_bwd_k)(dm_tensor *glogits, const dm_tensor *gw, const dm_tensor *logits,
                                   const dm_tensor *idx, int form);

/* "moe_sort": a stable counting sort of idx's N * k expert ids into perm,
** offsets and inv. Ids were checked to lie in 0 .. E-1 (E = offsets' size - 1). */
typedef void (*dm_moe_sort_k)(dm_tensor *perm, dm_tensor *offsets, dm_tensor *inv, const dm_tensor *idx);

/* "moe_check_offsets": raise unless offsets[0] = 0, offsets never decrease
** and offsets[E] = rows; `what` names the op. Unlike the other kernels it
** takes offsets as given (a strided view): it runs before anything is made. (A device backend records the
** error and raises it at its next synchronisation, as index_check does.) */
typedef void (*dm_moe_check_offsets_k)(const dm_tensor *offsets, int64_t rows, const char *what);

/* "moe_experts": y_rows[p] = expert e's output for token perm[p] / k, for
** every sorted position p of expert e; z_rows [N * k, 2r] (NULL: not
** wanted) receives row p's projections [x Ug[e] | x Uu[e]] before the
** scales cg, cu, in the compute type (f64 for f64 tensors, else f32), for
** the backward */
typedef void (*dm_moe_experts_k)(dm_tensor *y_rows, dm_tensor *z_rows, const dm_tensor *u, const dm_tensor *perm,
                                 const dm_tensor *offsets, const dm_moe_bank *bank, int64_t k);
/* "moe_experts_bwd": from gy_rows [N * k, F], each expert's weight gradients
** (written once per expert, zeros for an expert without rows) and gx_rows
** [N * k, d], the gradient of each sorted row's input (NULL: not wanted).
** z_rows: the forward's projections, or NULL (recomputed then); a kernel
** may recompute them anyway (the CPU's do: they gather the rows for dUg
** and dUu all the same), with the same result. */
typedef void (*dm_moe_experts_bwd_k)(dm_tensor *gx_rows, const dm_moe_grads *g, const dm_tensor *gy_rows,
                                     const dm_tensor *z_rows, const dm_tensor *u, const dm_tensor *perm,
                                     const dm_tensor *offsets, const dm_moe_bank *bank, int64_t k);

/* "moe_invert": inv[perm[p]] = p */
typedef void (*dm_moe_invert_k)(dm_tensor *inv, const dm_tensor *perm);

/* "moe_combine": y[t] = sum over j = 0 .. k-1, in that order, of
** w[t, j] * rows[inv[t * k + j]] (w NULL: weights 1). Each token gathers
** its own rows: no atomics. */
typedef void (*dm_moe_combine_k)(dm_tensor *y, const dm_tensor *rows, const dm_tensor *inv, const dm_tensor *w);
/* "moe_combine_bwd": grows[inv[a]] = w[a] * gy[a / k] (each row written
** once) and gw[a] = <gy[a / k], rows[inv[a]]>; either may be NULL */
typedef void (*dm_moe_combine_bwd_k)(dm_tensor *grows, dm_tensor *gw, const dm_tensor *gy, const dm_tensor *rows,
                                     const dm_tensor *inv, const dm_tensor *w);

/* "moe_capacity": out = w with the assignments ranked capacity or later
** within their expert (rank = inv[a] - offsets[idx[a]], so the earliest
** tokens stay) set to 0; drops[e] (when not NULL) counts expert e's. The
** backward masks the gradient with the same kernel. */
typedef void (*dm_moe_capacity_k)(dm_tensor *out, dm_tensor *drops, const dm_tensor *w, const dm_tensor *idx,
                                  const dm_tensor *inv, const dm_tensor *offsets, int64_t capacity);

/* "moe_counters": stats [3] f64 = the busiest expert's share of the
** assignments, the entropy (nats) of the load distribution counts / sum,
** and the number of experts with no assignment. All 0 when counts sum to 0
** (dead = E then). */
typedef void (*dm_moe_counters_k)(dm_tensor *stats, const dm_tensor *counts);

/* "moe_balance": loss-free balancing, in place: bias[e] += gamma *
** sign(mean(counts) - counts[e]) */
typedef void (*dm_moe_balance_k)(dm_tensor *bias, const dm_tensor *counts, double gamma);

/* The counters on the host (copies counts to the CPU when it lives elsewhere). */
typedef struct dm_moe_stats {
  double busiest_share;  /* max(counts) / sum(counts) */
  double entropy;        /* nats; log(E) when perfectly balanced */
  int64_t dead;          /* experts with no assignment */
} dm_moe_stats;
dm_moe_stats dm_moe_counters(const dm_tensor *counts);

/* The C API (each a dm_call; owned references out). */
void dm_moe_route(dm_tensor *logits, dm_tensor *bias, int64_t k, int form, dm_tensor **idx, dm_tensor **w,
                  dm_tensor **counts);
void dm_moe_sort(dm_tensor *idx, int64_t experts, dm_tensor **perm, dm_tensor **offsets, dm_tensor **inv);
dm_tensor *dm_moe_experts(dm_tensor *u, dm_tensor *perm, dm_tensor *offsets, dm_tensor *ug, dm_tensor *uu,
                          dm_tensor *cg, dm_tensor *cu, dm_tensor *d, int64_t k);
dm_tensor *dm_moe_combine(dm_tensor *y_rows, dm_tensor *inv, dm_tensor *w);
dm_tensor *dm_moe_capacity(dm_tensor *w, dm_tensor *idx, dm_tensor *inv, dm_tensor *offsets, int64_t capacity,
                           dm_tensor **drops);
void dm_moe_balance_(dm_tensor *bias, dm_tensor *counts, double gamma);

/* the family's kernels by name (core/ops.h): the ops look them up, the backends register them */
DM_KERNEL_TYPE(bank_fp8, dm_bank_fp8_k)
DM_KERNEL_TYPE(moe_balance, dm_moe_balance_k)
DM_KERNEL_TYPE(moe_capacity, dm_moe_capacity_k)
DM_KERNEL_TYPE(moe_check_offsets, dm_moe_check_offsets_k)
DM_KERNEL_TYPE(moe_combine, dm_moe_combine_k)
DM_KERNEL_TYPE(moe_combine_bwd, dm_moe_combine_bwd_k)
DM_KERNEL_TYPE(moe_counters, dm_moe_counters_k)
DM_KERNEL_TYPE(moe_experts, dm_moe_experts_k)
DM_KERNEL_TYPE(moe_experts_bwd, dm_moe_experts_bwd_k)
DM_KERNEL_TYPE(moe_invert, dm_moe_invert_k)
DM_KERNEL_TYPE(moe_route, dm_moe_route_k)
DM_KERNEL_TYPE(moe_route_bwd, dm_moe_route_bwd_k)
DM_KERNEL_TYPE(moe_sort, dm_moe_sort_k)

#endif
