/*
** tensor.c — storages, views, refcounts and the shape checks shared by ops.
*/
#include <stdlib.h>
#include <stdio.h>
#include <string.h>
#include "core/tensor.h"
#include "core/alloc.h"
#include "core/autograd.h"


/* The device memory first: if dm_alloc raises, nothing else was allocated. */
static dm_storage *storage_new(dm_device dev, size_t nbytes, void *wrapped) {
  void *data = wrapped ? wrapped : dm_alloc(dev, nbytes);
  dm_storage *s = calloc(1, sizeof *s);
  if (!s) {
    if (!wrapped) dm_free(dev, data, nbytes);
    dm_error("out of host memory for tensor metadata");
  }
  s->device = dev;
  s->nbytes = nbytes;
  s->refs = 1;
  s->data = data;
  if (wrapped) s->refs |= 0x40000000;                         /* high bit: not ours */
  return s;
}

static void storage_release(dm_storage *s) {
  if (!s) return;
  int owned = !(s->refs & 0x40000000);
  int refs = (s->refs & 0x3fffffff) - 1;
  s->refs = (s->refs & 0x40000000) | refs;
  if (refs > 0) return;
  if (owned) dm_free(s->device, s->data, s->nbytes);
  free(s);
}

void dm_contiguous_strides(int ndim, const int64_t *shape, int64_t *strides) {
  int64_t st = 1;
  for (int d = ndim - 1; d >= 0; d--) { strides[d] = st; st *= shape[d] > 0 ? shape[d] : 1; }
}

static void check_shape(int ndim, const int64_t *shape) {
  char buf[128];
  if (ndim < 0 || ndim > DM_MAXDIM) dm_error("a tensor has at most %d dims, got %d", DM_MAXDIM, ndim);
  int64_t n = 1;
  for (int d = 0; d < ndim; d++) {
    if (shape[d] < 0) dm_error("negative size in shape %s", dm_shape_str(buf, sizeof buf, ndim, shape));
    if (__builtin_mul_overflow(n, shape[d], &n) || n > ((int64_t)1 << 56))
      dm_error("shape %s has too many elements", dm_shape_str(buf, sizeof buf, ndim, shape));
  }
}

/* The header, for a shape already checked; `storage` is released if this fails. */
static dm_tensor *tensor_header(dm_device dev, dm_dtype dt, int ndim, const int64_t *shape,
                                dm_storage *storage) {
  dm_tensor *t = calloc(1, sizeof *t);
  if (!t) { storage_release(storage); dm_error("out of host memory for tensor metadata"); }
  t->storage = storage;
  t->refs = 1;
  t->ndim = ndim;
  t->dtype = dt;
  t->device = dev;
  if (ndim) memcpy(t->shape, shape, sizeof(int64_t) * (size_t)ndim);
  dm_contiguous_strides(ndim, shape, t->strides);
  return t;
}

static int64_t shape_numel(int ndim, const int64_t *shape) {
  int64_t n = 1;
  for (int d = 0; d < ndim; d++) n *= shape[d];
  return n;
}

dm_tensor *dm_tensor_new(dm_device dev, dm_dtype dt, int ndim, const int64_t *shape) {
  check_shape(ndim, shape);
  dm_storage *s = storage_new(dev, (size_t)shape_numel(ndim, shape) * dm_dtype_size(dt), NULL);
  return tensor_header(dev, dt, ndim, shape, s);
}

dm_tensor *dm_tensor_wrap(dm_device dev, dm_dtype dt, int ndim, const int64_t *shape, void *data) {
  check_shape(ndim, shape);
  dm_storage *s = storage_new(dev, (size_t)shape_numel(ndim, shape) * dm_dtype_size(dt), data);
  return tensor_header(dev, dt, ndim, shape, s);
}

dm_tensor *dm_tensor_like(const dm_tensor *t) {
  return dm_tensor_new(t->device, t->dtype, t->ndim, t->shape);
}

dm_tensor *dm_tensor_like_dtype(const dm_tensor *t, dm_dtype dt) {
  return dm_tensor_new(t->device, dt, t->ndim, t->shape);
}

