/*
** dm.h — the few types every part of the C core shares: dtypes, devices,
** and the error path.
**
** The core knows nothing of Lua. An error is raised with dm_error(), which
** formats a message and hands it to the installed handler; the handler does
** not return (the Lua binding turns it into a Lua error, a C test longjmps).
** Code validates its arguments before it allocates, so that an error leaves
** nothing half-built behind.
*/
#ifndef DM_H
#define DM_H

#include <stddef.h>
#include <stdint.h>
#include <stdbool.h>

#define DM_MAXDIM 8
#define DM_VERSION "0.1.0"

typedef enum {
  DM_F32, DM_F64, DM_BF16, DM_F16, DM_I32, DM_I64, DM_U8,
  DM_NDTYPE
} dm_dtype;

/* Where a storage lives. META tensors have shapes and no memory: they let a
** model be instantiated only to count its parameters or plan its memory. */
typedef enum { DM_CPU, DM_CUDA, DM_META, DM_NDEVICE } dm_device;

/* dtype facts (dtype.c) */
size_t dm_dtype_size(dm_dtype t);
const char *dm_dtype_name(dm_dtype t);
int dm_dtype_from_name(const char *name);         /* -1 when unknown */
bool dm_dtype_is_float(dm_dtype t);
const char *dm_device_name(dm_device d);
int dm_device_from_name(const char *name);        /* -1 when unknown */

/* scalar conversion, round to nearest even for the 16-bit formats */
uint16_t dm_f32_to_bf16(float f);
float dm_bf16_to_f32(uint16_t h);
uint16_t dm_f32_to_f16(float f);
float dm_f16_to_f32(uint16_t h);
double dm_load(dm_dtype t, const void *p);
void dm_store(dm_dtype t, void *p, double v);

/* errors (error.c) */
typedef void (*dm_error_handler)(const char *msg, void *ud);
void dm_set_error_handler(dm_error_handler h, void *ud);
void dm_get_error_handler(dm_error_handler *h, void **ud);
/* a layer above that must put its state back as an error unwinds through it (the tape:
** autograd.c) registers a function here, once; dm_error calls them in order, before the handler */
typedef void (*dm_unwind_fn)(void);
void dm_on_error_unwind(dm_unwind_fn fn);
#if defined(__GNUC__)
__attribute__((noreturn, format(printf, 1, 2)))
#endif
void dm_error(const char *fmt, ...);

/* shape formatting for messages: "[4, 8]" into buf */
const char *dm_shape_str(char *buf, size_t n, int ndim, const int64_t *shape);

/* debug level from DM_DEBUG, read once */
int dm_debug_level(void);

#endif
