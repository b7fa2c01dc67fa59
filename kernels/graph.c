/*
** graph.c — CUDA graph capture and replay on the one stream (graph.h).
**
** Begin switches the allocator to a new private pool and starts capturing
** the stream (global mode: a call that would wait for the device fails, and
** invalidates the capture, instead of silently running out of order). End
** instantiates the graph; the pool stays with it until it is freed. The
** graph's nodes hold the addresses of the tensors the captured code used:
** inputs must outlive the graph and are refreshed by copying into them.
*/
#include <stdlib.h>
#include "internal.h"
#include "core/graph.h"

struct dm_cuda_graph {
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  dm_cuda_pool *pool;
  int64_t nodes;
};

static dm_cuda_pool *pool;          /* the running capture's, or NULL */

bool dm_cuda_graph_capturing(void) { return pool != NULL; }

void dm_cuda_graph_begin(void) {
  dm_cuda_init();
  if (pool) dm_error("dm.cuda.graph: a capture is already running (captures do not nest)");
  if (dm_debug_level() >= 3)
    dm_error("dm.cuda.graph: DM_DEBUG=%d waits for every launch, which a capture cannot do (use 2 or less)",
             dm_debug_level());
  dm_cuda_pool *p = dm_cuda_pool_new();
  /* Global: a CUDA call of another thread that a capture forbids fails loudly; NCCL's own threads
  ** make such calls, so with its communicator the capture holds this thread to the rule alone */
  enum cudaStreamCaptureMode mode = dm_cuda_nccl_ready() ? cudaStreamCaptureModeThreadLocal : cudaStreamCaptureModeGlobal;
  cudaError_t e = cudaStreamBeginCapture(dm_cuda_stream(), mode);
  if (e != cudaSuccess) {
    dm_cuda_pool_release(p);
    DM_CU(e);
  }
  pool = p;
  dm_cuda_pool_capture(p);
}

/* ends the capture: the graph (NULL when it failed), and the pool, no longer capturing */
static cudaGraph_t stop(dm_cuda_pool **p, cudaError_t *err, bool *invalidated) {
  *p = pool;
  pool = NULL;
  dm_cuda_pool_capture(NULL);
  enum cudaStreamCaptureStatus st = cudaStreamCaptureStatusNone;
  cudaStreamIsCapturing(dm_cuda_stream(), &st);
  *invalidated = st == cudaStreamCaptureStatusInvalidated;
  cudaGraph_t g = NULL;
  *err = cudaStreamEndCapture(dm_cuda_stream(), &g);
  cudaGetLastError();
  if (*err != cudaSuccess && g) { cudaGraphDestroy(g); g = NULL; }
  return g;
}

bool dm_cuda_graph_abort(void) {
  if (!pool) return false;
  dm_cuda_pool *p;
  cudaError_t e;
  bool invalidated;
  cudaGraph_t g = stop(&p, &e, &invalidated);
  if (g) cudaGraphDestroy(g);
  dm_cuda_pool_release(p);
  return invalidated || e == cudaErrorStreamCaptureInvalidated;
}

dm_cuda_graph *dm_cuda_graph_end(void) {
  if (!pool) dm_error("dm.cuda.graph: no capture is running");
  dm_cuda_pool *p;
  cudaError_t e;
  bool invalidated;
  cudaGraph_t g = stop(&p, &e, &invalidated);
  if (!g) {
    dm_cuda_pool_release(p);
    dm_error("dm.cuda.graph: the capture failed (%s)%s", cudaGetErrorString(e),
             invalidated || e == cudaErrorStreamCaptureInvalidated
               ? ": something inside it waited for the device, which a capture cannot do" : "");
  }
  cudaGraphExec_t x;
  e = cudaGraphInstantiate(&x, g, 0);
  if (e != cudaSuccess) {
    cudaGetLastError();
    cudaGraphDestroy(g);
    dm_cuda_pool_release(p);
    dm_error("dm.cuda.graph: instantiating the captured graph failed: %s", cudaGetErrorString(e));
  }
  dm_cuda_graph *G = calloc(1, sizeof *G);
  if (!G) {
    cudaGraphExecDestroy(x);
    cudaGraphDestroy(g);
    dm_cuda_pool_release(p);
    dm_error("dm.cuda.graph: out of host memory");
  }
  size_t n = 0;
  cudaGraphGetNodes(g, NULL, &n);
  G->graph = g;
  G->exec = x;
  G->pool = p;
  G->nodes = (int64_t)n;
  return G;
}

void dm_cuda_graph_replay(dm_cuda_graph *g) {
  if (pool) dm_error("dm.cuda.graph: replay inside a capture (capture the work itself instead)");
  DM_CU(cudaGraphLaunch(g->exec, dm_cuda_stream()));
}

int64_t dm_cuda_graph_nodes(const dm_cuda_graph *g) { return g->nodes; }

/* a replay still queued finishes first: the exec is freed on completion, and
** the pool's blocks are reused only by work queued after it */
void dm_cuda_graph_free(dm_cuda_graph *g) {
  if (!g) return;
  cudaGraphExecDestroy(g->exec);
  cudaGraphDestroy(g->graph);
  dm_cuda_pool_release(g->pool);
  free(g);
}
