/*
** fuzz_files.c — libFuzzer targets for the readers of files a user hands the
** runtime: FUZZ_TARGET selects one.
**
**   safetensors   dm_safetensors_read on the input as a .safetensors file
**   corpus        dm_corpus_open on the input as a .zst corpus, every byte read (frames
**                 read in place or the file decoded whole)
**
** A reader may refuse an input (dm_error, caught here by longjmp); it must
** never crash, hang, leak or read out of bounds (ASan and UBSan watch).
*/
#include <setjmp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include "core/dm.h"
#include "io/ckpt.h"
#include "data/data.h"

static jmp_buf *refused;

static void on_error(const char *msg, void *ud) {
  (void)msg; (void)ud;
  if (refused) longjmp(*refused, 1);
  abort();                                         /* an error outside a reader: a bug of the harness */
}

/* the input as a file of the reader's suffix, one per process */
static const char *as_file(const uint8_t *data, size_t size, const char *suffix) {
  static char path[256];
  snprintf(path, sizeof path, "%s/dm-fuzz-%d%s", getenv("TMPDIR") ? getenv("TMPDIR") : "/tmp", (int)getpid(),
           suffix);
  FILE *f = fopen(path, "wb");
  if (!f || (size && fwrite(data, 1, size, f) != size) || fclose(f) != 0) abort();
  return path;
}

#if FUZZ_TARGET_safetensors
#define SUFFIX ".safetensors"
static void reader(const char *path) {
  dm_safetensors *st = dm_safetensors_read(path);
  dm_safetensors_free(st);
}
static void after(void) {}

#else
#define SUFFIX ".zst"
static dm_corpus *opened;      /* released after a refusal too: a frame read in place may fail at a read */
static void reader(const char *path) {
  opened = dm_corpus_open(1, &path, 0);
  uint8_t buf[4096];
  for (int64_t pos = 0, n = dm_corpus_size(opened); pos < n; pos += (int64_t)sizeof buf)
    dm_corpus_read(opened, pos, n - pos < (int64_t)sizeof buf ? n - pos : (int64_t)sizeof buf, buf);
}
static void after(void) {
  dm_corpus_release(opened);
  opened = NULL;
}
#endif

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  static int ready;
  if (!ready) { dm_set_error_handler(on_error, NULL); ready = 1; }
  const char *path = as_file(data, size, SUFFIX);
  jmp_buf jb;
  refused = &jb;
  if (setjmp(jb) == 0) reader(path);
  refused = NULL;
  after();
  unlink(path);
  return 0;
}
