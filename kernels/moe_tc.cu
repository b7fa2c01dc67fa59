/*
** moe_tc.cu — the routed experts' products on tensor cores (moe.cuh): bf16 and f16 at ranks 16, 32,
** 64 and 128, the fp8 banks in bf16. moe_experts.cu's entry points call dm_moe_tc_forward and
** dm_moe_tc_backward where dm_moe_tc_fits.
*/
#include "moe.cuh"

/* ---- the expert products on tensor cores (bf16, f16) ------------------------------------------------------
**
** At ranks r of 16, 32, 64 or 128, d a multiple of 8 and 16-byte aligned tensors, bf16 and f16 run on
** mma.sync m16n8k16 with f32 accumulators (DM_MOE_FMA=1 in the environment keeps the FMA kernels of
** moe_experts.cu, for comparison). The weights dominate the traffic, so each kernel reads every expert's weights once:
**
**   tc_rows_k  a tile of TC_TM rows of one expert: z = x [Ug | Uu] over chunks of d; the forward writes
**              h (and z, for the backward); the backward takes the forward's z (or recomputes it), then
**              dh = g D^T over chunks of F (the warps split the k steps and their sums are added in warp
**              order) and goes through the activation: h, [dag | dau] (storage dtype, for the products
**              below) and pg, pu (f32, for dcg, dcu)
**   tc_down_k  units (an expert's rows, or a group of them, and a range of chunks of F; see "units"):
**              y = h D, the chunks of D streamed, the rows in turn
**   tc_dd_k    units likewise: dD = h^T g over the unit's rows, in row order
**   tc_du_k    units over slices of d: [dUg | dUu] = x^T [dag | dau], likewise
**   tc_gx_k    a tile of rows: gx = [dag | dau] [Ug | Uu]^T over slices of d
**
** Operands move to shared memory as runs of 16-byte chunks (cp.async). A run that does not start on a
** chunk's boundary (rows of F elements when F is odd) keeps its offset in the chunk, sh (0..7), and is
** moved to the chunk's boundary in shared memory (realign) before ldmatrix reads it. Rows past an expert's end load as zeros,
** and so do columns past the summed dim's end. Outputs go through shared memory to whole-chunk stores.
** Every weight gradient is written by one block, summing in a fixed order: the same bits on every run.
*/

#define TC_TM DM_MOE_TC_TM  /* rows a tile (vm/ops/moe.h) */
#define TC_FS DM_MOE_TC_FS  /* columns of F a block of tc_down_k and tc_dd_k */
#define TC_DS DM_MOE_TC_DS  /* d's slice in tc_du_k and tc_gx_k */
#define TC_THREADS 256
#define TC_STAGES 3         /* cp.async pipeline depth of the loops over d and F */
static_assert(TC_TM % 8 == 0, "a tile of rows moves runs of F by a multiple of 8");

/* Fragments from aligned tiles (rows of ld elements, ld a multiple of 8). A is 16 x 16 at (m0, k0);
** B is 16 x 16 at (k0, n0) as two n8 halves: f[0], f[1] for n0, f[2], f[3] for n0 + 8. */
__device__ __forceinline__ void frag_a(uint32_t (&f)[4], const u16 *a, int ld, int m0, int k0) {   /* a[m ld + k] */
  int l = threadIdx.x & 31;
  dm_ldsm(f, a + (m0 + (l & 15)) * ld + k0 + (l >> 4) * 8);
}
__device__ __forceinline__ void frag_a_t(uint32_t (&f)[4], const u16 *a, int ld, int m0, int k0) { /* a[k ld + m] */
  int l = threadIdx.x & 31, i = l & 7, q = l >> 3;
  dm_ldsm_t(f, a + (k0 + i + (q >> 1) * 8) * ld + m0 + (q & 1) * 8);
}
__device__ __forceinline__ void frag_b(uint32_t (&f)[4], const u16 *b, int ld, int k0, int n0) {   /* b[k ld + n] */
  int l = threadIdx.x & 31, i = l & 7, q = l >> 3;
  dm_ldsm_t(f, b + (k0 + i + (q & 1) * 8) * ld + n0 + (q >> 1) * 8);
}
__device__ __forceinline__ void frag_b_t(uint32_t (&f)[4], const u16 *b, int ld, int k0, int n0) { /* b[n ld + k] */
  int l = threadIdx.x & 31, i = l & 7, q = l >> 3;
  dm_ldsm(f, b + (n0 + i + (q >> 1) * 8) * ld + k0 + (q & 1) * 8);
}

/* accumulators e and e + 1 (the same row, columns c and c + 1) in the storage dtype, as one word */
template <int DT> __device__ __forceinline__ uint32_t pack2(float a, float b) {
  const u16 lo = dt<DT>::store(a), hi = dt<DT>::store(b);
  return (uint32_t)lo | (uint32_t)hi << 16;
}

/* where an accumulator element sits: c[e] of the 16 x 8 tile at (m0, n0) is (m0 + row, n0 + col) */
__device__ __forceinline__ int acc_row(int e) { return ((threadIdx.x & 31) >> 2) + (e >> 1) * 8; }
__device__ __forceinline__ int acc_col(int e) { return (threadIdx.x & 3) * 2 + (e & 1); }

/* Rows r < NR of a tile t (rows of ld elements): the run of W elements at g + start(r) (start < 0: zeros),
** from the 16-byte chunk holding its first element (so offset by start & 7, kept in sh[r] when sh is given;
** SHIFT false: every start is a multiple of 8). Chunks past nv elements of the run, or past tot (g's size),
** read as zeros. The whole block takes part; asynchronous (cp_commit, cp_wait). The tile's shape is known
** at compile time: each thread's (row, chunk) pairs come without a division (these loops were most of the
** kernels' instructions when the shape was not). */
template <bool SHIFT, int NR, int W, typename Start>
__device__ __forceinline__ void load_runs(u16 *t, unsigned char *sh, int ld, int nv, const u16 *g, int64_t tot,
                                          Start start) {
  constexpr int NCH = SHIFT ? (W + 14) >> 3 : W >> 3, N = NR * NCH;
#pragma unroll
  for (int k = 0; k < (N + TC_THREADS - 1) / TC_THREADS; k++) {
    const int i = threadIdx.x + k * TC_THREADS;
    if (N % TC_THREADS && i >= N) break;
    const int r = i / NCH, c = i - r * NCH;
    const int64_t s = start(r);
    const int off = SHIFT && s >= 0 ? (int)s & 7 : 0;
    const int64_t e0 = s - off + 8 * c, room = tot - e0;  /* the chunk's first element; elements from it on */
    int bytes = s >= 0 && 8 * c < off + nv ? 16 : 0;
    if (room < 8) bytes = room > 0 ? min(bytes, (int)room * 2) : 0;
    dm_cp_async16(t + r * ld + 8 * c, bytes ? g + e0 : g, bytes);
    if (SHIFT && sh && c == 0) sh[r] = (unsigned char)off;
  }
}

/* The chunks a thread loads of a stream of shifted tiles (NR rows of W elements, as load_runs<true> takes
** them) whose rows keep their places from one tile to the next but for an offset common to all, a multiple
** of 8 (the next chunk of F, the next tile of rows): found once (a register a chunk), so that a tile's loads
** cost little more than the copies. Places count elements from a base pointer and fit 32 bits (dm_moe_tc_fits
** sees to it); sh[r] receives row r's offset in its first chunk, the same for every tile. */
template <int NR, int W> struct run_stream {
  static constexpr int NCH = (W + 14) >> 3, N = NR * NCH, K = (N + TC_THREADS - 1) / TC_THREADS;
  int at[K];   /* the chunk's first element at offset 0, a multiple of 8, | the row's offset (INT_MIN: none) */
  template <typename Start> __device__ run_stream(unsigned char *sh, Start start) {
#pragma unroll
    for (int k = 0; k < K; k++) {
      const int i = threadIdx.x + k * TC_THREADS, r = i < N ? i / NCH : 0, c = i - r * NCH;
      const int64_t s = i < N ? start(r) : -1;
      const int off = s >= 0 ? (int)s & 7 : 0;
      at[k] = s >= 0 ? ((int)(s - off) + 8 * c) | off : INT_MIN;
      if (i < N && c == 0) sh[r] = (unsigned char)off;
    }
  }
  /* the tile at offset delta from g into t (rows ld apart): rows from nr on, chunks from nv elements of the
  ** run on and elements from tot on (g's size) read as zeros */
  __device__ __forceinline__ void load(u16 *t, int ld, const u16 *g, int64_t tot, int64_t delta, int nr,
                                       int nv) const {
#pragma unroll
    for (int k = 0; k < K; k++) {
      const int i = threadIdx.x + k * TC_THREADS;
      if (N % TC_THREADS && i >= N) break;
      const int r = i / NCH, c = i - r * NCH;
      const int64_t e0 = (at[k] & ~7) + delta;
      int bytes = at[k] != INT_MIN && r < nr && 8 * c - (at[k] & 7) < nv ? 16 : 0;
      if (e0 + 8 > tot) bytes = e0 < tot ? min(bytes, (int)(tot - e0) * 2) : 0;
      dm_cp_async16(t + r * ld + 8 * c, bytes ? g + e0 : g, bytes);
    }
  }
};

/* chunk c of a run of n elements at g + s (s >= 0), from src (16 bytes, aligned): whole, or the part of it
** in the run element by element */
__device__ __forceinline__ void store_end(u16 *g, const u16 *src, int64_t s, int c, int n) {
  if (s < 0) return;
  const int64_t e0 = (s & ~(int64_t)7) + 8 * c;
  const int a = e0 > s ? 0 : (int)(s - e0), b = e0 + 8 < s + n ? 8 : (int)(s + n - e0);   /* in the chunk */
  if (a >= b) return;
  const uint4 v = *(const uint4 *)src;
  if (b - a == 8) {
    *(uint4 *)(g + e0) = v;
    return;
  }
  const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int m = 0; m < 8; m++)
    if (m >= a && m < b) g[e0 + m] = (u16)(w[m >> 1] >> (16 * (m & 1)));
}

