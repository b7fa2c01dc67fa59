/*
** fileio.c — the plumbing of the checkpoint files (fileio.h): host buffers that raise on
** failure, the error guard, the atomic file writer, regular files opened for reading, and
** the directory helpers (ckpt.h).
*/
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <ftw.h>
#include <sys/stat.h>
#include <unistd.h>
#include "io/ckpt.h"
#include "io/fileio.h"
#include "core/core.h"

/* ---- cleanup on error (fileio.h): code between begin and end can raise freely with a
** precise message and leak nothing ---------------------------------------------------------- */

static void guard_handler(const char *msg, void *ud) {
  dm_guard *g = ud;
  dm_set_error_handler(g->prev, g->prev_ud);
  g->cleanup(g->arg);
  if (g->prev) g->prev(msg, g->prev_ud);
}

void dm_guard_begin(dm_guard *g, void (*cleanup)(void *), void *arg) {
  dm_get_error_handler(&g->prev, &g->prev_ud);
  g->cleanup = cleanup;
  g->arg = arg;
  dm_set_error_handler(guard_handler, g);
}

void dm_guard_end(dm_guard *g) { dm_set_error_handler(g->prev, g->prev_ud); }

/* ---- the atomic file writer: "<path>.tmp", fsync, rename ---------------------------- */

void dm_afile_abort(dm_afile *f) {
  if (f->fd >= 0) close(f->fd);
  if (f->tmp) { unlink(f->tmp); free(f->tmp); }
  f->fd = -1;
  f->tmp = NULL;
}

/* the caller's guard runs dm_afile_abort if this raises */
void dm_afile_open(dm_afile *f, const char *path) {
  f->path = path;
  f->fd = -1;
  f->tmp = NULL;
  size_t n = strlen(path) + 5;
  char *tmp = dm_xmalloc(n);
  snprintf(tmp, n, "%s.tmp", path);
  f->tmp = tmp;
  f->fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (f->fd < 0) dm_error("%s: cannot create %s: %s", path, tmp, strerror(errno));
}

/* all of data to fd; `what` names it in an error */
static void write_all(int fd, const char *what, const void *data, size_t n) {
  const char *p = data;
  while (n > 0) {
    ssize_t w = write(fd, p, n > ((size_t)1 << 30) ? ((size_t)1 << 30) : n);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) dm_error("%s: write failed: %s", what, w < 0 ? strerror(errno) : "no progress");
    p += w;
    n -= (size_t)w;
  }
}

void dm_afile_write(dm_afile *f, const void *data, size_t n) { write_all(f->fd, f->path, data, n); }

static void dirname_of(const char *path, char *dir, size_t n) {
  const char *slash = strrchr(path, '/');
  if (!slash) snprintf(dir, n, ".");
  else if (slash == path) snprintf(dir, n, "/");
  else snprintf(dir, n, "%.*s", (int)(slash - path), path);
}

void dm_afile_commit(dm_afile *f) {
  if (fsync(f->fd) != 0) dm_error("%s: fsync failed: %s", f->path, strerror(errno));
  int fd = f->fd;
  f->fd = -1;
  if (close(fd) != 0) dm_error("%s: close failed: %s", f->path, strerror(errno));
  if (rename(f->tmp, f->path) != 0)
    dm_error("%s: cannot rename %s into place: %s", f->path, f->tmp, strerror(errno));
  free(f->tmp);
  f->tmp = NULL;
  char dir[PATH_MAX];
  dirname_of(f->path, dir, sizeof dir);
  dm_fsync_dir(dir);
}

static void af_cleanup(void *ud) { dm_afile_abort(ud); }

static void close_fd(void *ud) { close(*(int *)ud); }

/* A device, FIFO or socket: written through in place. O_NONBLOCK makes the open of a FIFO
** without a reader fail (ENXIO) rather than wait; the writes then block as usual. */
static void write_through(const char *path, const void *data, size_t n) {
  int fd = open(path, O_WRONLY | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0)
    dm_error("%s: cannot open for writing: %s", path, errno == ENXIO ? "a FIFO with no reader" : strerror(errno));
  int flags = fcntl(fd, F_GETFL);
  if (flags >= 0) fcntl(fd, F_SETFL, flags & ~O_NONBLOCK);
  dm_guard g;
  dm_guard_begin(&g, close_fd, &fd);
  write_all(fd, path, data, n);
  dm_guard_end(&g);
  if (close(fd) != 0) dm_error("%s: close failed: %s", path, strerror(errno));
}

