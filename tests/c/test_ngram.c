/* the Kneser–Ney byte n-gram baseline against a brute-force float64 reference */
#define _GNU_SOURCE
#include <math.h>
#include <stdlib.h>
#include <unistd.h>
#include "check.h"
#include "data/ngram.h"

static const char *TEXT =
  "In the beginning God created the heaven and the earth. And the earth was without form, "
  "and void; and darkness was upon the face of the deep. And the Spirit of God moved upon "
  "the face of the waters. And God said, Let there be light: and there was light. And God "
  "saw the light, that it was good: and God divided the light from the darkness. And God "
  "called the light Day, and the darkness he called Night. And the evening and the morning "
  "were the first day. Zebulun!";

/* ---- the reference: every count found by scanning the stream, nothing cached but D -------- */

static const uint8_t *D;
static int64_t N;
static int64_t POS[4096];       /* the positions counted, in stream order: 0..N-1, or a sampled fit's */
static int64_t NPOS;

static int byte_at(int64_t p) { return p < 0 ? 0 : D[p]; }

/* does the n-gram g (oldest byte first) end at position p of the padded stream? */
static bool ends_at(int64_t p, const uint8_t *g, int n) {
  for (int i = 0; i < n; i++)
    if (byte_at(p - n + 1 + i) != g[i]) return false;
  return true;
}

static int64_t raw_count(const uint8_t *g, int n) {
  int64_t c = 0;
  for (int64_t i = 0; i < NPOS; i++) c += ends_at(POS[i], g, n);
  return c;
}

static int64_t continuation_count(const uint8_t *g, int n) {
  bool seen[256] = {0};
  int64_t c = 0;
  for (int64_t i = 0; i < NPOS; i++) {
    int64_t p = POS[i];
    if (ends_at(p, g, n) && !seen[byte_at(p - n)]) { seen[byte_at(p - n)] = true; c++; }
  }
  return c;
}

static int64_t ref_count(int order, const uint8_t *g, int n) {
  return n == order ? raw_count(g, n) : continuation_count(g, n);
}

static double ref_discount(int order, int n) {
  int64_t n1 = 0, n2 = 0;
  uint8_t g[8];
  for (int64_t j = 0; j < NPOS; j++) {
    int64_t p = POS[j];
    for (int i = 0; i < n; i++) g[i] = (uint8_t)byte_at(p - n + 1 + i);
    bool first = true;
    for (int64_t q = 0; q < j && first; q++) first = !ends_at(POS[q], g, n);
    if (!first) continue;
    int64_t c = ref_count(order, g, n);
    n1 += c == 1;
    n2 += c == 2;
  }
  return n1 > 0 ? (double)n1 / (double)(n1 + 2 * n2) : 0.5;
}

static double ref_d[9];

static void ref_fit(const uint8_t *data, int64_t n, int order) {
  D = data;
  N = n;
  NPOS = n;
  for (int64_t p = 0; p < n; p++) POS[p] = p;
  for (int k = 1; k <= order; k++) ref_d[k] = ref_discount(order, k);
}

/* the fit on `pieces` pieces of `len` bytes, piece i at floor((train - len) * i / (pieces - 1)),
** each n-gram read from the whole stream (a piece's history is the bytes before it) */
static void ref_fit_pieces(const uint8_t *data, int64_t train, int pieces, int64_t len, int order) {
  D = data;
  N = train;
  NPOS = 0;
  for (int i = 0; i < pieces; i++) {
    int64_t at = (int64_t)((double)(train - len) * i / (pieces - 1));
    for (int64_t p = at; p < at + len; p++) POS[NPOS++] = p;
  }
  for (int k = 1; k <= order; k++) ref_d[k] = ref_discount(order, k);
}

/* hist: the order-1 bytes before w, oldest first */
static double ref_prob(int order, const uint8_t *hist, int w) {
  double p = 1.0 / 256;
  uint8_t g[8];
  for (int n = 1; n <= order; n++) {
    memcpy(g, hist + (order - 1) - (n - 1), (size_t)(n - 1));
    double total = 0, distinct = 0;
    for (int v = 0; v < 256; v++) {
      g[n - 1] = (uint8_t)v;
      int64_t c = ref_count(order, g, n);
      total += (double)c;
      distinct += c > 0;
    }
    if (total == 0) continue;
    g[n - 1] = (uint8_t)w;
    double c = (double)ref_count(order, g, n), d = ref_d[n];
    p = (fmax(c - d, 0) + d * distinct * p) / total;
  }
  return p;
}

