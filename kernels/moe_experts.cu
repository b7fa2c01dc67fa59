/*
** moe_experts.cu — the routed experts' products on CUDA (moe.cuh): moe_experts and its backward.
** The entry points pick the path: a few rows among many experts (decoding, dm_moe_few_experts) take
** two kernels of a row a block; bf16 and f16 at the tensor cores' shapes take moe_tc.cu; the rest the
** FMA tiles here, any float dtype, computing in float (double for f64). A tile is TM sorted rows of one
** expert: a small kernel lays the tiles out from the offsets, and a grid of ceil(N k / TM) + E blocks
** (an upper bound) lets each block find its tile and stop when there is none. A tile computes
** h = silu((x Ug) cg) (x Uu) cu through shared memory, then h D. The backward's weight gradients are
** sums over an expert's rows: one block per (expert, column slice) sums them in row order.
*/
#include "moe.cuh"

#define PAIRS 4                           /* (row, rank) pairs a thread: TM * r <= 1024 */
#define MOE_THREADS 256

/* ag, au [TM, r] (shared) = x Ug[x], x Uu[x] for the tile's rows (the tokens' u rows) */
template <int DT, int TM>
__device__ void project(C_<DT> *ag, C_<DT> *au, C_<DT> *xs, C_<DT> *ws, const S_<DT> *u, const int64_t *perm,
                        const S_<DT> *ug, const S_<DT> *uu, const moe_dims &M, int64_t x, int64_t row0, int64_t nrows) {
  typedef C_<DT> C;
  const int64_t r = M.r, d = M.d, DC = M.chunk;
  C accg[PAIRS], accu[PAIRS];
#pragma unroll
  for (int q = 0; q < PAIRS; q++) { accg[q] = 0; accu[q] = 0; }
  for (int64_t c0 = 0; c0 < d; c0 += DC) {
    __syncthreads();
    for (int64_t i = threadIdx.x; i < TM * DC; i += blockDim.x) {
      int64_t m = i / DC, c = c0 + i % DC, a = m < nrows ? perm[row0 + m] : 0;
      bool ok = a >= 0 && a < M.rows;
      if (!ok && i % DC == 0 && c0 == 0) dm_report(M.err, M.what, a, M.rows, 0);
      xs[i] = ok && m < nrows && c < d ? dt<DT>::load(u[(a / M.k) * d + c]) : (C)0;
    }
    for (int64_t i = threadIdx.x; i < DC * r; i += blockDim.x) {
      int64_t c = c0 + i / r, j = i % r;
      ws[i] = c < d ? dt<DT>::load(ug[(x * d + c) * r + j]) : (C)0;
      ws[DC * r + i] = c < d ? dt<DT>::load(uu[(x * d + c) * r + j]) : (C)0;
    }
    __syncthreads();
#pragma unroll
    for (int q = 0; q < PAIRS; q++) {
      int64_t pr = threadIdx.x + (int64_t)q * blockDim.x, m = pr / r, j = pr % r;
      if (m >= TM) continue;
      for (int64_t c = 0; c < DC; c++) {
        C xv = xs[m * DC + c];
        accg[q] += xv * ws[c * r + j];
        accu[q] += xv * ws[DC * r + c * r + j];
      }
    }
  }
#pragma unroll
  for (int q = 0; q < PAIRS; q++) {
    int64_t pr = threadIdx.x + (int64_t)q * blockDim.x;
    if (pr < TM * r) { ag[pr] = accg[q]; au[pr] = accu[q]; }
  }
  __syncthreads();
}

/* shared memory of a tile: xs [TM, DC], ws [2, DC, r], ag, au, h [TM, r] */
static size_t tile_smem(int tm, const moe_dims &M, size_t es) {
  return es * (size_t)(tm * M.chunk + 2 * M.chunk * M.r + 3 * tm * M.r);
}

