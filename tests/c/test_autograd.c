/* the tape: gradients accumulate, the tape frees itself, memory returns */
#include <math.h>
#include "check.h"
#include "core/core.h"
#include "core/alloc.h"
#include "core/autograd.h"

static dm_tensor *leaf(int n, const double *v) {
  int64_t shape[1] = {n};
  dm_tensor *t = dm_zeros(DM_CPU, DM_F64, 1, shape);
  for (int i = 0; i < n; i++) ((double *)dm_data(t))[i] = v[i];
  t->requires_grad = true;
  return t;
}

static void product_rule(void) {
  dm_tensor *x = leaf(3, (double[]){1, 2, 3}), *y = leaf(3, (double[]){4, 5, 6});
  dm_tensor *p = dm_mul(x, y), *s = dm_sum(p, -1, false);
  CHECK(dm_tape_size() == 2);
  dm_backward(s, NULL);
  CHECK(dm_tape_size() == 0);                       /* backward frees the tape */
  double *gx = dm_data(x->grad), *gy = dm_data(y->grad);
  CHECK(gx[0] == 4 && gx[2] == 6 && gy[1] == 2);
  EXPECT_ERROR(dm_backward(s, NULL), "already freed");
  dm_release(p); dm_release(s);
  /* a second backward accumulates */
  p = dm_mul(x, x);
  s = dm_sum(p, -1, false);
  dm_backward(s, NULL);
  CHECK(((double *)dm_data(x->grad))[1] == 5 + 4);  /* 5 from before, 2*2 now */
  dm_release(p); dm_release(s); dm_release(x); dm_release(y);
}

static void shared_input_twice(void) {
  dm_tensor *x = leaf(2, (double[]){3, -1});
  dm_tensor *a = dm_add(x, x), *s = dm_sum(a, -1, false);
  dm_backward(s, NULL);
  CHECK(((double *)dm_data(x->grad))[0] == 2);
  dm_release(a); dm_release(s); dm_release(x);
}

static void in_place_after_save_is_caught(void) {
  dm_tensor *x = leaf(2, (double[]){1, 2});
  dm_tensor *c = dm_clone(x);
  dm_tensor *e = dm_mul(x, c);                      /* saves c */
  dm_fill(c, 7);
  dm_tensor *s = dm_sum(e, -1, false);
  EXPECT_ERROR(dm_backward(s, NULL), "modified in place");
  CHECK(dm_tape_size() == 0);                       /* the failed backward cleared the tape */
  dm_release(c); dm_release(e); dm_release(s); dm_release(x);
}

static void stale_graph_is_an_error(void) {
  dm_tensor *x = leaf(2, (double[]){1, 2});
  dm_tensor *h = dm_mul(x, x);
  dm_tape_clear();
  EXPECT_ERROR(dm_add(h, x), "already");
  dm_release(h); dm_release(x);
}

/* 1000 steps of a two-layer net: after each step only the parameters and
** their gradients remain, and the tape is empty. */
static void memory_returns_each_step(void) {
  int64_t sw1[2] = {16, 32}, sw2[2] = {32, 4}, sx[2] = {8, 16};
  dm_manual_seed(3);
  dm_tensor *w1 = dm_randn(DM_CPU, DM_F32, 2, sw1), *w2 = dm_randn(DM_CPU, DM_F32, 2, sw2);
  dm_tensor *x = dm_randn(DM_CPU, DM_F32, 2, sx);
  w1->requires_grad = w2->requires_grad = true;
  int64_t baseline = -1;
  bool steady = true;
  for (int step = 0; step < 1000; step++) {
    dm_tensor *h = dm_matmul(x, w1, false, false);
    dm_tensor *a = dm_unary("tanh", h);
    dm_tensor *y = dm_matmul(a, w2, false, false);
    dm_tensor *sq = dm_mul(y, y);
    dm_tensor *loss = dm_mean(sq, -1, false);
    dm_release(h); dm_release(a); dm_release(y); dm_release(sq);
    dm_backward(loss, NULL);
    dm_release(loss);
    dm_release(w1->grad); w1->grad = NULL;          /* what an optimiser's zero_grad does */
    dm_release(w2->grad); w2->grad = NULL;
    int64_t now = dm_memory_stats(DM_CPU).allocated;
    if (baseline < 0) baseline = now;
    steady = steady && now == baseline && dm_tape_size() == 0;
  }
  CHECK(steady);
  CHECK(baseline == (int64_t)(16 * 32 + 32 * 4 + 8 * 16) * 4);
  dm_release(w1); dm_release(w2); dm_release(x);
  CHECK(dm_memory_stats(DM_CPU).allocated == 0);
  CHECK(dm_memory_stats(DM_CPU).count == 0);
}

int main(void) {
  check_begin();
  product_rule();
  shared_input_twice();
  in_place_after_save_is_caught();
  stale_graph_is_an_error();
  memory_returns_each_step();
  return check_end();
}