dm_tensor *dm_tensor_view(const dm_tensor *base, int ndim, const int64_t *shape,
                          const int64_t *strides, int64_t offset) {
  dm_check_live(base);
  check_shape(ndim, shape);
  base->storage->refs++;
  dm_tensor *t = tensor_header(base->device, base->dtype, ndim, shape, base->storage);
  if (ndim) memcpy(t->strides, strides, sizeof(int64_t) * (size_t)ndim);
  t->offset = offset;
  return t;
}

void dm_retain(dm_tensor *t) { t->refs++; }

static void drop_contents(dm_tensor *t) {
  storage_release(t->storage);
  t->storage = NULL;
  dm_release(t->grad);
  t->grad = NULL;
  t->node = NULL;
}

void dm_release(dm_tensor *t) {
  if (!t || --t->refs > 0) return;
  drop_contents(t);
  free(t);
}

void dm_tensor_free(dm_tensor *t) { drop_contents(t); }

void dm_check_live(const dm_tensor *t) {
  if (!t->storage) dm_error("tensor was freed (by :free() or a <close> scope); it can no longer be used");
}

int64_t dm_numel(const dm_tensor *t) { return shape_numel(t->ndim, t->shape); }

bool dm_is_contiguous(const dm_tensor *t) {
  int64_t st = 1;
  for (int d = t->ndim - 1; d >= 0; d--) {
    if (t->shape[d] != 1 && t->strides[d] != st) return false;
    st *= t->shape[d];
  }
  return true;
}

void *dm_data(const dm_tensor *t) {
  dm_check_live(t);
  return (char *)t->storage->data + t->offset * (int64_t)dm_dtype_size(t->dtype);
}

bool dm_same_shape(const dm_tensor *a, const dm_tensor *b) {
  if (a->ndim != b->ndim) return false;
  for (int d = 0; d < a->ndim; d++) if (a->shape[d] != b->shape[d]) return false;
  return true;
}

const char *dm_tensor_shape_str(const dm_tensor *t, char *buf, size_t n) {
  return dm_shape_str(buf, n, t->ndim, t->shape);
}

void dm_check_shape_equal(const char *what, const dm_tensor *a, const dm_tensor *b) {
  char sa[128], sb[128];
  if (!dm_same_shape(a, b))
    dm_error("%s: shape mismatch, %s and %s", what, dm_tensor_shape_str(a, sa, sizeof sa),
             dm_tensor_shape_str(b, sb, sizeof sb));
}

void dm_check_dtype_equal(const char *what, const dm_tensor *a, const dm_tensor *b) {
  if (a->dtype != b->dtype)
    dm_error("%s: dtype mismatch, %s and %s", what, dm_dtype_name(a->dtype), dm_dtype_name(b->dtype));
}

void dm_check_device_equal(const char *what, const dm_tensor *a, const dm_tensor *b) {
  if (a->device != b->device)
    dm_error("%s: tensors on different devices, %s and %s", what, dm_device_name(a->device),
             dm_device_name(b->device));
}

int dm_check_dim(const char *what, const dm_tensor *t, int64_t dim) {
  if (dim < 0 || dim >= (t->ndim ? t->ndim : 1))
    dm_error("%s: dim %lld is out of range for a tensor of %d dims (dims count from 1)", what,
             (long long)dim + 1, t->ndim);
  return (int)dim;
}

int dm_broadcast_shape(const char *what, int na, const int64_t *sa, int nb, const int64_t *sb,
                       int64_t *out) {
  int n = na > nb ? na : nb;
  for (int i = 0; i < n; i++) {
    int64_t x = i < n - na ? 1 : sa[i - (n - na)];
    int64_t y = i < n - nb ? 1 : sb[i - (n - nb)];
    if (x != y && x != 1 && y != 1) {
      char bufa[128], bufb[128];
      dm_error("%s: shapes %s and %s do not broadcast", what, dm_shape_str(bufa, sizeof bufa, na, sa),
               dm_shape_str(bufb, sizeof bufb, nb, sb));
    }
    out[i] = x == 1 ? y : x;
  }
  return n;
}

void dm_mark_written(dm_tensor *t) { t->storage->version++; }
