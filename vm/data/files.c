/*
** files.c — the files behind a corpus: listing paths (files, directories,
** globs) and loading one file, mapped or decompressed. See files.h.
**
** A mapped file that another process shortens turns the next read past its
** new end into a SIGBUS; the mappings are registered so that the handler can
** name the file instead of dying silently.
*/
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <glob.h>
#include <pthread.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zstd.h>
#include "data/files.h"
#include "data/zframes.h"

bool dm_data_fail(char *err, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(err, DM_DATA_ERRMAX, fmt, ap);
  va_end(ap);
  return false;
}

/* ---- the file list --------------------------------------------------------------------- */

static bool dm_pathlist_take(dm_pathlist *l, char *s, char *err) {
  if (s && l->n == l->cap) {
    int cap = l->cap ? 2 * l->cap : 16;
    char **v = realloc(l->v, sizeof *v * (size_t)cap);
    if (v) { l->v = v; l->cap = cap; }
  }
  if (!s || l->n == l->cap) { free(s); return dm_data_fail(err, "corpus: out of host memory listing files"); }
  l->v[l->n++] = s;
  return true;
}

void dm_pathlist_free(dm_pathlist *l) {
  for (int i = 0; i < l->n; i++) free(l->v[i]);
  free(l->v);
  *l = (dm_pathlist){0};
}

static char *join_path(const char *dir, const char *name) {
  size_t nd = strlen(dir);
  bool slash = nd > 0 && dir[nd - 1] == '/';
  char *p = malloc(nd + strlen(name) + 2);
  if (p) sprintf(p, slash ? "%s%s" : "%s/%s", dir, name);
  return p;
}

static int cmp_str(const void *a, const void *b) { return strcmp(*(char *const *)a, *(char *const *)b); }

static bool walk(const char *dir, dm_pathlist *out, char *err);

/* a directory's entries in sorted order, hidden names skipped; directories recursed */
static bool walk_entries(const char *dir, dm_pathlist *names, dm_pathlist *out, char *err) {
  if (names->n > 1) qsort(names->v, (size_t)names->n, sizeof *names->v, cmp_str);
  for (int i = 0; i < names->n; i++) {
    char *path = join_path(dir, names->v[i]);
    struct stat st;
    if (!path) return dm_data_fail(err, "corpus: out of host memory listing files");
    bool ok = true;
    if (stat(path, &st) != 0) ok = dm_data_fail(err, "corpus: cannot open '%s': %s", path, strerror(errno));
    else if (S_ISDIR(st.st_mode)) ok = walk(path, out, err);
    else if (S_ISREG(st.st_mode)) { ok = dm_pathlist_take(out, path, err); path = NULL; }
    free(path);
    if (!ok) return false;
  }
  return true;
}

static bool walk(const char *dir, dm_pathlist *out, char *err) {
  DIR *d = opendir(dir);
  if (!d) return dm_data_fail(err, "corpus: cannot read directory '%s': %s", dir, strerror(errno));
  dm_pathlist names = {0};
  bool ok = true;
  for (struct dirent *e; ok && (e = readdir(d));)
    if (e->d_name[0] != '.') ok = dm_pathlist_take(&names, strdup(e->d_name), err);
  closedir(d);
  if (ok) ok = walk_entries(dir, &names, out, err);
  dm_pathlist_free(&names);
  return ok;
}

/* a regular file, or a directory's files */
static bool collect_one(const char *path, dm_pathlist *out, char *err) {
  struct stat st;
  if (stat(path, &st) != 0) return dm_data_fail(err, "corpus: cannot open '%s': %s", path, strerror(errno));
  if (S_ISREG(st.st_mode)) return dm_pathlist_take(out, strdup(path), err);
  if (!S_ISDIR(st.st_mode)) return dm_data_fail(err, "corpus: '%s' is neither a regular file nor a directory", path);
  int before = out->n;
  if (!walk(path, out, err)) return false;
  if (out->n == before)
    return dm_data_fail(err, "corpus: directory '%s' holds no files (hidden names are skipped)", path);
  return true;
}

static bool is_glob(const char *path) { return strpbrk(path, "*?[") != NULL; }

/* a glob's matches in sorted order (glob sorts them), each a file or a directory */
static bool collect_glob(const char *pattern, dm_pathlist *out, char *err) {
  glob_t g;
  int rc = glob(pattern, GLOB_ERR, NULL, &g);
  if (rc == GLOB_NOMATCH) return dm_data_fail(err, "corpus: '%s' matches no file", pattern);
  if (rc != 0) {
    globfree(&g);
    return dm_data_fail(err, "corpus: cannot expand '%s': %s", pattern,
                        rc == GLOB_NOSPACE ? "out of host memory" : "a directory could not be read");
  }
  bool ok = true;
  for (size_t i = 0; ok && i < g.gl_pathc; i++) ok = collect_one(g.gl_pathv[i], out, err);
  globfree(&g);
  return ok;
}

