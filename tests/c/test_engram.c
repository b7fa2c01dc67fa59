/*
** Engram: the layout, the n-gram rows (direct orders exact, hashed orders in
** range, position-free, prefix handling), unique rows, the per-row gradient
** sums, sparse Adam against dense Adam, and the host tables (prefetch, take,
** apply, threads).
**
**   test_engram                 the tests
**   test_engram --bench [file]  timings at b1's scale (file: the bytes to
**                               index; default: generated word-like text)
*/
#define _GNU_SOURCE
#include <math.h>
#include <stdlib.h>
#include <time.h>
#include "check.h"
#include "core/core.h"
#include "core/autograd.h"
#include "ops/engram.h"
#include "core/code8.h"
#include "data/hostable.h"

/* ---- helpers -------------------------------------------------------------------------------- */

static uint64_t rng_state = 88172645463325252ull;
static uint64_t rnd(void) {
  rng_state ^= rng_state << 13;
  rng_state ^= rng_state >> 7;
  rng_state ^= rng_state << 17;
  return rng_state;
}

/* u8 [B, T] of values below alphabet */
static dm_tensor *bytes(int64_t B, int64_t T, int alphabet) {
  int64_t s[2] = {B, T};
  dm_tensor *x = dm_empty(DM_CPU, DM_U8, 2, s);
  uint8_t *p = dm_data(x);
  for (int64_t i = 0; i < B * T; i++) p[i] = (uint8_t)(rnd() % (uint64_t)alphabet);
  return x;
}

static dm_engram_layout layout(int n, const int64_t *orders, int64_t heads, int64_t rows) {
  dm_engram_layout L;
  dm_engram_layout_make(&L, n, orders, heads, rows);
  return L;
}

static bool prime_by_division(int64_t n) {
  if (n < 2) return false;
  for (int64_t q = 2; q * q <= n; q++)
    if (n % q == 0) return false;
  return true;
}

static int64_t *i64(dm_tensor *t) { return dm_data(t); }

static dm_tensor *randn_f32(int64_t r, int64_t c) {
  int64_t s[2] = {r, c};
  return dm_randn(DM_CPU, DM_F32, 2, s);
}

/* ---- the layout ------------------------------------------------------------------------------- */

static void primes(void) {
  CHECK(dm_engram_prev_prime(1) == 0);
  CHECK(dm_engram_prev_prime(2) == 2);
  CHECK(dm_engram_prev_prime(4) == 3);
  CHECK(dm_engram_prev_prime(100) == 97);
  CHECK(dm_engram_prev_prime(4194304) == 4194301);
  CHECK(dm_engram_prev_prime(((int64_t)1 << 61) - 1) == ((int64_t)1 << 61) - 1);   /* a Mersenne prime */
  CHECK(dm_engram_prev_prime((int64_t)1 << 61) == ((int64_t)1 << 61) - 1);
  int agree = 1;
  for (int64_t n = 2; n < 5000; n++) agree &= (dm_engram_prev_prime(n) == n) == prime_by_division(n);
  CHECK(agree);
}

static void layouts(void) {
  dm_engram_layout L = layout(3, (int64_t[]){3, 4, 5}, 1, 4194304);     /* b1 */
  CHECK(L.nsub == 3 && L.max_order == 5);
  int64_t below = 4194304, total = 0;
  for (int s = 0; s < 3; s++) {
    CHECK(!L.sub[s].direct && L.sub[s].order == 3 + s && L.sub[s].offset == total);
    CHECK(prime_by_division(L.sub[s].size) && L.sub[s].size <= below);
    for (int64_t q = L.sub[s].size + 1; q <= below; q++) CHECK(!prime_by_division(q));   /* the largest left */
    below = L.sub[s].size - 1;
    total += L.sub[s].size;
  }
  CHECK(L.total_rows == total);
  printf("b1 layout: %lld rows (%lld, %lld, %lld), %.1fM parameters at de = 32\n", (long long)L.total_rows,
         (long long)L.sub[0].size, (long long)L.sub[1].size, (long long)L.sub[2].size, 32e-6 * (double)L.total_rows);

  L = layout(3, (int64_t[]){1, 2, 3}, 2, 65536);
  CHECK(L.nsub == 6);
  CHECK(L.sub[0].direct && L.sub[0].size == 256 && L.sub[1].direct && L.sub[1].size == 256);
  CHECK(L.sub[2].direct && L.sub[2].size == 65536 && L.sub[3].size == 65536 && L.sub[3].head == 1);
  CHECK(!L.sub[4].direct && L.sub[4].size == 65521 && L.sub[5].size == 65519);   /* distinct primes */
  CHECK(L.sub[5].offset == 2 * 256 + 2 * 65536 + 65521 && L.total_rows == L.sub[5].offset + 65519);

  EXPECT_ERROR(layout(2, (int64_t[]){3, 3}, 1, 100), "orders must increase");
  EXPECT_ERROR(layout(1, (int64_t[]){9}, 1, 100), "order 9 is outside");
  EXPECT_ERROR(layout(1, (int64_t[]){3}, 0, 100), "heads");
  EXPECT_ERROR(layout(1, (int64_t[]){3}, 1, 1), "at least 2");
  EXPECT_ERROR(layout(1, (int64_t[]){3}, 5, 10), "not enough primes");   /* 7, 5, 3, 2 */
}

/* ---- n-gram rows -------------------------------------------------------------------------------- */

