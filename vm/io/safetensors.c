/*
** safetensors.c — safetensors files written and read (ckpt.h): a string buffer for the
** header, writing, then reading and validating.
*/
#define _GNU_SOURCE     /* qsort_r */
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <ftw.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>
#include "io/ckpt.h"
#include "io/fileio.h"
#include "io/json_read.h"
#include "core/core.h"

#if __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "safetensors data is little-endian; safetensors.c writes host memory as is"
#endif

/* safetensors' own reader refuses headers above 100 MB; so do we */
#define MAX_HEADER ((uint64_t)100 * 1000 * 1000)

/* A file's dtypes and the runtime's: the first entry of a dtype names it when written; F8_E4M3
** (the low-bit banks' codes, vm/ops/quant.h) reads as its bytes, u8, and is written for a u8 tensor
** declared so (dm_safetensors_write_as). */
static const struct { const char *name; dm_dtype dtype; } st_dtypes[] = {
  {"F32", DM_F32}, {"F64", DM_F64}, {"BF16", DM_BF16}, {"F16", DM_F16},
  {"I32", DM_I32}, {"I64", DM_I64}, {"U8", DM_U8}, {"F8_E4M3", DM_U8},
};
#define N_ST_DTYPES ((int)(sizeof st_dtypes / sizeof st_dtypes[0]))

static const char *st_dtype_name(dm_dtype dt) {
  for (int i = 0; i < N_ST_DTYPES; i++) if (st_dtypes[i].dtype == dt) return st_dtypes[i].name;
  return "?";
}

/* ---- a growing string buffer --------------------------------------------------------- */

typedef struct sbuf { char *p; size_t n, cap; } sbuf;

static void sb_add(sbuf *b, const char *s, size_t n) {
  if (b->n + n + 1 > b->cap) {
    size_t cap = b->cap ? b->cap : 256;
    while (cap < b->n + n + 1) cap *= 2;
    char *p = realloc(b->p, cap);
    if (!p) dm_error("out of host memory (%zu bytes) for a safetensors header", cap);
    b->p = p;
    b->cap = cap;
  }
  memcpy(b->p + b->n, s, n);
  b->n += n;
  b->p[b->n] = 0;
}

static void sb_str(sbuf *b, const char *s) { sb_add(b, s, strlen(s)); }

static void sb_printf(sbuf *b, const char *fmt, ...) {
  char tmp[128];
  va_list ap;
  va_start(ap, fmt);
  int n = vsnprintf(tmp, sizeof tmp, fmt, ap);
  va_end(ap);
  sb_add(b, tmp, (size_t)n);
}

/* a JSON string: quotes, backslashes and control characters escaped; other
** bytes (valid UTF-8, checked by the caller) pass through */
static void sb_json_string(sbuf *b, const char *s) {
  sb_add(b, "\"", 1);
  for (; *s; s++) {
    unsigned char c = (unsigned char)*s;
    if (c == '"' || c == '\\') { sb_add(b, "\\", 1); sb_add(b, s, 1); }
    else if (c == '\n') sb_str(b, "\\n");
    else if (c == '\t') sb_str(b, "\\t");
    else if (c < 0x20) sb_printf(b, "\\u%04x", c);
    else sb_add(b, s, 1);
  }
  sb_add(b, "\"", 1);
}

/* ---- writing ------------------------------------------------------------------------------ */

typedef struct wstate {
  dm_afile f;
  sbuf header;
  int *order, *morder;
  dm_tensor *host;           /* a contiguous host copy of the tensor being written */
} wstate;

static void wstate_cleanup(void *ud) {
  wstate *w = ud;
  dm_afile_abort(&w->f);
  free(w->header.p);
  free(w->order);
  free(w->morder);
  dm_release(w->host);
}

static int cmp_names(const void *a, const void *b, void *names) {
  const char *const *s = names;
  return strcmp(s[*(const int *)a], s[*(const int *)b]);
}

