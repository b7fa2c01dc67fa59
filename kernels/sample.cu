/*
** sample.cu — the byte draw of sample.h on CUDA: one block a row, a thread
** a value. Each thread weighs its value and finds its place in the nucleus
** order by counting the values ahead of it; one thread then adds the sum
** and walks the order serially, as the CPU does, so both add in the same
** order.
*/
#include "common.cuh"
extern "C" {
#include "ops/sample.h"
}

static_assert(DM_SAMPLE_MAXV <= 1024, "a block holds a row");

__global__ void sample_k(void *out, bool u8, const float *logits, int V, const int64_t *seeds,
                         const int64_t *counts, double temperature, double top_p, int64_t offset) {
  __shared__ float l[DM_SAMPLE_MAXV];
  __shared__ double p[DM_SAMPLE_MAXV], ps[DM_SAMPLE_MAXV];
  __shared__ int at[DM_SAMPLE_MAXV];
  __shared__ int best, pick;
  __shared__ double z;
  const int64_t b = blockIdx.x;
  const int i = threadIdx.x;
  if (i < V) l[i] = logits[b * V + i];
  __syncthreads();
  if (i == 0) best = pick = dm_sample_best(l, V);
  __syncthreads();
  if (temperature > 0) {
    if (i < V) p[i] = dm_sample_weight(l[i], l[best], temperature);
    __syncthreads();
    if (i == 0) {
      double s = 0;
      for (int j = 0; j < V; j++) s += p[j];
      z = s;
    }
    __syncthreads();
    if (z > 0 && z < INFINITY) {                  /* else (a non-finite maximum): the maximum */
      if (i < V) p[i] /= z;
      __syncthreads();
      if (i < V) {
        int rank = 0;
        for (int j = 0; j < V; j++) rank += dm_sample_ahead(p, i, j);
        at[rank] = i;
      }
      __syncthreads();
      if (i < V) ps[i] = p[at[i]];
      __syncthreads();
      if (i == 0) pick = at[dm_sample_walk(ps, V, top_p, dm_sample_uniform(seeds[b], counts[b] + offset))];
    }
  }
  __syncthreads();
  if (i == 0) {
    if (u8) ((uint8_t *)out)[b] = (uint8_t)pick;
    else ((int64_t *)out)[b] = pick;
  }
}

static void cuda_sample_bytes(dm_tensor *out, const dm_tensor *logits, const dm_tensor *seeds,
                              const dm_tensor *counts, const dm_sample_hp *hp) {
  sample_k<<<(unsigned)logits->shape[0], DM_SAMPLE_MAXV, 0, dm_cuda_stream()>>>(
      dm_data(out), out->dtype == DM_U8, (const float *)dm_data(logits), (int)logits->shape[1],
      (const int64_t *)dm_data(seeds), (const int64_t *)dm_data(counts), hp->temperature, hp->top_p, hp->offset);
  DM_CU_LAUNCHED();
}

static const dm_kernel_entry kernels[] = {
  DM_KERNEL_ENTRY(sample_bytes, cuda_sample_bytes),
};
DM_CUDA_KERNELS(kernels)