void dm_write_output(const char *path, const void *data, size_t n) {
  if (strcmp(path, "-") == 0) {
    write_all(STDOUT_FILENO, "standard output", data, n);
    return;
  }
  struct stat sb;
  if (stat(path, &sb) != 0) {                    /* nothing there, or a link to nothing */
    if (errno != ENOENT) dm_error("%s: cannot stat: %s", path, strerror(errno));
    if (lstat(path, &sb) == 0) dm_error("%s: is a symbolic link to nothing; name its target or another file", path);
    dm_write_file_atomic(path, data, n);
    return;
  }
  if (S_ISDIR(sb.st_mode)) dm_error("%s: is a directory; name a file in it", path);
  if (!S_ISREG(sb.st_mode)) { write_through(path, data, n); return; }
  char target[PATH_MAX];                         /* a symlink's target is replaced, the link stays */
  if (!realpath(path, target)) dm_error("%s: cannot resolve: %s", path, strerror(errno));
  dm_write_file_atomic(target, data, n);
}

void dm_write_file_atomic(const char *path, const void *data, size_t n) {
  dm_afile f = {.fd = -1};
  dm_guard g;
  dm_guard_begin(&g, af_cleanup, &f);
  dm_afile_open(&f, path);
  dm_afile_write(&f, data, n);
  dm_afile_commit(&f);
  dm_guard_end(&g);
}

/* A file opened for reading only when it is a regular one: O_NONBLOCK keeps a FIFO from blocking
** the open, and the check refuses it (and devices, sockets, folders) before a byte is read. */
static const char *file_kind(mode_t m) {
  return S_ISFIFO(m) ? "a FIFO" : S_ISDIR(m) ? "a directory" : S_ISSOCK(m) ? "a socket"
       : S_ISCHR(m) || S_ISBLK(m) ? "a device" : "not a plain file";
}

int dm_open_regular(const char *path, struct stat *sb) {
  int fd = open(path, O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0) dm_error("%s: cannot open: %s", path, strerror(errno));
  if (fstat(fd, sb) != 0) { int e = errno; close(fd); dm_error("%s: cannot stat: %s", path, strerror(e)); }
  if (!S_ISREG(sb->st_mode)) { close(fd); dm_error("%s: is %s, not a regular file", path, file_kind(sb->st_mode)); }
  return fd;
}

/* ---- directories ------------------------------------------------------------------------ */

void dm_fsync_dir(const char *path) {
  int fd = open(path, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) dm_error("%s: cannot open directory: %s", path, strerror(errno));
  int rc = fsync(fd), e = errno;
  close(fd);
  if (rc != 0 && e != EINVAL) dm_error("%s: fsync of the directory failed: %s", path, strerror(e));
}

void dm_mkdirs(const char *path) {
  char buf[PATH_MAX];
  if (!*path) dm_error("mkdirs: empty path");
  if (snprintf(buf, sizeof buf, "%s", path) >= (int)sizeof buf)
    dm_error("cannot create directory: path too long (%zu bytes): %.60s...", strlen(path), path);
  for (char *p = buf + 1; ; p++) {
    if (*p != '/' && *p != 0) continue;
    char c = *p;
    *p = 0;
    if (mkdir(buf, 0755) != 0 && errno != EEXIST) dm_error("%s: cannot create directory %s: %s", path, buf, strerror(errno));
    *p = c;
    if (!c) break;
  }
  struct stat sb;
  if (stat(path, &sb) != 0 || !S_ISDIR(sb.st_mode)) dm_error("%s: exists and is not a directory", path);
}

/* One entry of dm_remove_tree's walk, deepest first: a link is removed as a link (FTW_PHYS never
** follows one), a directory once it is empty. */
static int remove_entry(const char *path, const struct stat *sb, int flag, struct FTW *ftw) {
  (void)sb; (void)ftw;
  return (flag == FTW_DP ? rmdir(path) : unlink(path)) == 0 ? 0 : errno;
}

void dm_remove_tree(const char *path) {
  const char *base = strrchr(path, '/');
  base = base ? base + 1 : path;
  if (!*path || !*base || !strcmp(base, ".") || !strcmp(base, ".."))
    dm_error("remove: refusing to remove '%s' (a named folder is needed, not the current, parent or root one)", path);
  struct stat sb;
  if (lstat(path, &sb) != 0) {
    if (errno == ENOENT) return;
    dm_error("%s: cannot remove: %s", path, strerror(errno));
  }
  if (!S_ISDIR(sb.st_mode)) {                     /* a file or a link: itself, never what a link points to */
    if (unlink(path) != 0) dm_error("%s: cannot remove: %s", path, strerror(errno));
    return;
  }
  int rc = nftw(path, remove_entry, 16, FTW_DEPTH | FTW_PHYS | FTW_MOUNT);
  if (rc != 0) dm_error("%s: cannot remove all of it: %s", path, strerror(rc > 0 ? rc : errno));
}
