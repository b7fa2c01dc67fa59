/*
** gemm.c — matrix products on CUDA through cuBLASLt.
**
** out[..., m, n] = op(a)[..., m, k] @ op(b)[..., k, n] (vm/ops/matmul.c has
** checked the shapes and made out contiguous). cuBLASLt is column-major, so
** the row-major product is computed as its transpose, out^T = op(b)^T
** op(a)^T: b is cuBLASLt's first operand and a its second, and no matrix is
** ever copied to be transposed. A matrix goes to cuBLASLt where it lies when
** one of its last two dims is contiguous (a transposed view flips the
** transpose flag, as vm/cpu/matmul.c does for BLAS); anything else is first
** made contiguous.
**
** Batches: one strided-batched call when each operand's matrices lie at one
** stride through the batch dims (0 for an operand broadcast over them all);
** an operand broadcast in some batch dims only is first expanded into a
** contiguous copy. A b shared by the whole batch against a's rows at one
** stride (x @ w of a linear layer) is one product of [batch * m, k] rows.
**
** A few rows (at most 8) of 16-bit inputs against a weight, generation's
** products, go to kernels/rows_product.cu instead (with DM_ROWS_PRODUCT=1, until
** its device checks have run): reading the weight once at the copy rate.
**
** Types: bf16 and f16 in and out with fp32 accumulation (or out in f32: the
** sums kept), f32 (TF32 tensor cores when dm.cuda.tf32(true)), f64. The algorithm is chosen once per
** shape (dims, leading dims, batch strides, pointer alignment, dtype, TF32)
** and cached with its descriptors: for a product of at least a GFLOP, the
** fastest of cuBLASLt's first 8 heuristic candidates, timed on the first
** call's own operands (the host waits for that once); for smaller ones, or
** while a CUDA graph is being captured, the heuristic's first. The 32 MiB
** workspace is taken from the driver once.
*/
#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <cublasLt.h>
#include <cublas_v2.h>
#include "internal.h"
#include "core/core.h"
#include "core/alloc.h"
#include "ops/matmul.h"

#define MAX_PLANS 1024
#define CANDIDATES 8
#define TUNE_FLOP 1e9

static cublasLtHandle_t lt;
static void *workspace;

static void lt_check(cublasStatus_t s, const char *call, int line) {
  if (s != CUBLAS_STATUS_SUCCESS)
    dm_error("cuda: %s failed at kernels/gemm.c:%d: %s", call, line, cublasLtGetStatusString(s));
}
#define LT(call) lt_check((call), #call, __LINE__)

static void start(void) {
  if (lt) return;
  dm_cuda_init();
  LT(cublasLtCreate(&lt));
  DM_CU(cudaMalloc(&workspace, DM_GEMM_WORKSPACE));
}

/* ---- operands ------------------------------------------------------------------------ */

/* One operand as cuBLASLt reads it: a column-major matrix M of rows x cols
** with leading dimension ld, transposed by the product when trans is set,
** its batch's matrices `bstride` elements apart. */
typedef struct operand {
  const char *data;
  int64_t rows, cols, ld, bstride;
  bool trans;
} operand;

/* the stride between consecutive matrices of t over out's nb batch dims, or -1 when there is none */
static int64_t batch_stride(const dm_tensor *t, const dm_tensor *out, int nb) {
  int tb = t->ndim - 2;
  int64_t s = -1, span = 1;
  for (int d = nb - 1; d >= 0; d--) {
    if (out->shape[d] == 1) continue;
    int td = d - (nb - tb);
    int64_t st = td < 0 || t->shape[td] == 1 ? 0 : t->strides[td];
    if (s < 0) s = st;                            /* the innermost batch dim sets the stride */
    if (st != s * span) return -1;
    span *= out->shape[d];
  }
  return s < 0 ? 0 : s;
}

/* t broadcast to out's batch dims, as a contiguous copy */
static dm_tensor *expanded(dm_tensor *t, const dm_tensor *out, int nb) {
  int64_t shape[DM_MAXDIM], strides[DM_MAXDIM];
  int tb = t->ndim - 2;
  for (int d = 0; d < nb; d++) {
    int td = d - (nb - tb);
    shape[d] = out->shape[d];
    strides[d] = td < 0 || t->shape[td] == 1 ? 0 : t->strides[td];
  }
  for (int d = 0; d < 2; d++) {
    shape[nb + d] = t->shape[tb + d];
    strides[nb + d] = t->strides[tb + d];
  }
  dm_tensor *view = dm_tensor_view(t, nb + 2, shape, strides, t->offset);
  dm_tensor *c = dm_clone(view);
  dm_release(view);
  return c;
}