template <int DT, int TM>
__global__ void __launch_bounds__(MOE_THREADS) experts_k(S_<DT> *y, const S_<DT> *u, const int64_t *perm,
                                                         const int64_t *off, const int64_t *tiles, const S_<DT> *ug,
                                                         const S_<DT> *uu, const S_<DT> *cg, const S_<DT> *cu,
                                                         const S_<DT> *dw, C_<DT> *zs, moe_dims M) {
  typedef C_<DT> C;
  extern __shared__ __align__(16) unsigned char moe_smem[];
  int64_t x, row0, nrows;
  if (!tile_of(tiles, off, M.e, TM, M.rows, &x, &row0, &nrows)) return;
  const int64_t r = M.r, F = M.f;
  C *xs = (C *)moe_smem, *ws = xs + TM * M.chunk, *ag = ws + 2 * M.chunk * r, *au = ag + TM * r, *h = au + TM * r;
  project<DT, TM>(ag, au, xs, ws, u, perm, ug, uu, M, x, row0, nrows);
  if (zs)
    for (int64_t i = threadIdx.x; i < nrows * r; i += blockDim.x) {
      int64_t m = i / r, j = i % r;
      zs[(row0 + m) * 2 * r + j] = ag[i];
      zs[(row0 + m) * 2 * r + r + j] = au[i];
    }
  for (int64_t i = threadIdx.x; i < TM * r; i += blockDim.x) {
    int64_t j = i % r;
    C zg = ag[i] * dt<DT>::load(cg[x * r + j]), zu = au[i] * dt<DT>::load(cu[x * r + j]);
    h[i] = zg * sigm(zg) * zu;
  }
  __syncthreads();
  for (int64_t f = threadIdx.x; f < F; f += blockDim.x) {
    C acc[TM];
#pragma unroll
    for (int m = 0; m < TM; m++) acc[m] = 0;
    for (int64_t j = 0; j < r; j++) {
      C dv = dt<DT>::load(dw[(x * r + j) * F + f]);
#pragma unroll
      for (int m = 0; m < TM; m++) acc[m] += h[m * r + j] * dv;
    }
#pragma unroll
    for (int m = 0; m < TM; m++)
      if (m < nrows) y[(row0 + m) * F + f] = dt<DT>::store(acc[m]);
  }
}

/* TM for rank r (TM * r <= PAIRS * MOE_THREADS), and the summed dims' chunk */
static int tile_rows(const char *what, moe_dims *M) {
  if (M->r > PAIRS * MOE_THREADS)
    dm_error("%s: rank r = %lld is over the CUDA kernel's %d", what, (long long)M->r, PAIRS * MOE_THREADS);
  int tm = dm_moe_fma_tile_rows(M->r);
  int64_t dc = 2048 / M->r;
  M->chunk = dc < 1 ? 1 : dc > 32 ? 32 : dc;
  return tm;
}

/* a tile kernel's launch: the grid bound, its shared memory (raised past 48 KB when needed) */
static void tile_launch(const void *kernel, const moe_dims &M, int tm, size_t smem, void **args) {
  int64_t blocks = (M.rows + tm - 1) / tm + M.e;
  if (blocks == 0) return;
  if (smem > 48 * 1024) DM_CU(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
  DM_CU(cudaLaunchKernel(kernel, dim3((unsigned)blocks), dim3(MOE_THREADS), args, smem, dm_cuda_stream()));
  DM_CU_LAUNCHED();
}

#define BY_TM(tm, F, ...) ((tm) == 16 ? (const void *)F<__VA_ARGS__, 16> : (tm) == 4 ? (const void *)F<__VA_ARGS__, 4> \
                                                                       : (const void *)F<__VA_ARGS__, 1>)

template <int DT>
static void experts_forward(dm_tensor *y_rows, dm_tensor *z_rows, const dm_tensor *u, const dm_tensor *perm,
                            const dm_tensor *offsets, const dm_moe_bank *bank, moe_dims M, int tm) {
  size_t tb;
  int64_t *tiles = make_tiles((const int64_t *)dm_data(offsets), M.e, tm, M.rows, &tb);
  void *py = dm_data(y_rows), *pz = z_rows ? dm_data(z_rows) : NULL;
  const void *pu = dm_data(u), *pp = dm_data(perm), *po = dm_data(offsets), *pug = dm_data(bank->ug),
             *puu = dm_data(bank->uu), *pcg = dm_data(bank->cg), *pcu = dm_data(bank->cu), *pd = dm_data(bank->d);
  void *args[] = {&py, &pu, &pp, &po, &tiles, &pug, &puu, &pcg, &pcu, &pd, &pz, &M};
  tile_launch(BY_TM(tm, experts_k, DT), M, tm, tile_smem(tm, M, sizeof(C_<DT>)), args);
  dm_scratch_free(tiles, tb);
}

