/*
** cpu/elementwise.c — the unary, binary and where kernels and their backwards.
**
** Every kernel walks its operands with dm_iter and expands the formula
** tables of elementwise.h. f32 and f64 rows run typed loops with the switch
** over kinds outside the loop; bf16 and f16 load into float, compute and
** round on store; integers (binary ops only) compute in double.
**
** The backwards of binary ops and where write two gradients in one pass,
** but dm_iter walks one output: the second gradient has the first's shape
** and strides, so it is reached at the same byte offset from its own base.
*/
#include <tgmath.h>
#include <string.h>
#include "iter.h"
#include "ops/elementwise.h"

/* ---- one element in the compute type T, switch inside: the generic rows ---- */

#define UNARY_F_(ID, nm, f, df, saves, diff) case DM_UNARY_##ID: return f;
#define UNARY_DF_(ID, nm, f, df, saves, diff) case DM_UNARY_##ID: return df;
#define BINARY_F_(ID, nm, f, da, db, cmp) case DM_BINARY_##ID: return f;
#define BINARY_DA_(ID, nm, f, da, db, cmp) case DM_BINARY_##ID: return da;
#define BINARY_DB_(ID, nm, f, da, db, cmp) case DM_BINARY_##ID: return db;

#define SCALAR_FNS(T, sfx)                                                                  \
  static inline T unary_##sfx(int kind, T x, T p, T q) {                                    \
    switch (kind) { DM_UNARY_OPS(UNARY_F_) }                                                \
    return 0;                                                                               \
  }                                                                                         \
  static inline T dunary_##sfx(int kind, T x, T y, T p, T q) {                              \
    switch (kind) { DM_UNARY_OPS(UNARY_DF_) }                                               \
    return 0;                                                                               \
  }                                                                                         \
  static inline T binary_##sfx(int kind, T a, T b, T p) {                                   \
    switch (kind) { DM_BINARY_OPS(BINARY_F_) }                                              \
    return 0;                                                                               \
  }                                                                                         \
  static inline T dbinary_a_##sfx(int kind, T g, T a, T b) {                                \
    switch (kind) { DM_BINARY_OPS(BINARY_DA_) }                                             \
    return 0;                                                                               \
  }                                                                                         \
  static inline T dbinary_b_##sfx(int kind, T g, T a, T b) {                                \
    const T p = 1;                                                                          \
    switch (kind) { DM_BINARY_OPS(BINARY_DB_) }                                             \
    return 0;                                                                               \
  }
SCALAR_FNS(float, f)
SCALAR_FNS(double, d)

static bool computes_in_float(dm_dtype dt) { return dt == DM_F32 || dt == DM_BF16 || dt == DM_F16; }

/* element stride of a byte stride */
#define ES(st, T) ((st) / (int64_t)sizeof(T))

/* ---- unary ----------------------------------------------------------------------- */

typedef struct { int kind; dm_dtype dt; double p, q; } unary_args;

#define UNARY_LOOP_(ID, nm, f, df, saves, diff)                                             \
  case DM_UNARY_##ID:                                                                       \
    for (int64_t i = 0; i < n; i++) { E x = X[i * sx]; O[i * so] = f; }                     \
    break;

#define UNARY_ROW(T, sfx)                                                                   \
  static void unary_row_##sfx(char **ptr, const int64_t *st, int64_t n, void *ud) {         \
    typedef T E;   /* the loops of the tables name the element type E */                    \
    const unary_args *u = ud;                                                               \
    T *O = (T *)ptr[0];                                                                     \
    const T *X = (const T *)ptr[1];                                                         \
    const int64_t so = ES(st[0], T), sx = ES(st[1], T);                                     \
    const T p = (T)u->p, q = (T)u->q;                                                       \
    switch (u->kind) { DM_UNARY_OPS(UNARY_LOOP_) }                                          \
  }
UNARY_ROW(float, f)
UNARY_ROW(double, d)

static void unary_row_any(char **ptr, const int64_t *st, int64_t n, void *ud) {
  const unary_args *u = ud;
  for (int64_t i = 0; i < n; i++) {
    float x = (float)dm_load(u->dt, ptr[1] + i * st[1]);
    dm_store(u->dt, ptr[0] + i * st[0], unary_f(u->kind, x, (float)u->p, (float)u->q));
  }
}