/* ---- helpers ------------------------------------------------------------------------------- */

static uint64_t pack(const uint8_t *hist, int n) {     /* oldest first in, most recent lowest out */
  uint64_t h = 0;
  for (int i = 0; i < n; i++) h = (h << 8) | hist[i];
  return h;
}

static bool close_rel(double a, double b, double tol) { return fabs(a - b) <= tol * fabs(b); }

static dm_ngram *fit_bytes(const uint8_t *b, int64_t n, int order, int chunk) {
  dm_ngram *m = dm_ngram_new(order);
  for (int64_t at = 0; at < n; at += chunk) dm_ngram_add(m, b + at, n - at < chunk ? n - at : chunk);
  dm_ngram_finish(m);
  return m;
}

/* ---- the checks ------------------------------------------------------------------------------ */

/* probabilities of seen and unseen bytes after training contexts, unseen contexts and the pad */
static void agrees_with_reference(void) {
  const uint8_t *b = (const uint8_t *)TEXT;
  int64_t n = (int64_t)strlen(TEXT);
  const uint8_t *probe = (const uint8_t *)"And the dog was without light; Zyx?";
  for (int order = 1; order <= 8; order++) {
    ref_fit(b, n, order);
    dm_ngram *m = fit_bytes(b, n, order, 1000);
    bool ok = true, dok = true;
    for (int k = 1; k <= order; k++) dok = dok && dm_ngram_discount(m, k) == ref_d[k];
    int queries = order <= 6 ? 40 : 12;
    for (int q = 0; q < queries; q++) {
      uint8_t hist[8] = {0};
      int64_t at = (q * 37) % (int64_t)strlen((const char *)probe);
      for (int i = 0; i < order - 1; i++) {         /* history: the probe text, or the training text */
        int64_t j = at - (order - 1) + i;
        hist[i] = q % 3 == 0 ? (uint8_t)byte_at(q * 11 - (order - 1) + i) : j < 0 ? 0 : probe[j];
      }
      int ws[3] = {probe[at], b[(q * 7) % n], (q * 53) % 256};   /* 53 * q mod 256: often unseen */
      for (int i = 0; i < 3; i++) {
        double want = ref_prob(order, hist, ws[i]);
        double got = dm_ngram_prob(m, pack(hist, order - 1), ws[i]);
        if (!close_rel(got, want, 1e-9)) {
          ok = false;
          fprintf(stderr, "order %d query %d byte %d: %.17g vs reference %.17g\n", order, q, ws[i], got, want);
        }
      }
    }
    CHECK(ok);
    CHECK(dok);
    dm_ngram_free(m);
  }
}

static void sums_to_one(void) {
  const uint8_t *b = (const uint8_t *)TEXT;
  int64_t n = (int64_t)strlen(TEXT);
  const char *hists[4] = {"d the", "\0\0\0\0\0", "qqqqq", "God s"};
  for (int order = 1; order <= 6; order++) {
    ref_fit(b, n, order);
    dm_ngram *m = fit_bytes(b, n, order, 1000);
    for (int h = 0; h < 4; h++) {
      const uint8_t *hist = (const uint8_t *)hists[h] + 5 - (order - 1);
      double sum = 0, ref_sum = 0;
      for (int w = 0; w < 256; w++) {
        sum += dm_ngram_prob(m, pack(hist, order - 1), w);
        if (order <= 3 && h < 2) ref_sum += ref_prob(order, hist, w);
      }
      CHECK(fabs(sum - 1) < 1e-12);
      if (order <= 3 && h < 2) CHECK(fabs(ref_sum - 1) < 1e-12);
    }
    dm_ngram_free(m);
  }
}

/* counting in pieces is counting the stream */
static void chunks_do_not_matter(void) {
  const uint8_t *b = (const uint8_t *)TEXT;
  int64_t n = (int64_t)strlen(TEXT);
  dm_ngram *whole = fit_bytes(b, n, 5, 1 << 20), *pieces = fit_bytes(b, n, 5, 7);
  bool same = true;
  for (int k = 1; k <= 5; k++) same = same && dm_ngram_entries(whole, k) == dm_ngram_entries(pieces, k);
  for (int64_t p = 4; p < n; p += 3) same = same && dm_ngram_prob(whole, pack(b + p - 4, 4), b[p]) ==
                                                     dm_ngram_prob(pieces, pack(b + p - 4, 4), b[p]);
  CHECK(same);
  int distinct = 0;
  bool seen[256] = {0};
  for (int64_t i = 0; i < n; i++) if (!seen[b[i]]) { seen[b[i]] = true; distinct++; }
  CHECK(dm_ngram_entries(whole, 1) == distinct);
  dm_ngram_free(whole);
  dm_ngram_free(pieces);
}