/* rows r < nr of a tile t (at most NR), row r at t + r ld + (start(r) & 7), to the runs of n elements (at most
** W) at g + start(r) (start < 0: none): whole 16-byte chunks at once, the ends element by element. ALIGNED:
** every start and n are multiples of 8 (whole chunks only). */
template <int NR, int W, bool ALIGNED, typename Start>
__device__ __forceinline__ void store_runs(u16 *g, const u16 *t, int ld, int nr, int n, Start start) {
  constexpr int NCH = ALIGNED ? W >> 3 : (W + 14) >> 3, N = NR * NCH;
#pragma unroll
  for (int k = 0; k < (N + TC_THREADS - 1) / TC_THREADS; k++) {
    const int i = threadIdx.x + k * TC_THREADS;
    if (N % TC_THREADS && i >= N) break;
    const int r = i / NCH, c = i - r * NCH;
    if (r >= nr) continue;
    const int64_t s = start(r);
    if (s < 0) continue;
    const u16 *src = t + r * ld + 8 * c;
    if (ALIGNED) {
      if (8 * c < n) *(uint4 *)(g + s + 8 * c) = *(const uint4 *)src;
      continue;
    }
    store_end(g, src, s, c, n);
  }
}

/* Rows r < NR of a tile t (rows of ld >= W + 8 elements) whose runs start at offset sh[r] (0..7), as
** load_runs<true> leaves them: moved to offset 0 in place, so that ldmatrix can read them (the element-by-
** element fragments of shifted rows were most of the instructions of the kernels that read them). MASK:
** elements from nv on become zeros (a sum over the run must not take the next row's). Two phases
** around a barrier (a chunk's source overlaps the next chunk); the whole block takes part and ends with a
** barrier. */
template <int NR, int W, bool MASK>
__device__ __forceinline__ void realign(u16 *t, const unsigned char *sh, int ld, int nv) {
  constexpr int NCH = W / 8, N = NR * NCH, K = (N + TC_THREADS - 1) / TC_THREADS;
  uint32_t out[K][4];
#pragma unroll
  for (int k = 0; k < K; k++) {
    const int i = threadIdx.x + k * TC_THREADS;
    if (N % TC_THREADS && i >= N) break;
    const int r = i / NCH, c = i - r * NCH, o = sh[r];
    const uint32_t *w = (const uint32_t *)(t + r * ld + 8 * c + (o & 6));   /* 4-byte aligned */
    uint32_t v[5];
#pragma unroll
    for (int j = 0; j < 5; j++) v[j] = w[j];
#pragma unroll
    for (int j = 0; j < 4; j++) out[k][j] = __funnelshift_r(v[j], v[j + 1], 16 * (o & 1));
    if (MASK && 8 * c + 8 > nv) {
      const int left = nv - 8 * c;   /* elements of the chunk that stay */
#pragma unroll
      for (int j = 0; j < 4; j++) out[k][j] = 2 * j >= left ? 0u : 2 * j + 1 >= left ? out[k][j] & 0xffffu : out[k][j];
    }
  }
  __syncthreads();
#pragma unroll
  for (int k = 0; k < K; k++) {
    const int i = threadIdx.x + k * TC_THREADS;
    if (N % TC_THREADS && i >= N) break;
    const int r = i / NCH, c = i - r * NCH;
    *(uint4 *)(t + r * ld + 8 * c) = make_uint4(out[k][0], out[k][1], out[k][2], out[k][3]);
  }
  __syncthreads();
}

/* ---- fp8 banks (vm/ops/moe.h): the kernels read E4M3 codes and their scales, and form the weights in
** shared memory as they load them ----
**
** A factor's codes and scales go to a stage by cp.async like any operand (rows of codes start on 16-byte
** boundaries: nq, the row's codes, is a multiple of 32); the body of the pipeline then expands the stage into
** a tile of the compute dtype (code x scale, rounded as quantize rounds) that the fragments read as before.
** The products, their order and their sums are the 16-bit kernels': the same bits as those kernels on the
** quantised copy. */
struct moe_q8 {
  const uint8_t *qg, *qu, *qd;
  const float *sg, *su, *sd;
  int64_t fq;                      /* codes a row of D: dm_bank_fp8_cols(F) */
};
#define QBLK DM_BANK_FP8_BLOCK     /* codes a scale */
/* a stage's scales in bytes for `codes` codes (one f32 a block) */
__host__ __device__ constexpr int q8_scale_bytes(int codes) { return codes / QBLK * 4; }

/* Rows r < NR of codes: the run of W (a multiple of QBLK) at q + start(r) (start a multiple of QBLK, < 0:
** none) into tq (rows of W bytes), of which the first nvq (a multiple of QBLK) are there and the rest read
** as zeros, and its W / QBLK scales at s + start(r) / QBLK into ts (rows of W / QBLK). The whole block takes
** part. */
template <int NR, int W, typename Start>
__device__ __forceinline__ void load_codes(uint8_t *tq, float *ts, const uint8_t *q, const float *s, int nvq,
                                           Start start) {
  static_assert(W % QBLK == 0 && QBLK % 16 == 0, "codes come in blocks of whole 16-byte chunks");
  constexpr int NCH = W / 16, N = NR * NCH, NS = W / QBLK, NB = NR * NS;
#pragma unroll
  for (int k = 0; k < (N + TC_THREADS - 1) / TC_THREADS; k++) {
    const int i = threadIdx.x + k * TC_THREADS;
    if (N % TC_THREADS && i >= N) break;
    const int r = i / NCH, c = i - r * NCH;
    const int64_t s0 = start(r);
    const bool ok = s0 >= 0 && 16 * c < nvq;
    dm_cp_async16(tq + r * W + 16 * c, ok ? q + s0 + 16 * c : q, ok ? 16 : 0);
  }
#pragma unroll
  for (int k = 0; k < (NB + TC_THREADS - 1) / TC_THREADS; k++) {
    const int i = threadIdx.x + k * TC_THREADS;
    if (NB % TC_THREADS && i >= NB) break;
    const int r = i / NS, b = i - r * NS;
    const int64_t s0 = start(r);
    const bool ok = s0 >= 0 && QBLK * b < nvq;
    dm_cp_async4(ts + r * NS + b, ok ? s + s0 / QBLK + b : s, ok ? 4 : 0);
  }
}

/* The first NV (a multiple of 8) of each row r < NR of codes tq (rows of W) under scales ts, to t (rows ld
** apart) in the compute dtype: code x scale in f32 (the exact product of a 4-bit and a 24-bit significand,
** rounded once: quantize's double product rounded to f32), then rounded as dt stores. No barrier. */
template <int DT, int NR, int NV, int W>
__device__ __forceinline__ void expand_codes(u16 *t, int ld, const uint8_t *tq, const float *ts) {
  constexpr int NCH = NV / 8, N = NR * NCH;
#pragma unroll
  for (int k = 0; k < (N + TC_THREADS - 1) / TC_THREADS; k++) {
    const int i = threadIdx.x + k * TC_THREADS;
    if (N % TC_THREADS && i >= N) break;
    const int r = i / NCH, c = i - r * NCH;
    const uint2 w = *(const uint2 *)(tq + r * W + 8 * c);
    const float sc = ts[r * (W / QBLK) + 8 * c / QBLK];
    uint32_t out[4];
#pragma unroll
    for (int j = 0; j < 4; j++) {
      const __nv_fp8x2_storage_t two = (__nv_fp8x2_storage_t)(((j < 2 ? w.x : w.y) >> (16 * (j & 1))) & 0xffffu);
      const float2 v = __half22float2(__half2(__nv_cvt_fp8x2_to_halfraw2(two, __NV_E4M3)));
      if constexpr (DT == DM_BF16) {   /* one conversion of the pair (pack2's two roundings, in one instruction) */
        const __nv_bfloat162 h = __floats2bfloat162_rn(__fmul_rn(v.x, sc), __fmul_rn(v.y, sc));
        out[j] = *(const uint32_t *)&h;
      } else {
        out[j] = pack2<DT>(__fmul_rn(v.x, sc), __fmul_rn(v.y, sc));
      }
    }
    *(uint4 *)(t + r * ld + 8 * c) = make_uint4(out[0], out[1], out[2], out[3]);
  }
}

