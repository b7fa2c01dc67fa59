/*
** cpu/matmul.c — batched matrix products through OpenBLAS.
**
** out[..., m, n] = op(a)[..., m, k] @ op(b)[..., k, n], where op transposes
** the last two dims when the flag is set and the batch dims broadcast. The
** forward (vm/ops/matmul.c) has checked the shapes and made `out` contiguous.
**
** A matrix goes to BLAS where it lies when one of its two last dims is
** contiguous: row-major with the row stride as leading dimension, or, when
** the other dim is the contiguous one (a transposed view), as the transpose
** of a row-major matrix with the BLAS transpose flag flipped. Anything else
** is first copied to a contiguous temporary. bf16 and f16 operands are
** widened to f32, multiplied with sgemm (f32 accumulation) and rounded back.
*/
#include <cblas.h>
#include <limits.h>
#include <string.h>
#include "core/core.h"
#include "ops/matmul.h"

/* one operand as BLAS reads it */
typedef struct {
  const char *data;              /* the first matrix's first element */
  int64_t bstride[DM_MAXDIM];    /* bytes per step of each output batch dim; 0 where broadcast */
  bool trans;                    /* BLAS transposes what it reads */
  int64_t ld;                    /* leading dimension, in elements */
} operand;

/* Describe t's matrices ([r, c] in memory, op'd by `tr`) for a product with
** nb output batch dims. Returns t itself or, when its layout does not suit
** BLAS, a contiguous copy; the caller releases it. */
static dm_tensor *describe(dm_tensor *t, bool tr, int nb, operand *o) {
  int nd = t->ndim;
  bool flip = false;
  int64_t ld = 0;
  if (dm_blas_layout_of(t, &flip, &ld))
    dm_retain(t);
  else {
    t = dm_clone(t);
    dm_blas_layout_of(t, &flip, &ld);
  }
  int64_t es = (int64_t)dm_dtype_size(t->dtype);
  int tb = nd - 2;                             /* t's batch dims align with the last of the output's */
  for (int d = 0; d < nb; d++) {
    int td = d - (nb - tb);
    o->bstride[d] = td < 0 || t->shape[td] == 1 ? 0 : t->strides[td] * es;
  }
  o->data = dm_data(t);
  o->trans = tr != flip;
  o->ld = ld;
  return t;
}

static void gemm(dm_dtype dt, const operand *a, const operand *b, int64_t m, int64_t n, int64_t k,
                 const char *pa, const char *pb, char *pc) {
  enum CBLAS_TRANSPOSE ta = a->trans ? CblasTrans : CblasNoTrans, tb = b->trans ? CblasTrans : CblasNoTrans;
  if (dt == DM_F64)
    cblas_dgemm(CblasRowMajor, ta, tb, (int)m, (int)n, (int)k, 1.0, (const double *)pa, (int)a->ld,
                (const double *)pb, (int)b->ld, 0.0, (double *)pc, (int)n);
  else
    cblas_sgemm(CblasRowMajor, ta, tb, (int)m, (int)n, (int)k, 1.0f, (const float *)pa, (int)a->ld,
                (const float *)pb, (int)b->ld, 0.0f, (float *)pc, (int)n);
}

/* When b is the same matrix for every batch and a's rows (of op(a), held
** untransposed) run at one stride through the batch dims, the whole batch
** is one product of a [batch * m, k] matrix: the x @ w^T of a linear layer. */
static bool foldable(const operand *a, const operand *b, int nb, const int64_t *batch, int64_t m,
                     int64_t es, int64_t nbatch) {
  if (a->trans || nbatch * m > INT_MAX) return false;
  int64_t expect = m * a->ld * es;
  for (int d = nb - 1; d >= 0; d--) {
    if (batch[d] == 1) continue;
    if (b->bstride[d] != 0 || a->bstride[d] != expect) return false;
    expect *= batch[d];
  }
  return true;
}

/* f32 and f64: out is contiguous; a and b any strides */
static void matmul_blas(dm_tensor *out, dm_tensor *a, dm_tensor *b, bool ta, bool tb) {
  int nd = out->ndim, nb = nd - 2;
  int64_t m = out->shape[nd - 2], n = out->shape[nd - 1];
  int64_t k = ta ? a->shape[a->ndim - 2] : a->shape[a->ndim - 1];
  int64_t es = (int64_t)dm_dtype_size(out->dtype);
  if (dm_numel(out) == 0) return;
  if (k == 0) { memset(dm_data(out), 0, (size_t)(dm_numel(out) * es)); return; }
  operand oa, ob;
  dm_tensor *ha = describe(a, ta, nb, &oa);
  dm_tensor *hb = describe(b, tb, nb, &ob);
  int64_t nbatch = 1;
  for (int d = 0; d < nb; d++) nbatch *= out->shape[d];
  char *pc = dm_data(out);
  if (nbatch > 1 && foldable(&oa, &ob, nb, out->shape, m, es, nbatch))
    gemm(out->dtype, &oa, &ob, nbatch * m, n, k, oa.data, ob.data, pc);
  else
    for (int64_t p = 0; p < nbatch; p++) {
      int64_t offa = 0, offb = 0, rest = p;
      for (int d = nb - 1; d >= 0; d--) {
        int64_t i = rest % out->shape[d];
        rest /= out->shape[d];
        offa += i * oa.bstride[d];
        offb += i * ob.bstride[d];
      }
      gemm(out->dtype, &oa, &ob, m, n, k, oa.data + offa, ob.data + offb, pc + p * m * n * es);
    }
  dm_release(ha);
  dm_release(hb);
}

static dm_tensor *widened(dm_tensor *t) {
  dm_tensor *w = dm_tensor_like_dtype(t, DM_F32);
  dm_copy_(w, t);
  return w;
}

/* 16-bit inputs are widened to f32 and the product rounded to out's dtype (an f32 out keeps it) */
static void cpu_matmul(dm_tensor *out, dm_tensor *a, dm_tensor *b, bool ta, bool tb) {
  if (a->dtype == DM_F32 || a->dtype == DM_F64) { matmul_blas(out, a, b, ta, tb); return; }
  if (a->dtype != DM_BF16 && a->dtype != DM_F16)
    dm_error("matmul needs a float dtype, got %s", dm_dtype_name(a->dtype));
  dm_tensor *a32 = widened(a), *b32 = widened(b);
  dm_tensor *o32 = out->dtype == DM_F32 ? (dm_retain(out), out) : dm_tensor_like_dtype(out, DM_F32);
  matmul_blas(o32, a32, b32, ta, tb);
  if (o32 != out) dm_copy_(out, o32);
  dm_release(a32);
  dm_release(b32);
  dm_release(o32);
}

static const dm_kernel_entry kernels[] = {
  DM_KERNEL_ENTRY(matmul, cpu_matmul),
};
DM_REGISTER_KERNELS(DM_CPU, kernels)