/* Describe t (op'd by tr) for a product with out. Returns t itself or a
** copy that suits cuBLASLt; the caller releases it. */
static dm_tensor *describe(dm_tensor *t, bool tr, const dm_tensor *out, operand *o) {
  int nb = out->ndim - 2;
  dm_retain(t);
  int64_t bs = batch_stride(t, out, nb);
  bool flip = false;
  int64_t ld = 1;
  int nd = t->ndim;
  if (bs < 0 || !dm_blas_layout_of(t, &flip, &ld)) {
    dm_tensor *c = bs < 0 ? expanded(t, out, nb) : dm_clone(t);
    dm_release(t);
    t = c;
    nd = t->ndim;
    bs = batch_stride(t, out, nb);
    dm_blas_layout_of(t, &flip, &ld);
  }
  int64_t r = t->shape[nd - 2], c = t->shape[nd - 1];
  o->data = dm_data(t);
  o->rows = flip ? r : c;                        /* the column-major matrix as it lies */
  o->cols = flip ? c : r;
  o->ld = ld;
  o->bstride = bs;
  o->trans = tr != flip;
  return t;
}

/* ---- plans: descriptors and algorithm, once per shape ----------------------------------- */

typedef struct plan_key {                        /* no padding: its bytes are hashed and compared */
  int dt, tf32, ta, tb;
  int64_t m, n, k, lda, ldb, ldc, batch, sa, sb, sc;
  int align_a, align_b, align_c, odt;            /* odt: the product's dtype, dt's or f32 */
} plan_key;

typedef struct plan {
  plan_key key;
  bool used;
  cublasLtMatmulDesc_t op;
  cublasLtMatrixLayout_t la, lb, lc;
  cublasLtMatmulAlgo_t algo;
} plan;

static plan plans[MAX_PLANS];

static cudaDataType_t cuda_type(dm_dtype dt) {
  switch (dt) {
  case DM_F64: return CUDA_R_64F;
  case DM_BF16: return CUDA_R_16BF;
  case DM_F16: return CUDA_R_16F;
  default: return CUDA_R_32F;
  }
}

/* the alignment (a power of two, at most 256) of every matrix of a batch */
static int alignment(const void *p, int64_t bstride, size_t es) {
  uintptr_t a = (uintptr_t)p | 256;
  if (bstride) a |= (uintptr_t)(bstride * (int64_t)es);
  return (int)(a & -a);
}

static void layout(cublasLtMatrixLayout_t *l, dm_dtype dt, int64_t rows, int64_t cols, int64_t ld, int64_t batch,
                   int64_t stride) {
  LT(cublasLtMatrixLayoutCreate(l, cuda_type(dt), (uint64_t)rows, (uint64_t)cols, ld));
  if (batch > 1) {
    int32_t count = (int32_t)batch;
    LT(cublasLtMatrixLayoutSetAttribute(*l, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &count, sizeof count));
    LT(cublasLtMatrixLayoutSetAttribute(*l, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &stride, sizeof stride));
  }
}

/* the buffers of the call that builds a plan: candidates are timed on them */
typedef struct operands { const void *x, *y; void *c; } operands;

static cublasStatus_t matmul_with(const plan *p, const cublasLtMatmulAlgo_t *algo, dm_dtype dt, const void *x,
                                  const void *y, void *c) {
  float one = 1, zero = 0;
  double oned = 1, zerod = 0;
  bool d64 = dt == DM_F64;
  return cublasLtMatmul(lt, p->op, d64 ? (const void *)&oned : (const void *)&one, x, p->la, y, p->lb,
                        d64 ? (const void *)&zerod : (const void *)&zero, c, p->lc, c, p->lc, algo, workspace,
                        DM_GEMM_WORKSPACE, dm_cuda_stream());
}

static bool capturing(void) {
  enum cudaStreamCaptureStatus st = cudaStreamCaptureStatusNone;
  return cudaStreamIsCapturing(dm_cuda_stream(), &st) == cudaSuccess && st != cudaStreamCaptureStatusNone;
}

