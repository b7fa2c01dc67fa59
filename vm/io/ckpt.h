/*
** ckpt.h — checkpoint I/O: safetensors files, atomic writes, checksums
** (safetensors.c, json_read.c, xxh64.c, fileio.c).
**
** A safetensors file is an 8-byte little-endian header length N, N bytes of
** JSON header, then the raw little-endian data of every tensor:
**
**   {"__metadata__": {"key": "value", ...},
**    "name": {"dtype": "F32", "shape": [2, 3], "data_offsets": [begin, end]}, ...}
**
** Offsets count from the first byte after the header. We write names sorted,
** tensors packed in that order with no gaps, and the header padded with
** spaces so the data starts at a multiple of 8. Every file is written to
** "<path>.tmp", fsynced and renamed, so nothing half-written is ever found
** under the final name.
**
** Reading is strict: the header must be well-formed JSON of that shape,
** every dtype known, every shape × dtype size equal to its byte range, the
** ranges must tile the data exactly (no gap, no overlap), and the file must
** end where the data ends. Any violation is an error that names the file and
** what is wrong. Tensors are read (not memory-mapped) into fresh contiguous
** CPU storage: the checkpoint file can then be replaced or deleted while the
** tensors live on, and the storage is an ordinary dm_alloc block.
*/
#ifndef DM_CKPT_H
#define DM_CKPT_H

#include "core/tensor.h"

/* What a safetensors file held. Tensors are sorted by name; the struct owns
** one reference to each: dm_safetensors_free releases those still set, so a
** caller that takes one over sets its slot to NULL. */
typedef struct dm_safetensors {
  int n;
  char **names;
  dm_tensor **tensors;
  int nmeta;
  char **meta_keys;       /* the "__metadata__" object, sorted by key */
  char **meta_values;
} dm_safetensors;

/* Write n named tensors (any device but meta, any strides) and nmeta string
** pairs. Names must be unique, non-empty and not "__metadata__". */
void dm_safetensors_write(const char *path, int n, const char *const *names,
                          dm_tensor *const *tensors, int nmeta,
                          const char *const *meta_keys, const char *const *meta_values);
/* the same, tensor i written as the file dtype as[i] where it is not NULL (F8_E4M3 for u8 codes) */
void dm_safetensors_write_as(const char *path, int n, const char *const *names, dm_tensor *const *tensors,
                             const char *const *as, int nmeta, const char *const *meta_keys,
                             const char *const *meta_values);
dm_safetensors *dm_safetensors_read(const char *path);
void dm_safetensors_free(dm_safetensors *st);    /* NULL is fine */

/* XXH64 (the xxHash 64-bit algorithm, bit-exact) of a buffer, and of a whole
** file; *size receives the file's length in bytes. */
uint64_t dm_xxh64(const void *data, size_t n, uint64_t seed);
uint64_t dm_file_checksum(const char *path, int64_t *size);

/* Small filesystem helpers for checkpoint directories. */
void dm_write_file_atomic(const char *path, const void *data, size_t n);   /* tmp, fsync, rename */
/* a file a user names for output: "-" is standard output; a regular file or a new one is written
** atomically, through a symlink to its target; a device, FIFO or socket is written through, never
** replaced; a directory or a dangling symlink is refused */
void dm_write_output(const char *path, const void *data, size_t n);
void dm_fsync_dir(const char *path);       /* make renames inside `path` durable */
void dm_mkdirs(const char *path);          /* mkdir -p */
/* rm -r without a shell: a folder and everything below it, links removed as links (never followed),
** not past a mount point; a path that does not exist is nothing to do; ".", ".." and "" are refused */
void dm_remove_tree(const char *path);

#endif
