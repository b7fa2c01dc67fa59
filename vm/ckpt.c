/*
** ckpt.c — safetensors files, atomic writes, XXH64 checksums (see ckpt.h).
**
** Sections: cleanup on error, the atomic file writer, a string buffer, the
** strict JSON reader, writing, reading and validating, checksums, and the
** directory helpers.
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
#include "ckpt.h"
#include "core.h"

#if __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "safetensors data is little-endian; ckpt.c writes host memory as is"
#endif

/* safetensors' own reader refuses headers above 100 MB; so do we */
#define MAX_HEADER ((uint64_t)100 * 1000 * 1000)
#define MAX_JSON_DEPTH 64

static const struct { const char *name; dm_dtype dtype; } st_dtypes[] = {
  {"F32", DM_F32}, {"F64", DM_F64}, {"BF16", DM_BF16}, {"F16", DM_F16},
  {"I32", DM_I32}, {"I64", DM_I64}, {"U8", DM_U8},
};
#define N_ST_DTYPES ((int)(sizeof st_dtypes / sizeof st_dtypes[0]))

static const char *st_dtype_name(dm_dtype dt) {
  for (int i = 0; i < N_ST_DTYPES; i++) if (st_dtypes[i].dtype == dt) return st_dtypes[i].name;
  return "?";
}

static void *xmalloc(size_t n) {
  void *p = malloc(n ? n : 1);
  if (!p) dm_error("out of host memory (%zu bytes) in checkpoint I/O", n);
  return p;
}

static void *xcalloc(size_t n, size_t size) {
  void *p = calloc(n ? n : 1, size);
  if (!p) dm_error("out of host memory (%zu bytes) in checkpoint I/O", n * size);
  return p;
}

/* ---- cleanup on error ------------------------------------------------------------
** dm_error never returns. A function that holds files and buffers across calls
** that may raise installs a guard: when an error passes, the guard runs its
** cleanup, puts the previous handler back and hands the message on. Code in
** between can then raise freely with a precise message and leak nothing. */

typedef struct guard {
  dm_error_handler prev;
  void *prev_ud;
  void (*cleanup)(void *);
  void *arg;
} guard;

static void guard_handler(const char *msg, void *ud) {
  guard *g = ud;
  dm_set_error_handler(g->prev, g->prev_ud);
  g->cleanup(g->arg);
  if (g->prev) g->prev(msg, g->prev_ud);
}

static void guard_begin(guard *g, void (*cleanup)(void *), void *arg) {
  dm_get_error_handler(&g->prev, &g->prev_ud);
  g->cleanup = cleanup;
  g->arg = arg;
  dm_set_error_handler(guard_handler, g);
}

static void guard_end(guard *g) { dm_set_error_handler(g->prev, g->prev_ud); }

/* ---- the atomic file writer: "<path>.tmp", fsync, rename ---------------------------- */

typedef struct afile {
  const char *path;
  char *tmp;      /* NULL once committed or aborted */
  int fd;
} afile;

static void af_abort(afile *f) {
  if (f->fd >= 0) close(f->fd);
  if (f->tmp) { unlink(f->tmp); free(f->tmp); }
  f->fd = -1;
  f->tmp = NULL;
}

/* the caller's guard runs af_abort if this raises */
static void af_open(afile *f, const char *path) {
  f->path = path;
  f->fd = -1;
  f->tmp = NULL;
  size_t n = strlen(path) + 5;
  char *tmp = xmalloc(n);
  snprintf(tmp, n, "%s.tmp", path);
  f->tmp = tmp;
  f->fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (f->fd < 0) dm_error("%s: cannot create %s: %s", path, tmp, strerror(errno));
}

static void af_write(afile *f, const void *data, size_t n) {
  const char *p = data;
  while (n > 0) {
    ssize_t w = write(f->fd, p, n > ((size_t)1 << 30) ? ((size_t)1 << 30) : n);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) dm_error("%s: write failed: %s", f->path, w < 0 ? strerror(errno) : "no progress");
    p += w;
    n -= (size_t)w;
  }
}