bool dm_paths_collect(const char *path, dm_pathlist *out, char *err) {
  struct stat st;
  if (is_glob(path) && stat(path, &st) != 0) return collect_glob(path, out, err);
  return collect_one(path, out, err);
}

/* ---- mapped files that shrink ------------------------------------------------------------
** A mapped file cut short by another process makes the next read past its new end a SIGBUS.
** The mappings are registered here; a SIGBUS inside one ends the process with a message naming
** the file (exit status 1) instead of a signal's death; any other SIGBUS stays the default. The
** handler reads the table only (plain stores under a mutex add and remove its entries). */
#define MAPS_MAX 4096

static struct { const uint8_t *lo, *hi; const char *path; } maps[MAPS_MAX];
static pthread_mutex_t maps_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_once_t maps_once = PTHREAD_ONCE_INIT;

static void say(const char *s) {
  ssize_t r = write(2, s, strlen(s));
  (void)r;
}

static void on_sigbus(int sig, siginfo_t *si, void *ctx) {
  (void)ctx;
  const uint8_t *a = si->si_addr;
  for (int i = 0; i < MAPS_MAX; i++) {
    const char *path = maps[i].path;
    if (path && a >= maps[i].lo && a < maps[i].hi) {
      say("dormouse: corpus: '");
      say(path);
      say("' became shorter while it was being read (another program truncated or rewrote it); "
          "the run stops. Its checkpoints are complete: resume once the corpus is whole again.\n");
      _exit(1);
    }
  }
  signal(sig, SIG_DFL);                   /* not ours: the default death, at the same place */
}

static void maps_install(void) {
  struct sigaction sa;
  memset(&sa, 0, sizeof sa);
  sa.sa_sigaction = on_sigbus;
  sa.sa_flags = SA_SIGINFO;
  sigemptyset(&sa.sa_mask);
  sigaction(SIGBUS, &sa, NULL);
}

static void maps_add(const dm_file *p) {
  pthread_once(&maps_once, maps_install);
  pthread_mutex_lock(&maps_lock);
  for (int i = 0; i < MAPS_MAX; i++)
    if (!maps[i].path) {
      maps[i].lo = p->mapping;
      maps[i].hi = p->mapping + p->mapped_size;
      maps[i].path = p->path;          /* set last: the handler tests it first */
      break;
    }
  pthread_mutex_unlock(&maps_lock);
}

static void maps_remove(const dm_file *p) {
  pthread_mutex_lock(&maps_lock);
  for (int i = 0; i < MAPS_MAX; i++)
    if (maps[i].path && maps[i].lo == p->mapping) { maps[i].path = NULL; break; }
  pthread_mutex_unlock(&maps_lock);
}

/* ---- loading one file ------------------------------------------------------------------ */

static bool map_file(dm_file *p, char *err) {
  int fd = open(p->path, O_RDONLY | O_CLOEXEC);
  if (fd < 0) return dm_data_fail(err, "corpus: cannot read '%s': %s", p->path, strerror(errno));
  struct stat st;
  if (fstat(fd, &st) != 0) {
    close(fd);
    return dm_data_fail(err, "corpus: cannot read '%s': %s", p->path, strerror(errno));
  }
  if (st.st_size > 0) {
    void *m = mmap(NULL, (size_t)st.st_size, PROT_READ, MAP_PRIVATE, fd, 0);
    if (m == MAP_FAILED) {
      close(fd);
      return dm_data_fail(err, "corpus: cannot map '%s': %s", p->path, strerror(errno));
    }
    p->mapping = m;
    p->mapped_size = (int64_t)st.st_size;
    maps_add(p);
  }
  close(fd);
  return true;
}

static bool grow(uint8_t **buf, size_t *cap, size_t need) {
  size_t c = *cap ? *cap : (size_t)1 << 20;
  while (c < need) c *= 2;
  uint8_t *b = realloc(*buf, c);
  if (!b) return false;
  *buf = b;
  *cap = c;
  return true;
}

