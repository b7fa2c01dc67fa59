/*
** fileio.h — what the checkpoint files' code shares (fileio.c): host buffers that raise
** dm_error on failure (core/alloc.h's), a guard that cleans up when an error passes, a writer that writes
** "<path>.tmp", fsyncs and renames, and regular files opened for reading. Not an API:
** ckpt.h is that.
*/
#ifndef DM_FILEIO_H
#define DM_FILEIO_H

#include <stddef.h>
#include <sys/stat.h>
#include "core/dm.h"
#include "core/alloc.h"                     /* dm_xmalloc, dm_xcalloc */

/* dm_error never returns. A function that holds files and buffers across calls that may
** raise installs a guard: when an error passes, the guard runs its cleanup, puts the
** previous handler back and hands the message on. */
typedef struct dm_guard {
  dm_error_handler prev;
  void *prev_ud;
  void (*cleanup)(void *);
  void *arg;
} dm_guard;
void dm_guard_begin(dm_guard *g, void (*cleanup)(void *), void *arg);
void dm_guard_end(dm_guard *g);

/* the atomic file writer: open makes "<path>.tmp", commit fsyncs, renames it into place and
** fsyncs the folder; abort removes it (the caller's guard runs abort when an error passes) */
typedef struct dm_afile {
  const char *path;
  char *tmp;      /* NULL once committed or aborted */
  int fd;
} dm_afile;
void dm_afile_open(dm_afile *f, const char *path);
void dm_afile_write(dm_afile *f, const void *data, size_t n);
void dm_afile_commit(dm_afile *f);
void dm_afile_abort(dm_afile *f);

/* open path for reading only when it is a regular file (a FIFO, a device, a socket or a
** folder is refused, naming what it is, before a byte is read); *sb receives its stat */
int dm_open_regular(const char *path, struct stat *sb);

#endif
