/* storages, views, refcounts, freeing, memory statistics, copies */
#include "check.h"
#include "core/core.h"
#include "core/alloc.h"
#include "core/autograd.h"

static void views_share_storage(void) {
  int64_t shape[2] = {3, 4};
  dm_tensor *t = dm_arange(DM_CPU, DM_F32, 0, 12, 1);
  CHECK(dm_numel(t) == 12 && t->ndim == 1);
  dm_tensor *m = dm_tensor_view(t, 2, shape, (int64_t[]){4, 1}, 0);
  dm_tensor *col = dm_tensor_view(t, 1, (int64_t[]){3}, (int64_t[]){4}, 1);  /* column 2 */
  CHECK(dm_is_contiguous(m));
  CHECK(!dm_is_contiguous(col));
  CHECK(t->storage == col->storage && t->storage->refs == 3);
  dm_tensor *c = dm_clone(col);
  float *p = dm_data(c);
  CHECK(p[0] == 1 && p[1] == 5 && p[2] == 9);
  dm_release(t);
  CHECK(col->storage->refs == 2);               /* the views keep the storage */
  dm_release(m);
  dm_release(col);
  dm_release(c);
}

static void free_returns_memory(void) {
  dm_mem_stats before = dm_memory_stats(DM_CPU);
  int64_t shape[1] = {1000};
  dm_tensor *t = dm_zeros(DM_CPU, DM_F64, 1, shape);
  dm_mem_stats during = dm_memory_stats(DM_CPU);
  CHECK(during.allocated - before.allocated == 8000);
  CHECK(during.count == before.count + 1);
  dm_tensor_free(t);                             /* storage goes now, the header stays */
  CHECK(dm_memory_stats(DM_CPU).allocated == before.allocated);
  EXPECT_ERROR(dm_data(t), "tensor was freed");
  EXPECT_ERROR(dm_clone(t), "tensor was freed");
  dm_release(t);
}

static void copy_casts_and_broadcasts(void) {
  int64_t s23[2] = {2, 3}, s3[1] = {3};
  dm_tensor *row = dm_arange(DM_CPU, DM_F64, 1, 4, 1);      /* 1 2 3 */
  dm_tensor *dst = dm_zeros(DM_CPU, DM_BF16, 2, s23);
  dm_copy_(dst, row);
  CHECK(dm_bf16_to_f32(((uint16_t *)dm_data(dst))[5]) == 3.0f);
  dm_tensor *bad = dm_zeros(DM_CPU, DM_F32, 1, (int64_t[]){4});
  EXPECT_ERROR(dm_copy_(bad, row), "cannot be copied");
  dm_tensor *i = dm_full(DM_CPU, DM_I32, 1, s3, -2.7);
  CHECK(((int32_t *)dm_data(i))[2] == -2);                  /* truncation toward zero */
  dm_release(row); dm_release(dst); dm_release(bad); dm_release(i);
}

static void shape_errors(void) {
  int64_t sa[2] = {2, 3}, sb[2] = {4, 3}, out[DM_MAXDIM];
  EXPECT_ERROR(dm_broadcast_shape("add", 2, sa, 2, sb, out), "[2, 3] and [4, 3]");
  int64_t sc[3] = {5, 1, 3};
  CHECK(dm_broadcast_shape("add", 3, sc, 2, sa, out) == 3 && out[0] == 5 && out[1] == 2 && out[2] == 3);
  EXPECT_ERROR(dm_zeros(DM_CPU, DM_F32, 1, (int64_t[]){-1}), "negative size");
  EXPECT_ERROR(dm_zeros(DM_META, DM_F32, 2, ((int64_t[]){(int64_t)1 << 40, (int64_t)1 << 40})), "too many elements");
  EXPECT_ERROR(dm_arange(DM_CPU, DM_F32, 0, 1e300, 1e-300), "too many elements");
}

static void random_is_addressed(void) {
  int64_t shape[1] = {10};
  dm_tensor *a = dm_rand_at(DM_CPU, DM_F32, 1, shape, 42, 3, true);
  dm_tensor *b = dm_rand_at(DM_CPU, DM_F32, 1, shape, 42, 3, true);
  dm_tensor *c = dm_rand_at(DM_CPU, DM_F32, 1, shape, 42, 4, true);
  CHECK(memcmp(dm_data(a), dm_data(b), 40) == 0);
  CHECK(((float *)dm_data(a))[4] == ((float *)dm_data(c))[0]);   /* offset counts blocks of 4 */
  dm_manual_seed(9);
  dm_tensor *d = dm_randn(DM_CPU, DM_F32, 1, shape);
  uint64_t seed, off;
  dm_rng_state(&seed, &off);
  CHECK(seed == 9 && off == 3);                                   /* ceil(10 / 4) counters */
  EXPECT_ERROR(dm_rand(DM_CPU, DM_I32, 1, shape), "float type");
  EXPECT_ERROR(dm_randn(DM_CPU, DM_F32, 1, (int64_t[]){-3}), "negative size");
  dm_rng_state(&seed, &off);
  CHECK(seed == 9 && off == 3);                                   /* refused draws do not move it */
  dm_release(a); dm_release(b); dm_release(c); dm_release(d);
}

static void meta_tensors_take_no_memory(void) {
  int64_t shape[2] = {100000, 1000};
  dm_mem_stats cpu = dm_memory_stats(DM_CPU);
  dm_tensor *t = dm_zeros(DM_META, DM_F32, 2, shape);
  CHECK(dm_memory_stats(DM_META).allocated == 400000000);
  CHECK(dm_memory_stats(DM_CPU).allocated == cpu.allocated);
  dm_release(t);
  CHECK(dm_memory_stats(DM_META).allocated == 0);
}

int main(void) {
  check_begin();
  views_share_storage();
  free_returns_memory();
  copy_casts_and_broadcasts();
  shape_errors();
  random_is_addressed();
  meta_tensors_take_no_memory();
  return check_end();
}
