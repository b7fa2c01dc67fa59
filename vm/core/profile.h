/*
** profile.h — where a step's time goes, by op and op family.
**
** While profiling is on, every outermost op call is timed: its forward
** (dm_call), its backward (the autograd node, including the accumulation
** of its input gradients) and any named region a caller opens (the
** optimiser's kernels, which are no ops). Inner calls, made by a forward or
** a backward, count towards the outer one. On the GPU a call is timed with
** two CUDA events on the stream, so the host never waits and the figures
** are device time; on the CPU with the monotonic clock. dm_profile_read()
** waits for the device once and sums the events by (name, phase).
**
** The family of an op is the file that registers it (vm/ops/kda.c: "kda").
** Profiling is refused while a CUDA graph is being captured.
**
** Whether profiling is on or not, every open call is kept on a stack (up to
** 64 deep): dm_profile_where names them (dormouse plan: where the bytes live
** at the peak were allocated).
*/
#ifndef DM_PROFILE_H
#define DM_PROFILE_H

#include "core/dm.h"

/* RECOMPUTE: a forward that a recompute's backward runs again (dm_recompute);
** the recompute op itself is not timed, its inner ops are */
enum { DM_PHASE_FORWARD, DM_PHASE_BACKWARD, DM_PHASE_REGION, DM_PHASE_RECOMPUTE };

typedef struct dm_profile_row {
  const char *name, *family;
  int phase;
  double ms;                    /* summed device (or host) time */
  int64_t calls;
} dm_profile_row;

void dm_profile_start(void);    /* clear the table and start timing */
void dm_profile_stop(void);     /* stop timing; the table is kept until the next start */
bool dm_profile_on(void);

/* open and close a timed call; calls nest, only the outermost is timed.
** name and family must outlive the profile (string literals, op names). */
void dm_profile_push(const char *name, const char *family, int phase, dm_device dev);
void dm_profile_pop(void);
/* after an error unwound through open calls: they are dropped */
void dm_profile_recover(void);

/* the open calls, outermost first, whether timed or not ("backward of recompute >
** forward of moe_experts"): written into buf (always terminated), returns its length */
size_t dm_profile_where(char *buf, size_t size);

/* the table, after waiting for the device: up to max rows, returns the count */
int dm_profile_read(dm_profile_row *rows, int max);

/* a lasting copy of a name (regions named from Lua), the same pointer for equal names */
const char *dm_profile_intern(const char *name);

/* "vm/ops/kda.c" → "kda" (a pointer to a static copy) */
const char *dm_profile_family_of(const char *file);

#endif
