/*
** alloc.c — the CUDA caching allocator.
**
** cudaMalloc and cudaFree are slow and synchronise the device, so device
** memory is taken from the driver in segments and kept: a freed block goes
** back to a free list and the next request of a size it fits takes it, with
** no driver call. Two pools:
**
**   small: requests up to 1 MiB, rounded up to 512 bytes, cut from 2 MiB
**          segments;
**   large: bigger requests, rounded up to 2 MiB, each first given its own
**          segment of that size.
**
** A request takes the smallest free block of its pool that fits (best fit,
** searched in bins by powers of two) and the rest is split off as a free
** block when it is at least one rounding unit; a freed block merges with
** free neighbours of its segment. So after the first step of a training
** loop, whose sizes repeat, every request is served from the cache.
**
** Reuse is stream-ordered: every launch goes to one stream, so a block the
** host frees while a queued kernel still reads it is only written again by
** a kernel queued later, after that read. (A second stream would need
** events here.)
**
** Out of memory: the cache goes back to the driver and the request is
** tried once more; then NULL, and dm_alloc raises with the statistics.
** dm.cuda.empty_cache() returns every segment with nothing in use.
** With DM_POISON=1 every block handed out is filled with 0xff bytes (NaN in
** every float type), so a kernel that leaves an output element unwritten is
** caught. Not thread-safe: the core allocates from one thread.
**
** CUDA graphs (kernels/graph.c) get a private pool: while a capture runs,
** every request is served from segments of the capture's own pool, and a
** block allocated before the capture and freed during it is held back, not
** reused (a replay may still read it). When the graph is freed, its
** segments and the blocks it held join the shared cache.
*/
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "internal.h"
#include "core/alloc.h"
#include "core/graph.h"

#define GRAIN DM_CUDA_GRAIN                 /* core/alloc.h: the sizes dm_cuda_block_size rounds to */
#define SMALL_MAX DM_CUDA_SMALL_MAX
#define SMALL_SEGMENT ((size_t)2 << 20)
#define LARGE_GRAIN DM_CUDA_LARGE_GRAIN
#define NBINS 64

typedef struct block {
  char *ptr;
  size_t size;
  size_t segment;                   /* on a segment's first block: its size; else 0 */
  struct block *prev, *next;        /* neighbours by address in the segment */
  struct block *fprev, *fnext;      /* the free list of its bin, while free (or a graph's held list) */
  struct dm_cuda_pool *owner;       /* a CUDA graph's private pool, or NULL: the shared one */
  bool free, small;
} block;

typedef struct pool { block *bins[NBINS]; } pool;
static pool small_pool, large_pool;

struct dm_cuda_pool {
  pool small, large;
  block **segments;                 /* the first block of each of its segments */
  int n_segments, cap_segments;
  block *held;                      /* shared blocks freed during the capture */
};
static dm_cuda_pool *capturing;     /* the pool requests come from, while a capture runs */

static int bin_of(size_t size) { return 63 - __builtin_clzll((unsigned long long)size); }
static pool *pool_of(const block *b) {
  if (b->owner) return b->small ? &b->owner->small : &b->owner->large;
  return b->small ? &small_pool : &large_pool;
}

static void *xmalloc(size_t n) {
  void *p = calloc(1, n);
  if (!p) dm_error("out of host memory for the CUDA allocator's bookkeeping");
  return p;
}

/* ---- free lists --------------------------------------------------------------------- */

static void push_free(block *b) {
  block **head = &pool_of(b)->bins[bin_of(b->size)];
  b->free = true;
  b->fprev = NULL;
  b->fnext = *head;
  if (*head) (*head)->fprev = b;
  *head = b;
}

static void unlink_free(block *b) {
  block **head = &pool_of(b)->bins[bin_of(b->size)];
  if (b->fprev) b->fprev->fnext = b->fnext; else *head = b->fnext;
  if (b->fnext) b->fnext->fprev = b->fprev;
  b->fprev = b->fnext = NULL;
  b->free = false;
}

/* the smallest free block of at least size bytes */
static block *best_fit(pool *p, size_t size) {
  for (int bin = bin_of(size); bin < NBINS; bin++) {
    block *best = NULL;
    for (block *b = p->bins[bin]; b; b = b->fnext)
      if (b->size >= size && (!best || b->size < best->size)) best = b;
    if (best) return best;
  }
  return NULL;
}

/* ---- the blocks in use, by address ------------------------------------------------------ */

static block **table;             /* open addressing; TOMB marks a removed entry */
static size_t table_cap, table_used;
static block tomb_;
#define TOMB (&tomb_)

static size_t slot_of(const void *p) {
  uint64_t h = (uint64_t)(uintptr_t)p >> 9;
  h *= 0x9e3779b97f4a7c15ull;
  return (size_t)(h >> 20) & (table_cap - 1);
}

static void table_put(block *b);

static void table_grow(void) {
  block **old = table;
  size_t old_cap = table_cap;
  table_cap = table_cap ? table_cap * 2 : 1024;
  table = xmalloc(table_cap * sizeof *table);
  table_used = 0;
  for (size_t i = 0; i < old_cap; i++) if (old[i] && old[i] != TOMB) table_put(old[i]);
  free(old);
}

static void table_put(block *b) {
  if (2 * (table_used + 1) > table_cap) table_grow();
  size_t i = slot_of(b->ptr);
  while (table[i] && table[i] != TOMB) i = (i + 1) & (table_cap - 1);
  if (!table[i]) table_used++;
  table[i] = b;
}

static block *table_take(const void *p) {
  if (!table_cap) return NULL;
  for (size_t i = slot_of(p);; i = (i + 1) & (table_cap - 1)) {
    if (!table[i]) return NULL;
    if (table[i] != TOMB && table[i]->ptr == p) {
      block *b = table[i];
      table[i] = TOMB;
      return b;
    }
  }
}