static dm_row_fn pick_row(dm_dtype dt, dm_row_fn f32, dm_row_fn f64, dm_row_fn any) {
  return dt == DM_F32 ? f32 : dt == DM_F64 ? f64 : any;
}

static void cpu_unary(int kind, dm_tensor *out, const dm_tensor *x, const dm_attrs *a) {
  unary_args u = {kind, x->dtype, a->v[0], a->v[1]};
  dm_tensor *in = (dm_tensor *)x;
  dm_iter_walk(out, 1, &in, pick_row(x->dtype, unary_row_f, unary_row_d, unary_row_any), &u);
}

/* gin = gout * f'(x, y); x or y is whichever the kind saved (the other is NULL) */
#define UNARY_BWD_LOOP_(ID, nm, f, df, saves, diff)                                         \
  case DM_UNARY_##ID:                                                                       \
    for (int64_t i = 0; i < n; i++) {                                                       \
      E x = X[i * sx], y = Y[i * sy];                                                       \
      (void)x; (void)y;                                                                     \
      O[i * so] = G[i * sg] * (E)(df);                                                      \
    }                                                                                       \
    break;

#define UNARY_BWD_ROW(T, sfx)                                                               \
  static void unary_bwd_row_##sfx(char **ptr, const int64_t *st, int64_t n, void *ud) {     \
    typedef T E;   /* the loops of the tables name the element type E */                    \
    const unary_args *u = ud;                                                               \
    T *O = (T *)ptr[0];                                                                     \
    const T *G = (const T *)ptr[1], *X = (const T *)ptr[2], *Y = (const T *)ptr[3];         \
    const int64_t so = ES(st[0], T), sg = ES(st[1], T), sx = ES(st[2], T), sy = ES(st[3], T); \
    const T p = (T)u->p, q = (T)u->q;                                                       \
    (void)q;                                                                                \
    switch (u->kind) { DM_UNARY_OPS(UNARY_BWD_LOOP_) }                                      \
  }
UNARY_BWD_ROW(float, f)
UNARY_BWD_ROW(double, d)

static void unary_bwd_row_any(char **ptr, const int64_t *st, int64_t n, void *ud) {
  const unary_args *u = ud;
  dm_dtype dt = u->dt;
  for (int64_t i = 0; i < n; i++) {
    float g = (float)dm_load(dt, ptr[1] + i * st[1]);
    float x = (float)dm_load(dt, ptr[2] + i * st[2]), y = (float)dm_load(dt, ptr[3] + i * st[3]);
    dm_store(dt, ptr[0] + i * st[0], g * dunary_f(u->kind, x, y, (float)u->p, (float)u->q));
  }
}

static void cpu_unary_bwd(int kind, dm_tensor *gin, const dm_tensor *gout, const dm_tensor *x,
                          const dm_tensor *y, const dm_attrs *a) {
  unary_args u = {kind, gin->dtype, a->v[0], a->v[1]};
  /* a missing operand is walked as gout: its values are never used */
  dm_tensor *in[3] = {(dm_tensor *)gout, (dm_tensor *)(x ? x : gout), (dm_tensor *)(y ? y : gout)};
  dm_iter_walk(gin, 3, in, pick_row(gin->dtype, unary_bwd_row_f, unary_bwd_row_d, unary_bwd_row_any), &u);
}

/* ---- binary ----------------------------------------------------------------------- */

typedef struct { int kind; dm_dtype dt, out; double p; } binary_args;

/* comparisons store into the u8 output U, the others into O */
#define BINARY_LOOP_(ID, nm, f, da, db, cmp)                                                \
  case DM_BINARY_##ID:                                                                      \
    for (int64_t i = 0; i < n; i++) {                                                       \
      E a = A[i * sa], b = B[i * sb];                                                       \
      if (cmp) U[i * so] = (uint8_t)(f); else O[i * so] = (E)(f);                           \
    }                                                                                       \
    break;

#define BINARY_ROW(T, sfx)                                                                  \
  static void binary_row_##sfx(char **ptr, const int64_t *st, int64_t n, void *ud) {        \
    typedef T E;   /* the loops of the tables name the element type E */                    \
    const binary_args *u = ud;                                                              \
    T *O = (T *)ptr[0];                                                                     \
    uint8_t *U = (uint8_t *)ptr[0];                                                         \
    const T *A = (const T *)ptr[1], *B = (const T *)ptr[2];                                 \
    const int64_t so = u->out == DM_U8 ? st[0] : ES(st[0], T);                              \
    const int64_t sa = ES(st[1], T), sb = ES(st[2], T);                                     \
    const T p = (T)u->p;                                                                    \
    switch (u->kind) { DM_BINARY_OPS(BINARY_LOOP_) }                                        \
  }