/* *order = indices 0..n-1 sorted by name (stored before any check, so the
** guard frees it); a duplicate is an error naming `what` */
static void sort_names(const char *path, const char *what, int n, const char *const *names, int **order) {
  int *o = *order = dm_xmalloc(sizeof(int) * (size_t)n);
  for (int i = 0; i < n; i++) o[i] = i;
  qsort_r(o, (size_t)n, sizeof(int), cmp_names, (void *)names);
  for (int i = 1; i < n; i++)
    if (strcmp(names[o[i]], names[o[i - 1]]) == 0)
      dm_error("%s: %s '%s' appears twice", path, what, names[o[i]]);
}

static void check_name(const char *path, const char *what, const char *name) {
  if (!name) dm_error("%s: a %s is missing", path, what);
  if (!*name) dm_error("%s: a %s is empty", path, what);
  if (!dm_utf8_valid(name)) dm_error("%s: %s '%s' is not valid UTF-8", path, what, name);
}

static void check_tensors(const char *path, int n, const char *const *names, dm_tensor *const *tensors) {
  for (int i = 0; i < n; i++) {
    check_name(path, "tensor name", names[i]);
    if (strcmp(names[i], "__metadata__") == 0) dm_error("%s: '__metadata__' cannot name a tensor", path);
    const dm_tensor *t = tensors[i];
    if (!t) dm_error("%s: tensor '%s' is missing", path, names[i]);
    if (!t->storage) dm_error("%s: tensor '%s' was freed", path, names[i]);
    if (t->device == DM_META) dm_error("%s: tensor '%s' is on the meta device and has no data", path, names[i]);
  }
}

static size_t tensor_nbytes(const dm_tensor *t) { return (size_t)dm_numel(t) * dm_dtype_size(t->dtype); }

static void build_header(wstate *w, int n, const char *const *names, dm_tensor *const *tensors,
                         const char *const *as, int nmeta, const char *const *keys, const char *const *values) {
  sbuf *b = &w->header;
  sb_str(b, "{");
  if (nmeta > 0) {
    sb_str(b, "\"__metadata__\":{");
    for (int k = 0; k < nmeta; k++) {
      int m = w->morder[k];
      if (k) sb_str(b, ",");
      sb_json_string(b, keys[m]);
      sb_str(b, ":");
      sb_json_string(b, values[m]);
    }
    sb_str(b, "}");
  }
  size_t offset = 0;
  for (int k = 0; k < n; k++) {
    const dm_tensor *t = tensors[w->order[k]];
    if (k || nmeta > 0) sb_str(b, ",");
    sb_json_string(b, names[w->order[k]]);
    const char *as_name = as ? as[w->order[k]] : NULL;
    sb_printf(b, ":{\"dtype\":\"%s\",\"shape\":[", as_name ? as_name : st_dtype_name(t->dtype));
    for (int d = 0; d < t->ndim; d++) sb_printf(b, d ? ",%lld" : "%lld", (long long)t->shape[d]);
    size_t nb = tensor_nbytes(t);
    sb_printf(b, "],\"data_offsets\":[%zu,%zu]}", offset, offset + nb);
    offset += nb;
  }
  sb_str(b, "}");
  while (b->n % 8) sb_str(b, " ");    /* the data starts 8-aligned */
}

/* the tensor's bytes, contiguous on the host: itself, or a copy held in w->host */
static const void *host_bytes(wstate *w, dm_tensor *t) {
  if (t->device == DM_CPU && dm_is_contiguous(t)) return dm_data(t);
  w->host = t->device == DM_CPU ? dm_clone(t) : dm_to_device(t, DM_CPU);
  return dm_data(w->host);
}

void dm_safetensors_write(const char *path, int n, const char *const *names,
                          dm_tensor *const *tensors, int nmeta,
                          const char *const *meta_keys, const char *const *meta_values) {
  dm_safetensors_write_as(path, n, names, tensors, NULL, nmeta, meta_keys, meta_values);
}