/* the shapes of the kernels' tiles at rank R */
template <int R> struct tc_cfg {
  static constexpr int MT = TC_TM / 16;                  /* m16 tiles of a row tile */
  static constexpr int KC = R <= 64 ? 64 : 32;           /* d's chunk in the projection */
  static constexpr int LX = KC + 8, LW = 2 * R + 8;      /* row lengths in shared memory (+16 bytes: no bank conflicts) */
  static constexpr int FC = R <= 64 ? 128 : 64;          /* F's chunk in dh: its k16 steps are dealt to the warps */
  static constexpr int KS = FC / 16, NH = 8 / KS;        /* k16 steps a chunk; warps on one step (n halves) */
  static constexpr int NTW = R / 8 / NH;                 /* n8 tiles of dh a warp */
  static constexpr int LF = FC + 16, LS = TC_FS + 16;    /* shifted runs take up to 7 more */
  static constexpr int LH = R + 8, LZ = 2 * R + 4;
  static constexpr int PROJ = TC_TM * LX + KC * LW;      /* elements of a projection stage */
  static constexpr int DH = (TC_TM + R) * LF;            /* of a dh stage */
  static constexpr int NG = R / 8;                       /* n16 groups of z (2R columns) */
  static constexpr int UPW = (MT * NG + 7) / 8;          /* (m tile, n16 group) units a warp */
  static size_t rows_smem(bool bwd) {
    return 2 * (size_t)TC_STAGES * (bwd && DH > PROJ ? DH : PROJ) + (bwd ? 4 * (size_t)TC_TM * LZ : 0);
  }
  static constexpr int DOWN_TS = 2;                      /* tc_down_k's depth (its stages hold a chunk of D) */
  /* blocks an SM the streaming kernels' registers must allow. tc_dd_k: two (three fit in shared memory,
  ** but the registers that allows spilled, and it ran 663 against 563 us at b1) */
  static constexpr int DOWN_MINB = R <= 64 ? 4 : 2, DD_MINB = R <= 64 ? 2 : 1;
  /* tc_du_k: two stages at four blocks an SM did better than three at three (1.985 against 2.000 ms for
  ** the experts' forward+backward at b1, five runs each, interleaved) */
  static constexpr int DU_TS = R <= 64 ? 2 : TC_STAGES, DU_MINB = R <= 64 ? 3 : 1;
  static size_t down_smem() { return 2 * (size_t)(DOWN_TS * (R * LS + TC_TM * LH) + TC_TM * LS); }
  static size_t dd_smem() { return 2 * (size_t)(TC_STAGES * (TC_TM * LS + TC_TM * LH) + R * LS); }
  static size_t du_smem() { return 2 * (size_t)(DU_TS * (TC_TM * (TC_DS + 8) + TC_TM * LW) + TC_DS * LW); }
  static size_t gx_smem() { return 2 * (size_t)(TC_TM * LW + TC_STAGES * TC_DS * LW + TC_TM * (TC_DS + 8)); }

  /* With fp8 banks, in bytes: each stage holds the codes (a byte each) and their scales (4 bytes a block
  ** of 32: an eighth of the codes' bytes), and the weights expand into one tile after the stages. */
  static constexpr int QR = (R + QBLK - 1) / QBLK * QBLK;           /* codes a row of Ug, Uu (dm_bank_fp8_cols) */
  static constexpr int PROJ_Q = 2 * TC_TM * LX + 2 * (KC * QR + q8_scale_bytes(KC * QR));
  static constexpr int DH_Q = 2 * TC_TM * LF + R * FC + q8_scale_bytes(R * FC);
  static constexpr int ROWS_STAGE_Q(bool bwd) { return bwd && DH_Q > PROJ_Q ? DH_Q : PROJ_Q; }
  static constexpr int ROWS_WB_Q(bool bwd) { return 2 * (bwd && R * LF > KC * LW ? R * LF : KC * LW); }
  static size_t rows_smem_q(bool bwd) {
    return (size_t)TC_STAGES * ROWS_STAGE_Q(bwd) + ROWS_WB_Q(bwd) + 4 * (size_t)TC_TM * LZ;
  }
  static constexpr int DOWN_STAGE_Q = R * TC_FS + q8_scale_bytes(R * TC_FS) + 2 * TC_TM * LH;
  static size_t down_smem_q() { return (size_t)DOWN_TS * DOWN_STAGE_Q + 2 * (size_t)(R * LS + TC_TM * LS); }
  static constexpr int GX_STAGE_Q = 2 * (TC_DS * QR + q8_scale_bytes(TC_DS * QR));
  static size_t gx_smem_q() {
    return 2 * (size_t)TC_TM * LW + (size_t)TC_STAGES * GX_STAGE_Q + 2 * (size_t)(TC_DS * LW + TC_TM * (TC_DS + 8));
  }
  static_assert(PROJ_Q % 16 == 0 && DH_Q % 16 == 0 && DOWN_STAGE_Q % 16 == 0 && GX_STAGE_Q % 16 == 0,
                "the stages' parts start on 16-byte boundaries");
};

/* A row tile: z = x [Ug | Uu] (f32, in shared memory); the forward writes h = silu(z_g cg) (z_u cu) to hs
** and z to zio when given; the backward (gy given) also dh = gy D^T and from it hs, dagu = [dzg cg | dzu cu],
** pg = dzg z_g, pu = dzu z_u. With ZIN the backward reads z from zio (the forward's) instead. */
template <int DT, int R, bool BWD, bool ZIN = false, bool Q8 = false>
__global__ void __launch_bounds__(TC_THREADS, BWD ? 2 : 1) tc_rows_k(const u16 *u, const int64_t *perm, const int64_t *off,
                                                        const int64_t *tiles, const u16 *ug, const u16 *uu,
                                                        const u16 *cg, const u16 *cu, const u16 *dw, const u16 *gy,
                                                        u16 *hs, u16 *dagu, float *pg, float *pu, float *zio,
                                                        moe_dims M, moe_q8 Q) {
  typedef tc_cfg<R> T;
  extern __shared__ __align__(16) unsigned char moe_smem[];
  __shared__ int64_t xrow[TC_TM];
  __shared__ unsigned char shg[TC_TM], shd[R];
  int64_t x, row0, nrows64;
  if (!tile_of(tiles, off, M.e, TC_TM, M.rows, &x, &row0, &nrows64)) return;
  const int nrows = (int)nrows64, warp = threadIdx.x >> 5;
  const int64_t d = M.d, F = M.f, FQ = Q.fq;
  u16 *stage = (u16 *)moe_smem;   /* z: after the stages in the backward (they take dh's chunks next), on them in the forward */
  float *z = BWD ? (float *)(stage + TC_STAGES * (T::DH > T::PROJ ? T::DH : T::PROJ)) : (float *)stage;
  /* fp8 banks: stages of STQ bytes, the weights' tile wq after them, then z */
  constexpr int STQ = T::ROWS_STAGE_Q(BWD);
  u16 *const wq = (u16 *)(moe_smem + TC_STAGES * STQ);
  if constexpr (Q8) z = (float *)(moe_smem + TC_STAGES * STQ + T::ROWS_WB_Q(BWD));
  if constexpr (!ZIN) {
    for (int i = threadIdx.x; i < TC_TM; i += blockDim.x) {
      int64_t a = i < nrows ? perm[row0 + i] : -1;
      bool ok = a >= 0 && a < M.rows;
      if (i < nrows && !ok) dm_report(M.err, M.what, a, M.rows, 0);
      xrow[i] = ok ? (a / M.k) * d : -1;
    }
    __syncthreads();

    /* z = x [Ug | Uu]: the units (m tile, n16 group) of z are dealt to the warps */
    float acc[T::UPW][2][4] = {};
    const int nk = (int)((d + T::KC - 1) / T::KC);
    /* a stage: x's tile, then Ug's and Uu's rows, 16-bit or (Q8) codes and scales */
    auto proj_x = [&](int kc) {
      return Q8 ? (u16 *)(moe_smem + (kc % TC_STAGES) * STQ) : stage + (kc % TC_STAGES) * T::PROJ;
    };
    constexpr int QB = T::KC * T::QR;    /* a factor's codes in a stage */
    auto load_proj = [&](int kc) {
      u16 *xs = proj_x(kc), *ws = xs + TC_TM * T::LX;
      int64_t c0 = (int64_t)kc * T::KC;
      int nv = (int)(d - c0 < T::KC ? d - c0 : T::KC);
      load_runs<false, TC_TM, T::KC>(xs, nullptr, T::LX, nv, u, M.rows / M.k * d,
                       [&](int i) { return xrow[i] >= 0 ? xrow[i] + c0 : (int64_t)-1; });
      if constexpr (Q8) {
        uint8_t *qs = (uint8_t *)ws;
        float *ss = (float *)(qs + 2 * QB);
        auto qrow = [&](int i) { return c0 + i < d ? ((x * d + c0 + i) * T::QR) : (int64_t)-1; };
        load_codes<T::KC, T::QR>(qs, ss, Q.qg, Q.sg, T::QR, qrow);
        load_codes<T::KC, T::QR>(qs + QB, ss + QB / QBLK, Q.qu, Q.su, T::QR, qrow);
      } else {
        auto wrow = [&](int i) { return c0 + i < d ? ((x * d + c0 + i) * R) : (int64_t)-1; };
        load_runs<false, T::KC, R>(ws, nullptr, T::LW, R, ug, M.e * d * R, wrow);
        load_runs<false, T::KC, R>(ws + R, nullptr, T::LW, R, uu, M.e * d * R, wrow);
      }
    };
    dm_cp_pipeline<TC_STAGES>(nk, load_proj, [&](int kc) {
      const u16 *xs = proj_x(kc), *ws = xs + TC_TM * T::LX;
      if constexpr (Q8) {   /* the stage's codes to [Ug | Uu] rows in wq */
        const uint8_t *qs = (const uint8_t *)ws;
        const float *ss = (const float *)(qs + 2 * QB);
        expand_codes<DT, T::KC, R, T::QR>(wq, T::LW, qs, ss);
        expand_codes<DT, T::KC, R, T::QR>(wq + R, T::LW, qs + QB, ss + QB / QBLK);
        __syncthreads();
        ws = wq;
      }
#pragma unroll
      for (int ks = 0; ks < T::KC / 16; ks++)
#pragma unroll
        for (int w = 0; w < T::UPW; w++) {
          int unit = warp + 8 * w, mt = unit / T::NG, ng = unit % T::NG;
          if (unit >= T::MT * T::NG || mt * 16 >= nrows) continue;
          uint32_t a[4], b[4];
          frag_a(a, xs, T::LX, mt * 16, ks * 16);
          frag_b(b, ws, T::LW, ks * 16, ng * 16);
          dm_mma16816<DT == DM_BF16>(acc[w][0], a, b[0], b[1]);
          dm_mma16816<DT == DM_BF16>(acc[w][1], a, b[2], b[3]);
        }
    });
    dm_cp_wait<0>();
    __syncthreads();
#pragma unroll
    for (int w = 0; w < T::UPW; w++) {
      int unit = warp + 8 * w, mt = unit / T::NG, ng = unit % T::NG;
      if (unit >= T::MT * T::NG) continue;
#pragma unroll
      for (int h = 0; h < 2; h++)
#pragma unroll
        for (int e = 0; e < 4; e++) z[(mt * 16 + acc_row(e)) * T::LZ + ng * 16 + h * 8 + acc_col(e)] = acc[w][h][e];
    }
  }
  __syncthreads();

  if constexpr (!BWD) {
    if (zio)
      for (int i = threadIdx.x; i < nrows * 2 * R; i += blockDim.x) {
        int m = i / (2 * R), j = i - m * 2 * R;
        zio[(row0 + m) * 2 * R + j] = z[m * T::LZ + j];
      }
    for (int i = threadIdx.x; i < nrows * R; i += blockDim.x) {
      int m = i / R, j = i - m * R;
      float zg = z[m * T::LZ + j] * dt<DT>::load(cg[x * R + j]), zu = z[m * T::LZ + R + j] * dt<DT>::load(cu[x * R + j]);
      hs[(row0 + m) * R + j] = dt<DT>::store(zg * sigm(zg) * zu);
    }
  } else {
    /* dh = gy D^T over chunks of F: warp w takes k16 step w % KS of each chunk, n8 tiles of part w / KS of R */
    float dacc[T::MT][T::NTW][4] = {};
    const int nf = (int)((F + T::FC - 1) / T::FC), ks = warp % T::KS, nh = warp / T::KS;
    /* the tile's rows of gy and the expert's D, from 16-byte boundaries */
    const int64_t gb = row0 * F & ~(int64_t)7, db = x * R * F & ~(int64_t)7;
    const u16 *gyb = gy + gb, *dwb = dw + db;
    const run_stream<TC_TM, T::FC> gstream(shg, [&](int i) { return row0 * F - gb + i * F; });
    /* (with fp8 banks D's rows are aligned codes and dstream goes unused: made at its narrowest) */
    const run_stream<R, Q8 ? 8 : T::FC> dstream(shd, [&](int j) { return x * R * F - db + j * F; });
    auto dh_gs = [&](int fc) {
      return Q8 ? (u16 *)(moe_smem + (fc % TC_STAGES) * STQ) : stage + (fc % TC_STAGES) * T::DH;
    };
    auto load_dh = [&](int fc) {
      u16 *gs = dh_gs(fc), *ds = gs + TC_TM * T::LF;
      int64_t f0 = (int64_t)fc * T::FC;
      int nv = (int)(F - f0 < T::FC ? F - f0 : T::FC);
      gstream.load(gs, T::LF, gyb, M.rows * F - gb, f0, nrows, nv);
      if constexpr (Q8) {
        uint8_t *qs = (uint8_t *)ds;
        const int nvq = (int)(FQ - f0 < T::FC ? FQ - f0 : T::FC);
        load_codes<R, T::FC>(qs, (float *)(qs + R * T::FC), Q.qd, Q.sd, nvq, [&](int j) { return (x * R + j) * FQ + f0; });
      } else {
        dstream.load(ds, T::LF, dwb, M.e * R * F - db, f0, R, nv);
      }
    };
    if constexpr (ZIN)   /* the forward's z, with dh's first chunks (rows past the tile's: zeros) */
      for (int i = threadIdx.x; i < TC_TM * R / 2; i += blockDim.x) {
        int m = i / (R / 2), c = i - m * (R / 2);
        dm_cp_async16(z + m * T::LZ + 4 * c, m < nrows ? zio + (row0 + m) * 2 * R + 4 * c : zio, m < nrows ? 16 : 0);
      }
    dm_cp_pipeline<TC_STAGES>(nf, load_dh, [&](int fc) {
      int nv = (int)(F - (int64_t)fc * T::FC < T::FC ? F - (int64_t)fc * T::FC : T::FC);
      u16 *gs = dh_gs(fc), *ds = gs + TC_TM * T::LF;
      if constexpr (Q8) {   /* D's codes to wq (past F they are zeros), made visible by realign's barriers */
        const uint8_t *qs = (const uint8_t *)ds;
        expand_codes<DT, R, T::FC, T::FC>(wq, T::LF, qs, (const float *)(qs + R * T::FC));
        ds = wq;
      } else {
        realign<R, T::FC, true>(ds, shd, T::LF, nv);
      }
      realign<TC_TM, T::FC, true>(gs, shg, T::LF, nv);
      if (ks * 16 >= nv) return;
      uint32_t b[T::NTW][2];
#pragma unroll
      for (int t = 0; t < T::NTW; t += 2) {
        uint32_t f[4];
        frag_b_t(f, ds, T::LF, ks * 16, (nh * T::NTW + t) * 8);
        b[t][0] = f[0], b[t][1] = f[1], b[t + 1][0] = f[2], b[t + 1][1] = f[3];
      }
#pragma unroll
      for (int mt = 0; mt < T::MT; mt++) {
        if (mt * 16 >= nrows) continue;
        uint32_t a[4];
        frag_a(a, gs, T::LF, mt * 16, ks * 16);
#pragma unroll
        for (int t = 0; t < T::NTW; t++) dm_mma16816<DT == DM_BF16>(dacc[mt][t], a, b[t][0], b[t][1]);
      }
    });
    dm_cp_wait<0>();
    __syncthreads();
    /* the k steps' sums added in order, into the stage memory (free now) */
    float *red = (float *)stage;
    for (int kg = 0; kg < T::KS; kg++) {
      if (ks == kg)
#pragma unroll
        for (int mt = 0; mt < T::MT; mt++)
#pragma unroll
          for (int t = 0; t < T::NTW; t++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
              float *p = red + (mt * 16 + acc_row(e)) * T::LH + (nh * T::NTW + t) * 8 + acc_col(e);
              *p = kg ? *p + dacc[mt][t][e] : dacc[mt][t][e];
            }
      __syncthreads();
    }
    for (int i = threadIdx.x; i < nrows * R; i += blockDim.x) {
      int m = i / R, j = i - m * R;
      int64_t p = row0 + m;
      float cgv = dt<DT>::load(cg[x * R + j]), cuv = dt<DT>::load(cu[x * R + j]);
      float ag = z[m * T::LZ + j], au = z[m * T::LZ + R + j], zg = ag * cgv, zu = au * cuv, s = sigm(zg);
      float dh = red[m * T::LH + j], dzg = dh * zu * s * (1 + zg * (1 - s)), dzu = dh * zg * s;
      hs[p * R + j] = dt<DT>::store(zg * s * zu);
      dagu[p * 2 * R + j] = dt<DT>::store(dzg * cgv);
      dagu[p * 2 * R + R + j] = dt<DT>::store(dzu * cuv);
      pg[p * R + j] = dzg * ag;
      pu[p * R + j] = dzu * au;
    }
  }
}

