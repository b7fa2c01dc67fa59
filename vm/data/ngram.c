/*
** ngram.c — interpolated Kneser–Ney byte n-grams over exact packed keys.
** See ngram.h for the model.
**
** Tables map a uint64 key (up to 8 bytes, the most recent byte lowest) to
** two counts, with open addressing and linear probing; a slot whose first
** count is 0 is empty (every stored count is at least 1). Growing can fail
** only for memory; the internal steps then return false so the fit can
** free what it built before raising.
*/
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include "data/ngram.h"

typedef struct entry { uint64_t key; int64_t a, b; } entry;
typedef struct table { entry *e; size_t cap, used; } table;

struct dm_ngram {
  int order;
  bool finished;
  uint64_t key;                          /* the stream's last `order` bytes so far */
  table grams[DM_NGRAM_MAX_ORDER + 1];   /* [n]: n-gram hw -> a = c_n(hw) */
  table ctx[DM_NGRAM_MAX_ORDER + 1];     /* [n]: context h -> a = c_n(h.), b = N1+(h.) */
  double d[DM_NGRAM_MAX_ORDER + 1];
};

/* ---- the tables ------------------------------------------------------------------------- */

static uint64_t mask(int n) { return n >= 8 ? ~UINT64_C(0) : (UINT64_C(1) << (8 * n)) - 1; }

/* the murmur3 finaliser: packed bytes are far from random in their low bits */
static size_t slot_of(uint64_t key, size_t cap) {
  key ^= key >> 33; key *= UINT64_C(0xff51afd7ed558ccd);
  key ^= key >> 33; key *= UINT64_C(0xc4ceb9fe1a85ec53);
  key ^= key >> 33;
  return (size_t)key & (cap - 1);
}

static const entry *find(const table *t, uint64_t key) {
  if (!t->cap) return NULL;
  for (size_t i = slot_of(key, t->cap);; i = (i + 1) & (t->cap - 1)) {
    const entry *e = &t->e[i];
    if (e->a == 0) return NULL;
    if (e->key == key) return e;
  }
}

static entry *probe(entry *slots, size_t cap, uint64_t key) {
  size_t i = slot_of(key, cap);
  while (slots[i].a != 0 && slots[i].key != key) i = (i + 1) & (cap - 1);
  return &slots[i];
}

static bool grow(table *t) {
  size_t cap = t->cap ? 2 * t->cap : 1024;
  entry *e = calloc(cap, sizeof *e);
  if (!e) return false;
  for (size_t i = 0; i < t->cap; i++)
    if (t->e[i].a) *probe(e, cap, t->e[i].key) = t->e[i];
  free(t->e);
  t->e = e;
  t->cap = cap;
  return true;
}

/* the entry for key, added with zero counts if new (the caller must count it); NULL: out of memory */
static entry *upsert(table *t, uint64_t key) {
  if (2 * (t->used + 1) > t->cap && !grow(t)) return NULL;
  entry *e = probe(t->e, t->cap, key);
  if (e->a == 0) { e->key = key; t->used++; }
  return e;
}

/* ---- counting ------------------------------------------------------------------------------ */

dm_ngram *dm_ngram_new(int order) {
  if (order < 1 || order > DM_NGRAM_MAX_ORDER)
    dm_error("ngram: order must be in 1..%d, got %d", DM_NGRAM_MAX_ORDER, order);
  dm_ngram *m = calloc(1, sizeof *m);
  if (!m) dm_error("ngram: out of host memory");
  m->order = order;
  return m;
}

void dm_ngram_free(dm_ngram *m) {
  if (!m) return;
  for (int n = 0; n <= DM_NGRAM_MAX_ORDER; n++) { free(m->grams[n].e); free(m->ctx[n].e); }
  free(m);
}

static bool count(dm_ngram *m, const uint8_t *bytes, int64_t n) {
  table *t = &m->grams[m->order];
  uint64_t msk = mask(m->order), key = m->key;
  for (int64_t i = 0; i < n; i++) {
    key = ((key << 8) | bytes[i]) & msk;
    entry *e = upsert(t, key);
    if (!e) return false;
    e->a++;
  }
  m->key = key;
  return true;
}

/* continuation counts: each distinct (n+1)-gram xhw adds one to hw */
static bool continuations(dm_ngram *m) {
  for (int n = m->order - 1; n >= 1; n--) {
    const table *up = &m->grams[n + 1];
    for (size_t i = 0; i < up->cap; i++) {
      if (!up->e[i].a) continue;
      entry *e = upsert(&m->grams[n], up->e[i].key & mask(n));
      if (!e) return false;
      e->a++;
    }
  }
  return true;
}

static bool contexts(dm_ngram *m) {
  for (int n = 1; n <= m->order; n++) {
    const table *g = &m->grams[n];
    for (size_t i = 0; i < g->cap; i++) {
      if (!g->e[i].a) continue;
      entry *e = upsert(&m->ctx[n], g->e[i].key >> 8);
      if (!e) return false;
      e->a += g->e[i].a;
      e->b++;
    }
  }
  return true;
}

static void discounts(dm_ngram *m) {
  for (int n = 1; n <= m->order; n++) {
    const table *g = &m->grams[n];
    int64_t n1 = 0, n2 = 0;
    for (size_t i = 0; i < g->cap; i++) { n1 += g->e[i].a == 1; n2 += g->e[i].a == 2; }
    m->d[n] = n1 > 0 ? (double)n1 / (double)(n1 + 2 * n2) : 0.5;
  }
}