/* rows b of [256, 512]: b,0,b,1,...,b,255: every bigram (b, c) ends at an odd position */
static void direct_orders(void) {
  dm_engram_layout L = layout(2, (int64_t[]){1, 2}, 1, 65536);
  int64_t s[2] = {256, 512};
  dm_tensor *x = dm_empty(DM_CPU, DM_U8, 2, s);
  uint8_t *p = dm_data(x);
  for (int b = 0; b < 256; b++)
    for (int c = 0; c < 256; c++) { p[b * 512 + 2 * c] = (uint8_t)b; p[b * 512 + 2 * c + 1] = (uint8_t)c; }
  dm_tensor *idx = dm_engram_index(x, NULL, &L);
  const int64_t *ix = i64(idx);
  int32_t *owner = malloc(sizeof(int32_t) * 65536);     /* the bigram that took each row */
  for (int i = 0; i < 65536; i++) owner[i] = -1;
  bool keys = true, injective = true, every = true;
  for (int64_t i = 0; i < 256 * 512; i++) {
    int prev = i % 512 ? p[i - 1] : 0, cur = p[i];
    keys &= ix[2 * i] == cur && ix[2 * i + 1] == 256 + prev * 256 + cur;
    int64_t row = ix[2 * i + 1] - 256;
    if (row < 0 || row >= 65536) { keys = false; continue; }
    if (owner[row] < 0) owner[row] = prev * 256 + cur;
    injective &= owner[row] == prev * 256 + cur;
  }
  for (int i = 0; i < 65536; i++) every &= owner[i] == i;
  CHECK(keys);
  CHECK(injective);
  CHECK(every);                         /* all 65536 bigrams seen, each at its own row */
  free(owner);
  dm_release(idx);
  dm_release(x);
}

static void hashed_in_range(void) {
  dm_engram_layout L = layout(3, (int64_t[]){3, 4, 5}, 2, 4194304);
  dm_tensor *x = bytes(4, 300, 256);
  dm_tensor *idx = dm_engram_index(x, NULL, &L);
  CHECK(idx->ndim == 3 && idx->shape[0] == 4 && idx->shape[1] == 300 && idx->shape[2] == 6);
  bool ok = true;
  for (int64_t i = 0; i < 4 * 300; i++)
    for (int s = 0; s < 6; s++) {
      int64_t r = i64(idx)[i * 6 + s];
      ok &= r >= L.sub[s].offset && r < L.sub[s].offset + L.sub[s].size;
    }
  CHECK(ok);
  dm_release(idx);
  dm_release(x);
}

/* an 8-byte pattern planted at three places gives the same rows where it ends */
static void same_bytes_same_rows(void) {
  dm_engram_layout L = layout(3, (int64_t[]){2, 5, 8}, 2, 100003);
  dm_tensor *x = bytes(3, 50, 256);
  static const uint8_t pat[8] = {'e', 'n', 'g', 'r', 'a', 'm', '!', 0};
  int64_t at[3][2] = {{0, 10}, {2, 40}, {1, 7}};
  uint8_t *p = dm_data(x);
  for (int k = 0; k < 3; k++) memcpy(p + at[k][0] * 50 + at[k][1], pat, 8);
  dm_tensor *idx = dm_engram_index(x, NULL, &L);
  bool same = true;
  for (int k = 1; k < 3; k++)
    for (int s = 0; s < 6; s++)
      same &= i64(idx)[(at[k][0] * 50 + at[k][1] + 7) * 6 + s] == i64(idx)[(at[0][0] * 50 + at[0][1] + 7) * 6 + s];
  CHECK(same);
  dm_release(idx);
  dm_release(x);
}

static bool equal_rows(dm_tensor *a, int64_t a_from, dm_tensor *b, int64_t b_from, int64_t T) {
  int64_t S = a->shape[2], Ta = a->shape[1], Tb = b->shape[1];
  for (int64_t r = 0; r < a->shape[0]; r++)
    for (int64_t t = 0; t < T; t++)
      for (int64_t s = 0; s < S; s++)
        if (i64(a)[(r * Ta + a_from + t) * S + s] != i64(b)[(r * Tb + b_from + t) * S + s]) return false;
  return true;
}

/* x with prefix p indexes as the row p ++ x does, and a short or missing prefix as zeros */
static void prefixes(void) {
  dm_engram_layout L = layout(3, (int64_t[]){3, 4, 5}, 1, 4194304);
  int64_t B = 3, T = 20, P = 6;
  dm_tensor *whole = bytes(B, P + T, 256);
  dm_tensor *x = dm_narrow(whole, 1, P, T), *prefix = dm_narrow(whole, 1, 0, P);
  dm_tensor *a = dm_engram_index(whole, NULL, &L), *b = dm_engram_index(x, prefix, &L);
  CHECK(equal_rows(b, 0, a, P, T));
  /* a prefix of 2 bytes: as if preceded by 2 zeros */
  dm_tensor *p2 = dm_narrow(whole, 1, P - 2, 2), *c = dm_engram_index(x, p2, &L);
  dm_tensor *padded = dm_zeros(DM_CPU, DM_U8, 2, (int64_t[]){B, 4 + T});
  dm_tensor *tail = dm_narrow(padded, 1, 2, 2 + T), *from = dm_narrow(whole, 1, P - 2, 2 + T);
  dm_copy_(tail, from);
  dm_tensor *d = dm_engram_index(padded, NULL, &L);
  CHECK(equal_rows(c, 0, d, 4, T));
  /* none, an empty one and 4 zeros agree */
  dm_tensor *empty = dm_zeros(DM_CPU, DM_I64, 2, (int64_t[]){B, 0});
  dm_tensor *zeros = dm_zeros(DM_CPU, DM_I32, 2, (int64_t[]){B, 4});
  dm_tensor *e0 = dm_engram_index(x, NULL, &L), *e1 = dm_engram_index(x, empty, &L);
  dm_tensor *e2 = dm_engram_index(x, zeros, &L);
  CHECK(equal_rows(e0, 0, e1, 0, T) && equal_rows(e0, 0, e2, 0, T));
  /* errors */
  dm_tensor *wide = dm_full(DM_CPU, DM_I32, 2, (int64_t[]){B, 3}, 256);
  EXPECT_ERROR(dm_engram_index(x, wide, &L), "256");
  dm_tensor *other = dm_zeros(DM_CPU, DM_U8, 2, (int64_t[]){B + 1, 2});
  EXPECT_ERROR(dm_engram_index(x, other, &L), "different batch sizes");
  dm_tensor *f = dm_zeros(DM_CPU, DM_F32, 2, (int64_t[]){B, 2});
  EXPECT_ERROR(dm_engram_index(f, NULL, &L), "u8, i32 or i64");
  dm_tensor *rels[] = {whole, x, prefix, a, b, p2, c, padded, tail, from, d, empty, zeros, e0, e1, e2, wide, other, f};
  for (size_t i = 0; i < sizeof rels / sizeof rels[0]; i++) dm_release(rels[i]);
}