/* ---- the streaming kernels' units ----
**
** The weight-streaming kernels (tc_down_k, tc_dd_k, tc_du_k) go through units: a group of at most TC_GT row
** tiles of one expert and a range of its chunks (of F, or of d). A unit of an expert of one tile takes
** tc_cpb chunks, one of more tiles proportionally fewer (one at least), so that a unit costs about the same
** whatever the routing, and an expert of more than TC_GT tiles is split by rows as well: the sums over its
** rows (tc_dd_k, tc_du_k) then go by group to f32 partial slots that tc_join_k adds in group order (the
** same bits on every run). The units are laid out on the device from the offsets (no host sync); a grid
** sized for the units of an even routing goes through them, block b taking units b, b + grid, ..., so a
** heavy expert's units, which are consecutive, spread over the blocks. Within a unit a block goes through (chunk, row
** tile) items in that order, TS deep: each item's loads are issued TS - 1 items ahead, so a block streams
** its expert's weights or gradients instead of waiting on every tile's loads. The operand that is the same
** for every chunk (h, or [dag | dau]) is loaded with the first TS items only when the unit has one row tile
** (the common case: 16 rows an expert on average at b1), else with every item. */
#define TC_GT DM_MOE_TC_GT   /* row tiles a unit at most */
#define TC_WAVES 4     /* the streaming grids: blocks for at least this many waves at the kernels' occupancy */

/* chunks a unit of a one-tile expert: about a dozen (units enough to fill the SMs several times at b1,
** each long enough to keep its pipeline full) */
static int tc_cpb(int64_t nchunks) {
  int64_t splits = (nchunks + 11) / 12;
  return (int)((nchunks + splits - 1) / (splits > 0 ? splits : 1));
}

/* an expert's rows in the sorted order (bad offsets were recorded by the check: none here) */
__device__ __forceinline__ void expert_span(const int64_t *off, int64_t x, int64_t rows, int64_t *lo, int64_t *hi) {
  *lo = off[x];
  *hi = off[x + 1] < rows ? off[x + 1] : rows;
  if (*hi < *lo) *hi = *lo;
}

/* an expert of n rows in units: row groups, chunks a unit, units a group */
struct tc_split {
  int64_t groups, splits;
  int cpb;
  __device__ tc_split(int64_t n, int cpb1, int64_t nch) {
    const int64_t t = (n + TC_TM - 1) / TC_TM, tg = t < 1 ? 1 : t < TC_GT ? t : TC_GT;
    groups = t > TC_GT ? (t + TC_GT - 1) / TC_GT : 1;
    cpb = cpb1 / tg > 1 ? (int)(cpb1 / tg) : 1;
    splits = (nch + cpb - 1) / cpb;
  }
};

/* the units of one launch, in scratch (tc_plan) */
struct tc_units {
  int64_t *first;   /* [E + 1]: expert x's first unit; first[E], the units */
  int64_t *map;     /* [ucap]: unit -> expert */
  int64_t *slot;    /* [E + 1]: expert x's first partial slot (experts of one group take none); NULL: no partials */
  int64_t *smap;    /* [scap]: slot -> expert */
  float *part;      /* [scap][psize] */
  int64_t e, nch, ucap, scap, psize;
  int cpb;          /* chunks a unit of a one-tile expert */
  __device__ int64_t count() const { return first[e] < ucap ? first[e] : ucap; }
};