/* as[i]: the file dtype of tensor i when it is not its own (NULL: its own); only F8_E4M3, for u8 */
static void check_as(const char *path, int n, const char *const *names, dm_tensor *const *tensors,
                     const char *const *as) {
  for (int i = 0; as && i < n; i++) {
    if (!as[i]) continue;
    if (strcmp(as[i], "F8_E4M3") != 0 || tensors[i]->dtype != DM_U8)
      dm_error("%s: tensor '%s' (%s) cannot be written as %s: only u8 codes go as F8_E4M3", path, names[i],
               dm_dtype_name(tensors[i]->dtype), as[i]);
  }
}

void dm_safetensors_write_as(const char *path, int n, const char *const *names, dm_tensor *const *tensors,
                             const char *const *as, int nmeta, const char *const *meta_keys,
                             const char *const *meta_values) {
  check_tensors(path, n, names, tensors);
  check_as(path, n, names, tensors, as);
  for (int k = 0; k < nmeta; k++) {
    check_name(path, "metadata key", meta_keys[k]);
    if (!meta_values[k] || !dm_utf8_valid(meta_values[k]))
      dm_error("%s: metadata value of '%s' is missing or not valid UTF-8", path, meta_keys[k]);
  }
  wstate w = {.f = {.fd = -1}};
  dm_guard g;
  dm_guard_begin(&g, wstate_cleanup, &w);
  sort_names(path, "tensor name", n, names, &w.order);
  sort_names(path, "metadata key", nmeta, meta_keys, &w.morder);
  build_header(&w, n, names, tensors, as, nmeta, meta_keys, meta_values);
  if (w.header.n > MAX_HEADER)
    dm_error("%s: the header would be %zu bytes, more than the 100 MB readers accept", path, w.header.n);
  dm_afile_open(&w.f, path);
  uint64_t hlen = w.header.n;
  dm_afile_write(&w.f, &hlen, 8);
  dm_afile_write(&w.f, w.header.p, w.header.n);
  for (int k = 0; k < n; k++) {
    dm_tensor *t = tensors[w.order[k]];
    size_t nb = tensor_nbytes(t);
    if (nb) dm_afile_write(&w.f, host_bytes(&w, t), nb);
    dm_release(w.host);
    w.host = NULL;
  }
  dm_afile_commit(&w.f);
  dm_guard_end(&g);
  wstate_cleanup(&w);
}

/* ---- reading and validating ---------------------------------------------------------- */

typedef struct entry {
  const char *name;
  dm_dtype dtype;
  int ndim;
  int64_t shape[DM_MAXDIM];
  int64_t begin, end;
} entry;

typedef struct rstate {
  const char *path;
  int fd;
  char *header;
  dm_arena a;
  entry *entries;
  dm_safetensors *st;
} rstate;

static void rstate_cleanup(void *ud) {
  rstate *r = ud;
  if (r->fd >= 0) close(r->fd);
  free(r->header);
  dm_arena_free(&r->a);
  free(r->entries);
  dm_safetensors_free(r->st);
}

static void read_at(rstate *r, void *buf, size_t n, off_t at, const char *what) {
  char *p = buf;
  while (n > 0) {
    ssize_t got = pread(r->fd, p, n > ((size_t)1 << 30) ? ((size_t)1 << 30) : n, at);
    if (got < 0 && errno == EINTR) continue;
    if (got < 0) dm_error("%s: read failed (%s): %s", r->path, what, strerror(errno));
    if (got == 0) dm_error("%s: truncated while reading %s (the file shrank?)", r->path, what);
    p += got;
    n -= (size_t)got;
    at += got;
  }
}

/* a JSON string without embedded NUL bytes (names become C strings) */
static const char *cstring(rstate *r, const char *s, size_t len, const char *what) {
  if (strlen(s) != len) dm_error("%s: %s contains a NUL byte", r->path, what);
  return s;
}

