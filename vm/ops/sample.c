/*
** sample.c — dm_sample_bytes (sample.h): its checks; the draw is a kernel
** (vm/cpu/sample.c, kernels/sample.cu).
*/
#include <math.h>
#include "ops/sample.h"
#include "core/core.h"

static void check_rows(const char *what, const dm_tensor *t, int64_t B, const dm_tensor *logits) {
  char s[128];
  dm_check_live(t);
  if (t->ndim != 1 || t->shape[0] != B)
    dm_error("sample_bytes: %s must have shape [%lld] (a row of logits each), got %s", what, (long long)B,
             dm_tensor_shape_str(t, s, sizeof s));
  if (t->device != logits->device)
    dm_error("sample_bytes: %s is on %s but the logits are on %s", what, dm_device_name(t->device),
             dm_device_name(logits->device));
  if (!dm_is_contiguous(t)) dm_error("sample_bytes: %s is not contiguous", what);
}

void dm_sample_bytes(dm_tensor *out, const dm_tensor *logits, const dm_tensor *seeds,
                     const dm_tensor *counts, const dm_sample_hp *hp) {
  char s[128];
  dm_check_live(logits);
  if (logits->ndim != 2 || logits->shape[1] < 1 || logits->shape[1] > DM_SAMPLE_MAXV)
    dm_error("sample_bytes: logits must have shape [B, V] with 1 <= V <= %d, got %s", DM_SAMPLE_MAXV,
             dm_tensor_shape_str(logits, s, sizeof s));
  if (logits->dtype != DM_F32 || !dm_is_contiguous(logits))
    dm_error("sample_bytes: logits must be contiguous f32, got %s%s", dm_dtype_name(logits->dtype),
             dm_is_contiguous(logits) ? "" : " (not contiguous)");
  int64_t B = logits->shape[0];
  check_rows("out", out, B, logits);
  check_rows("seeds", seeds, B, logits);
  check_rows("counts", counts, B, logits);
  if (out->dtype != DM_U8 && out->dtype != DM_I64)
    dm_error("sample_bytes: out must be u8 or i64, got %s", dm_dtype_name(out->dtype));
  if (seeds->dtype != DM_I64 || counts->dtype != DM_I64)
    dm_error("sample_bytes: seeds and counts must be i64, got %s and %s", dm_dtype_name(seeds->dtype),
             dm_dtype_name(counts->dtype));
  if (!(hp->temperature >= 0) || !isfinite(hp->temperature))
    dm_error("sample_bytes: temperature must be a finite number >= 0, got %g", hp->temperature);
  if (!(hp->top_p > 0 && hp->top_p <= 1)) dm_error("sample_bytes: top_p must lie in (0, 1], got %g", hp->top_p);
  if (hp->offset < 0) dm_error("sample_bytes: offset must be >= 0, got %lld", (long long)hp->offset);
  if (B == 0 || logits->device == DM_META) return;
  DM_RUN(sample_bytes, logits->device, out, logits, seeds, counts, hp);
  dm_mark_written(out);
}