/* ---- unique rows and per-row sums ------------------------------------------------------------- */

static void unique_round_trip(void) {
  dm_engram_layout L = layout(3, (int64_t[]){1, 2, 3}, 1, 65536);
  dm_tensor *x = bytes(5, 333, 4);          /* 4 letters: n-grams repeat */
  dm_tensor *idx = dm_engram_index(x, NULL, &L), *rows, *inv, *counts;
  dm_engram_unique(idx, &rows, &inv, &counts);
  int64_t M = dm_numel(idx), U = rows->shape[0], sum = 0;
  CHECK(U < M && U > 0 && counts->shape[0] == U && dm_same_shape(inv, idx));
  bool increasing = true, round_trip = true, counted = true;
  for (int64_t u = 1; u < U; u++) increasing &= i64(rows)[u] > i64(rows)[u - 1];
  int64_t *seen = calloc((size_t)U, sizeof *seen);
  for (int64_t i = 0; i < M; i++) {
    round_trip &= i64(rows)[i64(inv)[i]] == i64(idx)[i];
    seen[i64(inv)[i]]++;
  }
  for (int64_t u = 0; u < U; u++) { counted &= seen[u] == i64(counts)[u]; sum += i64(counts)[u]; }
  CHECK(increasing);
  CHECK(round_trip);
  CHECK(counted && sum == M);
  free(seen);

  /* the per-row sums: the bits of a sequential scatter in lookup order */
  int64_t de = 7;
  dm_tensor *g = randn_f32(M, de), *flat = dm_reshape(inv, 1, &M);
  dm_tensor *red = dm_engram_sparse_grad(g, inv, U);
  float *ref = calloc((size_t)(U * de), sizeof *ref);
  const float *gp = dm_data(g);
  for (int64_t i = 0; i < M; i++)
    for (int64_t c = 0; c < de; c++) ref[i64(inv)[i] * de + c] += gp[i * de + c];
  CHECK(red->shape[0] == U && red->shape[1] == de && memcmp(dm_data(red), ref, sizeof(float) * (size_t)(U * de)) == 0);
  dm_tensor *again = dm_engram_sparse_grad(g, flat, U);
  CHECK(memcmp(dm_data(red), dm_data(again), sizeof(float) * (size_t)(U * de)) == 0);
  EXPECT_ERROR(dm_engram_sparse_grad(g, inv, U - 1), "out of range");
  free(ref);
  dm_tensor *rels[] = {x, idx, rows, inv, counts, g, flat, red, again};
  for (size_t i = 0; i < sizeof rels / sizeof rels[0]; i++) dm_release(rels[i]);
}

/* ---- sparse Adam ------------------------------------------------------------------------------ */

/* dense Adam in double over every row, with zero gradients where no row is named */
static void dense_adam(double *w, double *m, double *v, const double *gd, int64_t n, double lr, double b1,
                       double b2, double eps, int64_t t) {
  for (int64_t i = 0; i < n; i++) {
    m[i] = b1 * m[i] + (1 - b1) * gd[i];
    v[i] = b2 * v[i] + (1 - b2) * gd[i] * gd[i];
    double mh = m[i] / (1 - pow(b1, (double)t)), vh = v[i] / (1 - pow(b2, (double)t));
    w[i] -= lr * mh / (sqrt(vh) + eps);
  }
}

