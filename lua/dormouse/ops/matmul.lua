--[[
Matrix products.

  x:matmul(y)                                    [..., m, k] @ [..., k, n] -> [..., m, n]
  dm.matmul(a, b, {transpose_a = true})          a is [..., k, m]
  dm.linear(x, w, b)                             x @ w^T + b, w is [out, in], b optional

Batch dims broadcast. Both sides need at least 2 dims: reshape a vector to
{1, k} (a row) or {k, 1} (a column). A transpose flag reads that input
transposed without copying it.
]]
return function(dm, T, core)

-- (x:matmul(y) and dm.matmul(a, b, opts) come from the descriptor: lua/dormouse/ops/generated.lua)

-- The layer convention: w holds one row per output feature, so the product
-- reads w transposed in place; b (shape [out]) broadcasts over the rows.
function dm.linear(x, w, b)
  local y = core.call("matmul", x, w, {false, true})
  if b ~= nil then y = core.call("add", y, b) end
  return y
end

end
