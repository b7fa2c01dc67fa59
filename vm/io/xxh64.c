/*
** xxh64.c — XXH64 checksums of buffers and files (ckpt.h), bit-exact with the reference xxHash.
*/
#include <errno.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>
#include "io/ckpt.h"
#include "io/fileio.h"
#include "core/core.h"

/* ---- checksums: XXH64, bit-exact with the reference xxHash ------------------------------ */

#define XP1 11400714785074694791ULL
#define XP2 14029467366897019727ULL
#define XP3 1609587929392839161ULL
#define XP4 9650029242287828579ULL
#define XP5 2870177450012600261ULL

static uint64_t rotl64(uint64_t x, int r) { return (x << r) | (x >> (64 - r)); }
static uint64_t rd64(const unsigned char *p) { uint64_t v; memcpy(&v, p, 8); return v; }
static uint32_t rd32(const unsigned char *p) { uint32_t v; memcpy(&v, p, 4); return v; }

static uint64_t xround(uint64_t acc, uint64_t in) { return rotl64(acc + in * XP2, 31) * XP1; }
static uint64_t xmerge(uint64_t h, uint64_t v) { return (h ^ xround(0, v)) * XP1 + XP4; }

uint64_t dm_xxh64(const void *data, size_t n, uint64_t seed) {
  const unsigned char *p = n ? data : (const void *)"", *end = p + n;   /* (an empty file maps to NULL) */
  uint64_t h;
  if (n >= 32) {
    uint64_t v1 = seed + XP1 + XP2, v2 = seed + XP2, v3 = seed, v4 = seed - XP1;
    for (; end - p >= 32; p += 32) {
      v1 = xround(v1, rd64(p)); v2 = xround(v2, rd64(p + 8));
      v3 = xround(v3, rd64(p + 16)); v4 = xround(v4, rd64(p + 24));
    }
    h = rotl64(v1, 1) + rotl64(v2, 7) + rotl64(v3, 12) + rotl64(v4, 18);
    h = xmerge(xmerge(xmerge(xmerge(h, v1), v2), v3), v4);
  } else {
    h = seed + XP5;
  }
  h += (uint64_t)n;
  for (; end - p >= 8; p += 8) h = rotl64(h ^ xround(0, rd64(p)), 27) * XP1 + XP4;
  if (end - p >= 4) { h = rotl64(h ^ (uint64_t)rd32(p) * XP1, 23) * XP2 + XP3; p += 4; }
  for (; p < end; p++) h = rotl64(h ^ *p * XP5, 11) * XP1;
  h ^= h >> 33; h *= XP2;
  h ^= h >> 29; h *= XP3;
  h ^= h >> 32;
  return h;
}

uint64_t dm_file_checksum(const char *path, int64_t *size) {
  struct stat sb;
  int fd = dm_open_regular(path, &sb);
  size_t n = (size_t)sb.st_size;
  void *map = n ? mmap(NULL, n, PROT_READ, MAP_PRIVATE, fd, 0) : NULL;
  int e = errno;
  close(fd);
  if (map == MAP_FAILED) dm_error("%s: cannot map for its checksum: %s", path, strerror(e));
  if (map) madvise(map, n, MADV_SEQUENTIAL);
  uint64_t h = dm_xxh64(map, n, 0);
  if (map) munmap(map, n);
  if (size) *size = (int64_t)n;
  return h;
}