static void sparse_adam(dm_dtype dt) {
  int64_t R = 41, de = 5, n = R * de;
  int64_t s[2] = {R, de};
  dm_set_grad_enabled(false);
  dm_tensor *w = dm_randn(DM_CPU, dt, 2, s), *m = dm_randn(DM_CPU, dt, 2, s), *v = dm_rand(DM_CPU, dt, 2, s);
  size_t es = dm_dtype_size(dt), bytes_all = (size_t)n * es;
  double tol = dt == DM_F32 ? 2e-6 : 1e-13, worst = 0;
  bool untouched_same = true;
  char *w0 = malloc(bytes_all), *m0 = malloc(bytes_all), *v0 = malloc(bytes_all);
  double *wd = malloc(sizeof(double) * (size_t)n), *md = malloc(sizeof(double) * (size_t)n);
  double *vd = malloc(sizeof(double) * (size_t)n), *gd = malloc(sizeof(double) * (size_t)n);
  for (int64_t step = 1; step <= 4; step++) {
    /* rows: a random increasing subset */
    int64_t rows_buf[41], k = 0;
    for (int64_t r = 0; r < R; r++) if (rnd() % 3 == 0) rows_buf[k++] = r;
    dm_tensor *rows = dm_empty(DM_CPU, DM_I64, 1, &k);
    memcpy(dm_data(rows), rows_buf, sizeof(int64_t) * (size_t)k);
    int64_t gs[2] = {k + 2, de};                   /* two spare rows: n = k uses the first k */
    dm_tensor *g = dm_randn(DM_CPU, dt, 2, gs);
    memcpy(w0, dm_data(w), bytes_all); memcpy(m0, dm_data(m), bytes_all); memcpy(v0, dm_data(v), bytes_all);
    for (int64_t i = 0; i < n; i++) {
      wd[i] = dm_load(dt, (char *)dm_data(w) + i * (int64_t)es);
      md[i] = dm_load(dt, (char *)dm_data(m) + i * (int64_t)es);
      vd[i] = dm_load(dt, (char *)dm_data(v) + i * (int64_t)es);
      gd[i] = 0;
    }
    for (int64_t i = 0; i < k; i++)
      for (int64_t c = 0; c < de; c++)
        gd[rows_buf[i] * de + c] = dm_load(dt, (char *)dm_data(g) + (i * de + c) * (int64_t)es);
    dense_adam(wd, md, vd, gd, n, 1e-2, 0.9, 0.95, 1e-8, step);
    dm_engram_adam(w, m, v, rows, g, k, 1e-2, 0.9, 0.95, 1e-8, step);
    for (int64_t r = 0, i = 0; r < R; r++) {
      bool touched = i < k && rows_buf[i] == r;
      i += touched;
      size_t off = (size_t)(r * de) * es, len = (size_t)de * es;
      if (!touched) {
        untouched_same &= !memcmp((char *)dm_data(w) + off, w0 + off, len) &&
                          !memcmp((char *)dm_data(m) + off, m0 + off, len) &&
                          !memcmp((char *)dm_data(v) + off, v0 + off, len);
        continue;
      }
      for (int64_t c = r * de; c < (r + 1) * de; c++) {
        worst = fmax(worst, fabs(dm_load(dt, (char *)dm_data(w) + c * (int64_t)es) - wd[c]) / fmax(fabs(wd[c]), 1e-3));
        worst = fmax(worst, fabs(dm_load(dt, (char *)dm_data(m) + c * (int64_t)es) - md[c]) / fmax(fabs(md[c]), 1e-3));
        worst = fmax(worst, fabs(dm_load(dt, (char *)dm_data(v) + c * (int64_t)es) - vd[c]) / fmax(fabs(vd[c]), 1e-3));
      }
    }
    dm_release(rows);
    dm_release(g);
  }
  CHECK(worst <= tol);
  if (!(worst <= tol)) fprintf(stderr, "  sparse Adam %s: relative error %.3g\n", dm_dtype_name(dt), worst);
  CHECK(untouched_same);

  /* bad row lists change nothing */
  int64_t two = 2;
  dm_tensor *rows = dm_empty(DM_CPU, DM_I64, 1, &two), *g = dm_randn(DM_CPU, dt, 2, (int64_t[]){2, de});
  memcpy(w0, dm_data(w), bytes_all);
  i64(rows)[0] = 3; i64(rows)[1] = 3;
  EXPECT_ERROR(dm_engram_adam(w, m, v, rows, g, 2, 1e-2, 0.9, 0.95, 1e-8, 5), "distinct and increasing");
  i64(rows)[0] = 3; i64(rows)[1] = R;
  EXPECT_ERROR(dm_engram_adam(w, m, v, rows, g, 2, 1e-2, 0.9, 0.95, 1e-8, 5), "out of range");
  CHECK(memcmp(w0, dm_data(w), bytes_all) == 0);
  EXPECT_ERROR(dm_engram_adam(w, m, v, rows, g, 1, 1e-2, 0.9, 0.95, 1e-8, 0), "counts from 1");
  dm_set_grad_enabled(true);
  w->requires_grad = true;
  EXPECT_ERROR(dm_engram_adam(w, m, v, rows, g, 1, 1e-2, 0.9, 0.95, 1e-8, 5), "no_grad");
  w->requires_grad = false;
  dm_release(rows); dm_release(g);
  dm_release(w); dm_release(m); dm_release(v);
  free(w0); free(m0); free(v0); free(wd); free(md); free(vd); free(gd);
}

/* ---- host tables -------------------------------------------------------------------------------- */

typedef struct host_state { dm_tensor *w, *m, *v; } host_state;

static host_state host_state_new(int64_t R, int64_t de) {
  int64_t s[2] = {R, de};
  host_state h = {dm_randn(DM_CPU, DM_F32, 2, s), dm_zeros(DM_CPU, DM_F32, 2, s), dm_zeros(DM_CPU, DM_F32, 2, s)};
  return h;
}

static host_state host_state_clone(host_state a) {
  host_state h = {dm_clone(a.w), dm_clone(a.m), dm_clone(a.v)};
  return h;
}

static void host_state_free(host_state h) { dm_release(h.w); dm_release(h.m); dm_release(h.v); }

static bool host_state_equal(host_state a, host_state b) {
  size_t n = (size_t)dm_numel(a.w) * sizeof(float);
  return !memcmp(dm_data(a.w), dm_data(b.w), n) && !memcmp(dm_data(a.m), dm_data(b.m), n) &&
         !memcmp(dm_data(a.v), dm_data(b.v), n);
}

static dm_tensor *lookups(int64_t n, int64_t lo, int64_t hi) {
  dm_tensor *t = dm_empty(DM_CPU, DM_I64, 2, (int64_t[]){n / 3, 3});
  for (int64_t i = 0; i < n / 3 * 3; i++) i64(t)[i] = lo + (int64_t)(rnd() % (uint64_t)(hi - lo));
  return t;
}

/* rows[local[i]] is the table's row idx[i], and unique lists the distinct rows in order */
static bool matches_table(dm_tensor *table, dm_tensor *idx, dm_tensor *rows, dm_tensor *local, dm_tensor *unique) {
  int64_t de = table->shape[1];
  if (!dm_same_shape(local, idx) || rows->shape[0] != unique->shape[0] || rows->shape[1] != de) return false;
  for (int64_t u = 0; u < unique->shape[0]; u++) {
    if (u > 0 && i64(unique)[u] <= i64(unique)[u - 1]) return false;
    const float *got = (float *)dm_data(rows) + u * de, *want = (float *)dm_data(table) + i64(unique)[u] * de;
    if (memcmp(got, want, sizeof(float) * (size_t)de)) return false;
  }
  for (int64_t i = 0; i < dm_numel(idx); i++)
    if (i64(unique)[i64(local)[i]] != i64(idx)[i]) return false;
  return true;
}

