--[[
Elementwise ops.

  x + y   x - y   x * y   x / y   -x   x ^ p     a number works on either side
  x:exp() x:log() x:sqrt() x:rsqrt() x:tanh() x:sigmoid() x:silu() x:softplus()
  x:abs() x:relu() x:square() x:sign() x:neg() x:pow(p) x:clamp(lo, hi)
  x:add(y) x:sub(y) x:mul(y) x:div(y) x:maximum(y) x:minimum(y)
  x:eq(y) x:ne(y) x:lt(y) x:le(y) x:gt(y) x:ge(y)     u8 tensors of 0/1
  dm.where(cond, a, b)   dm.maximum(a, b)   dm.minimum(a, b)
  x:add_(y, alpha)   x:mul_(y)            in place, no autograd (optimisers)

Two tensors broadcast as in NumPy ([5, 1, 3] with [7, 3] gives [5, 7, 3])
and must have the same dtype. A number stays a scalar attribute where the
op allows (x * 2, 1 - x, 2 / x on float tensors); elsewhere, and for integer
tensors, it becomes a 0-dim tensor of the other side's dtype and device.
The unary ops take float tensors. x:clamp(nil, hi) leaves the low side open.
Comparisons and sign have no gradient; where has none for its condition.
Lua's ==, < and <= compare tensors as objects: use x:eq(y), x:lt(y), x:le(y).
]]
return function(dm, T, core)

local FLOAT = core.float_dtypes()         -- the floating-point dtypes (vm/core/dtype.c)

local function is_tensor(x) return getmetatable(x) == core.metatable end

local function check_number(v, where, what)
  if type(v) ~= "number" then
    core.error(string.format("%s: %s must be a number, got %s", where, what, type(v)))
  end
end

-- a number as a 0-dim tensor of like's dtype and device
local function scalar_like(v, like)
  return core.full({}, v, like.dtype, like.device)
end

-- x op y for a tensor and a tensor or number, on either side (core.error
-- locates its message at the user's line, however deep the library calls)
local function binary(name, a, b)
  if not is_tensor(a) then
    if type(a) ~= "number" then
      core.error(string.format("%s: expected a tensor or a number, got %s", name, type(a)))
    end
    a = scalar_like(a, b)
  elseif not is_tensor(b) then
    if type(b) ~= "number" then
      core.error(string.format("%s: expected a tensor or a number, got %s", name, type(b)))
    end
    b = scalar_like(b, a)
  end
  return core.call(name, a, b)
end

local function affine(x, scale, shift) return core.call("affine", x, {scale, shift}) end

-- the arithmetic metamethods: a number next to a float tensor is an attribute
local mt = core.metatable

function mt.__add(a, b)
  if type(a) == "number" and FLOAT[b.dtype] then return affine(b, 1, a) end
  if type(b) == "number" and FLOAT[a.dtype] then return affine(a, 1, b) end
  return binary("add", a, b)
end

function mt.__sub(a, b)
  if type(a) == "number" and FLOAT[b.dtype] then return affine(b, -1, a) end
  if type(b) == "number" and FLOAT[a.dtype] then return affine(a, 1, -b) end
  return binary("sub", a, b)
end

function mt.__mul(a, b)
  if type(a) == "number" and FLOAT[b.dtype] then return affine(b, a, 0) end
  if type(b) == "number" and FLOAT[a.dtype] then return affine(a, b, 0) end
  return binary("mul", a, b)
end

function mt.__div(a, b)
  if type(a) == "number" and FLOAT[b.dtype] then return core.call("rdiv", b, {a}) end
  if type(b) == "number" and FLOAT[a.dtype] then return affine(a, 1 / b, 0) end
  return binary("div", a, b)
end

function mt.__unm(a) return core.call("neg", a) end

function mt.__pow(a, b)
  if not is_tensor(a) or type(b) ~= "number" then
    core.error("tensor ^: only tensor ^ number is supported (use x:pow(p))")
  end
  return core.call("pow", a, {b})
end

-- (x:exp(), x:pow(p), x:clamp(lo, hi), dm.add(a, b), x:maximum(y), x:eq(y), dm.where(cond, a, b) and the
-- others come from their descriptors: lua/dormouse/ops/generated.lua)

-- the methods x:add(y) ... x:div(y) are the metamethods: a number beside a float tensor stays an attribute
T.add, T.sub, T.mul, T.div = mt.__add, mt.__sub, mt.__mul, mt.__div

-- in place, no autograd: x += alpha * y (alpha defaults to 1), x *= y
function T.add_(self, y, alpha)
  if alpha ~= nil then check_number(alpha, "add_", "alpha") end
  alpha = alpha or 1
  if type(y) == "number" and FLOAT[self.dtype] then
    core.call("affine_", self, {1, alpha * y})
  else
    if type(y) == "number" then y = scalar_like(y, self) end
    core.call("add_", self, y, {alpha})
  end
  return self
end

function T.mul_(self, y)
  if type(y) == "number" and FLOAT[self.dtype] then
    core.call("affine_", self, {y, 0})
  else
    if type(y) == "number" then y = scalar_like(y, self) end
    core.call("mul_", self, y)
  end
  return self
end

end