/* ---- segments ------------------------------------------------------------------------ */

/* give every segment with nothing in use back to the driver */
static void release_cached(dm_mem_stats *st) {
  DM_CU(cudaStreamSynchronize(dm_cuda_stream()));     /* queued kernels may still read them */
  pool *pools[2] = {&small_pool, &large_pool};
  for (int k = 0; k < 2; k++)
    for (int bin = 0; bin < NBINS; bin++)
      for (block *b = pools[k]->bins[bin], *next; b; b = next) {
        next = b->fnext;
        if (!b->segment || b->size != b->segment) continue;
        unlink_free(b);
        DM_CU(cudaFree(b->ptr));
        st->reserved -= (int64_t)b->size;
        free(b);
      }
}

static block *new_segment(size_t size, bool small, dm_mem_stats *st) {
  void *p = NULL;
  /* during a capture: cudaMalloc is no stream work, and the segment outlives it */
  enum cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;
  if (capturing) cudaThreadExchangeStreamCaptureMode(&mode);
  cudaError_t e = cudaMalloc(&p, size);
  if (capturing) cudaThreadExchangeStreamCaptureMode(&mode);
  if (e == cudaErrorMemoryAllocation && !capturing) {     /* (emptying the cache waits for the device) */
    cudaGetLastError();
    release_cached(st);
    e = cudaMalloc(&p, size);
  }
  if (e == cudaErrorMemoryAllocation) { cudaGetLastError(); return NULL; }
  DM_CU(e);
  st->reserved += (int64_t)size;
  st->sys_allocs++;
  block *b = xmalloc(sizeof *b);
  b->ptr = p;
  b->size = b->segment = size;
  b->small = small;
  if (capturing) {
    dm_cuda_pool *o = capturing;
    if (o->n_segments == o->cap_segments) {
      o->cap_segments = o->cap_segments ? 2 * o->cap_segments : 16;
      block **seg = realloc(o->segments, sizeof *seg * (size_t)o->cap_segments);
      if (!seg) dm_error("out of host memory for the CUDA allocator's bookkeeping");
      o->segments = seg;
    }
    o->segments[o->n_segments++] = b;
    b->owner = o;
  }
  return b;
}

/* ---- the allocator ---------------------------------------------------------------------- */

static void *cuda_alloc(size_t nbytes, dm_mem_stats *st) {
  dm_cuda_init();
  bool small = nbytes <= SMALL_MAX;
  size_t size = dm_cuda_block_size(nbytes);
  pool *from = capturing ? (small ? &capturing->small : &capturing->large) : small ? &small_pool : &large_pool;
  block *b = best_fit(from, size);
  if (b) unlink_free(b);
  else if (!(b = new_segment(small ? SMALL_SEGMENT : size, small, st))) return NULL;
  if (b->size - size >= (small ? GRAIN : LARGE_GRAIN)) {      /* split off the rest */
    block *rest = xmalloc(sizeof *rest);
    rest->ptr = b->ptr + size;
    rest->size = b->size - size;
    rest->small = small;
    rest->owner = b->owner;
    rest->prev = b;
    rest->next = b->next;
    if (b->next) b->next->prev = rest;
    b->next = rest;
    b->size = size;
    push_free(rest);
  }
  table_put(b);
  if (dm_poison_enabled()) DM_CU(cudaMemsetAsync(b->ptr, 0xff, b->size, dm_cuda_stream()));
  return b->ptr;
}

/* a absorbs its next neighbour b (both out of the free lists) */
static void merge(block *a, block *b) {
  a->size += b->size;
  a->next = b->next;
  if (b->next) b->next->prev = a;
  free(b);
}

/* b back to its pool's free lists, merged with free neighbours; held back instead
** while a capture into another pool runs */
static void free_block(block *b) {
  if (capturing && b->owner != capturing) {
    b->fnext = capturing->held;
    capturing->held = b;
    return;
  }
  if (b->prev && b->prev->free) {
    block *a = b->prev;
    unlink_free(a);
    merge(a, b);
    b = a;
  }
  if (b->next && b->next->free) {
    unlink_free(b->next);
    merge(b, b->next);
  }
  push_free(b);
}

static void cuda_free(void *p, size_t nbytes, dm_mem_stats *st) {
  block *b = table_take(p);
  if (!b) {
    fprintf(stderr, "dormouse: cuda allocator: freeing %p, which it did not hand out\n", p);
    return;
  }
  free_block(b);
}

/* ---- private pools of CUDA graphs (graph.h) ------------------------------------------------ */

dm_cuda_pool *dm_cuda_pool_new(void) { return xmalloc(sizeof(dm_cuda_pool)); }

void dm_cuda_pool_capture(dm_cuda_pool *p) { capturing = p; }

void dm_cuda_pool_release(dm_cuda_pool *p) {
  if (capturing == p) capturing = NULL;
  for (int i = 0; i < p->n_segments; i++)
    for (block *b = p->segments[i]; b; b = b->next) {
      bool was_free = b->free;
      if (was_free) unlink_free(b);
      b->owner = NULL;
      if (was_free) push_free(b);
    }
  for (block *b = p->held, *next; b; b = next) {
    next = b->fnext;
    b->fnext = NULL;
    free_block(b);
  }
  free(p->segments);
  free(p);
}

static void cuda_empty_cache(dm_mem_stats *st) {
  if (dm_cuda_available()) release_cached(st);
}

static const dm_allocator cuda_allocator = {cuda_alloc, cuda_free, cuda_empty_cache, dm_cuda_available};

__attribute__((constructor)) static void register_allocator(void) {
  dm_allocator_register(DM_CUDA, &cuda_allocator);
}