static void host_tables(void) {
  int64_t R = 5000, de = 8;
  host_state st = host_state_new(R, de);
  dm_hostable *h = dm_hostable_new(st.w, st.m, st.v, &(dm_hostable_opts){.threads = 3});
  dm_tensor *rows, *local, *unique;

  /* a direct gather, and prefetch + take, give the table's rows */
  dm_tensor *idx1 = lookups(3000, 0, 2000);
  dm_hostable_gather(h, idx1, &rows, &local, &unique);
  CHECK(matches_table(st.w, idx1, rows, local, unique));
  dm_hostable_counters c = dm_hostable_counters_of(h);
  CHECK(c.steps == 1 && c.lookups == 3000 && c.unique == unique->shape[0] &&
        fabs(c.unique_fraction - (double)c.unique / 3000) < 1e-15);
  dm_release(rows); dm_release(local); dm_release(unique);
  dm_hostable_prefetch(h, idx1);
  dm_hostable_take(h, &rows, &local, &unique);
  CHECK(matches_table(st.w, idx1, rows, local, unique));

  /* the next batch prefetched before this one's update: take still sees the updated rows */
  dm_tensor *idx2 = lookups(3000, 1000, 3000);              /* overlaps idx1's rows 1000..1999 */
  dm_hostable_prefetch(h, idx2);
  dm_tensor *g = randn_f32(unique->shape[0], de);
  dm_set_grad_enabled(false);
  host_state before = host_state_clone(st);
  dm_hostable_apply(h, g, 1e-2, 0.9, 0.95, 1e-8, 1);
  /* the same update through dm_engram_adam, bit for bit */
  dm_engram_adam(before.w, before.m, before.v, unique, g, unique->shape[0], 1e-2, 0.9, 0.95, 1e-8, 1);
  CHECK(host_state_equal(before, st));
  dm_tensor *rows2, *local2, *unique2;
  dm_hostable_take(h, &rows2, &local2, &unique2);
  CHECK(matches_table(st.w, idx2, rows2, local2, unique2));
  CHECK(!memcmp(dm_data(st.w), dm_data(before.w), sizeof(float) * (size_t)(R * de)));
  EXPECT_ERROR(dm_hostable_take(h, &rows, &local, &unique), "nothing was prefetched");
  dm_hostable_prefetch(h, idx1);
  EXPECT_ERROR(dm_hostable_prefetch(h, idx1), "has not been taken");
  dm_tensor *r3, *l3, *u3;
  dm_hostable_take(h, &r3, &l3, &u3);
  dm_tensor *g3 = randn_f32(u3->shape[0] + 1, de);
  EXPECT_ERROR(dm_hostable_apply(h, g3, 1e-2, 0.9, 0.95, 1e-8, 2), "gradients must be f32");
  dm_release(g3);
  g3 = randn_f32(u3->shape[0], de);
  dm_hostable_apply(h, g3, 1e-2, 0.9, 0.95, 1e-8, 2);
  EXPECT_ERROR(dm_hostable_apply(h, g3, 1e-2, 0.9, 0.95, 1e-8, 2), "no rows await");
  dm_tensor *bad = dm_full(DM_CPU, DM_I64, 1, (int64_t[]){4}, (double)R);
  EXPECT_ERROR(dm_hostable_prefetch(h, bad), "out of range");
  dm_set_grad_enabled(true);
  dm_tensor *rels[] = {idx1, idx2, rows, local, unique, g, rows2, local2, unique2, r3, l3, u3, g3, bad};
  for (size_t i = 0; i < sizeof rels / sizeof rels[0]; i++) dm_release(rels[i]);
  host_state_free(before);
  dm_hostable_free(h);
  host_state_free(st);
}

/* threads split the rows: 1 and 7 threads give the same bits over several steps with prefetch */
static void host_threads(void) {
  int64_t R = 20000, de = 16;
  host_state a = host_state_new(R, de), b = host_state_clone(a);
  dm_hostable *h1 = dm_hostable_new(a.w, a.m, a.v, &(dm_hostable_opts){.threads = 1});
  dm_hostable *h7 = dm_hostable_new(b.w, b.m, b.v, &(dm_hostable_opts){.threads = 7});
  dm_set_grad_enabled(false);
  dm_tensor *next = lookups(6000, 0, 8000);
  dm_hostable_prefetch(h1, next);
  dm_hostable_prefetch(h7, next);
  bool same = true;
  for (int step = 1; step <= 4; step++) {
    dm_tensor *r1, *l1, *u1, *r7, *l7, *u7;
    dm_hostable_take(h1, &r1, &l1, &u1);
    dm_hostable_take(h7, &r7, &l7, &u7);
    same &= !memcmp(dm_data(r1), dm_data(r7), sizeof(float) * (size_t)dm_numel(r1));
    dm_release(next);
    next = lookups(6000, 0, 8000);
    dm_hostable_prefetch(h1, next);
    dm_hostable_prefetch(h7, next);
    dm_tensor *g = randn_f32(u1->shape[0], de);
    dm_hostable_apply(h1, g, 1e-2, 0.9, 0.95, 1e-8, step);
    dm_hostable_apply(h7, g, 1e-2, 0.9, 0.95, 1e-8, step);
    same &= host_state_equal(a, b);
    dm_tensor *rels[] = {r1, l1, u1, r7, l7, u7, g};
    for (size_t i = 0; i < sizeof rels / sizeof rels[0]; i++) dm_release(rels[i]);
  }
  CHECK(same);
  CHECK(dm_hostable_threads(h7) == 7 && dm_hostable_counters_of(h7).thread_fallbacks == 0);
  dm_set_grad_enabled(true);
  dm_release(next);
  dm_hostable_free(h1);        /* with a prefetch still in flight */
  dm_hostable_free(h7);
  host_state_free(a);
  host_state_free(b);
}

