/*
** attrs.h — the op table's side of the attribute declarations (attrs.c): read at registration,
** defaults filled in by dm_call.
*/
#ifndef DM_ATTRS_H
#define DM_ATTRS_H

#include "core/ops.h"

void dm_attr_parse(const dm_op *op);                 /* op->attrs, once, after op->id is set */
/* the declared defaults of what a left out; an error naming the first it left out that has none */
void dm_attr_fill(const dm_op *op, dm_attrs *a);

#endif
