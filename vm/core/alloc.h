/*
** alloc.h — memory by device, with statistics.
**
** Every storage's bytes come from dm_alloc and go back through dm_free, so
** the statistics are exact: current bytes, peak bytes, live allocations.
** The host allocator is built in; a backend registers its own (the CUDA
** caching allocator) with dm_allocator_register. META allocations take no
** memory but are counted, so a shape-only model reports what it would use.
*/
#ifndef DM_ALLOC_H
#define DM_ALLOC_H

#include "core/dm.h"

typedef struct dm_mem_stats {
  int64_t allocated;     /* bytes handed out and not yet returned */
  int64_t peak;          /* the most allocated at once since the last reset */
  int64_t count;         /* live allocations */
  int64_t reserved;      /* bytes held from the system (caching allocators) */
  int64_t sys_allocs;    /* calls into the system allocator so far */
} dm_mem_stats;

typedef struct dm_allocator {
  void *(*alloc)(size_t nbytes, dm_mem_stats *st);      /* NULL when out of memory */
  void (*free)(void *p, size_t nbytes, dm_mem_stats *st);
  void (*empty_cache)(dm_mem_stats *st);                /* may be NULL */
  bool (*available)(void);    /* may be NULL (always); the CUDA one asks for a device */
} dm_allocator;

void dm_allocator_register(dm_device dev, const dm_allocator *a);
bool dm_device_available(dm_device dev);

void *dm_alloc(dm_device dev, size_t nbytes);    /* raises on failure, with the stats */
/* host memory for the runtime's own buffers (a CPU kernel's scratch, checkpoint I/O): malloc and
** calloc, or dm_error "out of host memory" with the size; free() lets it go */
void *dm_xmalloc(size_t n);
void *dm_xcalloc(size_t n, size_t size);
void dm_free(dm_device dev, void *p, size_t nbytes);
dm_mem_stats dm_memory_stats(dm_device dev);
void dm_memory_reset_peak(dm_device dev);
void dm_memory_empty_cache(dm_device dev);
/* DM_POISON=1: new memory is filled with NaN bytes, so an unwritten output shows */
bool dm_poison_enabled(void);

/* The CUDA caching allocator's sizes (kernels/alloc.c): a request up to DM_CUDA_SMALL_MAX is
** small, rounded up to DM_CUDA_GRAIN bytes; a larger one is rounded up to DM_CUDA_LARGE_GRAIN. */
#define DM_CUDA_GRAIN ((size_t)512)
#define DM_CUDA_SMALL_MAX ((size_t)1 << 20)
#define DM_CUDA_LARGE_GRAIN ((size_t)2 << 20)

/* The bytes a request of n bytes takes in the CUDA caching allocator (0 counts as 1): what the
** allocator hands out and what dormouse plan charges, one rule for both. */
static inline size_t dm_cuda_block_size(size_t n) {
  size_t unit = n <= DM_CUDA_SMALL_MAX ? DM_CUDA_GRAIN : DM_CUDA_LARGE_GRAIN;
  return ((n ? n : 1) + unit - 1) / unit * unit;
}

/* ---- the meta device's trace (dormouse plan) ----------------------------------------------
** Meta allocations are numbered from the last dm_meta_trace_reset (1, 2, ...).
** Since the last dm_meta_trace_mark the trace keeps the most bytes allocated
** at once and the number of the allocation that reached it, both in bytes as
** asked (the units of dm_mem_stats, so of dm.memory("cuda").peak) and in
** blocks of the CUDA caching allocator (dm_cuda_block_size). A watch calls
** fn(ud) right after allocation number `at` is counted: the bytes live at that
** moment are still held, so what holds them can be looked at. */
typedef struct dm_meta_trace {
  uint64_t allocs;          /* allocations since the reset */
  int64_t current;          /* meta bytes allocated now */
  int64_t peak;             /* the most since the mark */
  uint64_t peak_at;         /* the allocation that first reached it; 0: none since the mark */
  int64_t blocks;           /* meta bytes allocated now, in CUDA allocator blocks */
  int64_t blocks_peak;      /* the most since the mark */
  int64_t last;             /* the size of the last allocation */
} dm_meta_trace;

void dm_meta_trace_reset(void);     /* numbering from 1 again; also marks */
void dm_meta_trace_mark(void);      /* the peaks start again from now */
dm_meta_trace dm_meta_trace_get(void);
void dm_meta_watch(uint64_t at, void (*fn)(void *ud), void *ud);   /* at = 0: no watch */

/* ---- the kernels' device scratch, as a plan sees it ------------------------------------------
** The CUDA kernels take scratch from the device allocator inside a call and
** give it back before they return (dm_scratch, kernels/). Its size is a
** function in the family's header (vm/ops/<family>.h), which the kernel sizes
** its scratch with and the op calling the kernel hands to dm_plan_scratch.
** While a plan is on (dm_plan_begin), a meta tensor stands for one on the
** planned card: dm_plan_card(DM_META) gives that card's properties, and
** dm_plan_scratch makes the bytes one meta allocation given back at once,
** where the kernel's would be, so the trace's peak holds it only there. With
** no plan on, or on another device, dm_plan_card is NULL and ops skip it. */
typedef struct dm_plan_card {
  int64_t sm_count;         /* its SMs (the column sums' partials follow them) */
  int64_t smem_optin;       /* the most dynamic shared memory a block may opt in to */
} dm_plan_card;

void dm_plan_begin(const dm_plan_card *card);   /* NULL: the plan ends */
const dm_plan_card *dm_plan_card_of(dm_device dev);
void dm_plan_scratch(int64_t bytes, const char *what);   /* what: "name (kernels/file.cu function)" */
/* the scratch being made as a watch fires (its label, *bytes), or NULL */
const char *dm_plan_scratch_now(int64_t *bytes);

#endif