/* ---- timings at b1's scale ------------------------------------------------------------------- */

/* word-like text: Zipf-weighted words from a fixed list of syllables */
static void fill_text(uint8_t *p, int64_t n) {
  static const char *syl[] = {"the", "an", "or", "in", "ing", "er", "ed", "of", "to", "and", "is", "st",
                              "re", "th", "ou", "ch", "al", "ly", "con", "pro", "de", "un", "qu", "ex"};
  int64_t i = 0;
  while (i < n) {
    int len = 1 + (int)(rnd() % 3);
    for (int k = 0; k < len && i < n; k++) {
      uint64_t z = rnd() % 1000, pick = z < 500 ? z % 6 : z < 850 ? 6 + z % 8 : 14 + z % 10;
      for (const char *c = syl[pick]; *c && i < n; c++) p[i++] = (uint8_t)*c;
    }
    if (i < n) p[i++] = rnd() % 9 ? ' ' : (rnd() % 2 ? '\n' : ',');
  }
}

static int bench(const char *path) {
  int64_t B = 8, T = 1024, P = 4, de = 32;
  dm_tensor *whole = dm_empty(DM_CPU, DM_U8, 2, (int64_t[]){B, P + T});
  uint8_t *p = dm_data(whole);
  if (path) {
    FILE *f = fopen(path, "rb");
    if (!f) { perror(path); return 1; }
    size_t got = fread(p, 1, (size_t)(B * (P + T)), f);
    fclose(f);
    if (got < (size_t)(B * (P + T))) {
      fprintf(stderr, "%s: fewer than %lld bytes\n", path, (long long)(B * (P + T)));
      return 1;
    }
  } else fill_text(p, B * (P + T));
  dm_tensor *x = dm_narrow(whole, 1, P, T), *prefix = dm_narrow(whole, 1, 0, P);
  dm_engram_layout L = layout(3, (int64_t[]){3, 4, 5}, 1, 4194304);
  printf("b1 Engram: B=%lld T=%lld orders {3,4,5} R=4194304 (rows %lld, %lld, %lld; %lld in all) de=%lld, %s\n",
         (long long)B, (long long)T, (long long)L.sub[0].size, (long long)L.sub[1].size, (long long)L.sub[2].size,
         (long long)L.total_rows, (long long)de, path ? path : "generated text");
  double t_layout = check_now_ms();
  for (int i = 0; i < 100; i++) L = layout(3, (int64_t[]){3, 4, 5}, 1, 4194304);
  t_layout = (check_now_ms() - t_layout) / 100;
  enum { REPS = 20 };
  double t_index = 1e9, t_unique = 1e9, t_grad = 1e9, t_adam = 1e9;
  dm_tensor *idx = NULL, *rows = NULL, *inv = NULL, *counts = NULL;
  dm_set_grad_enabled(false);
  for (int r = 0; r < REPS; r++) {
    dm_release(idx);
    double t0 = check_now_ms();
    idx = dm_engram_index(x, prefix, &L);
    t_index = fmin(t_index, check_now_ms() - t0);
  }
  for (int r = 0; r < REPS; r++) {
    dm_release(rows); dm_release(inv); dm_release(counts);
    double t0 = check_now_ms();
    dm_engram_unique(idx, &rows, &inv, &counts);
    t_unique = fmin(t_unique, check_now_ms() - t0);
  }
  int64_t M = dm_numel(idx), U = rows->shape[0];
  dm_tensor *g = randn_f32(M, de);
  for (int r = 0; r < REPS; r++) {
    double t0 = check_now_ms();
    dm_tensor *red = dm_engram_sparse_grad(g, inv, U);
    t_grad = fmin(t_grad, check_now_ms() - t0);
    dm_release(red);
  }
  printf("  lookups %lld, unique rows %lld (%.1f%%)\n", (long long)M, (long long)U, 100.0 * (double)U / (double)M);
  printf("  layout (3 primes)      %8.3f ms\n", t_layout);
  printf("  engram_index           %8.3f ms\n", t_index);
  printf("  engram_unique          %8.3f ms\n", t_unique);
  printf("  engram_sparse_grad     %8.3f ms   [%lld, 32] -> [%lld, 32]\n", t_grad, (long long)M, (long long)U);
  /* the full table and its moments: 3 x 1.6 GB */
  int64_t ts[2] = {L.total_rows, de};
  dm_tensor *w = dm_zeros(DM_CPU, DM_F32, 2, ts), *m = dm_zeros(DM_CPU, DM_F32, 2, ts);
  dm_tensor *v = dm_zeros(DM_CPU, DM_F32, 2, ts);
  dm_tensor *gu = randn_f32(U, de);
  for (int r = 0; r < REPS; r++) {
    double t0 = check_now_ms();
    dm_engram_adam(w, m, v, rows, gu, U, 1e-3, 0.9, 0.95, 1e-8, r + 1);
    t_adam = fmin(t_adam, check_now_ms() - t0);
  }
  printf("  dm_engram_adam         %8.3f ms   %lld rows of a %.2f GB table (+ m, v)\n", t_adam, (long long)U,
         4e-9 * (double)(L.total_rows * de));
  printf("  index + unique + adam  %8.3f ms\n", t_index + t_unique + t_adam);
  /* host tables: gather (worker) and apply by thread count */
  int counts_t[] = {1, 2, 4, 8, 16};
  for (size_t k = 0; k < sizeof counts_t / sizeof counts_t[0]; k++) {
    dm_hostable *h = dm_hostable_new(w, m, v, &(dm_hostable_opts){.threads = counts_t[k]});
    double gather = 1e9, take = 1e9, apply = 1e9;
    for (int r = 0; r < REPS; r++) {
      dm_tensor *hr, *hl, *hu;
      dm_hostable_prefetch(h, idx);
      double t0 = check_now_ms();
      dm_hostable_take(h, &hr, &hl, &hu);
      take = fmin(take, check_now_ms() - t0);
      gather = fmin(gather, dm_hostable_counters_of(h).gather_ms);
      dm_hostable_apply(h, gu, 1e-3, 0.9, 0.95, 1e-8, r + 1);
      apply = fmin(apply, dm_hostable_counters_of(h).apply_ms);
      dm_release(hr); dm_release(hl); dm_release(hu);
    }
    printf("  host table, %2d threads: worker unique+gather %.3f ms, take (wait + copy out) %.3f ms, apply %.3f ms\n",
           counts_t[k], gather, take, apply);
    dm_hostable_free(h);
  }
  dm_tensor *rels[] = {whole, x, prefix, idx, rows, inv, counts, g, w, m, v, gu};
  for (size_t i = 0; i < sizeof rels / sizeof rels[0]; i++) dm_release(rels[i]);
  return 0;
}

