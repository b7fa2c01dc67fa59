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

typedef struct dm_file {
  char *path;              /* owned */
  const uint8_t *data;     /* mapped, or decompressed into the heap */
  int64_t size;
  bool mapped;
} dm_file;

/* Loads f->path into f->data and f->size (an empty file: data NULL, size 0). */
bool dm_file_load(dm_file *f, char *err);
/* Unmaps or frees the bytes and the path; a zeroed dm_file is fine. */
void dm_file_unload(dm_file *f);

#endif
