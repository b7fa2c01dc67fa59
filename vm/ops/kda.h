/*
** kda.h — Kimi Delta Attention: the op family's kernel signatures (shared by
** the CPU kernels in vm/cpu/kda.c and the CUDA ones to come) and its C API.
**
** The recurrence, per (batch b, head h), with the state S of dk x dv:
**
**   S'  = Diag(exp(g_t)) S_{t-1}                 decay first,
**   S_t = S' + beta_t k_t (v_t - S'^T k_t)^T     then the delta correction
**   o_t = S_t^T q_t                              (q is not scaled here)
**
** Layouts: q, k, g [B, T, H, dk]; v [B, T, H, dv]; beta [B, T, H];
** S0 and the final state [B, H, dk, dv]. The state and the gates are
** computed in float32, or in float64 when q is f64 ("the compute type").
**
** Kernel contract: the op layer hands the kernels contiguous tensors only
** (it copies a strided input first), of any float dtype: q, k and v share
** one dtype, g, beta, S0 and the incoming gradients may each have their own
** and are converted on load. Outputs are new contiguous tensors that the
** kernel must write completely (the test harness poisons them with NaN).
** A gradient output that is NULL is not wanted; the rest of the chain must
** still be computed.
**
** What the backward needs: only the forward's inputs are saved. The
** backward re-runs the recurrence once to keep the state at the start of
** every chunk of `chunk` steps (ceil(T / chunk) states of dk x dv per
** (b, h)), then walks the chunks from last to first: it recomputes the
** chunk's states from its checkpoint (chunk + 1 states) and runs the exact
** reverse-time recurrence of docs/kda.md §1 through it. Recomputed
** states are bit-identical to the forward's, so the chunk size changes
** nothing in the results. Peak scratch per (b, h): (ceil(T/chunk) + chunk
** + 1) dk dv values plus O(T (dk + dv)) for the pair's inputs and gradients.
*/
#ifndef DM_KDA_H
#define DM_KDA_H

#include "core/ops.h"

#define DM_KDA_CHUNK 64          /* the backward's default checkpoint interval; the chunked algorithm's chunk */
#define DM_KDA_SUBCHUNK 16       /* the chunked algorithm's sub-chunks (no exponent ever positive) */
#define DM_KDA_CHUNK_MAXD 128    /* the chunked CPU kernels' largest dk and dv */
#define DM_KDA_CUDA_CHUNK_MAXD 64  /* the chunked CUDA kernels' largest dk and dv */
#define DM_KDA_CHUNKED_MIN_T 32  /* "auto" on CUDA takes the chunked kernels from this T up */
#define DM_KDA_GATE_ROWS 64      /* rows a run of kda_gate's CUDA backward (2 hd partial sums each), doubled to fit */

/* "kda_fwd": o [B, T, H, dv] in q's dtype, s_final [B, H, dk, dv] in the
** compute type (f32, or f64 with f64 q). s0 may be NULL (a zero state). */
typedef void (*dm_kda_fwd_k)(dm_tensor *o, dm_tensor *s_final, const dm_tensor *q, const dm_tensor *k,
                             const dm_tensor *v, const dm_tensor *g, const dm_tensor *beta,
                             const dm_tensor *s0);

/* "kda_bwd": from do [B, T, H, dv] and ds_final [B, H, dk, dv] (the final
** state's gradient, zeros when unused), writes the wanted gradients, each
** in its input's dtype and shape; ds0 only when s0 is given. chunk >= 1 is
** the checkpoint interval. */
typedef void (*dm_kda_bwd_k)(dm_tensor *dq, dm_tensor *dk, dm_tensor *dv, dm_tensor *dg, dm_tensor *dbeta,
                             dm_tensor *ds0, const dm_tensor *q, const dm_tensor *k, const dm_tensor *v,
                             const dm_tensor *g, const dm_tensor *beta, const dm_tensor *s0,
                             const dm_tensor *dout, const dm_tensor *ds_final, int64_t chunk);

