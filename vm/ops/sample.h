/*
** sample.h — the next byte drawn on the device that holds the logits, so
** that generation's one-byte step (lua/dormouse/decode.lua) runs as a
** captured graph with no host round trip a byte.
**
** Row b of logits [B, V] (f32, V <= DM_SAMPLE_MAXV) gives out[b] as
** eval.sample's host draw does (lua/dormouse/eval.lua, pick), in double:
**   temperature 0: the first maximum;
**   else p_i = exp((l_i - max) / temperature) / z, z their sum in index order;
**   the nucleus: values in order of p, larger first, ties by index, taken
**   until their mass (added in that order) reaches top_p;
**   r = u·mass, u = dm_philox_uniform_at(seeds[b], 0, counts[b] + offset)
**   (dm.rand({n}, {seed = seeds[b]})'s element counts[b] + offset, 0-based);
**   the first value of the nucleus at which the mass added so far reaches r.
** Every backend adds in those orders, so the same finite logits give the
** same byte as the host's pick, up to the last bit of exp. A NaN logit
** weighs 0; a row whose weights do not sum to a finite positive number
** (an infinite maximum) gives its first maximum.
*/
#ifndef DM_SAMPLE_H
#define DM_SAMPLE_H

#include "core/tensor.h"
#include "core/ops.h"
#include "core/philox.h"

#define DM_SAMPLE_MAXV 256          /* a byte model's logits; the CUDA kernel's threads */

typedef struct dm_sample_hp {
  double temperature;               /* >= 0 */
  double top_p;                     /* (0, 1] */
  int64_t offset;                   /* added to each row's count */
} dm_sample_hp;

/* ---- the draw's serial parts, shared by every backend ----------------------------------- */

/* whether value j comes before value i in the nucleus order (p larger first, ties by index) */
DM_HD int dm_sample_ahead(const double *p, int i, int j) {
  return p[j] > p[i] || (p[j] == p[i] && j < i);
}

/* value i's weight before the sum divides it: exp((l_i - max) / temperature), 0 for a NaN */
DM_HD double dm_sample_weight(float li, float lmax, double temperature) {
  double w = exp(((double)li - (double)lmax) / temperature);
  return w >= 0 ? w : 0;
}

/* the first maximum of l[0..V) */
DM_HD int dm_sample_best(const float *l, int V) {
  int best = 0;
  for (int i = 1; i < V; i++) if (l[i] > l[best]) best = i;
  return best;
}

/* the position, in the nucleus order, drawn by u: ps the probabilities in that order */
DM_HD int dm_sample_walk(const double *ps, int V, double top_p, double u) {
  double mass = 0;
  int keep = 0;
  while (keep < V) {
    mass += ps[keep++];
    if (mass >= top_p) break;
  }
  double r = u * mass, acc = 0;
  for (int k = 0; k < keep; k++) {
    acc += ps[k];
    if (r <= acc) return k;
  }
  return keep - 1;
}

/* row b's uniform: dm.rand({n}, {seed = seed})'s element i */
DM_HD double dm_sample_uniform(int64_t seed, int64_t i) {
  return (double)dm_philox_uniform_at((uint64_t)seed, 0, (uint64_t)i);
}

/* out [B] (u8 or i64) = the byte drawn from each row of logits [B, V] (f32); seeds and counts
** [B] i64 on the logits' device (read when the kernel runs: a graph replays with new counts) */
void dm_sample_bytes(dm_tensor *out, const dm_tensor *logits, const dm_tensor *seeds,
                     const dm_tensor *counts, const dm_sample_hp *hp);

typedef void (*dm_sample_bytes_k)(dm_tensor *out, const dm_tensor *logits, const dm_tensor *seeds,
                                  const dm_tensor *counts, const dm_sample_hp *hp);   /* "sample_bytes" */

/* the family's kernels by name (core/ops.h): the ops look them up, the backends register them */
DM_KERNEL_TYPE(sample_bytes, dm_sample_bytes_k)

#endif