/* unit u: its expert x, the first of its row group's rows lo (sorted), nr rows (0 to TC_GT TC_TM), nt row
** tiles (at least one), chunks from c0, n items; slot: the group's partial slot, -1 for an expert of one
** group (its sums are whole), -2 when the slots are full (bad offsets: the check has them). Small, since
** tc_du_k keeps it in registers at 64 a thread. */
struct tc_items {
  int64_t lo;
  int x, nr, slot, nt, c0, n;   /* (E fits an int: dm_moe_tc_fits; slots are under 2 rows / 1024) */
  __device__ tc_items(const tc_units &U, const int64_t *off, int64_t rows, int u) {
    x = (int)U.map[u];
    int64_t elo, ehi;
    expert_span(off, x, rows, &elo, &ehi);
    const tc_split sp(ehi - elo, U.cpb, U.nch);
    const int local = (int)(u - U.first[x]), g = local / (int)sp.splits, s = local - g * (int)sp.splits;
    lo = elo + (int64_t)g * (TC_GT * TC_TM);
    nr = ehi - lo < TC_GT * TC_TM ? (int)(ehi > lo ? ehi - lo : 0) : TC_GT * TC_TM;
    nt = nr > 0 ? (nr + TC_TM - 1) / TC_TM : 1;
    c0 = s * sp.cpb;
    const int c1 = (int64_t)c0 + sp.cpb < U.nch ? c0 + sp.cpb : (int)U.nch;
    n = c1 > c0 ? (c1 - c0) * nt : 0;
    slot = sp.groups == 1 || !U.slot ? -1 : U.slot[x] + g < U.scap ? (int)(U.slot[x] + g) : -2;
  }
  __device__ int chunk(int it) const { return nt == 1 ? c0 + it : c0 + it / nt; }   /* no division in the usual case */
  __device__ int tile(int it) const { return nt == 1 ? 0 : it % nt; }
  __device__ int64_t row0(int it) const { return lo + (int64_t)tile(it) * TC_TM; }
  __device__ int rows(int it) const {
    const int left = nr - tile(it) * TC_TM;
    return left < TC_TM ? left : TC_TM;
  }
  /* whether item it loads the operand that does not change with the chunk */
  __device__ bool fixed(int it, int ts) const { return nt > 1 || it < ts; }
};

/* the units' and the slots' starts (tc_plan), in one block: each thread counts its run of experts, then
** the block scans the counts */
__global__ void __launch_bounds__(DM_SCAN_THREADS) units_k(tc_units U, const int64_t *off, int64_t rows) {
  const int64_t e = U.e, per = (e + blockDim.x - 1) / blockDim.x, lo = threadIdx.x * per;
  const int64_t hi = lo + per < e ? lo + per : e;
  auto split = [&](int64_t x) {
    int64_t a, b;
    expert_span(off, x, rows, &a, &b);
    return tc_split(b - a, U.cpb, U.nch);
  };
  int64_t nu = 0, ns = 0, tu, ts;
  for (int64_t x = lo; x < hi; x++) {
    const tc_split sp = split(x);
    nu += sp.groups * sp.splits;
    ns += sp.groups > 1 ? sp.groups : 0;
  }
  int64_t ru = dm_block_exscan(nu, &tu), rs = dm_block_exscan(ns, &ts);
  for (int64_t x = lo; x < hi; x++) {
    const tc_split sp = split(x);
    U.first[x] = ru;
    ru += sp.groups * sp.splits;
    if (U.slot) U.slot[x] = rs;
    rs += sp.groups > 1 ? sp.groups : 0;
  }
  if (threadIdx.x == 0) {
    U.first[e] = tu;
    if (U.slot) U.slot[e] = ts;
  }
}

/* map[u] = the expert of unit u (u < ucap), smap[s] = the expert of slot s (s < scap) */
__global__ void units_map_k(tc_units U) {
  DM_GRID_LOOP(x, U.e) {
    for (int64_t u = U.first[x]; u < U.first[x + 1] && u < U.ucap; u++) U.map[u] = x;
    if (U.slot)
      for (int64_t q = U.slot[x]; q < U.slot[x + 1] && q < U.scap; q++) U.smap[q] = x;
  }
}

/* The units of a launch over nch chunks, from the offsets (device memory, no host sync), and with psize > 0
** the partial slots of psize floats. Bounds (host): an expert's groups are 1, or ceil(t / TC_GT) for t > TC_GT
** tiles, so the groups are at most E + (rows / TC_TM + E) / TC_GT, and a group's units at most nch; an expert
** of more than S = TC_GT TC_TM rows has fewer than 2 n / S groups, so the slots are under 2 rows / S. */
static tc_units tc_plan(const int64_t *off, const moe_dims &M, int64_t nch, int64_t psize, void **mem,
                        size_t *nbytes) {
  tc_units U = {};
  U.e = M.e, U.nch = nch, U.psize = psize, U.cpb = tc_cpb(nch);
  U.ucap = dm_moe_tc_units(M.e, M.rows, nch);
  U.scap = dm_moe_tc_slots(M.rows, psize);
  const size_t head = (size_t)dm_moe_tc_units_head(M.e, M.rows, nch, psize);
  *nbytes = (size_t)dm_moe_tc_units_scratch(M.e, M.rows, nch, psize);
  unsigned char *p = (unsigned char *)dm_scratch(*nbytes);
  *mem = p;
  U.first = (int64_t *)p;
  U.map = U.first + M.e + 1;
  U.slot = psize > 0 ? U.map + U.ucap : NULL;
  U.smap = U.map + U.ucap + M.e + 1;
  U.part = (float *)(p + head);
  if (M.e == 0) {
    DM_CU(cudaMemsetAsync(U.first, 0, sizeof(int64_t), dm_cuda_stream()));
    return U;
  }
  units_k<<<1, DM_SCAN_THREADS, 0, dm_cuda_stream()>>>(U, off, M.rows);
  DM_CU_LAUNCHED();
  DM_LAUNCH(units_map_k, M.e, U);
  return U;
}

/* blocks of a streaming grid: a block a unit when every expert has one tile (the units the host can count
** without the offsets), TC_WAVES waves at minb blocks an SM at least; blocks go on to further units when
** there are more */
static unsigned tc_stream_grid(const tc_units &U, int minb) {
  int64_t g = (int64_t)dm_cuda_sm_count() * minb * TC_WAVES, even = U.e * ((U.nch + U.cpb - 1) / U.cpb);
  if (g < even) g = even;
  return (unsigned)(g < U.ucap ? g : U.ucap);
}

/* out = the sum of the partial slots of each expert split by rows, in group order, in the storage dtype;
** a block row a slot (its expert's first slot does the expert). Slot layouts: tc_dd_k's [R, F] to dd
** [E, R, F] (half 0); tc_du_k's [d, 2R] to dug, duu [E, d, R] (half R, columns R.. to duu) */
template <int DT>
__global__ void tc_join_k(u16 *out, u16 *out2, int64_t half, tc_units U) {
  const int64_t s = blockIdx.y, ns = U.slot[U.e] < U.scap ? U.slot[U.e] : U.scap;
  if (s >= ns) return;
  const int64_t x = U.smap[s];
  if (U.slot[x] != s) return;
  const int64_t s1 = U.slot[x + 1] < U.scap ? U.slot[x + 1] : U.scap;
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < U.psize; i += (int64_t)gridDim.x * blockDim.x) {
    float v = 0;
    for (int64_t q = s; q < s1; q++) v += U.part[q * U.psize + i];
    if (!half) {
      out[x * U.psize + i] = dt<DT>::store(v);
      continue;
    }
    const int64_t c = i / (2 * half), j = i - c * 2 * half;
    u16 *o = j < half ? out : out2;
    if (o) o[(x * (U.psize / (2 * half)) + c) * half + (j < half ? j : j - half)] = dt<DT>::store(v);
  }
}

static void tc_join(int dt, u16 *out, u16 *out2, int64_t half, const tc_units &U) {
  if (U.scap == 0) return;
  dim3 grid(256, (unsigned)U.scap);
  if (dt == DM_BF16) tc_join_k<DM_BF16><<<grid, 256, 0, dm_cuda_stream()>>>(out, out2, half, U);
  else tc_join_k<DM_F16><<<grid, 256, 0, dm_cuda_stream()>>>(out, out2, half, U);
  DM_CU_LAUNCHED();
}

/* where a 16-byte chunk starts: the offset of element i in its chunk (unsigned arithmetic keeps i mod 8) */
__device__ __forceinline__ int chunk_shift(int64_t i) { return (int)((uint32_t)(uint64_t)i & 7u); }

/* y = h D for a unit (an expert's group of row tiles, a range of chunks of F): items (chunk, row tile),
** the chunk of D and the tile of h two deep; warp w has n8 tiles 2w, 2w + 1 of the chunk */
template <int DT, int R, bool Q8>
__device__ __forceinline__ void tc_down_unit(const tc_items &I, u16 *y, const u16 *hs, const u16 *dw, const moe_dims &M,
                                             const moe_q8 &Q) {
  typedef tc_cfg<R> T;
  constexpr int TS = T::DOWN_TS;
  /* a stage: D's chunk (16-bit, or Q8: codes and scales), then h's tile; Q8 expands D into wq after the
  ** stages, and the output tile os follows */
  constexpr int DSZ = Q8 ? (R * TC_FS + q8_scale_bytes(R * TC_FS)) / 2 : R * T::LS, STAGE = DSZ + TC_TM * T::LH;
  extern __shared__ __align__(16) unsigned char moe_smem[];
  __shared__ unsigned char shd[R];
  const int64_t x = I.x, F = M.f, FQ = Q.fq;
  if (I.nr == 0) return;
  const int warp = threadIdx.x >> 5;
  u16 *const smem = (u16 *)moe_smem, *wq = smem + TS * STAGE, *os = wq + (Q8 ? R * T::LS : 0);
  auto load = [&](int it) {
    u16 *ds = smem + (it % TS) * STAGE, *hc = ds + DSZ;
    const int64_t f0 = (int64_t)I.chunk(it) * TC_FS, p0 = I.row0(it);
    const int np = I.rows(it), nv = (int)(F - f0 < TC_FS ? F - f0 : TC_FS);
    if constexpr (Q8) {
      const int nvq = (int)(FQ - f0 < TC_FS ? FQ - f0 : TC_FS);
      uint8_t *qs = (uint8_t *)ds;
      load_codes<R, TC_FS>(qs, (float *)(qs + R * TC_FS), Q.qd, Q.sd, nvq, [&](int j) { return (x * R + j) * FQ + f0; });
    } else {
      /* (a run_stream here took more registers than tc_down_k has at four blocks an SM, and was slower) */
      load_runs<true, R, TC_FS>(ds, shd, T::LS, nv, dw, M.e * R * F, [&](int j) { return (x * R + j) * F + f0; });
    }
    if (I.fixed(it, TS))
      load_runs<false, TC_TM, R>(hc, nullptr, T::LH, R, hs, M.rows * R,
                       [&](int i) { return i < np ? (p0 + i) * R : (int64_t)-1; });
  };
  dm_cp_pipeline<TS>(I.n, load, [&](int it) {
    u16 *ds = smem + (it % TS) * STAGE, *hc = ds + DSZ;
    if constexpr (Q8) {
      const uint8_t *qs = (const uint8_t *)ds;
      expand_codes<DT, R, TC_FS, TC_FS>(wq, T::LS, qs, (const float *)(qs + R * TC_FS));
      __syncthreads();
      ds = wq;
    } else {
      realign<R, TC_FS, false>(ds, shd, T::LS, 0);
    }
    const int np = I.rows(it);
    float acc[T::MT][2][4] = {};
#pragma unroll
    for (int ks = 0; ks < R / 16; ks++) {
      uint32_t b[4];
      frag_b(b, ds, T::LS, ks * 16, 16 * warp);
#pragma unroll
      for (int mt = 0; mt < T::MT; mt++) {
        if (mt * 16 >= np) continue;
        uint32_t a[4];
        frag_a(a, hc, T::LH, mt * 16, ks * 16);
        dm_mma16816<DT == DM_BF16>(acc[mt][0], a, b[0], b[1]);
        dm_mma16816<DT == DM_BF16>(acc[mt][1], a, b[2], b[3]);
      }
    }
    const int64_t f0 = (int64_t)I.chunk(it) * TC_FS, p0 = I.row0(it);
    const int nv = (int)(F - f0 < TC_FS ? F - f0 : TC_FS);
#pragma unroll
    for (int mt = 0; mt < T::MT; mt++)
#pragma unroll
      for (int t = 0; t < 2; t++)
#pragma unroll
        for (int e = 0; e < 4; e++) {
          int r = mt * 16 + acc_row(e);
          os[r * T::LS + chunk_shift((p0 + r) * F + f0) + (2 * warp + t) * 8 + acc_col(e)] =
              dt<DT>::store(acc[mt][t][e]);
        }
    __syncthreads();
    store_runs<TC_TM, TC_FS, false>(y, os, T::LS, np, nv, [&](int i) { return (p0 + i) * F + f0; });
  });
}

