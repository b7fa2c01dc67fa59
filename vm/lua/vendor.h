/*
** vendor.h — the files embedded in the binary at build time (cmake/vendor.cmake writes
** vendor_files.c, which defines the table; vm/lua/vendor.c reads it): name, bytes, size, and
** a NULL name last.
*/
#ifndef DM_VENDOR_H
#define DM_VENDOR_H

#include <stddef.h>

typedef struct { const char *name, *data; size_t size; } dm_vendor_file;
extern const dm_vendor_file dm_vendor_files[];

#endif
