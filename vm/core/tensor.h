/*
** tensor.h — storages and strided views.
**
** A storage is a refcounted block of one device's memory. A tensor is a
** view: dtype, shape, strides (in elements) and an offset into a storage.
** Many tensors may share one storage. Tensors are refcounted too: the Lua
** binding holds one reference per userdata, the tape holds references to
** what backward needs, and C code that creates a tensor owns one reference
** until it hands it on or calls dm_release.
**
** dm_tensor_free() drops a tensor's hold on its storage at once, whatever
** its refcount; any later use raises "tensor was freed". Memory returns to
** its allocator when the last tensor over a storage lets go.
*/
#ifndef DM_TENSOR_H
#define DM_TENSOR_H

#include "core/dm.h"

typedef struct dm_storage {
  void *data;
  size_t nbytes;
  dm_device device;
  int refs;
  uint32_t version;        /* bumped by every in-place write; checked by backward */
} dm_storage;

struct dm_node;

typedef struct dm_tensor {
  int refs;
  dm_storage *storage;     /* NULL once freed */
  int64_t offset;          /* in elements */
  int ndim;
  int64_t shape[DM_MAXDIM];
  int64_t strides[DM_MAXDIM];
  dm_dtype dtype;
  dm_device device;
  bool requires_grad;      /* a leaf the user marked, or the output of a recorded op */
  struct dm_tensor *grad;  /* accumulated by backward (leaves only) */
  struct dm_node *node;    /* the op that made it, while the tape holds that op */
  uint64_t node_epoch;     /* the tape's epoch when node was set */
  int node_out;            /* which output of node this is */
} dm_tensor;

/* creation: contiguous, uninitialised, refs = 1 */
dm_tensor *dm_tensor_new(dm_device dev, dm_dtype dt, int ndim, const int64_t *shape);
dm_tensor *dm_tensor_like(const dm_tensor *t);
dm_tensor *dm_tensor_like_dtype(const dm_tensor *t, dm_dtype dt);
/* a view of base's storage; refs = 1; no autograd link */
dm_tensor *dm_tensor_view(const dm_tensor *base, int ndim, const int64_t *shape,
                          const int64_t *strides, int64_t offset);
/* a tensor over caller memory: the storage is not freed by dormouse (data files, pinned buffers) */
dm_tensor *dm_tensor_wrap(dm_device dev, dm_dtype dt, int ndim, const int64_t *shape, void *data);

void dm_retain(dm_tensor *t);
void dm_release(dm_tensor *t);        /* NULL is fine */
void dm_tensor_free(dm_tensor *t);    /* drop storage, grad and tape link now */
void dm_check_live(const dm_tensor *t);  /* raises if freed */

int64_t dm_numel(const dm_tensor *t);
bool dm_is_contiguous(const dm_tensor *t);
void *dm_data(const dm_tensor *t);    /* first element's address */
bool dm_same_shape(const dm_tensor *a, const dm_tensor *b);
void dm_contiguous_strides(int ndim, const int64_t *shape, int64_t *strides);
const char *dm_tensor_shape_str(const dm_tensor *t, char *buf, size_t n);

/* shape checks with clear messages; `what` names the op */
void dm_check_shape_equal(const char *what, const dm_tensor *a, const dm_tensor *b);
void dm_check_dtype_equal(const char *what, const dm_tensor *a, const dm_tensor *b);
void dm_check_device_equal(const char *what, const dm_tensor *a, const dm_tensor *b);
/* dims: accepts 0..ndim-1 (C) after the binding has turned Lua's 1-based dims into 0-based */
int dm_check_dim(const char *what, const dm_tensor *t, int64_t dim);
/* the broadcast of two shapes, or an error naming both */
int dm_broadcast_shape(const char *what, int na, const int64_t *sa, int nb, const int64_t *sb,
                       int64_t *out);

void dm_mark_written(dm_tensor *t);   /* bump the storage version after an in-place write */

#endif