template <int DT, int R, bool Q8 = false>
__global__ void __launch_bounds__(TC_THREADS, tc_cfg<R>::DOWN_MINB) tc_down_k(u16 *y, const u16 *hs, const int64_t *off, const u16 *dw,
                                                        moe_dims M, tc_units U, moe_q8 Q) {
  for (int u = blockIdx.x; u < U.count(); u += gridDim.x) {
    __syncthreads();   /* the last unit's reads of shared memory are done */
    tc_down_unit<DT, R, Q8>(tc_items(U, off, M.rows, u), y, hs, dw, M, Q);
  }
}

/* dD = h^T gy for a unit, each chunk summed over the unit's rows in order (zeros without rows; to the
** group's partial slot when the expert is split by rows): items (chunk, row tile), TC_STAGES deep; warp w has n8 tiles 2w, 2w + 1 of the
** chunk and every m16 tile of R */
template <int DT, int R>
__device__ __forceinline__ void tc_dd_unit(const tc_items &I, u16 *dd, float *part, const u16 *hs, const u16 *gy,
                                           const moe_dims &M) {
  typedef tc_cfg<R> T;
  constexpr int TS = TC_STAGES, GSZ = TC_TM * T::LS, STAGE = GSZ + TC_TM * T::LH;
  extern __shared__ __align__(16) unsigned char moe_smem[];
  __shared__ unsigned char shg[TC_TM];
  const int64_t x = I.x, F = M.f;
  if (I.slot == -2) return;
  const int warp = threadIdx.x >> 5;
  u16 *const smem = (u16 *)moe_smem, *os = smem + TS * STAGE;
  /* the expert's rows of gy from a 16-byte boundary; a tile of rows TC_TM F further on */
  const int64_t gb = I.lo * F & ~(int64_t)7;
  const u16 *gyb = gy + gb;
  const run_stream<TC_TM, TC_FS> gstream(shg, [&](int i) { return I.lo * F - gb + i * F; });
  auto load = [&](int it) {
    u16 *gs = smem + (it % TS) * STAGE, *hc = gs + GSZ;
    const int64_t f0 = (int64_t)I.chunk(it) * TC_FS, p0 = I.row0(it);
    const int np = I.rows(it), nv = (int)(F - f0 < TC_FS ? F - f0 : TC_FS);
    gstream.load(gs, T::LS, gyb, M.rows * F - gb, (p0 - I.lo) * F + f0, np, nv);
    if (I.fixed(it, TS))
      load_runs<false, TC_TM, R>(hc, nullptr, T::LH, R, hs, M.rows * R,
                       [&](int i) { return i < np ? (p0 + i) * R : (int64_t)-1; });
  };
  float acc[R / 16][2][4];
  /* f(j, c, v) for each of this thread's sums: row j of R, column c of the chunk, the value */
  auto each_acc = [&](auto f) {
#pragma unroll
    for (int mt = 0; mt < R / 16; mt++)
#pragma unroll
      for (int h = 0; h < 2; h++)
#pragma unroll
        for (int e = 0; e < 4; e++) f(mt * 16 + acc_row(e), (2 * warp + h) * 8 + acc_col(e), acc[mt][h][e]);
  };
  dm_cp_pipeline<TS>(I.n, load, [&](int it) {
    const int t = I.tile(it), np = I.rows(it);
    if (t == 0)
#pragma unroll
      for (int mt = 0; mt < R / 16; mt++)
#pragma unroll
        for (int h = 0; h < 2; h++)
#pragma unroll
          for (int e = 0; e < 4; e++) acc[mt][h][e] = 0;
    u16 *gs = smem + (it % TS) * STAGE, *hc = gs + GSZ;
    realign<TC_TM, TC_FS, false>(gs, shg, T::LS, 0);
#pragma unroll
    for (int ks = 0; ks < TC_TM / 16; ks++) {
      if (ks * 16 >= np) continue;
      uint32_t b[4];
      frag_b(b, gs, T::LS, ks * 16, 16 * warp);
#pragma unroll
      for (int mt = 0; mt < R / 16; mt++) {
        uint32_t a[4];
        frag_a_t(a, hc, T::LH, mt * 16, ks * 16);
        dm_mma16816<DT == DM_BF16>(acc[mt][0], a, b[0], b[1]);
        dm_mma16816<DT == DM_BF16>(acc[mt][1], a, b[2], b[3]);
      }
    }
    if (t < I.nt - 1) return;
    const int64_t f0 = (int64_t)I.chunk(it) * TC_FS;
    const int nv = (int)(F - f0 < TC_FS ? F - f0 : TC_FS);
    if (I.slot >= 0) {   /* a group of an expert split by rows: its sums in f32, for tc_join_k */
      float *p = part + I.slot * R * F;
      each_acc([&](int j, int c, float v) { if (c < nv) p[j * F + f0 + c] = v; });
      return;
    }
    each_acc([&](int j, int c, float v) { os[j * T::LS + chunk_shift((x * R + j) * F + f0) + c] = dt<DT>::store(v); });
    __syncthreads();
    store_runs<R, TC_FS, false>(dd, os, T::LS, R, nv, [&](int j) { return (x * R + j) * F + f0; });
  });
}

template <int DT, int R>
__global__ void __launch_bounds__(TC_THREADS, tc_cfg<R>::DD_MINB) tc_dd_k(u16 *dd, const u16 *hs, const u16 *gy, const int64_t *off,
                                                      moe_dims M, tc_units U) {
  for (int u = blockIdx.x; u < U.count(); u += gridDim.x) {
    __syncthreads();   /* the last unit's reads of shared memory are done */
    tc_dd_unit<DT, R>(tc_items(U, off, M.rows, u), dd, U.part, hs, gy, M);
  }
}