/* the fastest candidate on the call's own operands: one warm-up run, then the best of three */
static int fastest(plan *p, const cublasLtMatmulHeuristicResult_t *res, int found, const operands *o) {
  dm_dtype dt = (dm_dtype)p->key.dt;
  int best = 0;
  double best_ms = INFINITY;
  for (int i = 0; i < found; i++) {
    if (matmul_with(p, &res[i].algo, dt, o->x, o->y, o->c) != CUBLAS_STATUS_SUCCESS) continue;
    double ms = INFINITY;
    for (int r = 0; r < 3; r++) {
      dm_cuda_timer_start();
      cublasStatus_t st = matmul_with(p, &res[i].algo, dt, o->x, o->y, o->c);
      double t = dm_cuda_timer_stop();
      if (st == CUBLAS_STATUS_SUCCESS && t < ms) ms = t;
    }
    if (ms < best_ms) { best_ms = ms; best = i; }
  }
  return best;
}

static void plan_build(plan *p, const plan_key *k, const operands *o) {
  dm_dtype dt = (dm_dtype)k->dt;
  cublasComputeType_t ct = dt == DM_F64 ? CUBLAS_COMPUTE_64F
                         : dt == DM_F32 && k->tf32 ? CUBLAS_COMPUTE_32F_FAST_TF32 : CUBLAS_COMPUTE_32F;
  LT(cublasLtMatmulDescCreate(&p->op, ct, dt == DM_F64 ? CUDA_R_64F : CUDA_R_32F));
  cublasOperation_t ta = k->ta ? CUBLAS_OP_T : CUBLAS_OP_N, tb = k->tb ? CUBLAS_OP_T : CUBLAS_OP_N;
  LT(cublasLtMatmulDescSetAttribute(p->op, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof ta));
  LT(cublasLtMatmulDescSetAttribute(p->op, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof tb));
  /* D[m, n] = op(A)[m, k] op(B)[k, n], column-major */
  layout(&p->la, dt, k->ta ? k->k : k->m, k->ta ? k->m : k->k, k->lda, k->batch, k->sa);
  layout(&p->lb, dt, k->tb ? k->n : k->k, k->tb ? k->k : k->n, k->ldb, k->batch, k->sb);
  layout(&p->lc, (dm_dtype)k->odt, k->m, k->n, k->ldc, k->batch, k->sc);
  cublasLtMatmulPreference_t pref;
  LT(cublasLtMatmulPreferenceCreate(&pref));
  uint64_t ws = DM_GEMM_WORKSPACE;
  uint32_t al[3] = {(uint32_t)k->align_a, (uint32_t)k->align_b, (uint32_t)k->align_c};
  LT(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof ws));
  LT(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &al[0], sizeof al[0]));
  LT(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &al[1], sizeof al[1]));
  LT(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &al[2], sizeof al[2]));
  LT(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &al[2], sizeof al[2]));
  cublasLtMatmulHeuristicResult_t res[CANDIDATES];
  int found = 0;
  cublasStatus_t s = cublasLtMatmulAlgoGetHeuristic(lt, p->op, p->la, p->lb, p->lc, p->lc, pref, CANDIDATES, res,
                                                    &found);
  cublasLtMatmulPreferenceDestroy(pref);
  if (s != CUBLAS_STATUS_SUCCESS || found == 0)
    dm_error("matmul: cuBLASLt has no algorithm for a %s product of [%lld, %lld] x [%lld, %lld] (batch %lld): %s",
             dm_dtype_name(dt), (long long)k->n, (long long)k->k, (long long)k->k, (long long)k->m,
             (long long)k->batch, s != CUBLAS_STATUS_SUCCESS ? cublasLtGetStatusString(s) : "none found");
  p->key = *k;
  p->used = true;
  double flop = 2.0 * (double)k->m * (double)k->n * (double)k->k * (double)k->batch;
  int pick = found > 1 && flop >= TUNE_FLOP && !capturing() ? fastest(p, res, found, o) : 0;
  p->algo = res[pick].algo;
}

static const plan *plan_for(const plan_key *k, const operands *o) {
  uint64_t h = 1469598103934665603ull;
  const unsigned char *b = (const unsigned char *)k;
  for (size_t i = 0; i < sizeof *k; i++) h = (h ^ b[i]) * 1099511628211ull;
  for (size_t i = 0; i < MAX_PLANS; i++) {
    plan *p = &plans[(h + i) % MAX_PLANS];
    if (p->used && memcmp(&p->key, k, sizeof *k) == 0) return p;
    if (!p->used) { plan_build(p, k, o); return p; }
  }
  /* the table is full: keep the last slot for whatever comes, rebuilt each time */
  plan *p = &plans[h % MAX_PLANS];
  cublasLtMatmulDescDestroy(p->op);
  cublasLtMatrixLayoutDestroy(p->la);
  cublasLtMatrixLayoutDestroy(p->lb);
  cublasLtMatrixLayoutDestroy(p->lc);
  plan_build(p, k, o);
  return p;
}

