/*
** files.h — the files behind a corpus (internal to vm/data): a path named
** as a file, a directory or a glob becomes a sorted list of files, and each
** file becomes bytes in memory (raw files mapped, `.zst` decompressed).
**
** Every function reports failure as false with a message in err (at least
** DM_DATA_ERRMAX bytes) and raises nothing, so the caller can free what it
** built before it raises.
*/
#ifndef DM_DATA_FILES_H
#define DM_DATA_FILES_H

#include <stdbool.h>
#include <stdint.h>

#define DM_DATA_ERRMAX 1024

/* writes the message into err and returns false */
bool dm_data_fail(char *err, const char *fmt, ...);

typedef struct dm_pathlist { char **v; int n, cap; } dm_pathlist;

/* Appends the regular files a path names: the file itself; a directory's files,
** recursively, each level in sorted name order, hidden names skipped; or the
** matches of a glob (a path with * ? or [ that names nothing as it stands), in
** sorted order, directories among them walked. Nothing found is an error. */
bool dm_paths_collect(const char *path, dm_pathlist *out, char *err);
void dm_pathlist_free(dm_pathlist *l);

typedef struct dm_zframes dm_zframes;

typedef struct dm_file {
  char *path;              /* owned */
  const uint8_t *data;     /* its bytes in memory (mapped, or decompressed into the heap); NULL when
                              read in frames */
  int64_t size;            /* its bytes (decoded) */
  const uint8_t *mapping;  /* the file as it is on disk, mapped; NULL when nothing is */
  int64_t mapped_size;
  dm_zframes *frames;      /* a zstd file read in place, frame by frame (zframes.h) */
  bool decoded_whole;      /* a zstd file that could not be read in frames, decoded at open */
} dm_file;

bool dm_is_zst(const char *path);          /* named *.zst */

/* Decodes the zstd file at path as it is read, handing its decoded bytes to sink a piece at a
** time (a sink's false stops it, its message in err). Names a corrupted stream, a truncated one
** and an unreadable file, each with the compressed byte offset. */
typedef bool (*dm_zst_sink)(void *ctx, const uint8_t *bytes, size_t n, char *err);
bool dm_zst_decode(const char *path, dm_zst_sink sink, void *ctx, char *err);

/* Loads f->path: a raw file is mapped; a zstd file is mapped and read in place when its frames
** allow (zframes.h), else decoded whole into the heap. An empty file: size 0, nothing held. */
bool dm_file_load(dm_file *f, char *err);
/* Unmaps or frees the bytes and the path; a zeroed dm_file is fine. */
void dm_file_unload(dm_file *f);

#endif