static moe_dims dims_of(const dm_tensor *u, const dm_tensor *perm, const dm_tensor *offsets, const dm_moe_bank *bank,
                        int64_t k) {
  moe_dims M;
  M.e = offsets->shape[0] - 1;
  M.d = u->shape[1];
  M.r = bank->ug->shape[2];
  M.f = bank->d->shape[2];
  M.k = k;
  M.rows = dm_numel(perm);
  M.chunk = 1;
  M.err = dm_cuda_device_error();
  M.what = name_id("moe_experts");
  return M;
}

/* ---- the experts' backward ----------------------------------------------------------------------------- */

/* per sorted row p and rank j (scratch, compute type): h, dag = dzg cg, dau = dzu cu, pg = dzg ag, pu = dzu au */
template <typename C> struct moe_rows {
  C *h, *dag, *dau, *pg, *pu;
};

/* recompute the tile's projections; dh = G D^T; through the activation into the row scratch */
template <int DT, int TM>
__global__ void __launch_bounds__(MOE_THREADS) experts_rows_k(moe_rows<C_<DT>> R, const S_<DT> *gy,
                                                              const S_<DT> *u, const int64_t *perm,
                                                              const int64_t *off, const int64_t *tiles,
                                                              const S_<DT> *ug, const S_<DT> *uu, const S_<DT> *cg,
                                                              const S_<DT> *cu, const S_<DT> *dw, moe_dims M) {
  typedef C_<DT> C;
  extern __shared__ __align__(16) unsigned char moe_smem[];
  int64_t x, row0, nrows;
  if (!tile_of(tiles, off, M.e, TM, M.rows, &x, &row0, &nrows)) return;
  const int64_t r = M.r, F = M.f, FC = M.chunk;
  C *xs = (C *)moe_smem, *ws = xs + TM * M.chunk, *ag = ws + 2 * M.chunk * r, *au = ag + TM * r;
  project<DT, TM>(ag, au, xs, ws, u, perm, ug, uu, M, x, row0, nrows);
  /* dh through chunks of F: gs [TM, FC] in xs, ds [r, FC] in ws */
  C acc[PAIRS];
#pragma unroll
  for (int q = 0; q < PAIRS; q++) acc[q] = 0;
  for (int64_t f0 = 0; f0 < F; f0 += FC) {
    __syncthreads();
    for (int64_t i = threadIdx.x; i < TM * FC; i += blockDim.x) {
      int64_t m = i / FC, f = f0 + i % FC;
      xs[i] = m < nrows && f < F ? dt<DT>::load(gy[(row0 + m) * F + f]) : (C)0;
    }
    for (int64_t i = threadIdx.x; i < r * FC; i += blockDim.x) {
      int64_t j = i / FC, f = f0 + i % FC;
      ws[i] = f < F ? dt<DT>::load(dw[(x * r + j) * F + f]) : (C)0;
    }
    __syncthreads();
#pragma unroll
    for (int q = 0; q < PAIRS; q++) {
      int64_t pr = threadIdx.x + (int64_t)q * blockDim.x, m = pr / r, j = pr % r;
      if (m >= TM) continue;
      for (int64_t c = 0; c < FC; c++) acc[q] += xs[m * FC + c] * ws[j * FC + c];
    }
  }
#pragma unroll
  for (int q = 0; q < PAIRS; q++) {
    int64_t pr = threadIdx.x + (int64_t)q * blockDim.x, m = pr / r, j = pr % r;
    if (m >= nrows || m >= TM) continue;
    C cgv = dt<DT>::load(cg[x * r + j]), cuv = dt<DT>::load(cu[x * r + j]);
    C a_g = ag[pr], a_u = au[pr], zg = a_g * cgv, zu = a_u * cuv, s = sigm(zg), dh = acc[q];
    C dzg = dh * zu * s * (1 + zg * (1 - s)), dzu = dh * zg * s;
    int64_t o = (row0 + m) * r + j;
    R.h[o] = zg * s * zu;
    R.dag[o] = dzg * cgv;
    R.dau[o] = dzu * cuv;
    R.pg[o] = dzg * a_g;
    R.pu[o] = dzu * a_u;
  }
}

