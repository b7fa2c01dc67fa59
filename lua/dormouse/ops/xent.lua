--[[
Cross-entropy, a single fused op with its own backward kernel (vm/ops/xent.h).

  dm.cross_entropy(logits, targets, {ignore_index = n, reduction = "mean"})

cross_entropy: logits [..., V], targets [...] of class ids 0..V-1 (values,
like byte values, not 1-based positions; i64, i32 or u8). It is fused with
its log-softmax and keeps only each row's logsumexp for the backward. Rows
whose target equals ignore_index take no loss and no gradient (default: no
index is ignored; -1 means the same). reduction "mean" (the default)
averages over the kept rows (NaN when every row is ignored), "sum" adds
them, "none" gives one loss per row (0 on ignored rows). The loss is f32
(f64 for f64 logits). A target out of range is an error naming it, its row
and V.

The function is the descriptor's (ops/generated.lua): this file only documents it.
]]
return function() end