BINARY_ROW(float, f)
BINARY_ROW(double, d)

static void binary_row_any(char **ptr, const int64_t *st, int64_t n, void *ud) {
  const binary_args *u = ud;
  bool fl = computes_in_float(u->dt);
  for (int64_t i = 0; i < n; i++) {
    double a = dm_load(u->dt, ptr[1] + i * st[1]), b = dm_load(u->dt, ptr[2] + i * st[2]);
    double v = fl ? binary_f(u->kind, (float)a, (float)b, (float)u->p) : binary_d(u->kind, a, b, u->p);
    dm_store(u->out, ptr[0] + i * st[0], v);
  }
}

/* out may be a or b itself (the in-place helpers): each element is read before it is written */
static void cpu_binary(int kind, dm_tensor *out, const dm_tensor *a, const dm_tensor *b, double p) {
  binary_args u = {kind, a->dtype, out->dtype, p};
  dm_tensor *in[2] = {(dm_tensor *)a, (dm_tensor *)b};
  dm_iter_walk(out, 2, in, pick_row(a->dtype, binary_row_f, binary_row_d, binary_row_any), &u);
}

typedef struct { int kind; dm_dtype dt; dm_grad2 g2; } bwd2_args;

#define BINARY_BWD_LOOP_(ID, nm, f, da, db, cmp)                                            \
  case DM_BINARY_##ID:                                                                      \
    for (int64_t i = 0; i < n; i++) {                                                       \
      E g = G[i * sg], a = A[i * sa], b = B[i * sb];                                        \
      (void)g; (void)a; (void)b;                                                            \
      if (GA) GA[i * so] = (E)(da);                                                         \
      if (GB) GB[i * so] = (E)(db);                                                         \
    }                                                                                       \
    break;

#define BINARY_BWD_ROW(T, sfx)                                                              \
  static void binary_bwd_row_##sfx(char **ptr, const int64_t *st, int64_t n, void *ud) {    \
    typedef T E;   /* the loops of the tables name the element type E */                    \
    const bwd2_args *u = ud;                                                                \
    char *ga, *gb;                                                                          \
    dm_grad2_at(&u->g2, ptr[0], &ga, &gb);                                                  \
    T *GA = (T *)ga, *GB = (T *)gb;                                                         \
    const T *G = (const T *)ptr[1], *A = (const T *)ptr[2], *B = (const T *)ptr[3];         \
    const int64_t so = ES(st[0], T), sg = ES(st[1], T), sa = ES(st[2], T), sb = ES(st[3], T); \
    const T p = 1;                                                                          \
    (void)p;                                                                                \
    switch (u->kind) { DM_BINARY_OPS(BINARY_BWD_LOOP_) }                                    \
  }
BINARY_BWD_ROW(float, f)
BINARY_BWD_ROW(double, d)

static void binary_bwd_row_any(char **ptr, const int64_t *st, int64_t n, void *ud) {
  const bwd2_args *u = ud;
  dm_dtype dt = u->dt;
  for (int64_t i = 0; i < n; i++) {
    char *ga, *gb;
    dm_grad2_at(&u->g2, ptr[0] + i * st[0], &ga, &gb);
    float g = (float)dm_load(dt, ptr[1] + i * st[1]);
    float a = (float)dm_load(dt, ptr[2] + i * st[2]), b = (float)dm_load(dt, ptr[3] + i * st[3]);
    if (ga) dm_store(dt, ga, dbinary_a_f(u->kind, g, a, b));
    if (gb) dm_store(dt, gb, dbinary_b_f(u->kind, g, a, b));
  }
}

static void cpu_binary_bwd(int kind, dm_tensor *ga, dm_tensor *gb, const dm_tensor *g,
                           const dm_tensor *a, const dm_tensor *b) {
  bwd2_args u = {.kind = kind};
  dm_tensor *lead = dm_grad2_init(&u.g2, ga, gb, "elementwise");
  if (!lead) return;
  u.dt = lead->dtype;
  dm_tensor *in[3] = {(dm_tensor *)g, (dm_tensor *)a, (dm_tensor *)b};
  dm_iter_walk(lead, 3, in, pick_row(u.dt, binary_bwd_row_f, binary_bwd_row_d, binary_bwd_row_any), &u);
}

