/*
** json_read.h — the safetensors header's JSON, read strictly (json_read.c): objects, arrays,
** strings and integers, values in an arena freed at once, members and items as linked lists
** in document order (duplicate keys are left to the caller). Not an API: ckpt.h is that.
*/
#ifndef DM_JSON_READ_H
#define DM_JSON_READ_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

typedef struct dm_ablock { struct dm_ablock *next; size_t used, cap; char data[]; } dm_ablock;
typedef struct dm_arena { dm_ablock *head; } dm_arena;

void *dm_arena_alloc(dm_arena *a, size_t n);
void dm_arena_free(dm_arena *a);

enum { DM_J_OBJECT, DM_J_ARRAY, DM_J_STRING, DM_J_INT };

typedef struct dm_jval {
  int type;
  long pos;                  /* byte offset in the header, for messages */
  int64_t i;                 /* DM_J_INT */
  const char *s; size_t len; /* DM_J_STRING */
  const char *key; size_t keylen;   /* set on object members */
  struct dm_jval *first, *next; /* DM_J_OBJECT / DM_J_ARRAY: members, in order */
  int n;
} dm_jval;

/* the JSON document text[0..n) (path names it in errors) as values in the arena a */
dm_jval *dm_json_parse(const char *path, const char *text, size_t n, dm_arena *a);

/* s is valid UTF-8 */
bool dm_utf8_valid(const char *s);

#endif