/* The chunked WY/UT algorithm (docs/kda.md §2; vm/cpu/kda_chunk.c
** has the equations), the same results up to rounding:
**   "kda_chunk_fwd": dm_kda_fwd_k, chunks of DM_KDA_CHUNK rows;
**   "kda_chunk_bwd": dm_kda_bwd_k with chunk = DM_KDA_CHUNK (the chunk size,
**                    not a checkpoint interval).
** The forward and the backward keep nothing between them: the backward
** recomputes the chunk states from the inputs. The op picks the algorithm
** (its attribute algo): */
enum { DM_KDA_AUTO, DM_KDA_RECURRENT, DM_KDA_CHUNKED };
#define DM_KDA_ALGO_SPELLINGS "auto|recurrent|chunked"      /* the attribute's names, in the enum's order */

/* The gate: z = f + dt_bias per channel, A = A_log of the channel's head.
**   DM_KDA_GATE_BOUNDED:  g = lb * sigmoid(exp(A) * z)     in (lb, 0)
**   DM_KDA_GATE_SOFTPLUS: g = -exp(A) * softplus(z)        in (-inf, 0]
** f (contiguous, any shape) is seen as [N, D], D = numel(dt_bias) = heads x dk
** channels per token, channel c = head * dk + i; a_log [heads] may be NULL
** (A = 0). Computed in f32 (f64 when f is f64); inf * 0 never happens: a
** saturated sigmoid or softplus gives a zero derivative. */
enum { DM_KDA_GATE_BOUNDED, DM_KDA_GATE_SOFTPLUS };
#define DM_KDA_GATE_SPELLINGS "bounded|softplus"

/* "kda_gate": g (f's shape) in the compute type */
typedef void (*dm_kda_gate_k)(dm_tensor *g, const dm_tensor *f, const dm_tensor *a_log,
                              const dm_tensor *dt_bias, int64_t heads, int kind, double lb);
/* "kda_gate_bwd": df, da_log and ddt_bias like f, a_log and dt_bias (each may be NULL);
** the sums over tokens are deterministic */
typedef void (*dm_kda_gate_bwd_k)(dm_tensor *df, dm_tensor *da_log, dm_tensor *ddt_bias, const dm_tensor *dg,
                                  const dm_tensor *f, const dm_tensor *a_log, const dm_tensor *dt_bias,
                                  int64_t heads, int kind, double lb);

/* ---- the CUDA kernels' device scratch, in bytes (core/alloc.h): the kernels size
** theirs with these, and the op hands the same to a plan. vb: the bytes of a value
** of the compute type (4; 8 for f64); pairs: B x H. ---- */

#define DM_KDA_WARPS 8           /* the recurrent CUDA kernels' warps a block */

/* the recurrent kernels' shared values a block: their vectors, and the state (two with
** the backward) when state is true */
static inline int64_t dm_kda_smem_values(int64_t dk, int64_t dv, bool bwd, bool state) {
  return 4 * dk + 3 * dv + 1 + 2 * DM_KDA_WARPS * dv + (state ? (bwd ? 2 : 1) * dk * dv : 0);
}

/* whether a block keeps its states in shared memory (smem_optin: the card's most a block) */
static inline bool dm_kda_state_in_smem(int64_t dk, int64_t dv, bool bwd, int64_t vb, int64_t smem_optin) {
  return vb * dm_kda_smem_values(dk, dv, bwd, true) <= smem_optin;
}

/* "kda_fwd": the pairs' states, in device memory when shared memory cannot hold them */
static inline int64_t dm_kda_fwd_scratch(int64_t pairs, int64_t dk, int64_t dv, int64_t vb, int64_t smem_optin) {
  return dm_kda_state_in_smem(dk, dv, false, vb, smem_optin) ? 0 : vb * pairs * dk * dv;
}

