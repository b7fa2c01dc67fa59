/*
** cpu/creation.c — fill, copy (with cast and broadcast), arange, random draws.
*/
#include "iter.h"
#include "core/ops.h"
#include "core/philox.h"
#include "core/creation.h"

static void fill_row(char **p, const int64_t *st, int64_t n, void *ud) {
  const struct { dm_dtype dt; double v; } *f = ud;
  char one[8];
  dm_store(f->dt, one, f->v);
  dm_move_elems(p[0], st[0], one, 0, n, dm_dtype_size(f->dt));
}

static void cpu_fill(dm_tensor *t, double v) {
  struct { dm_dtype dt; double v; } f = {t->dtype, v};
  dm_iter_walk(t, 0, NULL, fill_row, &f);
}

typedef struct { dm_dtype out, in; } cast_pair;

static void copy_row(char **p, const int64_t *st, int64_t n, void *ud) {
  const cast_pair *c = ud;
  if (c->out == c->in) { dm_move_elems(p[0], st[0], p[1], st[1], n, dm_dtype_size(c->out)); return; }
  if (c->out == DM_F32 && c->in == DM_BF16) {          /* the hot cast of mixed precision */
    for (int64_t i = 0; i < n; i++)
      *(float *)(p[0] + i * st[0]) = dm_bf16_to_f32(*(uint16_t *)(p[1] + i * st[1]));
    return;
  }
  for (int64_t i = 0; i < n; i++)
    dm_store(c->out, p[0] + i * st[0], dm_load(c->in, p[1] + i * st[1]));
}

static void cpu_copy(dm_tensor *dst, const dm_tensor *src) {
  dm_tensor *in = (dm_tensor *)src;
  cast_pair c = {dst->dtype, src->dtype};
  /* an overlapping copy (dst a view of src's storage) goes through a temporary */
  if (dst->storage == src->storage && dst != src) {
    dm_tensor *tmp = dm_tensor_like(src);
    cast_pair same = {src->dtype, src->dtype};
    dm_iter_walk(tmp, 1, &in, copy_row, &same);
    dm_iter_walk(dst, 1, &tmp, copy_row, &c);
    dm_release(tmp);
    return;
  }
  dm_iter_walk(dst, 1, &in, copy_row, &c);
}

static void cpu_arange(dm_tensor *t, double start, double step) {
  char *p = dm_data(t);
  size_t es = dm_dtype_size(t->dtype);
  int64_t n = dm_numel(t);
  for (int64_t i = 0; i < n; i++) dm_store(t->dtype, p + (size_t)i * es, start + (double)i * step);
}

static void cpu_philox(dm_tensor *t, uint64_t seed, uint64_t offset, bool normal) {
  char *p = dm_data(t);
  size_t es = dm_dtype_size(t->dtype);
  int64_t n = dm_numel(t);
  for (int64_t i = 0; i < n; i++) {
    float v = normal ? dm_philox_normal_at(seed, offset, (uint64_t)i)
                     : dm_philox_uniform_at(seed, offset, (uint64_t)i);
    dm_store(t->dtype, p + (size_t)i * es, v);
  }
}

static const dm_kernel_entry kernels[] = {
  DM_KERNEL_ENTRY(fill, cpu_fill),
  DM_KERNEL_ENTRY(copy, cpu_copy),
  DM_KERNEL_ENTRY(arange, cpu_arange),
  DM_KERNEL_ENTRY(philox, cpu_philox),
};
DM_REGISTER_KERNELS(DM_CPU, kernels)
