/*
** vm/lua/print.c — how a tensor prints: its values (summarised past 1000
** elements, three at each end of every dim), then shape, dtype and device.
**
**   tensor([[ 0.1000, -2.5000],
**           [ 3.0000,  4.0000]], shape=[2, 2], dtype=f32, device=cpu)
*/
#include <math.h>
#include <string.h>
#include "lua/bind.h"
#include "core/core.h"
#include "core/autograd.h"

#define EDGE 3
#define SUMMARY_AT 1000

typedef struct fmt {
  bool is_float, sci;
  int width;
  int64_t numel;
} fmt;

static bool shown(const dm_tensor *t, int d, int64_t i, bool summary) {
  return !summary || t->shape[d] <= 2 * EDGE || i < EDGE || i >= t->shape[d] - EDGE;
}

static double value(const dm_tensor *t, const int64_t *idx) {
  int64_t off = 0;
  for (int d = 0; d < t->ndim; d++) off += idx[d] * t->strides[d];
  return dm_load(t->dtype, (const char *)dm_data(t) + off * (int64_t)dm_dtype_size(t->dtype));
}

static void number(char *buf, size_t n, const fmt *f, double v) {
  if (!f->is_float) snprintf(buf, n, "%.0f", v);
  else if (isnan(v)) snprintf(buf, n, "nan");
  else if (isinf(v)) snprintf(buf, n, v > 0 ? "inf" : "-inf");
  else if (f->sci) snprintf(buf, n, "%.4e", v);
  else snprintf(buf, n, "%.4f", v);
}

/* the widest shown number decides the column width; big or tiny ones switch to %e */
static void measure(const dm_tensor *t, fmt *f, bool summary) {
  double maxabs = 0, minabs = INFINITY;
  int64_t idx[DM_MAXDIM] = {0};
  for (int64_t k = 0; k < f->numel; k++) {
    int64_t r = k;
    bool ok = true;
    for (int d = t->ndim - 1; d >= 0; d--) {
      idx[d] = r % t->shape[d];
      r /= t->shape[d];
      ok = ok && shown(t, d, idx[d], summary);
    }
    if (!ok) continue;
    double a = fabs(value(t, idx));
    if (isfinite(a)) { maxabs = fmax(maxabs, a); if (a > 0) minabs = fmin(minabs, a); }
  }
  f->sci = f->is_float && (maxabs >= 1e5 || (minabs < 1e-4 && minabs > 0));
  char buf[64];
  number(buf, sizeof buf, f, -maxabs);
  f->width = (int)strlen(buf);
  if (f->width < 4) f->width = 4;
}

static void rows(luaL_Buffer *b, const dm_tensor *t, int d, int64_t *idx, const fmt *f,
                 bool summary, int indent) {
  char buf[64];
  if (t->ndim == 0) { number(buf, sizeof buf, f, value(t, idx)); luaL_addstring(b, buf); return; }
  luaL_addchar(b, '[');
  bool skipped = false;
  for (int64_t i = 0; i < t->shape[d]; i++) {
    if (!shown(t, d, i, summary)) {
      if (skipped) continue;
      skipped = true;                       /* one "..." for the run, aligned like a number or a row */
      if (d == t->ndim - 1) { luaL_addstring(b, "..., "); continue; }
      for (int k = 0; k < indent + d + 1; k++) luaL_addchar(b, ' ');
      luaL_addstring(b, "...,");
      for (int k = d; k < t->ndim - 1; k++) luaL_addchar(b, '\n');
      continue;
    }
    idx[d] = i;
    if (d == t->ndim - 1) {
      char num[64];
      number(num, sizeof num, f, value(t, idx));
      snprintf(buf, sizeof buf, "%*s", f->width, num);
      luaL_addstring(b, buf);
      if (i + 1 < t->shape[d]) luaL_addstring(b, ", ");
    } else {
      if (i > 0) for (int k = 0; k < indent + d + 1; k++) luaL_addchar(b, ' ');
      rows(b, t, d + 1, idx, f, summary, indent);
      if (i + 1 < t->shape[d]) {
        luaL_addchar(b, ',');
        for (int k = d; k < t->ndim - 1; k++) luaL_addchar(b, '\n');
      }
    }
  }
  luaL_addchar(b, ']');
}

int dm_lua_tostring(lua_State *L) {
  dm_tensor **box = luaL_checkudata(L, 1, DM_TENSOR_MT);
  dm_tensor *t = *box;                  /* NULL once dropped */
  if (!t || !t->storage) { lua_pushstring(L, "tensor(freed)"); return 1; }
  DM_ENTER(L);
  char shape[160];
  dm_tensor_shape_str(t, shape, sizeof shape);
  luaL_Buffer b;
  luaL_buffinit(L, &b);
  luaL_addstring(&b, "tensor(");
  if (t->device == DM_META) luaL_addstring(&b, "...");
  else {
    dm_tensor *h = t->device == DM_CPU ? (dm_retain(t), t) : dm_to_device(t, DM_CPU);
    fmt f = {dm_dtype_is_float(h->dtype), false, 0, dm_numel(h)};
    bool summary = f.numel > SUMMARY_AT;
    int64_t idx[DM_MAXDIM] = {0};
    if (f.numel == 0) luaL_addstring(&b, "[]");
    else { measure(h, &f, summary); rows(&b, h, 0, idx, &f, summary, 7); }
    dm_release(h);
  }
  lua_pushfstring(L, ", shape=%s, dtype=%s, device=%s%s)", shape, dm_dtype_name(t->dtype),
                  dm_device_name(t->device), t->requires_grad ? ", requires_grad" : "");
  luaL_addvalue(&b);
  luaL_pushresult(&b);
  return 1;
}
