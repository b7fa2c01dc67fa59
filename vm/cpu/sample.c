/*
** cpu/sample.c — the byte draw of sample.h on the CPU, one row at a time.
*/
#include <math.h>
#include "ops/sample.h"
#include "core/ops.h"

static void cpu_sample_bytes(dm_tensor *out, const dm_tensor *logits, const dm_tensor *seeds,
                             const dm_tensor *counts, const dm_sample_hp *hp) {
  const int64_t B = logits->shape[0];
  const int V = (int)logits->shape[1];
  const int64_t *seed = dm_data(seeds), *count = dm_data(counts);
  double p[DM_SAMPLE_MAXV], ps[DM_SAMPLE_MAXV];
  for (int64_t b = 0; b < B; b++) {
    const float *l = (const float *)dm_data(logits) + b * V;
    int best = dm_sample_best(l, V), pick = best;
    if (hp->temperature > 0) {
      double z = 0;
      for (int i = 0; i < V; i++) {
        p[i] = dm_sample_weight(l[i], l[best], hp->temperature);
        z += p[i];
      }
      if (z > 0 && z < INFINITY) {                  /* else (a non-finite maximum): the maximum */
        int at[DM_SAMPLE_MAXV];
        for (int i = 0; i < V; i++) p[i] /= z;
        for (int i = 0; i < V; i++) {              /* i's place in the order: the values ahead of it */
          int rank = 0;
          for (int j = 0; j < V; j++) rank += dm_sample_ahead(p, i, j);
          at[rank] = i;
        }
        for (int k = 0; k < V; k++) ps[k] = p[at[k]];
        pick = at[dm_sample_walk(ps, V, hp->top_p, dm_sample_uniform(seed[b], count[b] + hp->offset))];
      }
    }
    if (out->dtype == DM_U8) ((uint8_t *)dm_data(out))[b] = (uint8_t)pick;
    else ((int64_t *)dm_data(out))[b] = pick;
  }
}

static const dm_kernel_entry kernels[] = {
  DM_KERNEL_ENTRY(sample_bytes, cpu_sample_bytes),
};
DM_REGISTER_KERNELS(DM_CPU, kernels)
