/*
** json_read.c — a small strict JSON reader for the safetensors header (json_read.h), and the
** UTF-8 check the header's strings must pass.
*/
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "io/json_read.h"
#include "io/fileio.h"
#include "core/core.h"

#define MAX_JSON_DEPTH 64

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

bool dm_utf8_valid(const char *s) {
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

void *dm_arena_alloc(dm_arena *a, size_t n) {
  n = (n + 15) & ~(size_t)15;
  if (!a->head || a->head->used + n > a->head->cap) {
    size_t cap = n > 65536 ? n : 65536;
    dm_ablock *b = dm_xmalloc(sizeof *b + cap);
    b->next = a->head;
    b->used = 0;
    b->cap = cap;
    a->head = b;
  }
  void *p = a->head->data + a->head->used;
  a->head->used += n;
  return p;
}

void dm_arena_free(dm_arena *a) {
  while (a->head) { dm_ablock *b = a->head; a->head = b->next; free(b); }
}

typedef struct jparser {
  const char *p, *start, *end;
  dm_arena *a;
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

static dm_jval *jnew(jparser *j, int type) {
  dm_jval *v = dm_arena_alloc(j->a, sizeof *v);
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
  char *out = dm_arena_alloc(j->a, (size_t)(scan - j->p) + 1), *o = out;
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

static dm_jval *jvalue(jparser *j);

/* the members of an object or the items of an array, after the opening bracket */
static void jmembers(jparser *j, dm_jval *v, char close, bool keyed) {
  if (++j->depth > MAX_JSON_DEPTH) jfail(j, "nested more than %d deep", MAX_JSON_DEPTH);
  dm_jval **tail = &v->first;
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
    dm_jval *item = jvalue(j);
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

static dm_jval *jvalue(jparser *j) {
  jskip_ws(j);
  char buf[16];
  if (j->p >= j->end) jfail(j, "unexpected end of the header");
  char c = *j->p;
  dm_jval *v;
  if (c == '{') { v = jnew(j, DM_J_OBJECT); j->p++; jmembers(j, v, '}', true); }
  else if (c == '[') { v = jnew(j, DM_J_ARRAY); j->p++; jmembers(j, v, ']', false); }
  else if (c == '"') { v = jnew(j, DM_J_STRING); v->s = jstring(j, &v->len); }
  else if (c == '-' || is_digit(c)) { v = jnew(j, DM_J_INT); v->i = jinteger(j); }
  else jfail(j, "unexpected %s (values are objects, arrays, strings and integers)", jnext_desc(j, buf, sizeof buf));
  return v;
}

dm_jval *dm_json_parse(const char *path, const char *text, size_t n, dm_arena *a) {
  jparser j = {text, text, text + n, a, path, 0};
  dm_jval *v = jvalue(&j);
  jskip_ws(&j);   /* the padding */
  char buf[16];
  if (j.p < j.end) jfail(&j, "unexpected %s after the header object", jnext_desc(&j, buf, sizeof buf));
  return v;
}