static bool finish(dm_ngram *m) {
  if (!continuations(m) || !contexts(m)) return false;
  discounts(m);
  m->finished = true;
  return true;
}

void dm_ngram_add(dm_ngram *m, const uint8_t *bytes, int64_t n) {
  if (m->finished) dm_error("ngram: the model is finished; counts cannot be added");
  if (!count(m, bytes, n)) dm_error("ngram: out of host memory counting order-%d n-grams", m->order);
}

void dm_ngram_finish(dm_ngram *m) {
  if (m->finished) dm_error("ngram: the model is already finished");
  if (!finish(m)) dm_error("ngram: out of host memory finishing the order-%d model", m->order);
}

/* ---- probabilities ----------------------------------------------------------------------- */

int dm_ngram_order(const dm_ngram *m) { return m->order; }

double dm_ngram_discount(const dm_ngram *m, int n) {
  if (n < 1 || n > m->order) dm_error("ngram: order %d of a model of order %d", n, m->order);
  return m->d[n];
}

int64_t dm_ngram_entries(const dm_ngram *m, int n) {
  if (n < 1 || n > m->order) dm_error("ngram: order %d of a model of order %d", n, m->order);
  return (int64_t)m->grams[n].used;
}

static double prob(const dm_ngram *m, uint64_t history, int byte) {
  double p = 1.0 / 256;
  for (int n = 1; n <= m->order; n++) {
    uint64_t h = history & mask(n - 1);
    const entry *c = find(&m->ctx[n], h);
    if (!c) break;                        /* an unseen context: no longer one is seen either */
    const entry *g = find(&m->grams[n], (h << 8) | (uint64_t)byte);
    double cnt = g ? (double)g->a : 0, d = m->d[n];
    p = (fmax(cnt - d, 0) + d * (double)c->b * p) / (double)c->a;
  }
  return p;
}

double dm_ngram_prob(const dm_ngram *m, uint64_t history, int byte) {
  if (!m->finished) dm_error("ngram: call dm_ngram_finish before asking for probabilities");
  if (byte < 0 || byte > 255) dm_error("ngram: a byte is 0..255, got %d", byte);
  return prob(m, history, byte);
}

/* ---- over a corpus -------------------------------------------------------------------------- */

#define CHUNK (1 << 16)          /* bytes read from the corpus at a time */

/* counts bytes [from, to) of the stream, the history the order - 1 bytes before from */
static bool count_range(dm_ngram *m, const dm_corpus *c, int64_t from, int64_t to) {
  uint8_t before[8];
  dm_corpus_read(c, from - 8, 8, before);     /* pad bytes 0 before the start */
  m->key = 0;
  for (int i = 0; i < 8; i++) m->key = (m->key << 8) | before[i];
  static _Thread_local uint8_t chunk[CHUNK];
  bool ok = true;
  for (int64_t pos = from; ok && pos < to;) {
    int64_t n = to - pos < CHUNK ? to - pos : CHUNK;
    dm_corpus_read(c, pos, n, chunk);
    ok = count(m, chunk, n);
    pos += n;
  }
  return ok;
}

dm_ngram *dm_ngram_fit(const dm_corpus *c, int order, int64_t sample) {
  dm_ngram *m = dm_ngram_new(order);
  int64_t train = dm_corpus_train_size(c);
  bool ok = true;
  if (sample <= 0 || sample >= train) ok = count_range(m, c, 0, train);
  else {
    int pieces = DM_NGRAM_PIECES;
    int64_t piece = sample / pieces;
    if (piece < 1) { pieces = (int)sample; piece = 1; }
    for (int i = 0; ok && i < pieces; i++) {
      int64_t at = pieces == 1 ? 0 : (int64_t)((double)(train - piece) * i / (pieces - 1));
      ok = count_range(m, c, at, at + piece);
    }
  }
  if (ok) ok = finish(m);
  if (!ok) {
    dm_ngram_free(m);
    dm_error("ngram: out of host memory fitting order %d on %lld bytes", order,
             (long long)(sample > 0 && sample < train ? sample : train));
  }
  return m;
}

double dm_ngram_bits(const dm_ngram *m, const dm_corpus *c, int64_t from, int64_t to) {
  if (!m->finished) dm_error("ngram: call dm_ngram_finish before scoring");
  if (from < 0 || from > to || to > dm_corpus_size(c))
    dm_error("ngram: cannot score bytes [%lld, %lld) of a corpus of %lld", (long long)from, (long long)to,
             (long long)dm_corpus_size(c));
  uint8_t before[8];
  dm_corpus_read(c, from - 8, 8, before);     /* pad bytes 0 before the start */
  uint64_t h = 0;
  for (int i = 0; i < 8; i++) h = (h << 8) | before[i];
  static _Thread_local uint8_t chunk[CHUNK];
  double bits = 0;
  for (int64_t pos = from; pos < to;) {
    int64_t n = to - pos < CHUNK ? to - pos : CHUNK;
    dm_corpus_read(c, pos, n, chunk);
    for (int64_t i = 0; i < n; i++) {
      bits -= log2(prob(m, h, chunk[i]));
      h = (h << 8) | chunk[i];
    }
    pos += n;
  }
  return bits;
}