/* D = X Y with X = cuBLASLt's A (our b), Y its B (our a); C column-major [m, n] */
static const plan *plan_of(dm_dtype dt, dm_dtype odt, const operand *x, const operand *y, void *c, int64_t m,
                           int64_t n, int64_t k, int64_t batch) {
  size_t es = dm_dtype_size(dt);
  plan_key key;
  memset(&key, 0, sizeof key);                   /* padding takes part in the hash */
  key.dt = (int)dt;
  key.odt = (int)odt;
  key.tf32 = dt == DM_F32 && dm_cuda_tf32();
  key.ta = x->trans;
  key.tb = y->trans;
  key.m = m;
  key.n = n;
  key.k = k;
  key.lda = x->ld;
  key.ldb = y->ld;
  key.ldc = m;
  key.batch = batch;
  key.sa = batch > 1 ? x->bstride : 0;
  key.sb = batch > 1 ? y->bstride : 0;
  key.sc = batch > 1 ? m * n : 0;
  key.align_a = alignment(x->data, key.sa, es);
  key.align_b = alignment(y->data, key.sb, es);
  key.align_c = alignment(c, key.sc, dm_dtype_size(odt));
  operands o = {x->data, y->data, c};
  return plan_for(&key, &o);
}

static void run(const plan *p, dm_dtype dt, const void *x, const void *y, void *c) {
  LT(matmul_with(p, &p->algo, dt, x, y, c));
}

/* ---- the kernel ------------------------------------------------------------------------- */

static int64_t rows_products, lt_products;      /* by path, since the start (dm_cuda_product_counts) */

void dm_cuda_product_counts(int64_t *rows, int64_t *lt) {
  *rows = rows_products;
  *lt = lt_products;
}

static void cuda_matmul(dm_tensor *out, dm_tensor *a, dm_tensor *b, bool ta, bool tb) {
  int nd = out->ndim, nb = nd - 2;
  int64_t m = out->shape[nd - 2], n = out->shape[nd - 1];
  int64_t k = ta ? a->shape[a->ndim - 2] : a->shape[a->ndim - 1];
  if (dm_numel(out) == 0) return;
  dm_dtype dt = a->dtype;                        /* the inputs'; out's is dt or, from 16 bits, f32 */
  if (dt != DM_F32 && dt != DM_F64 && dt != DM_BF16 && dt != DM_F16)
    dm_error("matmul needs a float dtype, got %s", dm_dtype_name(dt));
  if (k == 0) {
    dm_fill(out, 0);
    return;
  }
  if (dm_cuda_rows_product(out, a, b, ta, tb)) {          /* a few rows against a weight */
    rows_products++;
    return;
  }
  lt_products++;
  start();
  int64_t batch = 1;
  for (int d = 0; d < nb; d++) batch *= out->shape[d];
  operand oa, ob;
  dm_tensor *ha = describe(a, ta, out, &oa), *hb = describe(b, tb, out, &ob);
  /* b shared by the batch, a's rows at one stride through it: one product of all rows */
  if (batch > 1 && ob.bstride == 0 && !oa.trans && oa.bstride == m * oa.ld && batch * m <= INT_MAX) {
    m *= batch;
    batch = 1;
  }
  if (batch > INT_MAX) dm_error("matmul: a batch of %lld matrices is over cuBLASLt's limit", (long long)batch);
  const plan *p = plan_of(dt, out->dtype, &ob, &oa, dm_data(out), n, m, k, batch);
  run(p, dt, ob.data, oa.data, dm_data(out));
  DM_CU_LAUNCHED();
  dm_release(ha);
  dm_release(hb);
}

/* ---- the baselines of the benchmarks ------------------------------------------------------
** Each sample times `INNER` runs queued back to back, behind one untimed run
** that keeps the GPU busy while the host queues them: device time only. */

#define INNER 5

static int cmp_double(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return x < y ? -1 : x > y;
}

typedef void (*bench_fn)(void *ud);

