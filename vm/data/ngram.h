/*
** ngram.h — an order-N byte n-gram model with interpolated Kneser–Ney
** smoothing: the baseline a trained model's held-out bits per byte must beat.
**
** The model (Chen & Goodman's interpolated KN, one discount per order):
**
**   P_0(w)   = 1/256
**   P_n(w|h) = ( max(c_n(hw) - D_n, 0) + D_n * N1+(h.) * P_{n-1}(w|h') ) / c_n(h.)
**
** h is the n-1 bytes before w, h' is h without its oldest byte, c_n(h.) =
** sum over w of c_n(hw) and N1+(h.) the number of bytes w with c_n(hw) > 0.
** When c_n(h.) = 0 the order adds nothing: P_n(w|h) = P_{n-1}(w|h').
** c_N are raw counts at the top order N; below it c_n(hw) is the
** continuation count N1+(.hw), the number of distinct bytes seen before hw.
** D_n = n1 / (n1 + 2 n2) (plain KN, one D per order), where n1 and n2 are
** the numbers of n-grams whose c_n is 1 and 2; when an order has no n-gram
** of count 1 (the formula would give 0 and unseen bytes probability 0),
** D_n = 0.5 is used and dm_ngram_discount reports it.
**
** The stream is counted as if preceded by pad bytes 0, so every position
** has a full history, the same padding the batches' prefixes use. Keys are
** exact: an n-gram's bytes packed into a uint64 (orders up to 8), in
** open-addressing hash tables, so there are no collisions.
*/
#ifndef DM_NGRAM_H
#define DM_NGRAM_H

#include "data/data.h"

#define DM_NGRAM_MAX_ORDER 8

typedef struct dm_ngram dm_ngram;

dm_ngram *dm_ngram_new(int order);                  /* 1 .. DM_NGRAM_MAX_ORDER */
/* count the next n bytes of the stream (the history carries across calls) */
void dm_ngram_add(dm_ngram *m, const uint8_t *bytes, int64_t n);
/* after the last add: continuation counts, context totals, discounts */
void dm_ngram_finish(dm_ngram *m);
void dm_ngram_free(dm_ngram *m);                    /* NULL is fine */

int dm_ngram_order(const dm_ngram *m);
double dm_ngram_discount(const dm_ngram *m, int n);  /* D_n, n = 1 .. order */
int64_t dm_ngram_entries(const dm_ngram *m, int n);  /* distinct n-grams of order n */
/* P(byte | history): history holds the preceding bytes, the most recent in
** the low 8 bits (pad bytes 0 beyond the stream's start) */
double dm_ngram_prob(const dm_ngram *m, uint64_t history, int byte);

/* Fit on a corpus's train split: all of it when sample <= 0 or sample >= its size, else on
** DM_NGRAM_PIECES pieces of sample / DM_NGRAM_PIECES bytes spread evenly over it (the first at
** its start, the last at its end), each counted with the bytes before it as its history. */
#define DM_NGRAM_PIECES 64
dm_ngram *dm_ngram_fit(const dm_corpus *c, int order, int64_t sample);
/* total bits, -sum log2 P, of the bytes [from, to) of the corpus, each
** predicted from the bytes before it in the stream */
double dm_ngram_bits(const dm_ngram *m, const dm_corpus *c, int64_t from, int64_t to);

#endif
