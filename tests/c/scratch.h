/*
** scratch.h — a C test's files: a fresh folder under /tmp for the test's run,
** paths in it, whole files written and read back, and text-like bytes to fill
** them. scratch_begin makes the folder, scratch_end removes it and all it holds.
** Include it in a file that defines _GNU_SOURCE before its first include (nftw).
*/
#ifndef DM_SCRATCH_H
#define DM_SCRATCH_H

#include <ftw.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

static char scratch_dir[64];

/* the folder /tmp/dm_test_NAME_XXXXXX; false (said on stderr) when it cannot be made */
static bool scratch_begin(const char *name) {
  snprintf(scratch_dir, sizeof scratch_dir, "/tmp/dm_test_%s_XXXXXX", name);
  if (mkdtemp(scratch_dir)) return true;
  perror("mkdtemp");
  return false;
}

static int scratch_rm(const char *path, const struct stat *st, int flag, struct FTW *ftw) {
  (void)st; (void)flag; (void)ftw;
  return remove(path);
}

static void scratch_end(void) { nftw(scratch_dir, scratch_rm, 16, FTW_DEPTH | FTW_PHYS); }

/* NAME's path in the folder (the last 8 stay valid at once) */
static const char *tmp(const char *name) {
  static char buf[8][256];
  static int at;
  char *p = buf[at++ % 8];
  snprintf(p, 256, "%s/%s", scratch_dir, name);
  return p;
}

static void write_file(const char *path, const void *bytes, size_t n) {
  FILE *f = fopen(path, "wb");
  if (n) fwrite(bytes, 1, n, f);
  fclose(f);
}

/* a whole file, malloc'd; its size in *n */
static uint8_t *slurp(const char *path, size_t *n) {
  FILE *f = fopen(path, "rb");
  fseek(f, 0, SEEK_END);
  *n = (size_t)ftell(f);
  fseek(f, 0, SEEK_SET);
  uint8_t *b = malloc(*n ? *n : 1);
  if (fread(b, 1, *n, f) != *n) *n = 0;
  fclose(f);
  return b;
}

/* text-like bytes that are not periodic, so every window is distinguishable */
static uint8_t *make_bytes(size_t n, uint32_t seed) {
  uint8_t *b = malloc(n ? n : 1);
  for (size_t i = 0; i < n; i++) {
    seed = seed * 1664525u + 1013904223u;
    b[i] = (uint8_t)(" etaoinshrdlu\n"[(seed >> 24) % 14]);
  }
  return b;
}

#endif