/* the reference's bits of TEXT[from, to), each byte from the order - 1 before it (pad bytes 0
** before the start), under its last fit */
static double ref_bits(int order, int64_t from, int64_t to) {
  double bits = 0;
  for (int64_t p = from; p < to; p++) {
    uint8_t hist[8];
    for (int i = 0; i < order - 1; i++) hist[i] = (uint8_t)byte_at(p - (order - 1) + i);
    bits -= log2(ref_prob(order, hist, (uint8_t)TEXT[p]));
  }
  return bits;
}

/* fit on a corpus's train split, score its held-out bytes with context from the stream */
static void corpus_bits(void) {
  char path[] = "/tmp/dm_test_ngram_XXXXXX";
  int fd = mkstemp(path);
  int64_t n = (int64_t)strlen(TEXT);
  CHECK(write(fd, TEXT, (size_t)n) == n);
  close(fd);
  dm_corpus *c = dm_corpus_open(1, (const char *const[]){path}, 90);
  int64_t train = dm_corpus_train_size(c);
  for (int order = 1; order <= 5; order++) {
    dm_ngram *m = dm_ngram_fit(c, order, 0);
    ref_fit((const uint8_t *)TEXT, train, order);
    CHECK(close_rel(dm_ngram_bits(m, c, train, n), ref_bits(order, train, n), 1e-9));
    /* a range at the very start reads its history as pad bytes */
    CHECK(close_rel(dm_ngram_bits(m, c, 0, 3), ref_bits(order, 0, 3), 1e-9));
    CHECK(dm_ngram_bits(m, c, 10, 10) == 0);
    EXPECT_ERROR(dm_ngram_bits(m, c, 10, n + 1), "cannot score bytes [10, 464) of a corpus of 463");
    dm_ngram_free(m);
  }
  EXPECT_ERROR(dm_ngram_fit(c, 9, 0), "order must be in 1..8, got 9");
  /* a sampled fit: DM_NGRAM_PIECES pieces of 2 bytes, or 40 pieces of 1 byte (fewer bytes than
  ** pieces), against the reference counting the same positions; a sample as large as the split
  ** is the whole fit */
  const int64_t samples[][3] = {{2 * DM_NGRAM_PIECES, DM_NGRAM_PIECES, 2}, {40, 40, 1}, {train, 1, train}};
  for (int k = 0; k < 3; k++)
    for (int order = 1; order <= 4; order++) {
      dm_ngram *m = dm_ngram_fit(c, order, samples[k][0]);
      if (samples[k][1] == 1) ref_fit((const uint8_t *)TEXT, train, order);
      else ref_fit_pieces((const uint8_t *)TEXT, train, (int)samples[k][1], samples[k][2], order);
      CHECK(close_rel(dm_ngram_bits(m, c, train, n), ref_bits(order, train, n), 1e-9));
      dm_ngram_free(m);
    }
  dm_corpus_release(c);
  unlink(path);
}

static void errors(void) {
  EXPECT_ERROR(dm_ngram_new(0), "order must be in 1..8, got 0");
  dm_ngram *m = dm_ngram_new(3);
  dm_ngram_add(m, (const uint8_t *)"abcabc", 6);
  EXPECT_ERROR(dm_ngram_prob(m, 0, 'a'), "call dm_ngram_finish before");
  dm_ngram_finish(m);
  EXPECT_ERROR(dm_ngram_add(m, (const uint8_t *)"a", 1), "the model is finished");
  EXPECT_ERROR(dm_ngram_finish(m), "already finished");
  EXPECT_ERROR(dm_ngram_prob(m, 0, 256), "a byte is 0..255, got 256");
  EXPECT_ERROR(dm_ngram_discount(m, 4), "order 4 of a model of order 3");
  dm_ngram_free(m);
}

int main(void) {
  check_begin();
  agrees_with_reference();
  sums_to_one();
  chunks_do_not_matter();
  corpus_bits();
  errors();
  return check_end();
}