/* out[x, j, c] = sum over expert x's rows p (in order) of A[p, j] B(p, c); A has rank columns;
** block (32 c lanes, 8 j lanes) over (expert, slice of 32 c); two products at once (A2 may be NULL) */
#define RJ 8
template <typename C, typename Bf>
__global__ void expert_sum_k(void *out1, void *out2, int odt, const C *A1, const C *A2, Bf Bv, const int64_t *off,
                             int64_t r, int64_t ncols, bool jc) {
  const int64_t x = blockIdx.x, c = (int64_t)blockIdx.y * 32 + threadIdx.x;
  const int64_t lo = off[x], hi = off[x + 1];
  for (int64_t j0 = 0; j0 < r; j0 += 8 * RJ) {
    C a1[RJ], a2[RJ];
#pragma unroll
    for (int q = 0; q < RJ; q++) { a1[q] = 0; a2[q] = 0; }
    if (c < ncols)
      for (int64_t p = lo; p < hi; p++) {
        C b = Bv(p, c);
#pragma unroll
        for (int q = 0; q < RJ; q++) {
          int64_t j = j0 + threadIdx.y + 8 * q;
          if (j < r) {
            a1[q] += A1[p * r + j] * b;
            if (A2) a2[q] += A2[p * r + j] * b;
          }
        }
      }
    if (c >= ncols) continue;
#pragma unroll
    for (int q = 0; q < RJ; q++) {
      int64_t j = j0 + threadIdx.y + 8 * q;
      if (j >= r) continue;
      int64_t o = jc ? (x * r + j) * ncols + c : (x * ncols + c) * r + j;     /* [E, r, F] or [E, d, r] */
      if (out1) dm_st(odt, out1, o, (double)a1[q]);
      if (out2) dm_st(odt, out2, o, (double)a2[q]);
    }
  }
}

/* the incoming gradient's rows (for dD) and the rows' inputs (for dUg, dUu) */
template <int DT> struct gy_at {
  const S_<DT> *gy;
  int64_t F;
  __device__ C_<DT> operator()(int64_t p, int64_t f) const { return dt<DT>::load(gy[p * F + f]); }
};
template <int DT> struct x_at {
  const S_<DT> *u;
  const int64_t *perm;
  int64_t d, k;
  __device__ C_<DT> operator()(int64_t p, int64_t c) const { return dt<DT>::load(u[(perm[p] / k) * d + c]); }
};

/* dcg[x, j] = sum of pg over the expert's rows, dcu from pu */
template <typename C>
__global__ void expert_csum_k(void *dcg, void *dcu, int odt, const C *pg, const C *pu, const int64_t *off, int64_t e,
                              int64_t r) {
  DM_GRID_LOOP(i, e * r) {
    int64_t x = i / r, j = i - x * r;
    C sg = 0, su = 0;
    for (int64_t p = off[x]; p < off[x + 1]; p++) {
      sg += pg[p * r + j];
      su += pu[p * r + j];
    }
    if (dcg) dm_st(odt, dcg, i, (double)sg);
    if (dcu) dm_st(odt, dcu, i, (double)su);
  }
}

/* gx[p, c] = dag[p] . Ug[x, c] + dau[p] . Uu[x, c], x the expert owning p */
template <int DT>
__global__ void experts_gx_k(S_<DT> *gx, const C_<DT> *dag, const C_<DT> *dau, const S_<DT> *ug, const S_<DT> *uu,
                             const int64_t *off, moe_dims M) {
  typedef C_<DT> C;
  const int64_t d = M.d, r = M.r;
  DM_GRID_LOOP(i, M.rows * d) {
    int64_t p = i / d, c = i - p * d, lo = 0, hi = M.e - 1;
    while (lo < hi) {                                      /* the last expert with off[x] <= p */
      int64_t mid = (lo + hi + 1) / 2;
      if (off[mid] <= p) lo = mid; else hi = mid - 1;
    }
    const S_<DT> *g1 = ug + (lo * d + c) * r, *g2 = uu + (lo * d + c) * r;
    C s1 = 0, s2 = 0;
    for (int64_t j = 0; j < r; j++) {
      s1 += dag[p * r + j] * dt<DT>::load(g1[j]);
      s2 += dau[p * r + j] * dt<DT>::load(g2[j]);
    }
    gx[i] = dt<DT>::store(s1 + s2);
  }
}