static dm_tensor *scalar(dm_dtype dt, double v) {
  int64_t one = 1;
  dm_tensor *t = dm_empty(DM_CPU, dt, 1, &one);
  dm_fill(t, v);
  return t;
}

/* the update from device scalars (here CPU tensors read at once) equals the
** ordinary one on the real rows of a padded list, and a non-finite norm skips it */
static void sparse_adam_at(void) {
  int64_t R = 23, de = 5, shape[2] = {R, de}, M = 9;
  dm_tensor *w[2], *m[2], *v[2];
  for (int k = 0; k < 2; k++) {
    dm_manual_seed(3);
    w[k] = dm_randn(DM_CPU, DM_F32, 2, shape);
    m[k] = dm_zeros(DM_CPU, DM_F32, 2, shape);
    v[k] = dm_zeros(DM_CPU, DM_F32, 2, shape);
  }
  dm_tensor *rows = dm_zeros(DM_CPU, DM_I64, 1, &M);             /* 4 real rows, then the padding (row 0) */
  int64_t real[4] = {2, 5, 11, 22};
  memcpy(dm_data(rows), real, sizeof real);
  dm_tensor *g = dm_randn(DM_CPU, DM_F32, 2, (int64_t[]){M, de});
  dm_tensor *n_at = scalar(DM_I64, 4), *lr_at = scalar(DM_F64, 3e-3), *step_at = scalar(DM_I64, 2);
  dm_tensor *ok = scalar(DM_F64, 7.0), *nan = scalar(DM_F64, NAN);
  dm_engram_adam(w[0], m[0], v[0], rows, g, 4, 3e-3, 0.9, 0.95, 1e-8, 2);
  dm_engram_adam_at(w[1], m[1], v[1], rows, g, n_at, 0.9, 0.95, 1e-8, lr_at, step_at, ok);
  size_t bytes = sizeof(float) * (size_t)(R * de);
  CHECK(!memcmp(dm_data(w[0]), dm_data(w[1]), bytes) && !memcmp(dm_data(v[0]), dm_data(v[1]), bytes));
  char *before = malloc(bytes);
  memcpy(before, dm_data(w[1]), bytes);
  dm_engram_adam_at(w[1], m[1], v[1], rows, g, n_at, 0.9, 0.95, 1e-8, lr_at, step_at, nan);
  CHECK(!memcmp(before, dm_data(w[1]), bytes));
  dm_fill(n_at, 10);
  EXPECT_ERROR(dm_engram_adam_at(w[1], m[1], v[1], rows, g, n_at, 0.9, 0.95, 1e-8, lr_at, step_at, ok),
               "n_at holds 10, outside 0..9");
  EXPECT_ERROR(dm_engram_adam_at(w[1], m[1], v[1], rows, g, lr_at, 0.9, 0.95, 1e-8, lr_at, step_at, ok),
               "n_at must be one contiguous i64 element on cpu");
  free(before);
  dm_tensor *all[] = {w[0], w[1], m[0], m[1], v[0], v[1], rows, g, n_at, lr_at, step_at, ok, nan};
  for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) dm_release(all[i]);
}

