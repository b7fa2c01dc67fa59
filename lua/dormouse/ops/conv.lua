--[[
The causal depthwise convolution with its cache, a single fused op with its own backward kernels
(vm/ops/conv.h).

  dm.causal_conv1d(x, w, {dilation = 1, cache = c, return_cache = true, silu = false})

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

-- the descriptor's default dilation (vm/ops/conv.c)
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
