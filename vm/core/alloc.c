/*
** alloc.c — the allocator table and the host and meta allocators.
*/
#include <stdlib.h>
#include <string.h>
#include <malloc.h>
#include "core/alloc.h"
#include "core/cuda.h"

#define DM_HOST_ALIGN 64

static void *host_alloc(size_t nbytes, dm_mem_stats *st) {
  size_t rounded = (nbytes + DM_HOST_ALIGN - 1) / DM_HOST_ALIGN * DM_HOST_ALIGN;
  void *p = aligned_alloc(DM_HOST_ALIGN, rounded ? rounded : DM_HOST_ALIGN);
  if (!p) return NULL;
  st->reserved += (int64_t)nbytes;
  st->sys_allocs++;
  if (dm_poison_enabled()) memset(p, 0xff, rounded);     /* all-ones bytes are NaN in every float type */
  return p;
}

static void host_free(void *p, size_t nbytes, dm_mem_stats *st) {
  free(p);
  st->reserved -= (int64_t)nbytes;
}

/* META memory is an address that is never dereferenced; the trace counts it. */
static char meta_byte;
static dm_meta_trace trace;
static uint64_t watch_at;
static void (*watch_fn)(void *);
static void *watch_ud;

static void *meta_alloc(size_t nbytes, dm_mem_stats *st) {
  (void)st;
  trace.allocs++;
  trace.current += (int64_t)nbytes;
  trace.blocks += (int64_t)dm_cuda_block_size(nbytes);
  trace.last = (int64_t)nbytes;
  if (trace.current > trace.peak) { trace.peak = trace.current; trace.peak_at = trace.allocs; }
  if (trace.blocks > trace.blocks_peak) trace.blocks_peak = trace.blocks;
  if (watch_fn && trace.allocs == watch_at) watch_fn(watch_ud);
  return &meta_byte;
}

static void meta_free(void *p, size_t nbytes, dm_mem_stats *st) {
  (void)p; (void)st;
  trace.current -= (int64_t)nbytes;
  trace.blocks -= (int64_t)dm_cuda_block_size(nbytes);
}

void dm_meta_trace_mark(void) {
  trace.peak = trace.current;
  trace.blocks_peak = trace.blocks;
  trace.peak_at = 0;
}

void dm_meta_trace_reset(void) {
  trace.allocs = 0;
  dm_meta_trace_mark();
}

dm_meta_trace dm_meta_trace_get(void) { return trace; }

void dm_meta_watch(uint64_t at, void (*fn)(void *ud), void *ud) {
  watch_at = at;
  watch_fn = at ? fn : NULL;
  watch_ud = ud;
}

static dm_plan_card plan_card;
static bool planning;
static const char *scratch_what;     /* the scratch being allocated (dm_plan_scratch_now) */
static int64_t scratch_bytes;

void dm_plan_begin(const dm_plan_card *card) {
  planning = card != NULL;
  if (card) plan_card = *card;
}

const dm_plan_card *dm_plan_card_of(dm_device dev) { return planning && dev == DM_META ? &plan_card : NULL; }

void dm_plan_scratch(int64_t bytes, const char *what) {
  if (!planning || bytes <= 0) return;
  scratch_what = what;
  scratch_bytes = bytes;
  void *p = dm_alloc(DM_META, (size_t)bytes);
  scratch_what = NULL;
  dm_free(DM_META, p, (size_t)bytes);
}

const char *dm_plan_scratch_now(int64_t *bytes) {
  if (scratch_what) *bytes = scratch_bytes;
  return scratch_what;
}

bool dm_poison_enabled(void) {
  static int on = -1;
  if (on < 0) { const char *s = getenv("DM_POISON"); on = s && *s && *s != '0'; }
  return on;
}

/* Step after step asks for the same large blocks; glibc would hand each back
** to the kernel (munmap) and fault it in again. Keeping blocks up to 32 MiB
** in the heap and not trimming it makes the steady state fault-free. */
__attribute__((constructor)) static void host_malloc_tuning(void) {
  mallopt(M_MMAP_THRESHOLD, 32 << 20);
  mallopt(M_TRIM_THRESHOLD, 256 << 20);
}

/* The host's "cache" is the heap the tuning above keeps: its free pages go back to the kernel
** (work of changing shapes, a long prompt's chunks, leaves them scattered through it). */
static void host_empty_cache(dm_mem_stats *st) {
  (void)st;
  malloc_trim(0);
}

static const dm_allocator host_allocator = {host_alloc, host_free, host_empty_cache};
static const dm_allocator meta_allocator = {meta_alloc, meta_free, NULL};

static const dm_allocator *allocators[DM_NDEVICE] = {
  [DM_CPU] = &host_allocator, [DM_META] = &meta_allocator,
};
static dm_mem_stats stats[DM_NDEVICE];

void dm_allocator_register(dm_device dev, const dm_allocator *a) { allocators[dev] = a; }
bool dm_device_available(dm_device dev) {
  const dm_allocator *a = allocators[dev];
  return a && (!a->available || a->available());
}

void *dm_xmalloc(size_t n) {
  void *p = malloc(n ? n : 1);
  if (!p) dm_error("out of host memory (%zu bytes)", n);
  return p;
}

void *dm_xcalloc(size_t n, size_t size) {
  void *p = calloc(n ? n : 1, size);
  if (!p) dm_error("out of host memory (%zu bytes)", n * size);
  return p;
}

void *dm_alloc(dm_device dev, size_t nbytes) {
  const dm_allocator *a = allocators[dev];
  if (!a && dev == DM_CUDA) dm_error("cuda: no CUDA device is available (%s)", dm_cuda_unavailable_reason());
  if (!a) dm_error("device '%s' is not available in this build or on this machine", dm_device_name(dev));
  dm_mem_stats *st = &stats[dev];
  void *p = a->alloc(nbytes, st);
  if (!p)
    dm_error("out of %s memory: asked for %zu bytes with %lld allocated in %lld blocks, "
             "%lld reserved, peak %lld", dm_device_name(dev), nbytes, (long long)st->allocated,
             (long long)st->count, (long long)st->reserved, (long long)st->peak);
  st->allocated += (int64_t)nbytes;
  st->count++;
  if (st->allocated > st->peak) st->peak = st->allocated;
  return p;
}

void dm_free(dm_device dev, void *p, size_t nbytes) {
  dm_mem_stats *st = &stats[dev];
  allocators[dev]->free(p, nbytes, st);
  st->allocated -= (int64_t)nbytes;
  st->count--;
}

dm_mem_stats dm_memory_stats(dm_device dev) { return stats[dev]; }
void dm_memory_reset_peak(dm_device dev) { stats[dev].peak = stats[dev].allocated; }

void dm_memory_empty_cache(dm_device dev) {
  if (allocators[dev] && allocators[dev]->empty_cache) allocators[dev]->empty_cache(&stats[dev]);
}
