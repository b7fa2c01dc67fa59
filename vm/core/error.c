/*
** error.c — the error path of the core: format, then hand to the handler.
*/
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include "core/dm.h"

static dm_error_handler handler;
static void *handler_ud;

/* what the layers above registered to run as an error unwinds (dm_on_error_unwind): error.c
** knows no layer above it by name */
#define MAX_UNWIND 8
static dm_unwind_fn unwinders[MAX_UNWIND];
static int n_unwinders;

void dm_on_error_unwind(dm_unwind_fn fn) {
  if (n_unwinders == MAX_UNWIND) {
    fprintf(stderr, "dormouse: more than %d error-unwind functions registered\n", MAX_UNWIND);
    abort();
  }
  unwinders[n_unwinders++] = fn;
}

void dm_set_error_handler(dm_error_handler h, void *ud) { handler = h; handler_ud = ud; }
void dm_get_error_handler(dm_error_handler *h, void **ud) { *h = handler; *ud = handler_ud; }

void dm_error(const char *fmt, ...) {
  char msg[1024];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof msg, fmt, ap);
  va_end(ap);
  for (int i = 0; i < n_unwinders; i++) unwinders[i]();   /* it unwinds through whatever op was running */
  if (handler) handler(msg, handler_ud);
  /* no handler installed, or it returned: nothing sensible is left to do */
  fprintf(stderr, "dormouse: %s\n", msg);
  abort();
}

const char *dm_shape_str(char *buf, size_t n, int ndim, const int64_t *shape) {
  size_t at = 0;
  at += (size_t)snprintf(buf + at, n - at, "[");
  for (int i = 0; i < ndim && at < n; i++)
    at += (size_t)snprintf(buf + at, n - at, i ? ", %lld" : "%lld", (long long)shape[i]);
  if (at < n) snprintf(buf + at, n - at, "]");
  return buf;
}

int dm_debug_level(void) {
  static int level = -1;
  if (level < 0) {
    const char *s = getenv("DM_DEBUG");
    level = s ? atoi(s) : 0;
  }
  return level;
}