/* [dUg | dUu] = x^T [dag | dau] for a unit (a range of slices of d), each slice summed over the unit's
** rows in order (to the group's partial slot when the expert is split by rows): items (slice, row tile),
** TC_STAGES deep; the (m16 tile of the slice, n16 group of 2R) pairs are dealt to the warps. A unit of one
** tile finds its rows' places in u once. */
template <int DT, int R>
__device__ __forceinline__ void tc_du_unit(const tc_items &I, u16 *dug, u16 *duu, float *part, const u16 *u,
                                           const int64_t *perm, const u16 *dagu, const moe_dims &M) {
  typedef tc_cfg<R> T;
  constexpr int TS = T::DU_TS, LXS = TC_DS + 8, XSZ = TC_TM * LXS, STAGE = XSZ + TC_TM * T::LW;
  constexpr int NU = (TC_DS / 16) * T::NG, UPW = (NU + 7) / 8;
  extern __shared__ __align__(16) unsigned char moe_smem[];
  __shared__ int64_t xrow[TC_TM];
  const int64_t x = I.x, d = M.d;
  if (I.slot == -2) return;
  const int warp = threadIdx.x >> 5;
  u16 *const smem = (u16 *)moe_smem, *os = smem + TS * STAGE;
  /* f(w, mt, ng) for each of this warp's (m16 tile of the slice, n16 group of 2R) pairs, acc[w] its sums */
  auto each_pair = [&](auto f) {
#pragma unroll
    for (int w = 0; w < UPW; w++) {
      const int pr = warp + 8 * w;
      if (pr < NU) f(w, pr / T::NG, pr % T::NG);
    }
  };
  auto place = [&](int64_t p0, int np, int i) {   /* sorted row p0 + i's row of u (d elements), or -1 */
    int64_t a = i < np ? __ldg(perm + p0 + i) : -1;
    return a >= 0 && a < M.rows ? (a / M.k) * d : (int64_t)-1;
  };
  if (I.nt == 1) {
    for (int i = threadIdx.x; i < TC_TM; i += blockDim.x) xrow[i] = place(I.lo, I.rows(0), i);
    __syncthreads();
  }
  auto load = [&](int it) {
    u16 *xs = smem + (it % TS) * STAGE, *as = xs + XSZ;
    const int64_t c0 = (int64_t)I.chunk(it) * TC_DS, p0 = I.row0(it);
    const int np = I.rows(it), nvc = (int)(d - c0 < TC_DS ? d - c0 : TC_DS);
    load_runs<false, TC_TM, TC_DS>(xs, nullptr, LXS, nvc, u, M.rows / M.k * d, [&](int i) {
      int64_t a = I.nt == 1 ? xrow[i] : place(p0, np, i);
      return a >= 0 ? a + c0 : (int64_t)-1;
    });
    if (I.fixed(it, TS))
      load_runs<false, TC_TM, 2 * R>(as, nullptr, T::LW, 2 * R, dagu, M.rows * 2 * R,
                       [&](int i) { return i < np ? (p0 + i) * 2 * R : (int64_t)-1; });
  };
  float acc[UPW][2][4];
  dm_cp_pipeline<TS>(I.n, load, [&](int it) {
    const int t = I.tile(it), np = I.rows(it);
    if (t == 0)
#pragma unroll
      for (int w = 0; w < UPW; w++)
#pragma unroll
        for (int h = 0; h < 2; h++)
#pragma unroll
          for (int e = 0; e < 4; e++) acc[w][h][e] = 0;
    const u16 *xs = smem + (it % TS) * STAGE, *as = xs + XSZ;
#pragma unroll
    for (int ks = 0; ks < TC_TM / 16; ks++) {
      if (ks * 16 >= np) continue;
      each_pair([&](int w, int mt, int ng) {
        uint32_t a[4], b[4];
        frag_a_t(a, xs, LXS, mt * 16, ks * 16);
        frag_b(b, as, T::LW, ks * 16, ng * 16);
        dm_mma16816<DT == DM_BF16>(acc[w][0], a, b[0], b[1]);
        dm_mma16816<DT == DM_BF16>(acc[w][1], a, b[2], b[3]);
      });
    }
    if (t < I.nt - 1) return;
    if (I.slot >= 0) {   /* a group of an expert split by rows: its sums in f32, for tc_join_k */
      const int64_t c0 = (int64_t)I.chunk(it) * TC_DS;
      float *p = part + I.slot * d * 2 * R;
      each_pair([&](int w, int mt, int ng) {
#pragma unroll
        for (int h = 0; h < 2; h++)
#pragma unroll
          for (int e = 0; e < 4; e++) {
            const int64_t c = c0 + mt * 16 + acc_row(e);
            if (c < d) p[c * 2 * R + ng * 16 + h * 8 + acc_col(e)] = acc[w][h][e];
          }
      });
      return;
    }
    each_pair([&](int w, int mt, int ng) {
#pragma unroll
      for (int h = 0; h < 2; h++)
#pragma unroll
        for (int e = 0; e < 4; e += 2)
          *(uint32_t *)(os + (mt * 16 + acc_row(e)) * T::LW + ng * 16 + h * 8 + acc_col(e)) =
              pack2<DT>(acc[w][h][e], acc[w][h][e + 1]);
    });
    __syncthreads();
    const int64_t c0 = (int64_t)I.chunk(it) * TC_DS;
    const int nvc = (int)(d - c0 < TC_DS ? d - c0 : TC_DS);
    auto wrow = [&](int c) { return (x * d + c0 + c) * R; };
    if (dug) store_runs<TC_DS, R, true>(dug, os, T::LW, nvc, R, wrow);
    if (duu) store_runs<TC_DS, R, true>(duu, os + R, T::LW, nvc, R, wrow);
  });
}

template <int DT, int R>
__global__ void __launch_bounds__(TC_THREADS, tc_cfg<R>::DU_MINB) tc_du_k(u16 *dug, u16 *duu, const u16 *u, const int64_t *perm,
                                                      const u16 *dagu, const int64_t *off, moe_dims M, tc_units U) {
  for (int un = blockIdx.x; un < U.count(); un += gridDim.x) {
    __syncthreads();   /* the last unit's reads of shared memory are done */
    tc_du_unit<DT, R>(tc_items(U, off, M.rows, un), dug, duu, U.part, u, perm, dagu, M);
  }
}

/* a row tile: gx = [dag | dau] [Ug | Uu]^T over slices of d (TC_STAGES deep); warp w has m16 tile w / 4
** and n16 group w % 4 of the slice */
template <int DT, int R, bool Q8 = false>
__global__ void __launch_bounds__(TC_THREADS) tc_gx_k(u16 *gx, const u16 *dagu, const int64_t *off,
                                                      const int64_t *tiles, const u16 *ug, const u16 *uu, moe_dims M,
                                                      moe_q8 Q) {
  typedef tc_cfg<R> T;
  constexpr int LO = TC_DS + 8;
  /* a stage: the slice's rows of Ug and Uu, 16-bit, or (Q8) codes and scales expanded into wq after the stages */
  constexpr int WSZ = Q8 ? T::GX_STAGE_Q / 2 : TC_DS * T::LW, QB = TC_DS * T::QR;
  extern __shared__ __align__(16) unsigned char moe_smem[];
  int64_t x, row0, nrows64;
  if (!tile_of(tiles, off, M.e, TC_TM, M.rows, &x, &row0, &nrows64)) return;
  const int nrows = (int)nrows64, warp = threadIdx.x >> 5, mt = warp >> 2, ng = warp & 3;
  const int64_t d = M.d;
  u16 *as = (u16 *)moe_smem, *ws0 = as + TC_TM * T::LW, *wq = ws0 + TC_STAGES * WSZ;
  u16 *os = wq + (Q8 ? TC_DS * T::LW : 0);
  load_runs<false, TC_TM, 2 * R>(as, nullptr, T::LW, 2 * R, dagu, M.rows * 2 * R,
                   [&](int i) { return i < nrows ? (row0 + i) * 2 * R : (int64_t)-1; });
  const int nd = (int)((d + TC_DS - 1) / TC_DS);
  auto load_w = [&](int ci) {
    u16 *ws = ws0 + (ci % TC_STAGES) * WSZ;
    int64_t c0 = (int64_t)ci * TC_DS;
    if constexpr (Q8) {
      uint8_t *qs = (uint8_t *)ws;
      float *ss = (float *)(qs + 2 * QB);
      auto qrow = [&](int c) { return c0 + c < d ? (x * d + c0 + c) * T::QR : (int64_t)-1; };
      load_codes<TC_DS, T::QR>(qs, ss, Q.qg, Q.sg, T::QR, qrow);
      load_codes<TC_DS, T::QR>(qs + QB, ss + QB / QBLK, Q.qu, Q.su, T::QR, qrow);
    } else {
      auto wrow = [&](int c) { return c0 + c < d ? (x * d + c0 + c) * R : (int64_t)-1; };
      load_runs<false, TC_DS, R>(ws, nullptr, T::LW, R, ug, M.e * d * R, wrow);
      load_runs<false, TC_DS, R>(ws + R, nullptr, T::LW, R, uu, M.e * d * R, wrow);
    }
  };
  dm_cp_pipeline<TC_STAGES>(nd, load_w, [&](int ci) {
    const u16 *ws = ws0 + (ci % TC_STAGES) * WSZ;
    if constexpr (Q8) {
      const uint8_t *qs = (const uint8_t *)ws;
      const float *ss = (const float *)(qs + 2 * QB);
      expand_codes<DT, TC_DS, R, T::QR>(wq, T::LW, qs, ss);
      expand_codes<DT, TC_DS, R, T::QR>(wq + R, T::LW, qs + QB, ss + QB / QBLK);
      __syncthreads();
      ws = wq;
    }
    const int64_t c0 = (int64_t)ci * TC_DS;
    const int nvc = (int)(d - c0 < TC_DS ? d - c0 : TC_DS);
    float acc[2][4] = {};
    if (mt * 16 < nrows) {
#pragma unroll
      for (int ks = 0; ks < 2 * R / 16; ks++) {
        uint32_t a[4], b[4];
        frag_a(a, as, T::LW, mt * 16, ks * 16);
        frag_b_t(b, ws, T::LW, ks * 16, ng * 16);
        dm_mma16816<DT == DM_BF16>(acc[0], a, b[0], b[1]);
        dm_mma16816<DT == DM_BF16>(acc[1], a, b[2], b[3]);
      }
#pragma unroll
      for (int h = 0; h < 2; h++)
#pragma unroll
        for (int e = 0; e < 4; e += 2)
          *(uint32_t *)(os + (mt * 16 + acc_row(e)) * LO + ng * 16 + h * 8 + acc_col(e)) =
              pack2<DT>(acc[h][e], acc[h][e + 1]);
    }
    __syncthreads();
    store_runs<TC_TM, TC_DS, true>(gx, os, LO, nrows, nvc, [&](int i) { return (row0 + i) * d + c0; });
  });
}

/* dcg, dcu in two steps, so that a heavy expert's rows are summed in parallel: a tile's sums of pg and pu
** over its rows, in order (ts [cap, 2R]), then an expert's over its tiles, in order */
__global__ void tile_csum_k(float *ts, const float *pg, const float *pu, const int64_t *tiles, const int64_t *off,
                            moe_dims M, int64_t cap) {
  const int64_t r = M.r;
  DM_GRID_LOOP(i, cap * 2 * r) {
    int64_t bi = i / (2 * r), j = i - bi * 2 * r, x, row0, nrows;
    float s = 0;
    if (tile_at(tiles, off, M.e, TC_TM, M.rows, bi, &x, &row0, &nrows)) {
      const float *p = j < r ? pg + j : pu + (j - r);
      for (int64_t m = 0; m < nrows; m++) s += p[(row0 + m) * r];
    }
    ts[i] = s;
  }
}

__global__ void expert_tsum_k(void *dcg, void *dcu, int odt, const float *ts, const int64_t *tiles, int64_t e,
                              int64_t r, int64_t cap) {
  DM_GRID_LOOP(i, e * r) {
    int64_t x = i / r, j = i - x * r, t1 = tiles[x + 1] < cap ? tiles[x + 1] : cap;
    float sg = 0, su = 0;
    for (int64_t t = tiles[x]; t < t1; t++) {
      sg += ts[t * 2 * r + j];
      su += ts[t * 2 * r + r + j];
    }
    if (dcg) dm_st(odt, dcg, i, (double)sg);
    if (dcu) dm_st(odt, dcu, i, (double)su);
  }
}