static void dirname_of(const char *path, char *dir, size_t n) {
  const char *slash = strrchr(path, '/');
  if (!slash) snprintf(dir, n, ".");
  else if (slash == path) snprintf(dir, n, "/");
  else snprintf(dir, n, "%.*s", (int)(slash - path), path);
}

static void af_commit(afile *f) {
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

static void af_cleanup(void *ud) { af_abort(ud); }

void dm_write_file_atomic(const char *path, const void *data, size_t n) {
  afile f = {.fd = -1};
  guard g;
  guard_begin(&g, af_cleanup, &f);
  af_open(&f, path);
  af_write(&f, data, n);
  af_commit(&f);
  guard_end(&g);
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

/* ---- UTF-8: headers must be valid UTF-8 for other readers ---------------------------- */

/* the length of the valid UTF-8 sequence at s (1..4), or 0 */
static int utf8_len(const unsigned char *s, const unsigned char *end) {
  unsigned c = s[0];
  if (c < 0x80) return 1;
  int n = c >= 0xf0 ? 4 : c >= 0xe0 ? 3 : c >= 0xc2 ? 2 : 0;
  if (n == 0 || c > 0xf4 || end - s < n) return 0;
  uint32_t cp = c & (0x3f >> (n - 1));
  for (int i = 1; i < n; i++) {
    if ((s[i] & 0xc0) != 0x80) return 0;
    cp = cp << 6 | (s[i] & 0x3f);
  }
  static const uint32_t least[5] = {0, 0, 0x80, 0x800, 0x10000};
  if (cp < least[n] || cp > 0x10ffff || (cp >= 0xd800 && cp <= 0xdfff)) return 0;
  return n;
}

static bool utf8_valid(const char *s) {
  const unsigned char *p = (const unsigned char *)s, *end = p + strlen(s);
  while (p < end) {
    int n = utf8_len(p, end);
    if (!n) return false;
    p += n;
  }
  return true;
}

/* ---- a small strict JSON reader: objects, arrays, strings, integers -----------------
** Values live in an arena freed at once. Object members and array items are
** linked lists in document order; duplicate keys are left to the validator. */

typedef struct ablock { struct ablock *next; size_t used, cap; char data[]; } ablock;
typedef struct arena { ablock *head; } arena;

static void *arena_alloc(arena *a, size_t n) {
  n = (n + 15) & ~(size_t)15;
  if (!a->head || a->head->used + n > a->head->cap) {
    size_t cap = n > 65536 ? n : 65536;
    ablock *b = xmalloc(sizeof *b + cap);
    b->next = a->head;
    b->used = 0;
    b->cap = cap;
    a->head = b;
  }
  void *p = a->head->data + a->head->used;
  a->head->used += n;
  return p;
}

static void arena_free(arena *a) {
  while (a->head) { ablock *b = a->head; a->head = b->next; free(b); }
}

enum { J_OBJECT, J_ARRAY, J_STRING, J_INT };

typedef struct jval {
  int type;
  long pos;                  /* byte offset in the header, for messages */
  int64_t i;                 /* J_INT */
  const char *s; size_t len; /* J_STRING */
  const char *key; size_t keylen;   /* set on object members */
  struct jval *first, *next; /* J_OBJECT / J_ARRAY: members, in order */
  int n;
} jval;

typedef struct jparser {
  const char *p, *start, *end;
  arena *a;
  const char *path;
  int depth;
} jparser;

#if defined(__GNUC__)
__attribute__((noreturn, format(printf, 2, 3)))
#endif
static void jfail(jparser *j, const char *fmt, ...) {
  char what[256];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(what, sizeof what, fmt, ap);
  va_end(ap);
  dm_error("%s: corrupted header: bad JSON at header byte %ld: %s", j->path, (long)(j->p - j->start), what);
}

static void jskip_ws(jparser *j) {
  while (j->p < j->end && (*j->p == ' ' || *j->p == '\t' || *j->p == '\n' || *j->p == '\r')) j->p++;
}

/* what stands at the cursor, for messages */
static const char *jnext_desc(jparser *j, char *buf, size_t n) {
  if (j->p >= j->end) return "the end of the header";
  unsigned char c = (unsigned char)*j->p;
  if (c >= 0x20 && c < 0x7f) snprintf(buf, n, "'%c'", c);
  else snprintf(buf, n, "byte 0x%02x", c);
  return buf;
}

static void jexpect(jparser *j, char c, const char *context) {
  jskip_ws(j);
  char buf[16];
  if (j->p >= j->end || *j->p != c) jfail(j, "expected '%c' %s, found %s", c, context, jnext_desc(j, buf, sizeof buf));
  j->p++;
}

static jval *jnew(jparser *j, int type) {
  jval *v = arena_alloc(j->a, sizeof *v);
  memset(v, 0, sizeof *v);
  v->type = type;
  v->pos = (long)(j->p - j->start);
  return v;
}

static int hexval(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  return -1;
}

static uint32_t jhex4(jparser *j) {
  uint32_t u = 0;
  for (int k = 0; k < 4; k++) {
    int h = j->p < j->end ? hexval(*j->p) : -1;
    if (h < 0) jfail(j, "\\u must be followed by 4 hex digits");
    u = u << 4 | (uint32_t)h;
    j->p++;
  }
  return u;
}

static char *put_utf8(char *o, uint32_t cp) {
  if (cp < 0x80) *o++ = (char)cp;
  else if (cp < 0x800) { *o++ = (char)(0xc0 | cp >> 6); *o++ = (char)(0x80 | (cp & 0x3f)); }
  else if (cp < 0x10000) {
    *o++ = (char)(0xe0 | cp >> 12); *o++ = (char)(0x80 | ((cp >> 6) & 0x3f)); *o++ = (char)(0x80 | (cp & 0x3f));
  } else {
    *o++ = (char)(0xf0 | cp >> 18); *o++ = (char)(0x80 | ((cp >> 12) & 0x3f));
    *o++ = (char)(0x80 | ((cp >> 6) & 0x3f)); *o++ = (char)(0x80 | (cp & 0x3f));
  }
  return o;
}

/* \uXXXX, with a surrogate pair joined into one code point */
static uint32_t junicode(jparser *j) {
  uint32_t cp = jhex4(j);
  if (cp >= 0xdc00 && cp <= 0xdfff) jfail(j, "lone low surrogate \\u%04x", cp);
  if (cp >= 0xd800 && cp <= 0xdbff) {
    if (j->end - j->p < 2 || j->p[0] != '\\' || j->p[1] != 'u') jfail(j, "high surrogate \\u%04x without its pair", cp);
    j->p += 2;
    uint32_t lo = jhex4(j);
    if (lo < 0xdc00 || lo > 0xdfff) jfail(j, "high surrogate \\u%04x followed by \\u%04x", cp, lo);
    cp = 0x10000 + ((cp - 0xd800) << 10) + (lo - 0xdc00);
  }
  return cp;
}

/* a string at the cursor (after its opening quote was checked); decoded, NUL-terminated */
static const char *jstring(jparser *j, size_t *len) {
  j->p++;
  const char *scan = j->p;
  while (scan < j->end && *scan != '"') scan += *scan == '\\' ? 2 : 1;   /* an upper bound on the length */
  char *out = arena_alloc(j->a, (size_t)(scan - j->p) + 1), *o = out;
  for (;;) {
    if (j->p >= j->end) jfail(j, "unterminated string");
    unsigned char c = (unsigned char)*j->p;
    if (c == '"') { j->p++; break; }
    if (c < 0x20) jfail(j, "control character 0x%02x in a string (must be escaped)", c);
    if (c == '\\') {
      j->p++;
      char e = j->p < j->end ? *j->p++ : 0;
      switch (e) {
        case '"': *o++ = '"'; break;
        case '\\': *o++ = '\\'; break;
        case '/': *o++ = '/'; break;
        case 'b': *o++ = '\b'; break;
        case 'f': *o++ = '\f'; break;
        case 'n': *o++ = '\n'; break;
        case 'r': *o++ = '\r'; break;
        case 't': *o++ = '\t'; break;
        case 'u': o = put_utf8(o, junicode(j)); break;
        default: j->p--; jfail(j, "unknown escape '\\%c'", e ? e : '?');
      }
      continue;
    }
    int n = utf8_len((const unsigned char *)j->p, (const unsigned char *)j->end);
    if (!n) jfail(j, "invalid UTF-8 in a string");
    memcpy(o, j->p, (size_t)n);
    o += n;
    j->p += n;
  }
  *o = 0;
  *len = (size_t)(o - out);
  return out;
}

static bool is_digit(char c) { return c >= '0' && c <= '9'; }

static int64_t jinteger(jparser *j) {
  bool neg = j->p < j->end && *j->p == '-';
  if (neg) j->p++;
  if (j->p >= j->end || !is_digit(*j->p)) jfail(j, "expected a digit");
  if (*j->p == '0' && j->p + 1 < j->end && is_digit(j->p[1])) jfail(j, "leading zeros are not allowed");
  uint64_t u = 0;
  while (j->p < j->end && is_digit(*j->p)) {
    unsigned d = (unsigned)(*j->p - '0');
    if (u > (UINT64_MAX - d) / 10 || u * 10 + d > (uint64_t)INT64_MAX + neg) jfail(j, "integer too large");
    u = u * 10 + d;
    j->p++;
  }
  if (j->p < j->end && (*j->p == '.' || *j->p == 'e' || *j->p == 'E'))
    jfail(j, "only integers are allowed in a safetensors header");
  return neg ? (int64_t)(0 - u) : (int64_t)u;
}

static jval *jvalue(jparser *j);

/* the members of an object or the items of an array, after the opening bracket */
static void jmembers(jparser *j, jval *v, char close, bool keyed) {
  if (++j->depth > MAX_JSON_DEPTH) jfail(j, "nested more than %d deep", MAX_JSON_DEPTH);
  jval **tail = &v->first;
  jskip_ws(j);
  if (j->p < j->end && *j->p == close) { j->p++; j->depth--; return; }
  for (;;) {
    const char *key = NULL;
    size_t keylen = 0;
    if (keyed) {
      jskip_ws(j);
      char buf[16];
      if (j->p >= j->end || *j->p != '"') jfail(j, "expected a key string, found %s", jnext_desc(j, buf, sizeof buf));
      key = jstring(j, &keylen);
      jexpect(j, ':', "after a key");
    }
    jval *item = jvalue(j);
    item->key = key;
    item->keylen = keylen;
    *tail = item;
    tail = &item->next;
    v->n++;
    jskip_ws(j);
    if (j->p < j->end && *j->p == ',') { j->p++; continue; }
    jexpect(j, close, keyed ? "or ',' in an object" : "or ',' in an array");
    break;
  }
  j->depth--;
}

static jval *jvalue(jparser *j) {
  jskip_ws(j);
  char buf[16];
  if (j->p >= j->end) jfail(j, "unexpected end of the header");
  char c = *j->p;
  jval *v;
  if (c == '{') { v = jnew(j, J_OBJECT); j->p++; jmembers(j, v, '}', true); }
  else if (c == '[') { v = jnew(j, J_ARRAY); j->p++; jmembers(j, v, ']', false); }
  else if (c == '"') { v = jnew(j, J_STRING); v->s = jstring(j, &v->len); }
  else if (c == '-' || is_digit(c)) { v = jnew(j, J_INT); v->i = jinteger(j); }
  else jfail(j, "unexpected %s (values are objects, arrays, strings and integers)", jnext_desc(j, buf, sizeof buf));
  return v;
}

static jval *json_parse(const char *path, const char *text, size_t n, arena *a) {
  jparser j = {text, text, text + n, a, path, 0};
  jval *v = jvalue(&j);
  jskip_ws(&j);   /* the padding */
  char buf[16];
  if (j.p < j.end) jfail(&j, "unexpected %s after the header object", jnext_desc(&j, buf, sizeof buf));
  return v;
}

/* ---- writing ------------------------------------------------------------------------------ */

typedef struct wstate {
  afile f;
  sbuf header;
  int *order, *morder;
  dm_tensor *host;           /* a contiguous host copy of the tensor being written */
} wstate;

static void wstate_cleanup(void *ud) {
  wstate *w = ud;
  af_abort(&w->f);
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
  int *o = *order = xmalloc(sizeof(int) * (size_t)n);
  for (int i = 0; i < n; i++) o[i] = i;
  qsort_r(o, (size_t)n, sizeof(int), cmp_names, (void *)names);
  for (int i = 1; i < n; i++)
    if (strcmp(names[o[i]], names[o[i - 1]]) == 0)
      dm_error("%s: %s '%s' appears twice", path, what, names[o[i]]);
}

static void check_name(const char *path, const char *what, const char *name) {
  if (!name) dm_error("%s: a %s is missing", path, what);
  if (!*name) dm_error("%s: a %s is empty", path, what);
  if (!utf8_valid(name)) dm_error("%s: %s '%s' is not valid UTF-8", path, what, name);
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
                         int nmeta, const char *const *keys, const char *const *values) {
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
    sb_printf(b, ":{\"dtype\":\"%s\",\"shape\":[", st_dtype_name(t->dtype));
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
  check_tensors(path, n, names, tensors);
  for (int k = 0; k < nmeta; k++) {
    check_name(path, "metadata key", meta_keys[k]);
    if (!meta_values[k] || !utf8_valid(meta_values[k]))
      dm_error("%s: metadata value of '%s' is missing or not valid UTF-8", path, meta_keys[k]);
  }
  wstate w = {.f = {.fd = -1}};
  guard g;
  guard_begin(&g, wstate_cleanup, &w);
  sort_names(path, "tensor name", n, names, &w.order);
  sort_names(path, "metadata key", nmeta, meta_keys, &w.morder);
  build_header(&w, n, names, tensors, nmeta, meta_keys, meta_values);
  if (w.header.n > MAX_HEADER)
    dm_error("%s: the header would be %zu bytes, more than the 100 MB readers accept", path, w.header.n);
  af_open(&w.f, path);
  uint64_t hlen = w.header.n;
  af_write(&w.f, &hlen, 8);
  af_write(&w.f, w.header.p, w.header.n);
  for (int k = 0; k < n; k++) {
    dm_tensor *t = tensors[w.order[k]];
    size_t nb = tensor_nbytes(t);
    if (nb) af_write(&w.f, host_bytes(&w, t), nb);
    dm_release(w.host);
    w.host = NULL;
  }
  af_commit(&w.f);
  guard_end(&g);
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
  arena a;
  entry *entries;
  dm_safetensors *st;
} rstate;

static void rstate_cleanup(void *ud) {
  rstate *r = ud;
  if (r->fd >= 0) close(r->fd);
  free(r->header);
  arena_free(&r->a);
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

static int64_t nonneg_int(rstate *r, const jval *v, const char *name, const char *field) {
  if (v->type != J_INT || v->i < 0)
    dm_error("%s: tensor '%s': %s must hold non-negative integers", r->path, name, field);
  return v->i;
}

static dm_dtype parse_dtype(rstate *r, const jval *v, const char *name) {
  if (v->type != J_STRING) dm_error("%s: tensor '%s': dtype must be a string", r->path, name);
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

static void parse_entry(rstate *r, const jval *v, entry *e) {
  const char *name = e->name;
  if (v->type != J_OBJECT) dm_error("%s: tensor '%s': its entry must be an object", r->path, name);
  const jval *dtype = NULL, *shape = NULL, *offsets = NULL;
  for (const jval *m = v->first; m; m = m->next) {
    const char *field = cstring(r, m->key, m->keylen, "a field name");
    const jval **slot = !strcmp(field, "dtype") ? &dtype : !strcmp(field, "shape") ? &shape
                      : !strcmp(field, "data_offsets") ? &offsets : NULL;
    if (!slot) dm_error("%s: tensor '%s': unknown field '%s'", r->path, name, field);
    if (*slot) dm_error("%s: tensor '%s': field '%s' appears twice", r->path, name, field);
    *slot = m;
  }
  if (!dtype || !shape || !offsets)
    dm_error("%s: tensor '%s': missing field '%s'", r->path, name, !dtype ? "dtype" : !shape ? "shape" : "data_offsets");
  e->dtype = parse_dtype(r, dtype, name);
  if (shape->type != J_ARRAY) dm_error("%s: tensor '%s': shape must be an array", r->path, name);
  if (shape->n > DM_MAXDIM) dm_error("%s: tensor '%s': %d dims, dormouse allows at most %d", r->path, name, shape->n, DM_MAXDIM);
  e->ndim = 0;
  for (const jval *d = shape->first; d; d = d->next) e->shape[e->ndim++] = nonneg_int(r, d, name, "shape");
  if (offsets->type != J_ARRAY || offsets->n != 2)
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
  return strcmp((*(const jval *const *)a)->key, (*(const jval *const *)b)->key);
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
static void parse_metadata(rstate *r, const jval *v) {
  if (v->type != J_OBJECT) dm_error("%s: __metadata__ must be an object of strings", r->path);
  const jval **members = arena_alloc(&r->a, sizeof(jval *) * (size_t)(v->n ? v->n : 1));
  int n = 0;
  for (const jval *m = v->first; m; m = m->next) {
    const char *key = cstring(r, m->key, m->keylen, "a metadata key");
    if (m->type != J_STRING) dm_error("%s: __metadata__ value of '%s' must be a string", r->path, key);
    cstring(r, m->s, m->len, "a metadata value");
    members[n++] = m;
  }
  qsort(members, (size_t)n, sizeof *members, cmp_member_key);
  dm_safetensors *st = r->st;
  st->meta_keys = xcalloc((size_t)n, sizeof(char *));
  st->meta_values = xcalloc((size_t)n, sizeof(char *));
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
  entry **by_begin = xmalloc(sizeof(entry *) * (size_t)(n ? n : 1));
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
  jval *root = json_parse(r->path, text, len, &r->a);
  if (root->type != J_OBJECT) dm_error("%s: corrupted header: it is not a JSON object", r->path);
  dm_safetensors *st = r->st;
  r->entries = xcalloc((size_t)root->n, sizeof(entry));
  int n = 0;
  bool seen_meta = false;
  for (const jval *m = root->first; m; m = m->next) {
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
  st->names = xcalloc((size_t)st->n, sizeof(char *));
  st->tensors = xcalloc((size_t)st->n, sizeof(dm_tensor *));
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

/* A file opened for reading only when it is a regular one: O_NONBLOCK keeps a FIFO from blocking
** the open, and the check refuses it (and devices, sockets, folders) before a byte is read. */
static const char *file_kind(mode_t m) {
  return S_ISFIFO(m) ? "a FIFO" : S_ISDIR(m) ? "a directory" : S_ISSOCK(m) ? "a socket"
       : S_ISCHR(m) || S_ISBLK(m) ? "a device" : "not a plain file";
}

static int open_regular(const char *path, struct stat *sb) {
  int fd = open(path, O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0) dm_error("%s: cannot open: %s", path, strerror(errno));
  if (fstat(fd, sb) != 0) { int e = errno; close(fd); dm_error("%s: cannot stat: %s", path, strerror(e)); }
  if (!S_ISREG(sb->st_mode)) { close(fd); dm_error("%s: is %s, not a regular file", path, file_kind(sb->st_mode)); }
  return fd;
}

dm_safetensors *dm_safetensors_read(const char *path) {
  rstate r = {.path = path, .fd = -1};
  guard g;
  guard_begin(&g, rstate_cleanup, &r);
  struct stat sb;
  r.fd = open_regular(path, &sb);
  int64_t size = sb.st_size;
  if (size < 8) dm_error("%s: truncated: %lld bytes, too short for the 8-byte header length", path, (long long)size);
  uint64_t hlen;
  read_at(&r, &hlen, 8, 0, "the header length");
  if (hlen > MAX_HEADER) dm_error("%s: corrupted header: header length %llu is not sane (more than 100 MB)", path, (unsigned long long)hlen);
  if ((int64_t)hlen > size - 8)
    dm_error("%s: truncated: header says %llu bytes of header, file has %lld after the length", path,
             (unsigned long long)hlen, (long long)(size - 8));
  if (hlen < 2) dm_error("%s: corrupted header: %llu bytes cannot hold a JSON object", path, (unsigned long long)hlen);
  r.header = xmalloc(hlen + 1);
  read_at(&r, r.header, hlen, 8, "the header");
  r.header[hlen] = 0;
  if (r.header[0] != '{') dm_error("%s: corrupted header: it does not start with '{'", path);
  r.st = xcalloc(1, sizeof *r.st);
  parse_header(&r, r.header, hlen, size - 8 - (int64_t)hlen);
  read_tensors(&r, 8 + hlen);
  guard_end(&g);
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

/* ---- checksums: XXH64, bit-exact with the reference xxHash ------------------------------ */

#define XP1 11400714785074694791ULL
#define XP2 14029467366897019727ULL
#define XP3 1609587929392839161ULL
#define XP4 9650029242287828579ULL
#define XP5 2870177450012600261ULL

static uint64_t rotl64(uint64_t x, int r) { return (x << r) | (x >> (64 - r)); }
static uint64_t rd64(const unsigned char *p) { uint64_t v; memcpy(&v, p, 8); return v; }
static uint32_t rd32(const unsigned char *p) { uint32_t v; memcpy(&v, p, 4); return v; }

static uint64_t xround(uint64_t acc, uint64_t in) { return rotl64(acc + in * XP2, 31) * XP1; }
static uint64_t xmerge(uint64_t h, uint64_t v) { return (h ^ xround(0, v)) * XP1 + XP4; }

uint64_t dm_xxh64(const void *data, size_t n, uint64_t seed) {
  const unsigned char *p = n ? data : (const void *)"", *end = p + n;   /* (an empty file maps to NULL) */
  uint64_t h;
  if (n >= 32) {
    uint64_t v1 = seed + XP1 + XP2, v2 = seed + XP2, v3 = seed, v4 = seed - XP1;
    for (; end - p >= 32; p += 32) {
      v1 = xround(v1, rd64(p)); v2 = xround(v2, rd64(p + 8));
      v3 = xround(v3, rd64(p + 16)); v4 = xround(v4, rd64(p + 24));
    }
    h = rotl64(v1, 1) + rotl64(v2, 7) + rotl64(v3, 12) + rotl64(v4, 18);
    h = xmerge(xmerge(xmerge(xmerge(h, v1), v2), v3), v4);
  } else {
    h = seed + XP5;
  }
  h += (uint64_t)n;
  for (; end - p >= 8; p += 8) h = rotl64(h ^ xround(0, rd64(p)), 27) * XP1 + XP4;
  if (end - p >= 4) { h = rotl64(h ^ (uint64_t)rd32(p) * XP1, 23) * XP2 + XP3; p += 4; }
  for (; p < end; p++) h = rotl64(h ^ *p * XP5, 11) * XP1;
  h ^= h >> 33; h *= XP2;
  h ^= h >> 29; h *= XP3;
  h ^= h >> 32;
  return h;
}

uint64_t dm_file_checksum(const char *path, int64_t *size) {
  struct stat sb;
  int fd = open_regular(path, &sb);
  size_t n = (size_t)sb.st_size;
  void *map = n ? mmap(NULL, n, PROT_READ, MAP_PRIVATE, fd, 0) : NULL;
  int e = errno;
  close(fd);
  if (map == MAP_FAILED) dm_error("%s: cannot map for its checksum: %s", path, strerror(e));
  if (map) madvise(map, n, MADV_SEQUENTIAL);
  uint64_t h = dm_xxh64(map, n, 0);
  if (map) munmap(map, n);
  if (size) *size = (int64_t)n;
  return h;
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