template <int DT>
static void experts_backward(dm_tensor *gx_rows, const dm_moe_grads *g, const dm_tensor *gy_rows, const dm_tensor *u,
                             const dm_tensor *perm, const dm_tensor *offsets, const dm_moe_bank *bank, moe_dims M,
                             int tm) {
  typedef C_<DT> C;
  const int64_t *off = (const int64_t *)dm_data(offsets), *pp = (const int64_t *)dm_data(perm);
  size_t rb = (size_t)dm_moe_fma_bwd_rows((int64_t)sizeof(C), M.rows, M.r);
  C *scratch = (C *)dm_scratch(rb);
  moe_rows<C> R = {scratch, scratch + M.rows * M.r, scratch + 2 * M.rows * M.r, scratch + 3 * M.rows * M.r,
                   scratch + 4 * M.rows * M.r};
  size_t tb;
  int64_t *tiles = make_tiles(off, M.e, tm, M.rows, &tb);
  if (M.rows > 0) {
    const void *pgy = dm_data(gy_rows), *pu = dm_data(u), *pug = dm_data(bank->ug), *puu = dm_data(bank->uu),
               *pcg = dm_data(bank->cg), *pcu = dm_data(bank->cu), *pd = dm_data(bank->d);
    void *args[] = {&R, &pgy, &pu, &pp, &off, &tiles, &pug, &puu, &pcg, &pcu, &pd, &M};
    tile_launch(BY_TM(tm, experts_rows_k, DT), M, tm, tile_smem(tm, M, sizeof(C)), args);
  }
  cudaStream_t st = dm_cuda_stream();
  int odt = DT;
  if (g->d && M.e > 0 && M.f > 0) {
    gy_at<DT> b = {(const S_<DT> *)dm_data(gy_rows), M.f};
    expert_sum_k<C, gy_at<DT>><<<dim3((unsigned)M.e, (unsigned)((M.f + 31) / 32)), dim3(32, 8), 0, st>>>(
        dm_data(g->d), NULL, odt, R.h, (const C *)NULL, b, off, M.r, M.f, true);
    DM_CU_LAUNCHED();
  }
  if ((g->ug || g->uu) && M.e > 0 && M.d > 0) {
    x_at<DT> b = {(const S_<DT> *)dm_data(u), pp, M.d, M.k};
    expert_sum_k<C, x_at<DT>><<<dim3((unsigned)M.e, (unsigned)((M.d + 31) / 32)), dim3(32, 8), 0, st>>>(
        g->ug ? dm_data(g->ug) : NULL, g->uu ? dm_data(g->uu) : NULL, odt, R.dag, R.dau, b, off, M.r, M.d, false);
    DM_CU_LAUNCHED();
  }
  if ((g->cg || g->cu) && M.e * M.r > 0)
    DM_LAUNCH(expert_csum_k<C>, M.e * M.r, g->cg ? dm_data(g->cg) : NULL, g->cu ? dm_data(g->cu) : NULL, odt, R.pg,
              R.pu, off, M.e, M.r);
  if (gx_rows && M.rows * M.d > 0)
    DM_LAUNCH(experts_gx_k<DT>, M.rows * M.d, (S_<DT> *)dm_data(gx_rows), R.dag, R.dau,
              (const S_<DT> *)dm_data(bank->ug), (const S_<DT> *)dm_data(bank->uu), off, M);
  dm_scratch_free(tiles, tb);
  dm_scratch_free(scratch, rb);
}

/* ---- a few rows against many experts: decoding (moe.h dm_moe_few_experts) ---------------------------- */

/* Two kernels, no tiles and no units to plan. few_project_k: a block per (row, slice of d) sums the row's slice of
** x Ug[e] and x Uu[e] (2r columns; the block's threads split the slice into groups, joined in group order)
** into part [rows, slices, 2r]. few_down_k: a block per (row, chunk of F) joins the slices in order, takes
** the scales and the activation (h in the compute type), and writes its chunk of h D[e]. Each block finds
** its row's expert by one look at every offset (off[x] <= p < off[x + 1]), not a chain of dependent loads. */
#define FEW_THREADS DM_MOE_FEW_THREADS

__device__ int64_t few_owner(const int64_t *off, int64_t e, int64_t p) {
  __shared__ int64_t owner;
  if (threadIdx.x == 0) owner = 0;
  __syncthreads();
  for (int64_t x = threadIdx.x; x < e; x += blockDim.x)
    if (off[x] <= p && p < off[x + 1]) owner = x;
  __syncthreads();
  return owner;
}

