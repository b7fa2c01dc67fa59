/*
** creation.c — new tensors, fills, copies and the global random generator.
** None of these record on the tape.
*/
#include "core/core.h"
#include <math.h>
#include "core/alloc.h"
#include "core/creation.h"

static uint64_t rng_seed = 0x5eed, rng_offset;

dm_tensor *dm_empty(dm_device dev, dm_dtype dt, int ndim, const int64_t *shape) {
  return dm_tensor_new(dev, dt, ndim, shape);
}

dm_tensor *dm_full(dm_device dev, dm_dtype dt, int ndim, const int64_t *shape, double v) {
  dm_tensor *t = dm_tensor_new(dev, dt, ndim, shape);
  DM_RUN(fill, dev, t, v);
  return t;
}

dm_tensor *dm_zeros(dm_device dev, dm_dtype dt, int ndim, const int64_t *shape) {
  return dm_full(dev, dt, ndim, shape, 0.0);
}

dm_tensor *dm_arange(dm_device dev, dm_dtype dt, double start, double stop, double step) {
  if (step == 0) dm_error("arange: step must not be 0");
  double span = (stop - start) / step;
  if (!(span < 1e15)) dm_error("arange: %g to %g by %g gives too many elements", start, stop, step);
  int64_t n = span > 0 ? (int64_t)ceil(span - 1e-9) : 0;
  dm_tensor *t = dm_tensor_new(dev, dt, 1, &n);
  DM_RUN(arange, dev, t, start, step);
  return t;
}

static void check_float(const char *what, dm_dtype dt) {
  if (!dm_dtype_is_float(dt)) dm_error("%s: dtype must be a float type, got %s", what, dm_dtype_name(dt));
}

dm_tensor *dm_rand_at(dm_device dev, dm_dtype dt, int ndim, const int64_t *shape,
                      uint64_t seed, uint64_t offset, bool normal) {
  check_float(normal ? "randn" : "rand", dt);
  dm_tensor *t = dm_tensor_new(dev, dt, ndim, shape);
  DM_RUN(philox, dev, t, seed, offset, normal);
  return t;
}

uint64_t dm_rng_advance(int64_t n) {
  uint64_t at = rng_offset;
  rng_offset += (uint64_t)(n + 3) / 4;
  return at;
}

/* The tensor is made (and its shape checked) before the generator moves, so a
** refused draw leaves the generator where it was. */
static dm_tensor *draw(dm_device dev, dm_dtype dt, int ndim, const int64_t *shape, bool normal) {
  check_float(normal ? "randn" : "rand", dt);
  dm_tensor *t = dm_tensor_new(dev, dt, ndim, shape);
  uint64_t offset = dm_rng_advance(dm_numel(t));      /* the generator moves on every device, meta too */
  DM_RUN(philox, dev, t, rng_seed, offset, normal);
  return t;
}

dm_tensor *dm_rand(dm_device dev, dm_dtype dt, int ndim, const int64_t *shape) {
  return draw(dev, dt, ndim, shape, false);
}

dm_tensor *dm_randn(dm_device dev, dm_dtype dt, int ndim, const int64_t *shape) {
  return draw(dev, dt, ndim, shape, true);
}

void dm_manual_seed(uint64_t seed) { rng_seed = seed; rng_offset = 0; }
void dm_rng_state(uint64_t *seed, uint64_t *offset) { *seed = rng_seed; *offset = rng_offset; }
void dm_rng_set_state(uint64_t seed, uint64_t offset) { rng_seed = seed; rng_offset = offset; }

void dm_fill(dm_tensor *t, double v) {
  dm_check_live(t);
  DM_RUN(fill, t->device, t, v);
  dm_mark_written(t);
}

void dm_copy_(dm_tensor *dst, const dm_tensor *src) {
  dm_check_live(dst);
  dm_check_live(src);
  bool fits = src->ndim <= dst->ndim;                   /* src must broadcast to dst's shape */
  for (int d = 0; fits && d < src->ndim; d++) {
    int64_t ss = src->shape[src->ndim - 1 - d], ds = dst->shape[dst->ndim - 1 - d];
    fits = ss == ds || ss == 1;
  }
  if (!fits) {
    char a[128], b[128];
    dm_error("copy: a tensor of shape %s cannot be copied into one of shape %s",
             dm_tensor_shape_str(src, a, sizeof a), dm_tensor_shape_str(dst, b, sizeof b));
  }
  if (dst->device == src->device) DM_RUN(copy, dst->device, dst, src);
  else {
    dm_device other = dst->device == DM_CPU ? src->device : dst->device;
    DM_RUN(copy_cross, other, dst, src);
  }
  dm_mark_written(dst);
}

dm_tensor *dm_clone(const dm_tensor *t) {
  dm_check_live(t);
  dm_tensor *c = dm_tensor_like(t);
  dm_copy_(c, t);
  return c;
}

dm_tensor *dm_to_device(const dm_tensor *t, dm_device dev) {
  dm_check_live(t);
  dm_tensor *c = dm_tensor_new(dev, t->dtype, t->ndim, t->shape);
  dm_copy_(c, t);
  return c;
}
