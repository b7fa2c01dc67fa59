--[[
Shapes, views and dtype conversion.

  x:reshape{4, -1}      x:view{4, -1}      the same elements in a new shape (-1: inferred)
  x:permute{2, 1, 3}    x:transpose(1, 2)  x:t()         reorder dims (t: a 2-D tensor)
  x:narrow(dim, start, len)               len positions from start (1-based) along dim
  x:expand{3, -1, 4}                      size-1 dims repeated without copying (-1 keeps a dim)
  x:squeeze()  x:squeeze(dim)  x:unsqueeze(dim)
  x:contiguous()  x:clone()
  x:to("bf16")  x:float()  x:double()  x:bf16()  x:half()  x:long()  x:int()
  dm.cat({a, b, c}, dim)  dm.stack({a, b}, dim)   (dim defaults to 1)

Views (reshape where the layout allows, permute, transpose, narrow, expand,
squeeze, unsqueeze, and contiguous of a contiguous tensor) share memory
with x: an in-place write to one shows in the other. Dims are 1-based and
negative dims count from the end; for unsqueeze and stack, which make a new
dim, -1 puts it last.
]]
return function(dm, T, core)

-- dm_dtype's names, in its order (vm/core/dtype.c), for the messages
local DTYPE_NAMES = table.concat(core.dtype_names(), " ")

-- (reshape, permute, transpose, narrow, expand, squeeze, unsqueeze, contiguous, clone, dm.cast and
-- dm.stand_in come from their descriptors: lua/dormouse/ops/generated.lua)

function T.view(self, ...) return self:reshape(...) end

function T.t(self)
  if self:dim() ~= 2 then
    core.error(string.format("t: takes a 2-D tensor, got %d dims (use transpose or permute)", self:dim()))
  end
  return core.call("transpose", self, {0, 1})
end

-- a 0-based position for a new dim among n: 1..n+1, or -1..-(n+1) from the end
local function new_dim0(n, d, where)
  if math.type(d) ~= "integer" then
    core.error(string.format("%s: dim must be an integer, got %s", where, tostring(d)))
  end
  local pos = d < 0 and n + 2 + d or d
  if pos < 1 or pos > n + 1 then
    core.error(string.format("%s: dim %d is out of range for a new dim among %d (1..%d, or negative)",
                        where, d, n, n + 1))
  end
  return pos - 1
end

-- dtype's code, or an error of `what` naming the choices (and `more` of them)
local function dtype_code(dtype, what, more)
  local id = core.dtype_code(dtype)
  if id == nil then
    core.error(string.format("%s '%s' (%s%s)", what, tostring(dtype), DTYPE_NAMES, more or ""))
  end
  return id
end

-- x:to(dtype) of the base layer lands here. Casting to an integer dtype ends the graph.
function T._cast(self, dtype)
  return core.call("cast", self, {dtype_code(dtype, "to: unknown dtype or device", ", cpu cuda meta")})
end

for name, dtype in pairs {float = "f32", double = "f64", bf16 = "bf16", half = "f16", long = "i64", int = "i32"} do
  local id = core.dtype_code(dtype)
  T[name] = function(self) return core.call("cast", self, {id}) end
end

local function tensor_list(list, where)
  if type(list) ~= "table" or not dm.is_tensor(list[1]) then
    local got = type(list) ~= "table" and type(list)
                or list[1] == nil and "an empty list" or "a list starting with a " .. type(list[1])
    core.error(string.format("%s: takes a list of tensors such as {a, b}, got %s", where, got))
  end
  return list
end

function dm.cat(list, dim)
  tensor_list(list, "cat")
  return core.call("cat", list, {list[1]:_dim0(dim or 1, "cat")})
end

function dm.stack(list, dim)
  tensor_list(list, "stack")
  return core.call("stack", list, {new_dim0(list[1]:dim(), dim or 1, "stack")})
end

end