template <int DT>
__global__ void __launch_bounds__(FEW_THREADS) few_project_k(C_<DT> *part, const S_<DT> *u, const int64_t *perm,
                                                             const int64_t *off, const S_<DT> *ug, const S_<DT> *uu,
                                                             moe_dims M, int64_t slices) {
  typedef C_<DT> C;
  __shared__ C red[FEW_THREADS];
  const int64_t p = blockIdx.x, s = blockIdx.y, r = M.r, d = M.d, ncol = 2 * r, groups = FEW_THREADS / ncol;
  const int64_t x = few_owner(off, M.e, p), a = perm[p];
  const bool ok = a >= 0 && a < M.rows;
  if (!ok && threadIdx.x == 0 && s == 0) dm_report(M.err, M.what, a, M.rows, 0);
  const int64_t len = (d + slices - 1) / slices, c0 = s * len, c1 = c0 + len < d ? c0 + len : d;
  const int64_t col = threadIdx.x % ncol, g = threadIdx.x / ncol;
  C acc = 0;
  if (ok && g < groups) {
    const S_<DT> *w = (col < r ? ug : uu) + x * d * r + col % r, *row = u + (a / M.k) * d;
#pragma unroll 4
    for (int64_t c = c0 + g; c < c1; c += groups) acc += dt<DT>::load(row[c]) * dt<DT>::load(w[c * r]);
  }
  red[threadIdx.x] = acc;
  __syncthreads();
  if (g == 0) {
    C sum = 0;
    for (int64_t q = 0; q < groups; q++) sum += red[q * ncol + col];
    part[(p * slices + s) * ncol + col] = sum;
  }
}

template <int DT>
__global__ void __launch_bounds__(FEW_THREADS) few_down_k(S_<DT> *y, C_<DT> *zs, const C_<DT> *part,
                                                          const int64_t *off, const S_<DT> *cg, const S_<DT> *cu,
                                                          const S_<DT> *dw, moe_dims M, int64_t slices) {
  typedef C_<DT> C;
  __shared__ C h[DM_MOE_FEW_RANK];
  const int64_t p = blockIdx.x, r = M.r, F = M.f, ncol = 2 * r;
  const int64_t x = few_owner(off, M.e, p);
  for (int64_t j = threadIdx.x; j < r; j += blockDim.x) {
    C zg = 0, zu = 0;
    for (int64_t s = 0; s < slices; s++) {
      zg += part[(p * slices + s) * ncol + j];
      zu += part[(p * slices + s) * ncol + r + j];
    }
    if (zs && blockIdx.y == 0) { zs[p * ncol + j] = zg; zs[p * ncol + r + j] = zu; }
    zg *= dt<DT>::load(cg[x * r + j]);
    zu *= dt<DT>::load(cu[x * r + j]);
    h[j] = zg * sigm(zg) * zu;
  }
  __syncthreads();
  const int64_t f = (int64_t)blockIdx.y * blockDim.x + threadIdx.x;
  if (f >= F) return;
  const S_<DT> *col = dw + x * r * F + f;
  C acc = 0;
#pragma unroll 8
  for (int64_t j = 0; j < r; j++) acc += h[j] * dt<DT>::load(col[j * F]);
  y[p * F + f] = dt<DT>::store(acc);
}

template <int DT>
static void few_forward(dm_tensor *y_rows, dm_tensor *z_rows, const dm_tensor *u, const dm_tensor *perm,
                        const dm_tensor *offsets, const dm_moe_bank *bank, const moe_dims &M) {
  typedef C_<DT> C;
  const int64_t slices = dm_moe_few_slices(M.rows, M.d);
  const size_t pb = (size_t)dm_moe_few_scratch((int64_t)sizeof(C), M.rows, M.d, M.r);
  C *part = (C *)dm_scratch(pb);
  const int64_t *off = (const int64_t *)dm_data(offsets);
  cudaStream_t st = dm_cuda_stream();
  few_project_k<DT><<<dim3((unsigned)M.rows, (unsigned)slices), FEW_THREADS, 0, st>>>(
      part, (const S_<DT> *)dm_data(u), (const int64_t *)dm_data(perm), off, (const S_<DT> *)dm_data(bank->ug),
      (const S_<DT> *)dm_data(bank->uu), M, slices);
  DM_CU_LAUNCHED();
  few_down_k<DT><<<dim3((unsigned)M.rows, (unsigned)((M.f + FEW_THREADS - 1) / FEW_THREADS)), FEW_THREADS, 0, st>>>(
      (S_<DT> *)dm_data(y_rows), z_rows ? (C *)dm_data(z_rows) : NULL, part, off, (const S_<DT> *)dm_data(bank->cg),
      (const S_<DT> *)dm_data(bank->cu), (const S_<DT> *)dm_data(bank->d), M, slices);
  DM_CU_LAUNCHED();
  dm_scratch_free(part, pb);
}

