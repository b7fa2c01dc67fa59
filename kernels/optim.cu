/*
** optim.cu — the optimisers' element loops on CUDA (optim.h has the
** signatures): AdamW, the gradient norm and its clipping, and Muon's
** momentum, Newton–Schulz normalisation and update.
**
** Lists of tensors go MT_MAX at a time into one launch: the launch takes
** every tensor's pointers, dtypes and sizes by value, and each block finds
** its tensor and its chunk of elements (MT_CHUNK, or SUMSQ_CHUNK for the
** sums of squares, whose blocks each end in a block-wide sum) from the
** blocks' starts.
** The per-step scalars (learning rate, step) are turned into the update's
** constants by a one-thread kernel, from hp's values or, when set, from
** lr_at / step_at in device memory, so a captured graph replays with what
** the schedule wrote there. Sums of squares run in double through per-block
** partials added in a fixed order: the same bits on every run. Elementwise
** arithmetic is f32, as on the CPU; bf16 is read and rounded on store.
*/
#include "model.cuh"
#include "core/sround.h"
#include "core/code8.h"
extern "C" {
#include "ops/optim.h"
}

#define MT_MAX 32
#define MT_CHUNK 2048
#define SUMSQ_CHUNK DM_SUMSQ_CHUNK   /* vm/ops/optim.h */

/* up to 4 tensors per entry (their roles set by the kernel), one entry per list member */
struct mt_list {
  int n;
  void *p[MT_MAX][4];
  int dt[MT_MAX][4];
  int64_t numel[MT_MAX];
  int64_t start[MT_MAX + 1];       /* first block of each entry; start[n] = the blocks */
  int64_t chunk;                   /* elements a block */
};

/* entries [i0, i1) of the list (NULL first tensor: skipped) into L; returns the next i0 */
static int mt_fill(mt_list *L, int i0, int n, int roles, dm_tensor *const *const *lists,
                   int64_t chunk = MT_CHUNK) {
  memset(L, 0, sizeof *L);
  L->chunk = chunk;
  int i = i0;
  for (; i < n && L->n < MT_MAX; i++) {
    if (!lists[0][i] || (roles > 1 && !lists[1][i])) continue;      /* no gradient: skipped */
    int k = L->n++;
    for (int r = 0; r < roles; r++) {
      L->p[k][r] = lists[r][i] ? dm_data(lists[r][i]) : NULL;
      L->dt[k][r] = lists[r][i] ? lists[r][i]->dtype : DM_F32;
    }
    L->numel[k] = dm_numel(lists[0][i]);
    L->start[k + 1] = L->start[k] + (L->numel[k] + chunk - 1) / chunk;
  }
  return i;
}

/* this block's entry and its element range */
__device__ __forceinline__ int mt_entry(const mt_list &L, int64_t *lo, int64_t *hi) {
  int t = 0;
  while (t + 1 < L.n && L.start[t + 1] <= (int64_t)blockIdx.x) t++;
  *lo = ((int64_t)blockIdx.x - L.start[t]) * L.chunk;
  *hi = *lo + L.chunk < L.numel[t] ? *lo + L.chunk : L.numel[t];
  return t;
}