/* ---- where: values are moved as bytes, so every dtype takes the same path -------- */

static inline bool is_true(dm_dtype dt, const char *p) {
  return dt == DM_U8 ? *p != 0 : dm_load(dt, p) != 0;
}

typedef struct { dm_dtype cond; size_t es; } where_args;

/* one row per element size, so that the copy is a load and a store; the
** choice is a mask rather than a branch (conditions are often random) */
#define WHERE_LOOP(T, TRUE_AT)                                                              \
  for (int64_t i = 0; i < n; i++) {                                                         \
    T m = (T)0 - (T)(TRUE_AT);                                                              \
    T va = *(const T *)(a + i * sa), vb = *(const T *)(b + i * sb);                         \
    *(T *)(o + i * so) = (T)((va & m) | (vb & (T)~m));                                      \
  }
#define WHERE_ROW(T)                                                                        \
  static void where_row_##T(char **ptr, const int64_t *st, int64_t n, void *ud) {           \
    const dm_dtype cdt = ((const where_args *)ud)->cond;                                    \
    char *o = ptr[0];                                                                       \
    const char *c = ptr[1], *a = ptr[2], *b = ptr[3];                                       \
    const int64_t so = st[0], sc = st[1], sa = st[2], sb = st[3];                           \
    if (cdt == DM_U8) WHERE_LOOP(T, c[i * sc] != 0)                                         \
    else WHERE_LOOP(T, is_true(cdt, c + i * sc))                                            \
  }
WHERE_ROW(uint8_t)
WHERE_ROW(uint16_t)
WHERE_ROW(uint32_t)
WHERE_ROW(uint64_t)

static dm_row_fn where_row(size_t es) {
  return es == 1 ? where_row_uint8_t : es == 2 ? where_row_uint16_t : es == 4 ? where_row_uint32_t
                                                                     : where_row_uint64_t;
}

static void cpu_where(dm_tensor *out, const dm_tensor *cond, const dm_tensor *a, const dm_tensor *b) {
  where_args u = {cond->dtype, dm_dtype_size(out->dtype)};
  dm_tensor *in[3] = {(dm_tensor *)cond, (dm_tensor *)a, (dm_tensor *)b};
  dm_iter_walk(out, 3, in, where_row(u.es), &u);
}

typedef struct { dm_grad2 g2; dm_dtype cond; size_t es; } where_bwd_args;

/* ga = cond ? g : 0, gb = cond ? 0 : g (all-zero bytes are 0 in every float type) */
static void where_bwd_row(char **ptr, const int64_t *st, int64_t n, void *ud) {
  const where_bwd_args *u = ud;
  for (int64_t i = 0; i < n; i++) {
    char *g = ptr[2] + i * st[2], *ga, *gb;
    dm_grad2_at(&u->g2, ptr[0] + i * st[0], &ga, &gb);
    bool c = is_true(u->cond, ptr[1] + i * st[1]);
    if (ga) { if (c) memcpy(ga, g, u->es); else memset(ga, 0, u->es); }
    if (gb) { if (c) memset(gb, 0, u->es); else memcpy(gb, g, u->es); }
  }
}

static void cpu_where_bwd(dm_tensor *ga, dm_tensor *gb, const dm_tensor *cond, const dm_tensor *g) {
  where_bwd_args u = {.cond = cond->dtype, .es = dm_dtype_size(g->dtype)};
  dm_tensor *lead = dm_grad2_init(&u.g2, ga, gb, "elementwise");
  if (!lead) return;
  dm_tensor *in[2] = {(dm_tensor *)cond, (dm_tensor *)g};
  dm_iter_walk(lead, 2, in, where_bwd_row, &u);
}

static const dm_kernel_entry kernels[] = {
  DM_KERNEL_ENTRY(unary, cpu_unary),
  DM_KERNEL_ENTRY(unary_bwd, cpu_unary_bwd),
  DM_KERNEL_ENTRY(binary, cpu_binary),
  DM_KERNEL_ENTRY(binary_bwd, cpu_binary_bwd),
  DM_KERNEL_ENTRY(where, cpu_where),
  DM_KERNEL_ENTRY(where_bwd, cpu_where_bwd),
};
DM_REGISTER_KERNELS(DM_CPU, kernels)