static int64_t nonneg_int(rstate *r, const dm_jval *v, const char *name, const char *field) {
  if (v->type != DM_J_INT || v->i < 0)
    dm_error("%s: tensor '%s': %s must hold non-negative integers", r->path, name, field);
  return v->i;
}

static dm_dtype parse_dtype(rstate *r, const dm_jval *v, const char *name) {
  if (v->type != DM_J_STRING) dm_error("%s: tensor '%s': dtype must be a string", r->path, name);
  for (int i = 0; i < N_ST_DTYPES; i++)
    if (strcmp(v->s, st_dtypes[i].name) == 0) return st_dtypes[i].dtype;
  dm_error("%s: tensor '%s': unknown dtype '%s' (dormouse reads F32 F64 BF16 F16 I32 I64 U8)",
           r->path, name, cstring(r, v->s, v->len, "a dtype"));
}

/* shape × dtype size in bytes, or an error when it overflows */
static int64_t entry_nbytes(rstate *r, const entry *e) {
  int64_t n = (int64_t)dm_dtype_size(e->dtype);
  for (int d = 0; d < e->ndim; d++)
    if (__builtin_mul_overflow(n, e->shape[d], &n))
      dm_error("%s: tensor '%s': shape is too large", r->path, e->name);
  return n;
}

static void parse_entry(rstate *r, const dm_jval *v, entry *e) {
  const char *name = e->name;
  if (v->type != DM_J_OBJECT) dm_error("%s: tensor '%s': its entry must be an object", r->path, name);
  const dm_jval *dtype = NULL, *shape = NULL, *offsets = NULL;
  for (const dm_jval *m = v->first; m; m = m->next) {
    const char *field = cstring(r, m->key, m->keylen, "a field name");
    const dm_jval **slot = !strcmp(field, "dtype") ? &dtype : !strcmp(field, "shape") ? &shape
                      : !strcmp(field, "data_offsets") ? &offsets : NULL;
    if (!slot) dm_error("%s: tensor '%s': unknown field '%s'", r->path, name, field);
    if (*slot) dm_error("%s: tensor '%s': field '%s' appears twice", r->path, name, field);
    *slot = m;
  }
  if (!dtype || !shape || !offsets)
    dm_error("%s: tensor '%s': missing field '%s'", r->path, name, !dtype ? "dtype" : !shape ? "shape" : "data_offsets");
  e->dtype = parse_dtype(r, dtype, name);
  if (shape->type != DM_J_ARRAY) dm_error("%s: tensor '%s': shape must be an array", r->path, name);
  if (shape->n > DM_MAXDIM) dm_error("%s: tensor '%s': %d dims, dormouse allows at most %d", r->path, name, shape->n, DM_MAXDIM);
  e->ndim = 0;
  for (const dm_jval *d = shape->first; d; d = d->next) e->shape[e->ndim++] = nonneg_int(r, d, name, "shape");
  if (offsets->type != DM_J_ARRAY || offsets->n != 2)
    dm_error("%s: tensor '%s': data_offsets must be [begin, end]", r->path, name);
  e->begin = nonneg_int(r, offsets->first, name, "data_offsets");
  e->end = nonneg_int(r, offsets->first->next, name, "data_offsets");
  int64_t need = entry_nbytes(r, e);
  char sb[160];
  if (e->end < e->begin || e->end - e->begin != need)
    dm_error("%s: tensor '%s': data_offsets [%lld, %lld] hold %lld bytes, but shape %s of %s needs %lld",
             r->path, name, (long long)e->begin, (long long)e->end, (long long)(e->end - e->begin),
             dm_shape_str(sb, sizeof sb, e->ndim, e->shape), st_dtype_name(e->dtype), (long long)need);
}

static int cmp_member_key(const void *a, const void *b) {
  return strcmp((*(const dm_jval *const *)a)->key, (*(const dm_jval *const *)b)->key);
}

static int cmp_entry_name(const void *a, const void *b) {
  return strcmp(((const entry *)a)->name, ((const entry *)b)->name);
}

