/*
** data.h — byte corpora: files, splits, training batches, a loader thread
** and held-out windows.
**
** A corpus is one byte stream: a file, a list of files, a directory (its
** regular files, recursively, each level in sorted name order, hidden names
** skipped) or a glob, concatenated. Raw files are memory-mapped; a `.zst`
** file is mapped too and read in place, a frame at a time through a small
** cache, when its frames have bounded sizes (zframes.h; any frame above
** 16 MiB, or of unknown size, and it is decompressed into memory at open). The held-out split is
** the LAST eval_bytes of the stream and no training window ever touches it;
** the train split is the rest.
**
** A mixture is several sources, each a list of paths with a weight: the
** stream holds each source's train bytes in turn, then the held-out bytes,
** either each source's tail (eval_bytes shared by weight) or the last
** eval_bytes of a separate eval source. A row picks its source by weight,
** then its start within that source's train bytes, so no row crosses two.
**
** Training batch k (k = 0, 1, ...: the number of batches drawn before it)
** is B rows of T+1 bytes. Row r starts at a position drawn by Philox from
** (seed, k, r) alone, so batch k never depends on batches 0..k-1: the next
** k is the whole data state a checkpoint needs. Each row also carries the
** ctx bytes before its start (Engram n-grams read them), with the pad byte
** 0 before the start of the corpus.
**
** Offsets are byte offsets from 0, as in a file.
*/
#ifndef DM_DATA_H
#define DM_DATA_H

#include "core/tensor.h"

/* ---- the corpus ------------------------------------------------------------------------- */

typedef struct dm_corpus dm_corpus;

/* Opens and concatenates the paths; raises naming the file on a missing or
** unreadable path, a directory without files, an empty corpus, a corrupted
** or truncated zstd frame (with the compressed byte offset), or an
** eval_bytes that is negative or not smaller than the corpus. refs = 1. */
dm_corpus *dm_corpus_open(int npaths, const char *const *paths, int64_t eval_bytes);

typedef struct dm_source {
  int npaths;
  const char *const *paths;
  double weight;        /* > 0; a source draws weight / (the weights' sum) of the rows */
} dm_source;

/* A mixture of sources (one source is dm_corpus_open); eval, when not NULL, is the
** held-out source (its weight unused) and needs eval_bytes > 0. Raises as
** dm_corpus_open, and on a weight that is not > 0 or a source whose share of
** eval_bytes leaves it no train bytes. */
dm_corpus *dm_corpus_open_sources(int nsources, const dm_source *sources, const dm_source *eval,
                                  int64_t eval_bytes);
void dm_corpus_retain(dm_corpus *c);
void dm_corpus_release(dm_corpus *c);      /* the last release unmaps and frees; NULL is fine */

int64_t dm_corpus_size(const dm_corpus *c);
int64_t dm_corpus_train_size(const dm_corpus *c);   /* bytes [0, train) */
int64_t dm_corpus_eval_size(const dm_corpus *c);    /* bytes [train, size) */
int dm_corpus_nfiles(const dm_corpus *c);           /* files that hold bytes, in stream order */
const char *dm_corpus_file(const dm_corpus *c, int i);
/* file i's decoded size when it is a zstd file decoded whole at open (one frame above
** DM_ZFRAME_MAX, or frames without their sizes), else 0: such a file is held in memory */
int64_t dm_corpus_whole(const dm_corpus *c, int i);
int dm_corpus_nsources(const dm_corpus *c);
/* source i's train bytes [begin, end) in the stream and its share of the rows */
void dm_corpus_source(const dm_corpus *c, int i, int64_t *begin, int64_t *end, double *share);

/* n bytes from pos into dst; positions before 0 read as the pad byte 0.
** Raises if pos + n passes the end, or on a zstd frame that does not decode. */
void dm_corpus_read(const dm_corpus *c, int64_t pos, int64_t n, uint8_t *dst);

/* ---- training batches ------------------------------------------------------------------- */

typedef struct dm_batch_spec {
  int64_t batch;        /* B rows */
  int64_t seq;          /* T: each row holds T+1 bytes (inputs and the targets shifted by one) */
  int64_t ctx;          /* bytes before each row's start, given as the prefix */
  uint64_t seed;
  dm_dtype dtype;       /* DM_U8, DM_I32 or DM_I64 */
  dm_device device;     /* where the returned tensors live */
  int64_t first_row;    /* training batches: the rows drawn are first_row .. first_row + B - 1 of the
                           batch (a rank of a data-parallel job reads its share); 0 otherwise */
} dm_batch_spec;

/* raises when the spec is invalid or a source's train bytes are shorter than one window */
void dm_batch_check(const dm_corpus *c, const dm_batch_spec *s);
/* where row first_row + r of batch k starts: one source by weight (one source: no draw), then
** uniform over its train bytes [begin, end - (T+1)] */
int64_t dm_batch_start(const dm_corpus *c, const dm_batch_spec *s, int64_t k, int64_t row);
/* batch k: x [B, T+1] and prefix [B, ctx], two views of one allocation */
void dm_corpus_batch(const dm_corpus *c, const dm_batch_spec *s, int64_t k, dm_tensor **x,
                     dm_tensor **prefix);

/* ---- held-out windows -------------------------------------------------------------------
** Window i covers [train + i*T, train + i*T + T + 1): consecutive windows
** share one byte, so their targets cover every held-out byte but the first
** exactly once (the targets of windows 0..n-1 are [train + 1, train + 1 + n*T)).
** Prefixes come from the stream (they may reach into the train split). */

int64_t dm_eval_window_count(const dm_corpus *c, int64_t seq);
/* n windows (n < 0: all); the spec's batch and seed are ignored */
void dm_corpus_eval_windows(const dm_corpus *c, const dm_batch_spec *s, int64_t n, dm_tensor **x,
                            dm_tensor **prefix);

/* ---- host buffers ------------------------------------------------------------------------
** The loader's ring buffers come from this pair, so a backend can hand out
** pinned memory for asynchronous copies. NULL restores malloc / free. A
** loader keeps the pair it was created with; alloc is called from the
** loader thread and returns NULL on failure (reported by dm_loader_next). */

typedef struct dm_host_buffers {
  void *(*alloc)(size_t nbytes);
  void (*free)(void *p, size_t nbytes);
} dm_host_buffers;

void dm_data_set_host_buffers(const dm_host_buffers *hb);

/* ---- the loader thread -------------------------------------------------------------------
** A pthread fills a ring of `depth` batches ahead. dm_loader_next hands
** out batches start, start+1, ... in order (each a fresh copy in the spec's
** device, so a slot is free again at once) and returns its k. An error in
** the thread is raised by the dm_loader_next that asks for the batch it
** failed on, in the caller's thread. The loader holds a reference to the
** corpus. */

typedef struct dm_loader dm_loader;

#define DM_LOADER_DEPTH 4
/* the largest batch number a loader starts at: its counters run on from there and must not overflow
** (a checkpoint's data.position is checked against it before a resume touches the run folder) */
#define DM_LOADER_MAX_START ((int64_t)1 << 62)

dm_loader *dm_loader_new(dm_corpus *c, const dm_batch_spec *s, int64_t start, int64_t depth);
int64_t dm_loader_next(dm_loader *l, dm_tensor **x, dm_tensor **prefix);
int64_t dm_loader_position(const dm_loader *l);   /* the k the next call returns */
void dm_loader_free(dm_loader *l);                /* stops and joins the thread; NULL is fine */

#endif