/* ---- the experts' entry points ---------------------------------------------------------------------------- */

/* fp8 banks reach the kernels only where the tensor-core kernels read them (the op decodes them
** elsewhere): what else keeps them off those kernels is an error, not a slower path */
static void q8_check(bool tc, dm_dtype t, const char *what) {
  if (tc && t == DM_BF16) return;
  dm_error("%s: fp8 banks need the tensor-core kernels, which %s", what,
           t != DM_BF16 ? "read them in bf16 only" : dm_moe_fma_forced() ? "DM_MOE_FMA turns off"
                                                   : "take 16-byte aligned tensors");
}

static void cuda_experts(dm_tensor *y_rows, dm_tensor *z_rows, const dm_tensor *u, const dm_tensor *perm,
                         const dm_tensor *offsets, const dm_moe_bank *bank, int64_t k) {
  moe_dims M = dims_of(u, perm, offsets, bank, k);
  int tm = tile_rows("moe_experts", &M);
  if (M.rows == 0 || M.f == 0) return;
  const bool q8 = bank->qg.codes != NULL;
  if (dm_moe_few_experts(M.e, M.rows, M.f, M.r, q8)) {
    dm_dispatch_float(u->dtype, "moe_experts",
                      [&](auto d) { few_forward<decltype(d)::value>(y_rows, z_rows, u, perm, offsets, bank, M); });
    return;
  }
  const void *ptrs[] = {dm_data(y_rows), dm_data(u), q8 ? NULL : dm_data(bank->ug), q8 ? NULL : dm_data(bank->uu),
                        q8 ? NULL : dm_data(bank->d)};
  bool tc = dm_moe_tc_fits(u->dtype, M, ptrs, 5) && (!z_rows || dm_aligned(dm_data(z_rows), 16));
  if (q8) q8_check(tc, u->dtype, "moe_experts");
  if (tc) return dm_moe_tc_forward(y_rows, z_rows, u, perm, offsets, bank, M);
  dm_dispatch_float(u->dtype, "moe_experts",
                    [&](auto d) { experts_forward<decltype(d)::value>(y_rows, z_rows, u, perm, offsets, bank, M, tm); });
}

static void cuda_experts_bwd(dm_tensor *gx_rows, const dm_moe_grads *g, const dm_tensor *gy_rows,
                             const dm_tensor *z_rows, const dm_tensor *u, const dm_tensor *perm,
                             const dm_tensor *offsets, const dm_moe_bank *bank, int64_t k) {
  moe_dims M = dims_of(u, perm, offsets, bank, k);
  int tm = tile_rows("moe_experts_bwd", &M);
  const bool q8 = bank->qg.codes != NULL;
  const void *ptrs[] = {gx_rows ? dm_data(gx_rows) : NULL, dm_data(gy_rows), dm_data(u),
                        q8 ? NULL : dm_data(bank->ug), q8 ? NULL : dm_data(bank->uu), q8 ? NULL : dm_data(bank->d),
                        g->ug ? dm_data(g->ug) : NULL, g->uu ? dm_data(g->uu) : NULL, g->d ? dm_data(g->d) : NULL};
  bool tc = dm_moe_tc_fits(u->dtype, M, ptrs, 9);
  if (q8) q8_check(tc, u->dtype, "moe_experts backward");
  /* the forward's projections when they are there in f32 and aligned (the FMA kernels recompute them) */
  const dm_tensor *zk = z_rows && z_rows->dtype == DM_F32 && dm_aligned(dm_data(z_rows), 16) ? z_rows : NULL;
  if (tc) return dm_moe_tc_backward(gx_rows, g, gy_rows, zk, u, perm, offsets, bank, M);
  dm_dispatch_float(u->dtype, "moe_experts_bwd", [&](auto d) {
    experts_backward<decltype(d)::value>(gx_rows, g, gy_rows, u, perm, offsets, bank, M, tm);
  });
}

static const dm_kernel_entry kernels[] = {
  DM_KERNEL_ENTRY(moe_experts, cuda_experts),
  DM_KERNEL_ENTRY(moe_experts_bwd, cuda_experts_bwd),
};
DM_CUDA_KERNELS(kernels)