static double median_ms(bench_fn fn, void *ud, int reps) {
  if (reps < 1) reps = 1;
  double *ms = malloc(sizeof(double) * (size_t)reps);
  if (!ms) dm_error("out of host memory");
  for (int i = 0; i < 3; i++) fn(ud);
  for (int i = 0; i < reps; i++) {
    fn(ud);
    dm_cuda_timer_start();
    for (int j = 0; j < INNER; j++) fn(ud);
    ms[i] = dm_cuda_timer_stop() / INNER;
  }
  qsort(ms, (size_t)reps, sizeof *ms, cmp_double);
  double med = ms[reps / 2];
  free(ms);
  return med;
}

typedef struct gemm_run { const plan *p; dm_dtype dt; const void *x, *y; void *c; } gemm_run;
static void gemm_once(void *ud) {
  gemm_run *g = ud;
  run(g->p, g->dt, g->x, g->y, g->c);
}

typedef struct classic_run { cublasHandle_t h; cudaDataType_t t; int m, n, k; const void *x, *y; void *c; } classic_run;
static void classic_once(void *ud) {
  classic_run *g = ud;
  float one = 1, zero = 0;
  cublasStatus_t s = cublasGemmEx(g->h, CUBLAS_OP_N, CUBLAS_OP_N, g->n, g->m, g->k, &one, g->x, g->t, g->n, g->y, g->t,
                                  g->k, &zero, g->c, g->t, g->n, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
  if (s != CUBLAS_STATUS_SUCCESS) dm_error("cuda: cublasGemmEx failed: %s", cublasGetStatusString(s));
}

double dm_cuda_bench_gemm(dm_dtype dt, int64_t m, int64_t n, int64_t k, int reps, bool classic) {
  start();
  if (dt != DM_BF16 && dt != DM_F16 && dt != DM_F32) dm_error("bench_gemm: bf16, f16 or f32, not %s", dm_dtype_name(dt));
  int64_t sa[2] = {m, k}, sb[2] = {k, n}, sc[2] = {m, n};
  dm_tensor *a = dm_randn(DM_CUDA, dt, 2, sa), *b = dm_randn(DM_CUDA, dt, 2, sb);
  dm_tensor *c = dm_empty(DM_CUDA, dt, 2, sc);
  double ms;
  if (classic) {                    /* cuBLAS's own choice, for reference */
    static cublasHandle_t h;
    if (!h) {
      if (cublasCreate(&h) != CUBLAS_STATUS_SUCCESS) dm_error("cuda: cublasCreate failed");
      cublasSetStream(h, dm_cuda_stream());
      cublasSetWorkspace(h, workspace, DM_GEMM_WORKSPACE);
    }
    classic_run g = {h, cuda_type(dt), (int)m, (int)n, (int)k, dm_data(b), dm_data(a), dm_data(c)};
    ms = median_ms(classic_once, &g, reps);
  } else {
    /* row-major C = A B is column-major C^T = B^T A^T: B as cuBLASLt's A, untransposed */
    operand x = {dm_data(b), n, k, n, 0, false}, y = {dm_data(a), k, m, k, 0, false};
    gemm_run g = {plan_of(dt, dt, &x, &y, dm_data(c), n, m, k, 1), dt, x.data, y.data, dm_data(c)};
    ms = median_ms(gemm_once, &g, reps);
  }
  dm_release(a);
  dm_release(b);
  dm_release(c);
  return ms;
}

typedef struct copy_run { void *dst; const void *src; size_t n; } copy_run;
static void copy_once(void *ud) {
  copy_run *c = ud;
  DM_CU(cudaMemcpyAsync(c->dst, c->src, c->n, cudaMemcpyDeviceToDevice, dm_cuda_stream()));
}

double dm_cuda_bench_copy(size_t nbytes, int reps) {
  dm_cuda_init();
  int64_t n = (int64_t)(nbytes / 4);
  dm_tensor *src = dm_randn(DM_CUDA, DM_F32, 1, &n), *dst = dm_empty(DM_CUDA, DM_F32, 1, &n);
  copy_run c = {dm_data(dst), dm_data(src), (size_t)n * 4};
  double ms = median_ms(copy_once, &c, reps);
  dm_release(src);
  dm_release(dst);
  return ms;
}

static const dm_kernel_entry kernels[] = {
  DM_KERNEL_ENTRY(matmul, cuda_matmul),
};
DM_REGISTER_KERNELS(DM_CUDA, kernels)
