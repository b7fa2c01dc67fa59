/*
** trace.h — which op makes two runs part: a fingerprint of every op call.
**
** While the trace is on, every outermost op call is recorded with a hash of
** what went in and what came out: a forward's inputs, attributes and outputs (dm_call),
** a backward's output gradients and the input gradients it gave (the
** autograd node; for one that adds into a gradient in place, that gradient
** before and after). Calls made inside a forward or a backward count towards
** the outer one. Callers add marks (a step's start) and named tensors (a
** parameter after the optimiser's update, which runs no ops).
**
** Two runs from one seed give two traces; the first entry whose outputs
** differ while its inputs agree is an op that is not deterministic, on that
** device, at that call (dormouse determinism reports it). The first entry
** whose inputs differ before any output did names what came from outside
** the ops: the data, or an update.
**
** A hash copies each tensor to the host (xxh64 of its bytes, its dtype and
** shape; of a meta tensor, its dtype and shape): slow, for short runs.
** Refused while a CUDA graph is captured. The traces stay in C (a run's can
** hold a million entries): dm_trace_keep sets one aside, dm_trace_parting
** finds where the next one parts from it.
*/
#ifndef DM_TRACE_H
#define DM_TRACE_H

#include "core/ops.h"

enum { DM_TRACE_FORWARD, DM_TRACE_BACKWARD, DM_TRACE_MARK, DM_TRACE_TENSOR };

typedef struct dm_trace_entry {
  const char *name;             /* the op's name, or a mark's or tensor's label (interned) */
  int kind;                     /* DM_TRACE_* */
  uint64_t in, out;             /* hashes of what went in and came out (0 for a mark) */
} dm_trace_entry;

void dm_trace_start(void);      /* clear the trace and start recording */
void dm_trace_stop(void);       /* stop; the entries are kept until the next start */
bool dm_trace_on(void);

/* around an op's forward or a node's backward: enter returns whether this call
** is the outermost (recorded) one, and takes its inputs' hash then (with the
** attributes a forward was given; NULL for a backward, whose are its forward's) */
bool dm_trace_enter(int n_in, dm_tensor *const *in, const dm_attrs *a, uint64_t *in_hash);
void dm_trace_leave(bool outermost, const char *name, int kind, uint64_t in_hash, int n_out,
                    dm_tensor *const *out);

void dm_trace_mark(const char *label);                     /* label: interned here */
void dm_trace_tensor(const char *label, dm_tensor *t);     /* label: interned here */

/* set the trace made so far aside (the kept one it replaces is dropped) and begin an empty one:
** two runs' traces, one after the other, without holding the first anywhere else */
void dm_trace_keep(void);

/* the entries of the trace being made, or (kept) of the one set aside: *n is set to their count;
** valid until the next start or keep */
const dm_trace_entry *dm_trace_entries(bool kept, int64_t *n);

/* the first entry (0-based) where the kept trace and the current one differ (name, kind or a
** hash; or where one ends), or -1 where they are the same; *mark: the last mark before it (-1: none) */
int64_t dm_trace_parting(int64_t *mark);

#endif