static int cmp_entry_begin(const void *a, const void *b) {
  const entry *x = *(entry *const *)a, *y = *(entry *const *)b;
  if (x->begin != y->begin) return x->begin < y->begin ? -1 : 1;
  return (x->end > y->end) - (x->end < y->end);
}

/* __metadata__: string → string, kept sorted by key */
static void parse_metadata(rstate *r, const dm_jval *v) {
  if (v->type != DM_J_OBJECT) dm_error("%s: __metadata__ must be an object of strings", r->path);
  const dm_jval **members = dm_arena_alloc(&r->a, sizeof(dm_jval *) * (size_t)(v->n ? v->n : 1));
  int n = 0;
  for (const dm_jval *m = v->first; m; m = m->next) {
    const char *key = cstring(r, m->key, m->keylen, "a metadata key");
    if (m->type != DM_J_STRING) dm_error("%s: __metadata__ value of '%s' must be a string", r->path, key);
    cstring(r, m->s, m->len, "a metadata value");
    members[n++] = m;
  }
  qsort(members, (size_t)n, sizeof *members, cmp_member_key);
  dm_safetensors *st = r->st;
  st->meta_keys = dm_xcalloc((size_t)n, sizeof(char *));
  st->meta_values = dm_xcalloc((size_t)n, sizeof(char *));
  for (int i = 0; i < n; i++) {
    if (i && strcmp(members[i]->key, members[i - 1]->key) == 0)
      dm_error("%s: __metadata__ key '%s' appears twice", r->path, members[i]->key);
    st->meta_keys[i] = strdup(members[i]->key);
    st->meta_values[i] = strdup(members[i]->s);
    st->nmeta = i + 1;
    if (!st->meta_keys[i] || !st->meta_values[i]) dm_error("out of host memory reading %s", r->path);
  }
}

/* the byte ranges must tile [0, data) exactly, as safetensors itself requires */
static void check_layout(rstate *r, int n, int64_t avail) {
  int64_t total = 0;
  const char *last = NULL;
  for (int i = 0; i < n; i++)
    if (r->entries[i].end > total) { total = r->entries[i].end; last = r->entries[i].name; }
  if (total > avail)
    dm_error("%s: truncated: header says %lld bytes of data (tensor '%s' ends there), file has %lld",
             r->path, (long long)total, last, (long long)avail);
  entry **by_begin = dm_xmalloc(sizeof(entry *) * (size_t)(n ? n : 1));
  for (int i = 0; i < n; i++) by_begin[i] = &r->entries[i];
  qsort(by_begin, (size_t)n, sizeof(entry *), cmp_entry_begin);
  const entry *prev = NULL, *bad = NULL;
  int64_t at = 0;
  for (int i = 0; i < n && !bad; i++) {
    if (by_begin[i]->begin != at) bad = by_begin[i];
    else { at = by_begin[i]->end; prev = by_begin[i]; }
  }
  free(by_begin);
  if (bad && bad->begin < at)
    dm_error("%s: tensor '%s' at bytes [%lld, %lld] overlaps tensor '%s' (ends at %lld)", r->path, bad->name,
             (long long)bad->begin, (long long)bad->end, prev->name, (long long)at);
  if (bad)
    dm_error("%s: gap in the data: tensor '%s' starts at byte %lld, but the data before it ends at %lld",
             r->path, bad->name, (long long)bad->begin, (long long)at);
  if (avail > total)
    dm_error("%s: %lld bytes of unexpected data after the last tensor (header says %lld bytes of data)",
             r->path, (long long)(avail - total), (long long)total);
}

