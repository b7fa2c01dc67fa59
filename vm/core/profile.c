/*
** profile.c — op timing by name and phase (profile.h), and the stack of open
** calls (dm_profile_where: where the planner's allocations come from).
*/
#include <string.h>
#include <time.h>
#include "core/profile.h"
#include <stdlib.h>
#include "core/cuda.h"
#include "core/graph.h"
#include "core/autograd.h"
#include <stdio.h>

#define MAX_ROWS 1024
#define MAX_OPEN 64

typedef struct pending { int row, start, stop; } pending;   /* a CUDA call not yet read */
typedef struct open_call { const char *name; int phase; bool timed; } open_call;

static struct {
  bool on;
  int depth;                       /* open calls; only depth 0 → 1 is timed */
  dm_profile_row rows[MAX_ROWS];
  int nrows;
  pending *wait;                   /* CUDA calls to read at dm_profile_read */
  int nwait, capwait;
  struct { int row; dm_device dev; int mark; double t0; } open;   /* the outermost open call */
  /* every open call, timed or not (the planner asks where an allocation came from);
  ** a recompute is not timed itself: its inner ops are, so time stays with the ops */
  open_call stack[MAX_OPEN];
  int nstack;
} P;

static double host_ms(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return 1e3 * (double)ts.tv_sec + 1e-6 * (double)ts.tv_nsec;
}

void dm_profile_start(void) {
  if (dm_cuda_graph_capturing()) dm_error("profile: cannot time ops while a CUDA graph is being captured");
  P.nrows = 0;
  P.nwait = 0;
  P.depth = 0;
  P.on = true;
  dm_cuda_marks_clear();
}

void dm_profile_stop(void) { P.on = false; }
bool dm_profile_on(void) { return P.on; }

static int row_of(const char *name, const char *family, int phase) {
  for (int i = 0; i < P.nrows; i++)
    if (P.rows[i].phase == phase && (P.rows[i].name == name || !strcmp(P.rows[i].name, name))) return i;
  if (P.nrows == MAX_ROWS) dm_error("profile: more than %d distinct ops and regions", MAX_ROWS);
  dm_profile_row *r = &P.rows[P.nrows];
  r->name = name;
  r->family = family;
  r->phase = phase;
  r->ms = 0;
  r->calls = 0;
  return P.nrows++;
}

static bool untimed(const char *family) { return family && !strcmp(family, "recompute"); }

void dm_profile_push(const char *name, const char *family, int phase, dm_device dev) {
  bool timed = !untimed(family) || phase == DM_PHASE_REGION;
  /* a forward run again by a recompute's backward (directly, or inside such a forward) */
  const open_call *parent = P.nstack > 0 && P.nstack <= MAX_OPEN ? &P.stack[P.nstack - 1] : NULL;
  if (phase == DM_PHASE_FORWARD && dm_tape_depth() > 0 && parent &&
      ((parent->phase == DM_PHASE_BACKWARD && !parent->timed) || parent->phase == DM_PHASE_RECOMPUTE))
    phase = DM_PHASE_RECOMPUTE;
  if (P.nstack < MAX_OPEN) P.stack[P.nstack] = (open_call){name, phase, timed};
  P.nstack++;
  if (!P.on || !timed) return;
  if (P.depth++ > 0) return;
  P.open.row = row_of(name, family, phase);
  P.open.dev = dev;
  P.rows[P.open.row].calls++;
  if (dev == DM_CUDA && !dm_cuda_graph_capturing()) P.open.mark = dm_cuda_mark();
  else { P.open.mark = -1; P.open.t0 = host_ms(); }
}

void dm_profile_pop(void) {
  bool timed = P.nstack > MAX_OPEN || (P.nstack > 0 && P.stack[P.nstack - 1].timed);
  if (P.nstack > 0) P.nstack--;
  if (!P.on || !timed || P.depth == 0) return;
  if (--P.depth > 0) return;
  if (P.open.mark < 0) { P.rows[P.open.row].ms += host_ms() - P.open.t0; return; }
  if (P.nwait == P.capwait) {
    P.capwait = P.capwait ? 2 * P.capwait : 1024;
    pending *w = realloc(P.wait, sizeof(pending) * (size_t)P.capwait);
    if (!w) dm_error("profile: out of host memory for %d timed calls", P.capwait);
    P.wait = w;
  }
  P.wait[P.nwait++] = (pending){P.open.row, P.open.mark, dm_cuda_mark()};
}

void dm_profile_recover(void) {
  P.depth = 0;
  P.nstack = 0;
}

static const char *phase_word[] = {"forward", "backward", "region", "recompute"};

size_t dm_profile_where(char *buf, size_t size) {
  size_t used = 0;
  if (size) buf[0] = 0;
  int n = P.nstack < MAX_OPEN ? P.nstack : MAX_OPEN;
  for (int i = 0; i < n && used + 1 < size; i++) {
    int w = snprintf(buf + used, size - used, "%s%s of %s", i ? " > " : "", phase_word[P.stack[i].phase],
                     P.stack[i].name);
    if (w < 0) break;
    used += (size_t)w < size - used ? (size_t)w : size - used - 1;
  }
  return used;
}

int dm_profile_read(dm_profile_row *rows, int max) {
  if (P.nwait > 0) {
    dm_cuda_synchronize();
    for (int i = 0; i < P.nwait; i++)
      P.rows[P.wait[i].row].ms += dm_cuda_mark_elapsed(P.wait[i].start, P.wait[i].stop);
    P.nwait = 0;
    dm_cuda_marks_clear();
  }
  int n = P.nrows < max ? P.nrows : max;
  memcpy(rows, P.rows, sizeof(dm_profile_row) * (size_t)n);
  return n;
}

const char *dm_profile_intern(const char *name) {
  static char *names[MAX_ROWS];
  static int nnames;
  for (int i = 0; i < nnames; i++)
    if (!strcmp(names[i], name)) return names[i];
  if (nnames == MAX_ROWS) dm_error("profile: more than %d region names", MAX_ROWS);
  size_t len = strlen(name) + 1;
  char *copy = malloc(len);
  if (!copy) dm_error("profile: out of host memory");
  memcpy(copy, name, len);
  return names[nnames++] = copy;
}

const char *dm_profile_family_of(const char *file) {
  static char names[64][24];
  static int nnames;
  const char *base = strrchr(file, '/');
  base = base ? base + 1 : file;
  if (!strncmp(base, "ops_", 4)) base += 4;
  size_t len = strcspn(base, ".");
  if (len >= sizeof names[0]) len = sizeof names[0] - 1;
  for (int i = 0; i < nnames; i++)
    if (strlen(names[i]) == len && !strncmp(names[i], base, len)) return names[i];
  if (nnames == 64) return "other";
  memcpy(names[nnames], base, len);
  names[nnames][len] = 0;
  return names[nnames++];
}
