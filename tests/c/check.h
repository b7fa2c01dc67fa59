/*
** check.h — a minimal C test harness: CHECK(cond) and a closing count.
** Errors raised by the core inside EXPECT_ERROR are caught by longjmp.
*/
#ifndef DM_CHECK_H
#define DM_CHECK_H

#include <setjmp.h>
#include <stdio.h>
#include <string.h>
#include <time.h>
#include "core/dm.h"

static int check_passed, check_failed;
static jmp_buf *check_jb;
static char check_msg[1024];

static void check_on_error(const char *msg, void *ud) {
  (void)ud;
  snprintf(check_msg, sizeof check_msg, "%s", msg);
  if (check_jb) longjmp(*check_jb, 1);
  fprintf(stderr, "unexpected error: %s\n", msg);
}

#define CHECK(cond) do {                                                   \
    if (cond) check_passed++;                                              \
    else { check_failed++; fprintf(stderr, "%s:%d: CHECK failed: %s\n", __FILE__, __LINE__, #cond); } \
  } while (0)

/* run stmt, which must raise an error whose message contains `part` */
#define EXPECT_ERROR(stmt, part) do {                                      \
    jmp_buf jb_; check_jb = &jb_; check_msg[0] = 0;                        \
    if (setjmp(jb_) == 0) { stmt; check_jb = NULL; check_failed++;          \
      fprintf(stderr, "%s:%d: expected an error from %s\n", __FILE__, __LINE__, #stmt); } \
    else { check_jb = NULL; CHECK(strstr(check_msg, part) != NULL);        \
      if (!strstr(check_msg, part)) fprintf(stderr, "  message was: %s\n", check_msg); } \
  } while (0)

/* timings of the tests' --bench modes: a monotonic clock, and a qsort comparator for medians */
static inline double check_now_ms(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return 1e3 * (double)ts.tv_sec + 1e-6 * (double)ts.tv_nsec;
}

static inline int check_cmp_double(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return x < y ? -1 : x > y;
}

static void check_begin(void) { dm_set_error_handler(check_on_error, NULL); }

static int check_end(void) {
  printf("%d passed, %d failed\n", check_passed, check_failed);
  return check_failed ? 1 : 0;
}

#endif