/* The sparse Adam with 8-bit moments (a row a block) against float64 from the moments it decoded:
** the named rows follow it to 1e-5 and encode within a code's step; every other row, its codes and
** its scales stay as they were; the at form with the same scalars does the same; a NaN norm skips;
** an f64 table and a scale of the wrong length are refused. */
static void sparse_adam_8bit(void) {
  int64_t R = 19, de = 40, shape[2] = {R, de}, rs = R;
  dm_set_grad_enabled(false);
  dm_manual_seed(5);
  dm_tensor *w = dm_randn(DM_CPU, DM_F32, 2, shape);
  dm_engram_8bit m8 = {dm_zeros(DM_CPU, DM_U8, 2, shape), dm_zeros(DM_CPU, DM_F32, 1, &rs),
                     dm_zeros(DM_CPU, DM_U8, 2, shape), dm_zeros(DM_CPU, DM_F32, 1, &rs), 13};
  float *pw = dm_data(w), *ms = dm_data(m8.m_scale), *vs = dm_data(m8.v_scale);
  uint8_t *mc = dm_data(m8.m), *vc = dm_data(m8.v);
  bool ok_w = true, ok_codes = true, untouched = true;
  for (int64_t step = 1; step <= 4; step++) {
    int64_t rows_buf[19], k = 0;
    for (int64_t r = 0; r < R; r++) if (rnd() % 2 == 0) rows_buf[k++] = r;
    dm_tensor *rows = dm_empty(DM_CPU, DM_I64, 1, &k);
    memcpy(dm_data(rows), rows_buf, sizeof(int64_t) * (size_t)k);
    dm_tensor *g = dm_randn(DM_CPU, DM_F32, 2, (int64_t[]){k, de});
    const float *pg = dm_data(g);
    double bc1 = 1 - pow(0.9, (double)step), bc2 = 1 - pow(0.95, (double)step);
    size_t nb = (size_t)(R * de);
    float *w0 = malloc(nb * sizeof(float));
    uint8_t *c0 = malloc(2 * nb);
    float s0[2 * 19];
    memcpy(w0, pw, nb * sizeof(float)); memcpy(c0, mc, nb); memcpy(c0 + nb, vc, nb);
    memcpy(s0, ms, sizeof(float) * 19); memcpy(s0 + 19, vs, sizeof(float) * 19);
    dm_engram_adam_8bit(w, &m8, rows, g, k, 1e-2, 0.9, 0.95, 1e-8, step);
    for (int64_t r = 0, i = 0; r < R; r++) {
      bool touched = i < k && rows_buf[i] == r;
      if (!touched) {
        untouched &= !memcmp(pw + r * de, w0 + r * de, sizeof(float) * (size_t)de) &&
                     !memcmp(mc + r * de, c0 + r * de, (size_t)de) && !memcmp(vc + r * de, c0 + nb + r * de, (size_t)de) &&
                     ms[r] == s0[r] && vs[r] == s0[19 + r];
        continue;
      }
      for (int64_t c = 0; c < de; c++) {
        int64_t e = r * de + c;
        double mo = (double)dm_code8_signed(c0[e]) * s0[r], ro = (double)dm_code8_unsigned(c0[nb + e]) * s0[19 + r];
        double gv = pg[i * de + c], m1 = 0.9 * mo + 0.1 * gv, v1 = 0.95 * ro * ro + 0.05 * gv * gv;
        double w1 = w0[e] - 1e-2 / bc1 * m1 / (sqrt(v1 / bc2) + 1e-8);
        ok_w &= fabs(pw[e] - w1) <= 1e-5 * (1 + fabs(w1));
        double dmv = dm_code8_signed(mc[e]) * ms[r], drv = dm_code8_unsigned(vc[e]) * vs[r];
        ok_codes &= fabs(dmv - m1) <= 0.126 * fabs(m1) + 0x1p-17 * ms[r] + 1e-6 * ms[r] &&
                    fabs(drv - sqrt(v1)) <= 0.063 * sqrt(v1) + 0x1p-18 * vs[r] + 1e-6 * vs[r];
      }
      i++;
    }
    free(w0); free(c0);
    dm_release(rows); dm_release(g);
  }
  CHECK(ok_w);
  CHECK(ok_codes);
  CHECK(untouched);
  /* the at form: the same update from scalars; a NaN norm skips it */
  int64_t M = 3, three[3] = {1, 7, 18};
  dm_tensor *rows = dm_empty(DM_CPU, DM_I64, 1, &M);
  memcpy(dm_data(rows), three, sizeof three);
  dm_tensor *g = dm_randn(DM_CPU, DM_F32, 2, (int64_t[]){M, de});
  dm_tensor *w2 = dm_clone(w);
  dm_engram_8bit m8b = {dm_clone(m8.m), dm_clone(m8.m_scale), dm_clone(m8.v), dm_clone(m8.v_scale), 13};
  dm_tensor *n_at = scalar(DM_I64, 3), *lr_at = scalar(DM_F64, 1e-2), *step_at = scalar(DM_I64, 5);
  dm_tensor *ok = scalar(DM_F64, 2.0), *nan = scalar(DM_F64, NAN);
  dm_engram_adam_8bit(w, &m8, rows, g, 3, 1e-2, 0.9, 0.95, 1e-8, 5);
  dm_engram_adam_8bit_at(w2, &m8b, rows, g, n_at, 0.9, 0.95, 1e-8, lr_at, step_at, ok);
  size_t bytes = sizeof(float) * (size_t)(R * de);
  CHECK(!memcmp(dm_data(w), dm_data(w2), bytes) && !memcmp(dm_data(m8.v), dm_data(m8b.v), (size_t)(R * de)));
  float *before = malloc(bytes);
  memcpy(before, dm_data(w2), bytes);
  dm_engram_adam_8bit_at(w2, &m8b, rows, g, n_at, 0.9, 0.95, 1e-8, lr_at, step_at, nan);
  CHECK(!memcmp(before, dm_data(w2), bytes));
  free(before);
  dm_tensor *w64 = dm_randn(DM_CPU, DM_F64, 2, shape), *g64 = dm_randn(DM_CPU, DM_F64, 2, (int64_t[]){M, de});
  EXPECT_ERROR(dm_engram_adam_8bit(w64, &m8, rows, g64, 3, 1e-2, 0.9, 0.95, 1e-8, 1), "8-bit moments take an f32 table");
  dm_tensor *short_scale = dm_zeros(DM_CPU, DM_F32, 1, &M);
  dm_engram_8bit bad = m8;
  bad.v_scale = short_scale;
  EXPECT_ERROR(dm_engram_adam_8bit(w, &bad, rows, g, 3, 1e-2, 0.9, 0.95, 1e-8, 1),
               "the v scales must be contiguous f32 [19] (one a row)");
  dm_tensor *all[] = {w, w2, m8.m, m8.m_scale, m8.v, m8.v_scale, m8b.m, m8b.m_scale, m8b.v, m8b.v_scale, rows, g, n_at,
                      lr_at, step_at, ok, nan, w64, g64, short_scale};
  for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) dm_release(all[i]);
}

int main(int argc, char **argv) {
  check_begin();
  if (argc > 1 && !strcmp(argv[1], "--bench")) return bench(argc > 2 ? argv[2] : NULL);
  primes();
  layouts();
  direct_orders();
  hashed_in_range();
  same_bytes_same_rows();
  prefixes();
  unique_round_trip();
  sparse_adam(DM_F32);
  sparse_adam(DM_F64);
  sparse_adam_at();
  sparse_adam_8bit();
  host_tables();
  host_threads();
  return check_end();
}
