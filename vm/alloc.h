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

#include "dm.h"

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
void dm_free(dm_device dev, void *p, size_t nbytes);
dm_mem_stats dm_memory_stats(dm_device dev);
void dm_memory_reset_peak(dm_device dev);
void dm_memory_empty_cache(dm_device dev);
/* DM_POISON=1: new memory is filled with NaN bytes, so an unwritten output shows */
bool dm_poison_enabled(void);

#endif
