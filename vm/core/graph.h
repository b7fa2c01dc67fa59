/*
** graph.h — CUDA graphs: capture the launches of a stretch of code on the
** one stream, replay them (kernels/graph.c; dm.cuda.graph in Lua,
** lua/dormouse/graph.lua).
**
** A capture queues nothing: every launch, copy and product made while it
** runs becomes a node of the graph, with its pointers, sizes and scalars
** frozen; a replay runs them all again, in order, on the stream. Memory
** allocated during the capture comes from the graph's private pool (the
** allocator's side is kernels/alloc.c) and is handed to nothing else while
** the graph lives; the graph returns it when freed. Anything that waits for
** the device during a capture fails it.
*/
#ifndef DM_GRAPH_H
#define DM_GRAPH_H

#include "core/dm.h"

typedef struct dm_cuda_graph dm_cuda_graph;

#ifdef DM_HAVE_CUDA

void dm_cuda_graph_begin(void);              /* raises when a capture already runs, or without a device */
dm_cuda_graph *dm_cuda_graph_end(void);      /* raises when the capture failed */
/* after an error inside the capture: ends it; true when something had invalidated it
** (a call that waits for the device) */
bool dm_cuda_graph_abort(void);
bool dm_cuda_graph_capturing(void);
void dm_cuda_graph_replay(dm_cuda_graph *g);
int64_t dm_cuda_graph_nodes(const dm_cuda_graph *g);
void dm_cuda_graph_free(dm_cuda_graph *g);

/* the allocator's private pools (kernels/alloc.c) */
typedef struct dm_cuda_pool dm_cuda_pool;
dm_cuda_pool *dm_cuda_pool_new(void);
void dm_cuda_pool_capture(dm_cuda_pool *p);  /* requests come from p (NULL: the shared cache) */
void dm_cuda_pool_release(dm_cuda_pool *p);  /* p's memory and held blocks join the shared cache */

#else

static inline void dm_cuda_graph_begin(void) { dm_error("dm.cuda.graph: CUDA graphs need a CUDA device (this build has no CUDA backend)"); }
static inline dm_cuda_graph *dm_cuda_graph_end(void) { dm_cuda_graph_begin(); return NULL; }
static inline bool dm_cuda_graph_abort(void) { return false; }
static inline bool dm_cuda_graph_capturing(void) { return false; }
static inline void dm_cuda_graph_replay(dm_cuda_graph *g) { (void)g; dm_cuda_graph_begin(); }
static inline int64_t dm_cuda_graph_nodes(const dm_cuda_graph *g) { (void)g; return 0; }
static inline void dm_cuda_graph_free(dm_cuda_graph *g) { (void)g; }

#endif
#endif
