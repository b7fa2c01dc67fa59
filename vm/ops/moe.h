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

/* The CUDA expert kernels' sizes that their scratch follows (kernels/moe.cu; the planner reads them):
** rows a tile, row tiles a unit at most, the chunks of F and d the streaming kernels take, and the
** ranks the tensor-core kernels take (DM_MOE_TC_RANK(r)). Keys a block of the bucket sort by
** expert (kernels/model.cuh dm_bucket_sort: a row of counters each). */
#define DM_MOE_TC_TM 32
#define DM_MOE_TC_GT 32
#define DM_MOE_TC_FS 128
#define DM_MOE_TC_DS 64
#define DM_MOE_TC_RANK(r) ((r) == 16 || (r) == 32 || (r) == 64 || (r) == 128)
#define DM_BS_CHUNK 256

/* The expert weights, and their gradients (a NULL member is not wanted). */
typedef struct dm_moe_bank { const dm_tensor *ug, *uu, *cg, *cu, *d; } dm_moe_bank;
typedef struct dm_moe_grads { dm_tensor *ug, *uu, *cg, *cu, *d; } dm_moe_grads;

/* "moe_route": s = sigmoid(logits); idx = the k largest s + bias per row
** (ties to the lower expert id), best first; w = s[idx] / sum(s[idx]);
** counts[e] = how many rows picked e. bias may be NULL (zeros). */
typedef void (*dm_moe_route_k)(dm_tensor *idx, dm_tensor *w, dm_tensor *counts, const dm_tensor *logits,
                               const dm_tensor *bias);
/* "moe_route_bwd": glogits [N, E] from gw [N, k]; zero off the chosen
** experts (the gates are recomputed from logits) */
typedef void (*dm_moe_route_bwd_k)(dm_tensor *glogits, const dm_tensor *gw, const dm_tensor *logits,
                                   const dm_tensor *idx);

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
void dm_moe_route(dm_tensor *logits, dm_tensor *bias, int64_t k, dm_tensor **idx, dm_tensor **w,
                  dm_tensor **counts);
void dm_moe_sort(dm_tensor *idx, int64_t experts, dm_tensor **perm, dm_tensor **offsets, dm_tensor **inv);
dm_tensor *dm_moe_experts(dm_tensor *u, dm_tensor *perm, dm_tensor *offsets, dm_tensor *ug, dm_tensor *uu,
                          dm_tensor *cg, dm_tensor *cu, dm_tensor *d, int64_t k);
dm_tensor *dm_moe_combine(dm_tensor *y_rows, dm_tensor *inv, dm_tensor *w);
dm_tensor *dm_moe_capacity(dm_tensor *w, dm_tensor *idx, dm_tensor *inv, dm_tensor *offsets, int64_t capacity,
                           dm_tensor **drops);
void dm_moe_balance_(dm_tensor *bias, dm_tensor *counts, double gamma);

#endif
