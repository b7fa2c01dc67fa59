--[[
The model's building blocks: single fused ops with their own backward kernels.

  x:rmsnorm(gain, eps)                   x / sqrt(mean(x^2) + eps) * gain over the last dim
  dm.rmsnorm(x, gain, {eps = 1e-6})      gain is [D] or nil (no gain); eps defaults to 1e-6
  x:l2norm(eps)   dm.l2norm(x, eps)      x / sqrt(sum(x^2) + eps) over the last dim (eps inside
                                         the square root, default 1e-6)
  dm.cross_entropy(logits, targets, {ignore_index = n, reduction = "mean"})
  dm.causal_conv1d(x, w, {dilation = 1, cache = c, return_cache = true, silu = false})
  dm.silu_mul(a, b), a:silu_mul(b)       silu(a) * b in one pass (a and b of one shape; the
                                         functions are the descriptor's, ops/generated.lua)

cross_entropy: logits [..., V], targets [...] of class ids 0..V-1 (values,
like byte values, not 1-based positions; i64, i32 or u8). It is fused with
its log-softmax and keeps only each row's logsumexp for the backward. Rows
whose target equals ignore_index take no loss and no gradient (default: no
index is ignored; -1 means the same). reduction "mean" (the default)
averages over the kept rows (NaN when every row is ignored), "sum" adds
them, "none" gives one loss per row (0 on ignored rows). The loss is f32
(f64 for f64 logits). A target out of range is an error naming it, its row
and V.

causal_conv1d: depthwise and causal, no bias. x [B, T, C], w [C, K]:
  y[b, t, c] = sum_k w[c, k] * x[b, t - (K-k) * dilation, c]      (k, t 1-based)
The positions before the first come from cache [B, (K-1) * dilation, C]
when given (the inputs that preceded x), else they are zeros. With
return_cache = true the call returns y and the new cache: the last
(K-1) * dilation inputs, the cache of the next segment. Gradients flow to
x, w and the cache. silu = true gives silu(y) in one op that keeps only x for
its backward (the convolution is run again there): the memory of one
[B, T, C] tensor less than :silu() after it, for one more convolution.
]]
return function(dm, T, core)

local function is_tensor(x) return getmetatable(x) == core.metatable end

-- an options table with only the known keys
local function options(opts, where, known)
  if opts == nil then return {} end
  local names = {}
  for k in pairs(known) do names[#names + 1] = k end
  table.sort(names)
  if type(opts) ~= "table" then
    core.error(string.format("%s: options must be a table (of %s), got a %s", where,
                             table.concat(names, ", "), type(opts)))
  end
  for key in pairs(opts) do
    if not known[key] then
      core.error(string.format("%s: unknown option '%s' (it takes %s)", where, tostring(key),
                               table.concat(names, ", ")))
    end
  end
  return opts
end

local function number_or(v, default, where, what)
  if v == nil then return default end
  if type(v) ~= "number" then
    core.error(string.format("%s: %s must be a number, got %s", where, what, type(v)))
  end
  return v
end

local function optional_tensor(v, where, what)
  if v ~= nil and not is_tensor(v) then
    core.error(string.format("%s: %s must be a tensor or nil, got %s", where, what, type(v)))
  end
  return v
end

-- (dm.cross_entropy comes from its descriptor: lua/dormouse/ops/generated.lua)

-- the descriptor's default dilation (vm/ops/blocks.c)
local DILATION = require("dormouse.ops.generated").default(core, "causal_conv1d", "dilation")

function dm.causal_conv1d(x, w, opts)
  local o = options(opts, "causal_conv1d", {dilation = true, cache = true, return_cache = true, silu = true})
  local cache = optional_tensor(o.cache, "causal_conv1d", "cache")
  if o.silu ~= nil and type(o.silu) ~= "boolean" then
    core.error(string.format("causal_conv1d: silu must be true or false, got %s", type(o.silu)))
  end
  local y, new_cache = core.call("causal_conv1d", x, w, cache,
                                 {number_or(o.dilation, DILATION, "causal_conv1d", "dilation"), o.silu and 1 or 0})
  if o.return_cache then return y, new_cache end
  return y
end

end
