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

local known = {transpose_a = true, transpose_b = true}

local function flags(opts, where)
  if opts == nil then return {false, false} end
  if type(opts) ~= "table" then
    core.error(string.format("%s: options must be a table such as {transpose_b = true}, got a %s",
                        where, type(opts)))
  end
  for key, v in pairs(opts) do
    if not known[key] then
      core.error(string.format("%s: unknown option '%s' (it takes transpose_a and transpose_b)",
                          where, tostring(key)))
    end
    if type(v) ~= "boolean" then
      core.error(string.format("%s: %s must be true or false, got %s", where, key, tostring(v)))
    end
  end
  return {opts.transpose_a == true, opts.transpose_b == true}
end

function T.matmul(self, other, opts)
  return core.call("matmul", self, other, flags(opts, "matmul"))
end

function dm.matmul(a, b, opts)
  return core.call("matmul", a, b, flags(opts, "matmul"))
end

-- The layer convention: w holds one row per output feature, so the product
-- reads w transposed in place; b (shape [out]) broadcasts over the rows.
function dm.linear(x, w, b)
  local y = core.call("matmul", x, w, {false, true})
  if b ~= nil then y = core.call("add", y, b) end
  return y
end

end