static void parse_header(rstate *r, const char *text, size_t len, int64_t avail) {
  dm_jval *root = dm_json_parse(r->path, text, len, &r->a);
  if (root->type != DM_J_OBJECT) dm_error("%s: corrupted header: it is not a JSON object", r->path);
  dm_safetensors *st = r->st;
  r->entries = dm_xcalloc((size_t)root->n, sizeof(entry));
  int n = 0;
  bool seen_meta = false;
  for (const dm_jval *m = root->first; m; m = m->next) {
    const char *key = cstring(r, m->key, m->keylen, "a tensor name");
    if (strcmp(key, "__metadata__") == 0) {
      if (seen_meta) dm_error("%s: __metadata__ appears twice", r->path);
      seen_meta = true;
      parse_metadata(r, m);
      continue;
    }
    if (!*key) dm_error("%s: a tensor has an empty name", r->path);
    r->entries[n].name = key;
    parse_entry(r, m, &r->entries[n]);
    n++;
  }
  qsort(r->entries, (size_t)n, sizeof(entry), cmp_entry_name);
  for (int i = 1; i < n; i++)
    if (strcmp(r->entries[i].name, r->entries[i - 1].name) == 0)
      dm_error("%s: tensor '%s' appears twice in the header", r->path, r->entries[i].name);
  check_layout(r, n, avail);
  st->n = n;
}

static void read_tensors(rstate *r, uint64_t data_at) {
  dm_safetensors *st = r->st;
  st->names = dm_xcalloc((size_t)st->n, sizeof(char *));
  st->tensors = dm_xcalloc((size_t)st->n, sizeof(dm_tensor *));
  for (int i = 0; i < st->n; i++) {
    const entry *e = &r->entries[i];
    st->names[i] = strdup(e->name);
    if (!st->names[i]) dm_error("out of host memory reading %s", r->path);
    st->tensors[i] = dm_tensor_new(DM_CPU, e->dtype, e->ndim, e->shape);
    char what[300];
    snprintf(what, sizeof what, "tensor '%s'", e->name);
    if (e->end > e->begin) read_at(r, dm_data(st->tensors[i]), (size_t)(e->end - e->begin), (off_t)(data_at + (uint64_t)e->begin), what);
  }
}

dm_safetensors *dm_safetensors_read(const char *path) {
  rstate r = {.path = path, .fd = -1};
  dm_guard g;
  dm_guard_begin(&g, rstate_cleanup, &r);
  struct stat sb;
  r.fd = dm_open_regular(path, &sb);
  int64_t size = sb.st_size;
  if (size < 8) dm_error("%s: truncated: %lld bytes, too short for the 8-byte header length", path, (long long)size);
  uint64_t hlen;
  read_at(&r, &hlen, 8, 0, "the header length");
  if (hlen > MAX_HEADER) dm_error("%s: corrupted header: header length %llu is not sane (more than 100 MB)", path, (unsigned long long)hlen);
  if ((int64_t)hlen > size - 8)
    dm_error("%s: truncated: header says %llu bytes of header, file has %lld after the length", path,
             (unsigned long long)hlen, (long long)(size - 8));
  if (hlen < 2) dm_error("%s: corrupted header: %llu bytes cannot hold a JSON object", path, (unsigned long long)hlen);
  r.header = dm_xmalloc(hlen + 1);
  read_at(&r, r.header, hlen, 8, "the header");
  r.header[hlen] = 0;
  if (r.header[0] != '{') dm_error("%s: corrupted header: it does not start with '{'", path);
  r.st = dm_xcalloc(1, sizeof *r.st);
  parse_header(&r, r.header, hlen, size - 8 - (int64_t)hlen);
  read_tensors(&r, 8 + hlen);
  dm_guard_end(&g);
  dm_safetensors *st = r.st;
  r.st = NULL;
  rstate_cleanup(&r);
  return st;
}

void dm_safetensors_free(dm_safetensors *st) {
  if (!st) return;
  for (int i = 0; i < st->n; i++) {
    if (st->names) free(st->names[i]);
    if (st->tensors) dm_release(st->tensors[i]);
  }
  for (int i = 0; i < st->nmeta; i++) {
    free(st->meta_keys[i]);
    free(st->meta_values[i]);
  }
  free(st->names);
  free(st->tensors);
  free(st->meta_keys);
  free(st->meta_values);
  free(st);
}