bool dm_zst_decode(const char *path, dm_zst_sink sink, void *ctx, char *err) {
  FILE *fp = fopen(path, "rb");
  if (!fp) return dm_data_fail(err, "corpus: cannot read '%s': %s", path, strerror(errno));
  ZSTD_DCtx *z = ZSTD_createDCtx();
  size_t in_cap = ZSTD_DStreamInSize(), out_cap = ZSTD_DStreamOutSize(), last = 1;   /* 0: a frame just ended */
  uint8_t *in = malloc(in_cap), *out = malloc(out_cap);
  bool ok = z && in && out ? true : dm_data_fail(err, "corpus: out of host memory opening '%s'", path);
  int64_t base = 0;                                /* the compressed offset of the chunk being decoded */
  for (size_t n; ok && (n = fread(in, 1, in_cap, fp)) > 0; base += (int64_t)n) {
    ZSTD_inBuffer ib = {in, n, 0};
    bool full = false;
    while (ok && (ib.pos < ib.size || full)) {
      ZSTD_outBuffer ob = {out, out_cap, 0};
      last = ZSTD_decompressStream(z, &ob, &ib);
      if (ZSTD_isError(last))
        ok = dm_data_fail(err, "corpus: '%s' is a corrupted zstd stream: %s (at compressed byte offset %lld)",
                          path, ZSTD_getErrorName(last), (long long)(base + (int64_t)ib.pos));
      else ok = ob.pos == 0 || sink(ctx, out, ob.pos, err);
      full = ob.pos == ob.size;                    /* the decoder may hold more output */
    }
  }
  if (ok && ferror(fp))
    ok = dm_data_fail(err, "corpus: cannot read '%s' at compressed byte offset %lld", path, (long long)base);
  if (ok && (base == 0 || last != 0))
    ok = dm_data_fail(err, "corpus: '%s' is a truncated zstd stream: the file ends inside a frame "
                      "(at compressed byte offset %lld)", path, (long long)base);
  fclose(fp);
  ZSTD_freeDCtx(z);
  free(in);
  free(out);
  return ok;
}

/* the decoded bytes gathered in memory */
typedef struct gathered { const char *path; uint8_t *bytes; size_t len, cap; } gathered;

static bool gather(void *ctx, const uint8_t *bytes, size_t n, char *err) {
  gathered *g = ctx;
  if (g->cap - g->len < n && !grow(&g->bytes, &g->cap, g->len + n))
    return dm_data_fail(err, "corpus: out of host memory decompressing '%s' (%zu bytes so far)", g->path, g->len);
  memcpy(g->bytes + g->len, bytes, n);
  g->len += n;
  return true;
}

static bool inflate_file(dm_file *p, char *err) {
  gathered g = {p->path, NULL, 0, 0};
  bool ok = dm_zst_decode(p->path, gather, &g, err);
  if (!ok || g.len == 0) { free(g.bytes); return ok; }
  uint8_t *fit = realloc(g.bytes, g.len);      /* give back the slack of the last doubling */
  p->data = fit ? fit : g.bytes;
  p->size = (int64_t)g.len;
  return true;
}

bool dm_is_zst(const char *path) {
  size_t n = strlen(path);
  return n >= 4 && strcmp(path + n - 4, ".zst") == 0;
}

/* ---- one file ------------------------------------------------------------------------------ */

static void unmap(dm_file *f) {
  if (!f->mapping) return;
  maps_remove(f);
  munmap((void *)f->mapping, (size_t)f->mapped_size);
  f->mapping = NULL;
  f->mapped_size = 0;
}

/* a zstd file: read in place when its frames allow, else decoded whole */
static bool load_zst(dm_file *f, char *err) {
  if (!map_file(f, err)) return false;
  bool oom = false;
  f->frames = f->mapping ? dm_zframes_index(f->mapping, f->mapped_size, &oom) : NULL;
  if (oom) return dm_data_fail(err, "corpus: out of host memory indexing '%s'", f->path);
  if (f->frames) {
    f->size = dm_zframes_size(f->frames);
    /* rows read frames at random: no read-ahead past the frame a fault asks for */
    madvise((void *)f->mapping, (size_t)f->mapped_size, MADV_RANDOM);
    return true;
  }
  unmap(f);
  f->decoded_whole = true;
  return inflate_file(f, err);
}

bool dm_file_load(dm_file *f, char *err) {
  if (dm_is_zst(f->path)) return load_zst(f, err);
  if (!map_file(f, err)) return false;
  f->data = f->mapping;
  f->size = f->mapped_size;
  return true;
}

void dm_file_unload(dm_file *f) {
  if (!f->mapping) free((void *)f->data);
  unmap(f);
  dm_zframes_free(f->frames);
  free(f->path);
  *f = (dm_file){0};
}
