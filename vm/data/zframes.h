/*
** zframes.h — a zstd file read in place, one frame at a time (internal to
** vm/data). A file written in frames of bounded size (dm_zwriter, or any
** zstd tool that cuts frames) is indexed at open — by its seek table when
** it ends with one (zstd's seekable format), else by walking the frames'
** headers — and a read decodes only the frames it touches, into a small
** cache of decoded frames that a corpus's files share. Memory stays at the
** cache's slots times the largest frame, whatever the file's size.
*/
#ifndef DM_DATA_ZFRAMES_H
#define DM_DATA_ZFRAMES_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#define DM_ZFRAME_MAX ((int64_t)16 << 20)   /* a larger frame (or one of unknown size): decoded whole at open */
#define DM_ZCACHE_SLOTS 8                   /* decoded frames a corpus keeps */

typedef struct dm_zframes dm_zframes;

/* Indexes comp[0, n). Returns the index, or NULL when the file cannot be read in frames (a frame
** above DM_ZFRAME_MAX or without its size, a truncated or corrupted header): the caller then
** decodes it whole, which names any error. NULL with *oom set: out of host memory. */
dm_zframes *dm_zframes_index(const uint8_t *comp, int64_t n, bool *oom);
void dm_zframes_free(dm_zframes *z);                       /* NULL is fine */
int64_t dm_zframes_size(const dm_zframes *z);              /* the decoded bytes */
int dm_zframes_count(const dm_zframes *z);

typedef struct dm_zcache dm_zcache;
dm_zcache *dm_zcache_new(void);                            /* NULL: out of host memory */
void dm_zcache_free(dm_zcache *c);                         /* NULL is fine */

/* Decoded bytes [at, at + n) of z into dst, through the cache (thread-safe). False with a
** message naming path and the frame in err (at least 256 bytes) on a corrupted frame. */
bool dm_zframes_read(const dm_zframes *z, dm_zcache *cache, const char *path, int64_t at, int64_t n,
                     uint8_t *dst, char *err, size_t errlen);

/* ---- writing ----------------------------------------------------------------------------
** A zstd file of frames of frame_bytes decoded bytes each (the last shorter), each with its
** checksum, then a seek table: any zstd tool decodes it as one stream, and a corpus reads it in
** place. Written to PATH.tmp and renamed at close, so PATH is never half-written. */
typedef struct dm_zwriter dm_zwriter;
/* NULL with a message in err (DM_DATA_ERRMAX bytes) on a bad argument or an unwritable path */
dm_zwriter *dm_zwriter_open(const char *path, int64_t frame_bytes, int level, char *err);
bool dm_zwriter_add(dm_zwriter *w, const uint8_t *bytes, int64_t n, char *err);
/* a file's bytes: a raw file as it is, a .zst file decoded */
bool dm_zwriter_add_file(dm_zwriter *w, const char *path, char *err);
/* the last frame and the seek table, then the rename; *written (when not NULL): the file's
** bytes. Frees w either way. */
bool dm_zwriter_close(dm_zwriter *w, int64_t *written, char *err);
void dm_zwriter_abort(dm_zwriter *w);                      /* removes PATH.tmp and frees w */
int64_t dm_zwriter_bytes_in(const dm_zwriter *w);

#endif