/* f32 or bf16 (the optimisers' dtypes), in float */
__device__ __forceinline__ float ldf(int t, const void *p, int64_t i) {
  return t == DM_BF16 ? dt<DM_BF16>::load(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}
__device__ __forceinline__ void stf(int t, void *p, int64_t i, float v) {
  if (t == DM_BF16) ((uint16_t *)p)[i] = dt<DM_BF16>::store(v);
  else ((float *)p)[i] = v;
}

/* the launch of `kernel(L, extra...)` over each batch of the list */
template <typename K, typename... A>
static void mt_run(int n, int roles, dm_tensor *const *const *lists, K kernel, A... extra) {
  for (int i0 = 0; i0 < n;) {
    mt_list L;
    i0 = mt_fill(&L, i0, n, roles, lists);
    if (L.n == 0 || L.start[L.n] == 0) continue;
    kernel<<<(unsigned)L.start[L.n], DM_THREADS, 0, dm_cuda_stream()>>>(L, extra...);
    DM_CU_LAUNCHED();
  }
}

/* ---- AdamW -------------------------------------------------------------------------------------------- */

/* a step the firewall skips: its gradients' sum of squares is not finite */
__device__ __forceinline__ bool skipped(const double *sumsq_at) { return sumsq_at && !isfinite(*sumsq_at); }

/* c = {step size lr / (1 - b1^t), 1 / sqrt(1 - b2^t), decay 1 - lr wd, skip} as the CPU rounds them */
__global__ void adamw_consts_k(float *c, dm_adamw_hp hp) {
  c[3] = skipped(hp.sumsq_at) ? 1.f : 0.f;
  double lr = hp.lr_at ? *hp.lr_at : hp.lr;
  double step = hp.step_at ? (double)*hp.step_at : (double)hp.step;
  double bc1 = 1 - pow(hp.beta1, step), bc2 = 1 - pow(hp.beta2, step);
  c[0] = (float)(lr / bc1);
  c[1] = (float)(1 / sqrt(bc2));
  c[2] = (float)(1 - lr * hp.weight_decay);
}

/* roles: p, g, m, v */
__global__ void adamw_k(mt_list L, const float *c, float b1, float b2, float eps) {
  int64_t lo, hi;
  int t = mt_entry(L, &lo, &hi);
  float *p = (float *)L.p[t][0], *m = (float *)L.p[t][2], *v = (float *)L.p[t][3];
  const float step_size = c[0], rbc2 = c[1], decay = c[2];
  if (c[3] != 0) return;
  for (int64_t e = lo + threadIdx.x; e < hi; e += blockDim.x) {
    float g = ldf(L.dt[t][1], L.p[t][1], e);
    float mj = b1 * m[e] + (1 - b1) * g;
    float vj = b2 * v[e] + (1 - b2) * g * g;
    m[e] = mj;
    v[e] = vj;
    p[e] = p[e] * decay - step_size * mj / (sqrtf(vj) * rbc2 + eps);
  }
}

static void cuda_adamw(int n, dm_tensor *const *p, dm_tensor *const *g, dm_tensor *const *m, dm_tensor *const *v,
                       const dm_adamw_hp *hp) {
  float *c = (float *)dm_scratch(DM_ADAMW_SCRATCH);
  adamw_consts_k<<<1, 1, 0, dm_cuda_stream()>>>(c, *hp);
  DM_CU_LAUNCHED();
  dm_tensor *const *lists[4] = {p, g, m, v};        /* a NULL gradient skips its parameter */
  mt_run(n, 4, lists, adamw_k, (const float *)c, (float)hp->beta1, (float)hp->beta2, (float)hp->eps);
  dm_scratch_free(c, DM_ADAMW_SCRATCH);
}

/* ---- AdamW with 8-bit moments (code8.h) ------------------------------------------------------------------ */

/* Up to CODE8_MAX members a launch, a block of DM_CODE8_BLOCK threads a quantisation block: each thread
** one element, the block's largest moments found in shared memory (a max: the same in any order) */
#define CODE8_MAX 16
struct code8_list {
  int n;
  float *p[CODE8_MAX];
  const void *g[CODE8_MAX];
  int gdt[CODE8_MAX];
  uint8_t *mc[CODE8_MAX], *rc[CODE8_MAX];
  float *ms[CODE8_MAX], *rs[CODE8_MAX];
  int member[CODE8_MAX];                /* the entry's place in the caller's list: its random bits' key */
  int64_t numel[CODE8_MAX];
  int64_t start[CODE8_MAX + 1];
};

__global__ void adamw_8bit_k(code8_list L, const float *c, float b1, float b2, float eps, const int64_t *step_at,
                           int64_t step, uint32_t salt) {
  __shared__ float mmax[DM_CODE8_BLOCK], rmax[DM_CODE8_BLOCK];
  if (c[3] != 0) return;
  int t = 0;
  while (t + 1 < L.n && L.start[t + 1] <= (int64_t)blockIdx.x) t++;
  const int64_t b = (int64_t)blockIdx.x - L.start[t], e = b * DM_CODE8_BLOCK + threadIdx.x;
  const bool live = e < L.numel[t];
  const float step_size = c[0], rbc2 = c[1], decay = c[2];
  float mj = 0, rj = 0;
  if (live) {
    float g = ldf(L.gdt[t], L.g[t], e);
    float mo = dm_code8_signed(L.mc[t][e]) * L.ms[t][b], ro = dm_code8_unsigned(L.rc[t][e]) * L.rs[t][b];
    mj = b1 * mo + (1 - b1) * g;
    float vj = b2 * (ro * ro) + (1 - b2) * g * g;
    rj = sqrtf(vj);
    L.p[t][e] = L.p[t][e] * decay - step_size * mj / (rj * rbc2 + eps);
  }
  mmax[threadIdx.x] = fabsf(mj);
  rmax[threadIdx.x] = rj;
  __syncthreads();
  for (int w = DM_CODE8_BLOCK / 2; w > 0; w /= 2) {
    if (threadIdx.x < w) {
      mmax[threadIdx.x] = fmaxf(mmax[threadIdx.x], mmax[threadIdx.x + w]);
      rmax[threadIdx.x] = fmaxf(rmax[threadIdx.x], rmax[threadIdx.x + w]);
    }
    __syncthreads();
  }
  const float ms = mmax[0], rs = rmax[0];
  if (!live) return;
  if (threadIdx.x == 0) { L.ms[t][b] = ms; L.rs[t][b] = rs; }
  const int64_t k = step_at ? *step_at : step;
  const uint32_t i = (uint32_t)L.member[t];
  L.mc[t][e] = dm_code8_encode_signed(mj * dm_code8_inverse(ms), dm_sround_bits(salt, 2u * i, k, e));
  L.rc[t][e] = dm_code8_encode_unsigned(rj * dm_code8_inverse(rs), dm_sround_bits(salt, 2u * i + 1u, k, e));
}

static void cuda_adamw_8bit(int n, dm_tensor *const *p, dm_tensor *const *g, dm_tensor *const *m,
                          dm_tensor *const *m_scale, dm_tensor *const *r, dm_tensor *const *r_scale,
                          const dm_adamw_hp *hp, uint32_t salt) {
  float *c = (float *)dm_scratch(DM_ADAMW_SCRATCH);
  adamw_consts_k<<<1, 1, 0, dm_cuda_stream()>>>(c, *hp);
  DM_CU_LAUNCHED();
  for (int i = 0; i < n;) {
    code8_list L;
    memset(&L, 0, sizeof L);
    for (; i < n && L.n < CODE8_MAX; i++) {
      if (!g[i]) continue;                            /* no gradient: left alone */
      int k = L.n++;
      L.p[k] = (float *)dm_data(p[i]);
      L.g[k] = dm_data(g[i]);
      L.gdt[k] = g[i]->dtype;
      L.mc[k] = (uint8_t *)dm_data(m[i]); L.ms[k] = (float *)dm_data(m_scale[i]);
      L.rc[k] = (uint8_t *)dm_data(r[i]); L.rs[k] = (float *)dm_data(r_scale[i]);
      L.member[k] = i;
      L.numel[k] = dm_numel(p[i]);
      L.start[k + 1] = L.start[k] + dm_code8_blocks(L.numel[k]);
    }
    if (L.n == 0 || L.start[L.n] == 0) continue;
    adamw_8bit_k<<<(unsigned)L.start[L.n], DM_CODE8_BLOCK, 0, dm_cuda_stream()>>>(
        L, c, (float)hp->beta1, (float)hp->beta2, (float)hp->eps, hp->step_at, hp->step, salt);
    DM_CU_LAUNCHED();
  }
  dm_scratch_free(c, DM_ADAMW_SCRATCH);
}

/* ---- the gradient norm -------------------------------------------------------------------------------- */

/* part[block] = the sum of squares of the block's chunk, in double */
__global__ void sumsq_part_k(mt_list L, double *part, int64_t base) {
  int64_t lo, hi;
  int t = mt_entry(L, &lo, &hi);
  double s = 0;
  if (L.dt[t][0] == DM_F32) {                     /* the usual case, without the dtype switch */
    const float *p = (const float *)L.p[t][0];
#pragma unroll 8
    for (int64_t e = lo + threadIdx.x; e < hi; e += blockDim.x) {
      double x = p[e];
      s += x * x;
    }
  } else {
    for (int64_t e = lo + threadIdx.x; e < hi; e += blockDim.x) {
      double x = dm_ld(L.dt[t][0], L.p[t][0], e);
      s += x * x;
    }
  }
  s = dm_block_sum(s);
  if (threadIdx.x == 0) part[base + blockIdx.x] = s;
}

/* out = the partials summed in a fixed order (one block) */
__global__ void sum_parts_k(double *out, const double *part, int64_t n) {
  const int64_t per = (n + blockDim.x - 1) / blockDim.x, lo = threadIdx.x * per;
  const int64_t hi = lo + per < n ? lo + per : n;
  double s = 0;
  for (int64_t i = lo; i < hi; i++) s += part[i];
  s = dm_block_sum(s);
  if (threadIdx.x == 0) out[0] = s;
}

static void cuda_sumsq(int n, dm_tensor *const *x, dm_tensor *out) {
  int64_t blocks = 0;
  for (int i = 0; i < n; i++) if (x[i]) blocks += dm_sumsq_blocks(dm_numel(x[i]));
  size_t pb = (size_t)dm_sumsq_scratch(blocks);
  double *part = (double *)dm_scratch(pb);
  dm_tensor *const *lists[1] = {x};
  int64_t base = 0;
  for (int i0 = 0; i0 < n;) {
    mt_list L;
    i0 = mt_fill(&L, i0, n, 1, lists, SUMSQ_CHUNK);
    if (L.n == 0 || L.start[L.n] == 0) continue;
    sumsq_part_k<<<(unsigned)L.start[L.n], DM_THREADS, 0, dm_cuda_stream()>>>(L, part, base);
    DM_CU_LAUNCHED();
    base += L.start[L.n];
  }
  sum_parts_k<<<1, DM_SCAN_THREADS, 0, dm_cuda_stream()>>>((double *)dm_data(out), part, blocks);
  DM_CU_LAUNCHED();
  dm_scratch_free(part, pb);
}

/* x *= max_norm / norm when the norm (from the device's sum) is finite and above max_norm */
__global__ void clip_k(mt_list L, const double *sumsq, double max_norm) {
  double norm = sqrt(*sumsq);
  if (!isfinite(norm) || !(norm > max_norm)) return;
  double s = max_norm / norm;
  int64_t lo, hi;
  int t = mt_entry(L, &lo, &hi);
  for (int64_t e = lo + threadIdx.x; e < hi; e += blockDim.x)
    dm_st(L.dt[t][0], L.p[t][0], e, dm_ld(L.dt[t][0], L.p[t][0], e) * s);
}

static void cuda_clip_scale(int n, dm_tensor *const *x, const dm_tensor *sumsq, double max_norm) {
  dm_tensor *const *lists[1] = {x};
  mt_run(n, 1, lists, clip_k, (const double *)dm_data(sumsq), max_norm);
}

/* ---- Muon -------------------------------------------------------------------------------------------------- */

/* the stack index of element e: rows `pitch` apart, `cols` of each used (dm_muon_momentum_k) */
struct pitch_map {
  int64_t cols, pitch;
  __device__ __forceinline__ int64_t operator()(int64_t e) const {
    return pitch == cols ? e : e / cols * pitch + e % cols;
  }
};

/* g as clip_k would leave it: (g · s) rounded once to its dtype */
__device__ __forceinline__ float clipped(int t, float g, double s) {
  if (t == DM_F32) return (float)(g * s);
  char r[8];
  dm_store_any(t, r, g * s);
  return (float)dm_load_any(t, r);
}

/* stochastic rounding of the momentum (sround.h): on when `on`, member = first + the entry */
struct sround_arg {
  bool on;
  uint32_t salt;
  int first;
  int64_t step;
  const int64_t *step_at;
};

/* roles: buf, g, out. buf = mu buf + g; out = nesterov ? g + mu buf : buf; g clipped first
** when clip_at says so (as clip_k would have in a pass of its own) */
__global__ void momentum_k(mt_list L, float mu, bool nesterov, const double *sumsq_at, const double *clip_at,
                           double clip, pitch_map at, sround_arg sr) {
  if (skipped(sumsq_at)) return;
  double norm = clip_at ? sqrt(*clip_at) : 0, s = clip_at && isfinite(norm) && norm > clip ? clip / norm : 0;
  int64_t lo, hi;
  int t = mt_entry(L, &lo, &hi);
  const bool stochastic = sr.on && L.dt[t][0] == DM_BF16;
  const int64_t step = sr.step_at ? *sr.step_at : sr.step;
  for (int64_t e = lo + threadIdx.x; e < hi; e += blockDim.x) {
    float g = ldf(L.dt[t][1], L.p[t][1], e);
    if (s != 0) g = clipped(L.dt[t][1], g, s);
    float bj = mu * ldf(L.dt[t][0], L.p[t][0], e) + g;
    if (stochastic)
      ((uint16_t *)L.p[t][0])[e] = dm_bf16_stochastic(bj, dm_sround_bits(sr.salt, (uint32_t)(sr.first + t), step, e));
    else
      stf(L.dt[t][0], L.p[t][0], e, bj);         /* f32, or bf16 (momentum_dtype) */
    stf(L.dt[t][2], L.p[t][2], at(e), nesterov ? g + mu * bj : bj);
  }
}

static void cuda_muon_momentum(int n, dm_tensor *const *buf, dm_tensor *const *g, dm_tensor *const *out, double mu,
                               bool nesterov, const double *sumsq_at, const double *clip_at, double clip,
                               int64_t cols, int64_t pitch, const dm_sround_key *sround) {
  dm_tensor *const *lists[3] = {buf, g, out};
  sround_arg sr = {sround != NULL, sround ? sround->salt : 0u, 0, sround ? sround->step : 0,
                   sround ? sround->step_at : NULL};
  for (int i0 = 0; i0 < n;) {               /* mt_run's loop, each launch told its first member */
    mt_list L;
    sr.first = i0;
    i0 = mt_fill(&L, i0, n, 3, lists);
    /* entry t is member first + t only while none is skipped: a group's members all have a buffer and a
    ** gradient (dm_muon_step's groups), which the CPU's count assumes too */
    if (L.n != i0 - sr.first) dm_error("muon: a member without a buffer or a gradient in a momentum pass");
    if (L.n == 0 || L.start[L.n] == 0) continue;
    momentum_k<<<(unsigned)L.start[L.n], DM_THREADS, 0, dm_cuda_stream()>>>(L, (float)mu, nesterov, sumsq_at,
                                                                            clip_at, clip, pitch_map{cols, pitch}, sr);
    DM_CU_LAUNCHED();
  }
}

/* part[b, s] = the sum of squares of slice s of matrix b */
__global__ void ns_part_k(double *part, const void *x, int xdt, int64_t per, int64_t slice) {
  const int64_t b = blockIdx.x, s = blockIdx.y, lo = s * slice, hi = lo + slice < per ? lo + slice : per;
  double acc = 0;
  for (int64_t e = lo + threadIdx.x; e < hi; e += blockDim.x) {
    double v = ldf(xdt, x, b * per + e);
    acc += v * v;
  }
  acc = dm_block_sum(acc);
  if (threadIdx.x == 0) part[b * gridDim.y + s] = acc;
}

/* r[b] = 1 / (|x_b| mult + eps), the norm from matrix b's slices added in order */
__global__ void ns_factor_k(float *r, const double *part, int64_t nb, int64_t slices, double mult, double eps) {
  int64_t b = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (b >= nb) return;
  double s = 0;
  for (int64_t q = 0; q < slices; q++) s += part[b * slices + q];
  r[b] = (float)(1 / (sqrt(s) * mult + eps));
}

/* x_b *= r[b] */
__global__ void ns_scale_k(void *x, int xdt, const float *r, int64_t nb, int64_t per) {
  DM_GRID_LOOP(i, nb * per) stf(xdt, x, i, ldf(xdt, x, i) * r[i / per]);
}

static void cuda_ns_normalize(dm_tensor *x, double mult, double eps) {
  int64_t nb = x->shape[0], per = x->shape[1] * x->shape[2];
  if (nb * per == 0) return;
  if (x->dtype != DM_F32 && x->dtype != DM_BF16)
    dm_error("ns_normalize: runs in f32 or bf16, got %s", dm_dtype_name(x->dtype));
  int64_t slices = dm_ns_slices(per), slice = (per + slices - 1) / slices;
  size_t pb = (size_t)dm_ns_normalize_scratch(nb, per);       /* nb x slices partials, then nb factors */
  double *part = (double *)dm_scratch(pb);
  float *r = (float *)(part + nb * slices);
  ns_part_k<<<dim3((unsigned)nb, (unsigned)slices), DM_THREADS, 0, dm_cuda_stream()>>>(part, dm_data(x), x->dtype,
                                                                                      per, slice);
  DM_CU_LAUNCHED();
  ns_factor_k<<<(unsigned)((nb + 127) / 128), 128, 0, dm_cuda_stream()>>>(r, part, nb, slices, mult, eps);
  DM_CU_LAUNCHED();
  DM_LAUNCH(ns_scale_k, nb * per, dm_data(x), x->dtype, r, nb, per);
  dm_scratch_free(part, pb);
}

__global__ void axpby_k(void *y, int ydt, const void *x, int xdt, float a, float b, int64_t n) {
  DM_GRID_LOOP(i, n) stf(ydt, y, i, a * ldf(xdt, x, i) + b * ldf(ydt, y, i));
}

static void cuda_ns_axpby(dm_tensor *y, double alpha, const dm_tensor *x, double beta) {
  int64_t n = dm_numel(y);
  if (n == 0) return;
  if ((y->dtype != DM_F32 && y->dtype != DM_BF16) || (x->dtype != DM_F32 && x->dtype != DM_BF16))
    dm_error("ns_axpby: runs in f32 or bf16, got %s and %s", dm_dtype_name(y->dtype), dm_dtype_name(x->dtype));
  DM_LAUNCH(axpby_k, n, dm_data(y), y->dtype, dm_data(x), x->dtype, (float)alpha, (float)beta, n);
}

/* one block a matrix: the trace in double (thread 0, in order), then Q = r I */
__global__ void gram_start_k(float *q, const float *a, int64_t s, double mult, double eps) {
  __shared__ float r;
  const int64_t b = blockIdx.x;
  if (threadIdx.x == 0) {
    double tr = 0;
    for (int64_t i = 0; i < s; i++) tr += a[(b * s + i) * s + i];
    r = (float)(1 / (sqrt(tr) * mult + eps));
  }
  __syncthreads();
  for (int64_t i = threadIdx.x; i < s * s; i += blockDim.x) q[b * s * s + i] = i % (s + 1) == 0 ? r : 0.f;
}

static void cuda_ns_gram_start(dm_tensor *q, const dm_tensor *a, double mult, double eps) {
  if (a->dtype != DM_F32 || q->dtype != DM_F32) dm_error("ns_gram_start: runs in f32, got %s", dm_dtype_name(a->dtype));
  if (a->shape[0] == 0) return;
  gram_start_k<<<(unsigned)a->shape[0], DM_THREADS, 0, dm_cuda_stream()>>>((float *)dm_data(q),
      (const float *)dm_data(a), a->shape[1], mult, eps);
  DM_CU_LAUNCHED();
}

/* c = {decay 1 - lr wd, step lr scale, skip} (a skipped step's o may hold anything: not read) */
__global__ void muon_consts_k(float *c, const double *lr_at, double lr, double wd, double scale,
                              const double *sumsq_at) {
  double l = lr_at ? *lr_at : lr;
  c[0] = (float)(1 - l * wd);
  c[1] = (float)(l * scale);
  c[2] = skipped(sumsq_at) ? 1.f : 0.f;
}

/* roles: p, o. p = p decay - step o */
/* roles: p, o, and s (f32 [E] or NULL): matrix e's update times s[e]; per: the elements of a matrix */
__global__ void muon_apply_k(mt_list L, const float *c, pitch_map at, int64_t per) {
  int64_t lo, hi;
  int t = mt_entry(L, &lo, &hi);
  float *p = (float *)L.p[t][0];
  const float *s = (const float *)L.p[t][2];
  const float decay = c[0], step = c[1];
  if (c[2] != 0) return;
  for (int64_t e = lo + threadIdx.x; e < hi; e += blockDim.x)
    p[e] = p[e] * decay - (s ? step * s[e / per] : step) * ldf(L.dt[t][1], L.p[t][1], at(e));
}

static void cuda_muon_apply(int n, dm_tensor *const *p, dm_tensor *const *o, dm_tensor *const *s,
                            const dm_muon_hp *hp, double scale, int64_t cols, int64_t pitch) {
  float *c = (float *)dm_scratch(DM_MUON_APPLY_SCRATCH);
  muon_consts_k<<<1, 1, 0, dm_cuda_stream()>>>(c, hp->lr_at, hp->lr, hp->weight_decay, scale, hp->sumsq_at);
  DM_CU_LAUNCHED();
  dm_tensor *none[n > 0 ? n : 1];
  for (int i = 0; i < n; i++) none[i] = NULL;
  dm_tensor *const *lists[3] = {p, o, s ? s : none};
  const int64_t per = n > 0 ? p[0]->shape[p[0]->ndim - 2] * cols : 1;   /* a group's matrices share a shape */
  mt_run(n, 3, lists, muon_apply_k, (const float *)c, pitch_map{cols, pitch}, per);
  dm_scratch_free(c, DM_MUON_APPLY_SCRATCH);
}

__global__ void tick_k(int64_t *step, const double *sumsq) {
  if (!skipped(sumsq)) ++*step;
}

static void cuda_optim_tick(dm_tensor *step, const dm_tensor *sumsq) {
  tick_k<<<1, 1, 0, dm_cuda_stream()>>>((int64_t *)dm_data(step), (const double *)dm_data(sumsq));
  DM_CU_LAUNCHED();
}

static const dm_kernel_entry kernels[] = {
  DM_KERNEL_ENTRY(adamw, cuda_adamw),
  DM_KERNEL_ENTRY(adamw_8bit, cuda_adamw_8bit),
  DM_KERNEL_ENTRY(optim_tick, cuda_optim_tick),
  DM_KERNEL_ENTRY(sumsq, cuda_sumsq),
  DM_KERNEL_ENTRY(clip_scale, cuda_clip_scale),
  DM_KERNEL_ENTRY(muon_momentum, cuda_muon_momentum),
  DM_KERNEL_ENTRY(ns_normalize, cuda_ns_normalize),
  DM_KERNEL_ENTRY(ns_axpby, cuda_ns_axpby),
  DM_KERNEL_ENTRY(ns_gram_start, cuda_ns_gram_start),
  DM_KERNEL_ENTRY(muon_apply, cuda_muon_apply),
};
DM_CUDA_KERNELS(kernels)