/* "kda_bwd": a pair's checkpoints, one chunk's states and its values of v (work), and its
** two states when shared memory cannot hold them */
static inline int64_t dm_kda_bwd_work(int64_t pairs, int64_t T, int64_t dk, int64_t dv, int64_t chunk, int64_t vb) {
  const int64_t nc = (T + chunk - 1) / chunk, len = chunk < T ? chunk : T;
  return vb * pairs * (nc * dk * dv + len * dk * dv + len * dv);
}
static inline int64_t dm_kda_bwd_states(int64_t pairs, int64_t dk, int64_t dv, int64_t vb, int64_t smem_optin) {
  return dm_kda_state_in_smem(dk, dv, true, vb, smem_optin) ? 0 : vb * pairs * 2 * dk * dv;
}

/* "kda_chunk_fwd", "kda_chunk_bwd": f32 tiles of DM_KDA_CHUNK^2 a chunk (5; 16 with the
** backward) and the decays */
static inline int64_t dm_kda_chunk_tiles(int64_t pairs, int64_t T, bool bwd) {
  const int64_t chunks = pairs * ((T + DM_KDA_CHUNK - 1) / DM_KDA_CHUNK);
  return 4 * chunks * ((bwd ? 16 : 5) * DM_KDA_CHUNK * DM_KDA_CHUNK + DM_KDA_CHUNK);
}
/* "kda_chunk_bwd": f32 rows standing in for an unwanted dv or dbeta (rows: B x T x H) */
static inline int64_t dm_kda_chunk_spare(int64_t rows, int64_t dv, bool want_dv, bool want_dbeta) {
  return (want_dv ? 0 : 4 * rows * dv) + (want_dbeta ? 0 : 4 * rows);
}

/* kda_gate's CUDA backward: runs of DM_KDA_GATE_ROWS rows, doubled until the grid fits */
static inline int64_t dm_kda_gate_rows_per(int64_t rows) {
  int64_t per = DM_KDA_GATE_ROWS;
  while ((rows + per - 1) / per > 65535) per *= 2;
  return per;
}
/* "kda_gate_bwd" with a sum over tokens wanted: 2 D f64 partial sums a run, then the D
** channels' sums */
static inline int64_t dm_kda_gate_bwd_partials(int64_t rows, int64_t D) {
  const int64_t per = dm_kda_gate_rows_per(rows);
  return 8 * ((rows + per - 1) / per) * 2 * D;
}
static inline int64_t dm_kda_gate_bwd_channels(int64_t D) { return 8 * D; }
static inline int64_t dm_kda_gate_bwd_scratch(int64_t rows, int64_t D) {
  return dm_kda_gate_bwd_partials(rows, D) + dm_kda_gate_bwd_channels(D);
}

/* The C API (vm/ops/kda.c). dm_kda returns o; when s_final is not NULL it
** receives the final state (an owned reference). chunk <= 0 means
** DM_KDA_CHUNK. dm_kda_gate: a_log may be NULL. */
dm_tensor *dm_kda(dm_tensor *q, dm_tensor *k, dm_tensor *v, dm_tensor *g, dm_tensor *beta, dm_tensor *s0,
                  int64_t chunk, dm_tensor **s_final);
dm_tensor *dm_kda_gate(dm_tensor *f, dm_tensor *a_log, dm_tensor *dt_bias, int kind, double lb);

/* The forward passes kda has run since the process began, by path (the log line's `kda`, so that
** the recurrent path's slowness on a CUDA device is seen, not guessed); a plan's are not counted. */
typedef struct { int64_t chunked, recurrent; } dm_kda_pass_counts;
dm_kda_pass_counts dm_kda_passes(void);

/* the family's kernels by name (core/ops.h): the ops look them up, the backends register them */
DM_KERNEL_TYPE(kda_bwd, dm_kda_bwd_k)
DM_KERNEL_TYPE(kda_chunk_bwd, dm_kda_bwd_k)
DM_KERNEL_TYPE(kda_chunk_fwd, dm_kda_fwd_k)
DM_KERNEL_TYPE(kda_fwd, dm_kda_fwd_k)
DM_KERNEL_TYPE(kda_gate, dm_kda_gate_k)
DM_KERNEL_TYPE(kda_gate_bwd, dm_kda_gate_bwd_k)

#endif