/* the kernel's shared memory, raised past 48 KB when needed */
static void tc_launch(const void *kernel, dim3 grid, size_t smem, void **args) {
  if (grid.x == 0 || grid.y == 0) return;
  if (smem > 48 * 1024) DM_CU(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
  DM_CU(cudaLaunchKernel(kernel, grid, dim3(TC_THREADS), args, smem, dm_cuda_stream()));
  DM_CU_LAUNCHED();
}

bool dm_moe_tc_fits(dm_dtype t, const moe_dims &M, const void *const *ptrs, int n) {
  if (!dm_moe_tc_path(t, M.e, M.rows, M.d, M.f, M.r)) return false;
  for (int i = 0; i < n; i++) if (ptrs[i] && !dm_aligned(ptrs[i], 16)) return false;
  return true;
}

static unsigned tc_tile_blocks(const moe_dims &M) { return (unsigned)((M.rows + TC_TM - 1) / TC_TM + M.e); }

/* the fp8 banks' pointers (zeros when the bank is 16-bit) */
static moe_q8 q8_of(const dm_moe_bank *b) {
  moe_q8 Q = {};
  if (!b->qg.codes) return Q;
  Q.qg = (const uint8_t *)dm_data(b->qg.codes), Q.qu = (const uint8_t *)dm_data(b->qu.codes);
  Q.qd = (const uint8_t *)dm_data(b->qd.codes);
  Q.sg = (const float *)dm_data(b->qg.scales), Q.su = (const float *)dm_data(b->qu.scales);
  Q.sd = (const float *)dm_data(b->qd.scales);
  Q.fq = dm_bank_fp8_cols(b->d->shape[2]);
  return Q;
}

template <int DT, int R, bool Q8>
static void tc_forward(dm_tensor *y_rows, dm_tensor *z_rows, const dm_tensor *u, const dm_tensor *perm,
                       const dm_tensor *offsets, const dm_moe_bank *bank, moe_dims M) {
  typedef tc_cfg<R> T;
  moe_q8 Q = q8_of(bank);
  const int64_t *off = (const int64_t *)dm_data(offsets);
  size_t hb = (size_t)dm_moe_tc_fwd_rows(M.rows, R), tb;
  u16 *hs = (u16 *)dm_scratch(hb);
  int64_t *tiles = make_tiles(off, M.e, TC_TM, M.rows, &tb);
  const void *pu = dm_data(u), *pp = dm_data(perm), *pug = dm_data(bank->ug), *puu = dm_data(bank->uu),
             *pcg = dm_data(bank->cg), *pcu = dm_data(bank->cu), *pd = dm_data(bank->d), *none = NULL;
  void *py = dm_data(y_rows), *ph = hs, *pz = z_rows ? dm_data(z_rows) : NULL;
  void *rargs[] = {&pu, &pp, &off, &tiles, &pug, &puu, &pcg, &pcu, &pd, &none, &ph, &none, &none, &none, &pz, &M, &Q};
  tc_launch((const void *)tc_rows_k<DT, R, false, false, Q8>, dim3(tc_tile_blocks(M)),
            Q8 ? T::rows_smem_q(false) : T::rows_smem(false), rargs);
  void *um;
  size_t ub;
  tc_units U = tc_plan(off, M, (M.f + TC_FS - 1) / TC_FS, 0, &um, &ub);
  void *dargs[] = {&py, &ph, &off, &pd, &M, &U, &Q};
  tc_launch((const void *)tc_down_k<DT, R, Q8>, dim3(tc_stream_grid(U, T::DOWN_MINB)),
            Q8 ? T::down_smem_q() : T::down_smem(), dargs);
  dm_scratch_free(um, ub);
  dm_scratch_free(tiles, tb);
  dm_scratch_free(hs, hb);
}

template <int DT, int R, bool Q8>
static void tc_backward(dm_tensor *gx_rows, const dm_moe_grads *g, const dm_tensor *gy_rows, const dm_tensor *z_rows,
                        const dm_tensor *u, const dm_tensor *perm, const dm_tensor *offsets, const dm_moe_bank *bank,
                        moe_dims M) {
  typedef tc_cfg<R> T;
  moe_q8 Q = q8_of(bank);
  const int64_t *off = (const int64_t *)dm_data(offsets);
  size_t nr = (size_t)(M.rows * R), sb = (size_t)dm_moe_tc_bwd_rows(M.rows, R), tb;   /* u16 3 nr, f32 2 nr */
  unsigned char *scratch = (unsigned char *)dm_scratch(sb);
  u16 *hs = (u16 *)scratch, *dagu = hs + nr;
  float *pg = (float *)(dagu + 2 * nr), *pu = pg + nr;
  int64_t *tiles = make_tiles(off, M.e, TC_TM, M.rows, &tb);
  const void *pgy = dm_data(gy_rows), *pux = dm_data(u), *pp = dm_data(perm), *pug = dm_data(bank->ug),
             *puu = dm_data(bank->uu), *pcg = dm_data(bank->cg), *pcu = dm_data(bank->cu), *pd = dm_data(bank->d);
  void *ph = hs, *pa = dagu, *ppg = pg, *ppu = pu, *pz = z_rows ? dm_data(z_rows) : NULL;
  void *rargs[] = {&pux, &pp, &off, &tiles, &pug, &puu, &pcg, &pcu, &pd, &pgy, &ph, &pa, &ppg, &ppu, &pz, &M, &Q};
  tc_launch(pz ? (const void *)tc_rows_k<DT, R, true, true, Q8> : (const void *)tc_rows_k<DT, R, true, false, Q8>,
            dim3(tc_tile_blocks(M)), Q8 ? T::rows_smem_q(true) : T::rows_smem(true), rargs);
  void *um;
  size_t ub;
  if (g->d) {
    void *pdd = dm_data(g->d);
    tc_units U = tc_plan(off, M, (M.f + TC_FS - 1) / TC_FS, R * M.f, &um, &ub);
    void *args[] = {&pdd, &ph, &pgy, &off, &M, &U};
    tc_launch((const void *)tc_dd_k<DT, R>, dim3(tc_stream_grid(U, T::DD_MINB)), T::dd_smem(), args);
    tc_join(DT, (u16 *)pdd, NULL, 0, U);
    dm_scratch_free(um, ub);
  }
  if (g->ug || g->uu) {
    void *pdg = g->ug ? dm_data(g->ug) : NULL, *pdu = g->uu ? dm_data(g->uu) : NULL;
    tc_units U = tc_plan(off, M, (M.d + TC_DS - 1) / TC_DS, M.d * 2 * R, &um, &ub);
    void *args[] = {&pdg, &pdu, &pux, &pp, &pa, &off, &M, &U};
    tc_launch((const void *)tc_du_k<DT, R>, dim3(tc_stream_grid(U, T::DU_MINB)), T::du_smem(), args);
    tc_join(DT, (u16 *)pdg, (u16 *)pdu, R, U);
    dm_scratch_free(um, ub);
  }
  if ((g->cg || g->cu) && M.e * M.r > 0) {
    const int64_t cap = (M.rows + TC_TM - 1) / TC_TM + M.e;
    size_t tsb = (size_t)dm_moe_tc_tile_sums(M.e, M.rows, R);      /* cap x 2R floats */
    float *ts = (float *)dm_scratch(tsb);
    DM_LAUNCH(tile_csum_k, cap * 2 * R, ts, (const float *)pg, (const float *)pu, tiles, off, M, cap);
    DM_LAUNCH(expert_tsum_k, M.e * R, g->cg ? dm_data(g->cg) : NULL, g->cu ? dm_data(g->cu) : NULL, DT, ts, tiles,
              M.e, (int64_t)R, cap);
    dm_scratch_free(ts, tsb);
  }
  if (gx_rows && M.rows > 0) {
    void *pgx = dm_data(gx_rows);
    void *args[] = {&pgx, &pa, &off, &tiles, &pug, &puu, &M, &Q};
    tc_launch((const void *)tc_gx_k<DT, R, Q8>, dim3(tc_tile_blocks(M)), Q8 ? T::gx_smem_q() : T::gx_smem(), args);
  }
  dm_scratch_free(tiles, tb);
  dm_scratch_free(scratch, sb);
}

/* f(std::integral_constant<int, R>) for the kernels' ranks */
template <typename Fn> static void tc_by_rank(int64_t r, Fn f) {
  switch (r) {
  case 16: f(std::integral_constant<int, 16>()); break;
  case 32: f(std::integral_constant<int, 32>()); break;
  case 64: f(std::integral_constant<int, 64>()); break;
  default: f(std::integral_constant<int, 128>()); break;
  }
}

void dm_moe_tc_forward(dm_tensor *y_rows, dm_tensor *z_rows, const dm_tensor *u, const dm_tensor *perm,
                       const dm_tensor *offsets, const dm_moe_bank *bank, const moe_dims &M) {
  const bool q8 = bank->qg.codes != NULL;
  tc_by_rank(M.r, [&](auto rr) {
    constexpr int R = decltype(rr)::value;
    if (u->dtype == DM_F16) return tc_forward<DM_F16, R, false>(y_rows, z_rows, u, perm, offsets, bank, M);
    if (q8) return tc_forward<DM_BF16, R, true>(y_rows, z_rows, u, perm, offsets, bank, M);
    tc_forward<DM_BF16, R, false>(y_rows, z_rows, u, perm, offsets, bank, M);
  });
}

void dm_moe_tc_backward(dm_tensor *gx_rows, const dm_moe_grads *g, const dm_tensor *gy_rows, const dm_tensor *z_rows,
                        const dm_tensor *u, const dm_tensor *perm, const dm_tensor *offsets, const dm_moe_bank *bank,
                        const moe_dims &M) {
  const bool q8 = bank->qg.codes != NULL;
  tc_by_rank(M.r, [&](auto rr) {
    constexpr int R = decltype(rr)::value;
    if (u->dtype == DM_F16) return tc_backward<DM_F16, R, false>(gx_rows, g, gy_rows, z_rows, u, perm, offsets, bank, M);
    if (q8) return tc_backward<DM_BF16, R, true>(gx_rows, g, gy_rows, z_rows, u, perm, offsets, bank, M);
    tc_backward<DM_BF16, R, false>(gx_rows, g, gy_rows, z_rows, u, perm, offsets, bank, M);
  });
}
