--[[
Reductions and softmax.

  x:sum()  x:sum(dim)  x:sum(dim, true)     over every dim, or over one (true keeps it, size 1)
  x:mean(dim, keepdim)  x:logsumexp(dim, keepdim)
  x:max()  x:min()                          the largest / smallest value, a 0-dim tensor
  x:max(dim, keepdim)  x:min(dim, keepdim)  values, indices (1-based positions along dim, i64)
  x:argmax(dim, keepdim)  x:argmin(...)     indices only; with no dim, the 1-based position
                                            in the flattened tensor (row-major)
  x:norm(p, dim, keepdim)                   (sum |x|^p)^(1/p), p > 0, default 2
  x:softmax(dim)  x:log_softmax(dim)        dim defaults to -1 (the last)
  dm.softmax(x, dim)  dm.log_softmax(x, dim)  dm.sum(x, dim, keepdim) ...
  x:sum_to(shape)                           sum a broadcast result down to shape

Dims are 1-based; negative dims count from the end. logsumexp, softmax and
log_softmax shift by the max, so large inputs do not overflow. Ties in max,
min, argmax and argmin go to the first position; a NaN wins over numbers.
Integer tensors: sum gives an exact i64 sum; max, min, argmax and argmin take
them too; mean, logsumexp, norm and the softmaxes need floats. Gradients flow
through sum, mean, max and min values (to the chosen position), logsumexp,
norm (0 where x is 0), softmax, log_softmax and sum_to.
]]
return function(dm, T, core)

-- (sum, mean, logsumexp, argmax, argmin, norm, softmax, log_softmax and sum_to come from their
-- descriptors: lua/dormouse/ops/generated.lua)

-- keepdim as the generated reductions take it: true, false or nil
local function flag(v, name)
  if v ~= nil and type(v) ~= "boolean" then
    core.error(string.format("%s: keepdim must be true or false, got %s", name, tostring(v)))
  end
  return v == true
end

-- max and min give values and indices for a dim, the value alone for all dims
local function extreme(name)
  return function(self, dim, keepdim)
    if dim == nil then return (core.call(name, self, {-1, flag(keepdim, name), 1})) end
    return core.call(name, self, {self:_dim0(dim, name), flag(keepdim, name), 1})
  end
end
T.max = extreme("max")
T.min = extreme("min")

end
