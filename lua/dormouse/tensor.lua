--[[
The base of the tensor surface: creation, devices and dtypes, grad mode,
the generator, memory, comparison. The op families (dormouse/ops/*.lua)
add the arithmetic, reductions, shapes, indexing and products.
]]
return function(dm, T, core)

-- The options each kind of function takes; a key outside them (a typo such
-- as dtyp) is an error rather than a silent default.
local CREATE = {"dtype", "device", "requires_grad"}
local DRAW = {"dtype", "device", "requires_grad", "seed", "offset"}

local function opts_of(opts, where, known)
  if opts == nil then return {} end
  local takes = table.concat(known, ", ")
  if type(opts) ~= "table" then
    core.error(string.format("%s: options must be a table (of %s), got a %s", where, takes, type(opts)))
  end
  for key in pairs(opts) do
    local ok = false
    for _, k in ipairs(known) do ok = ok or k == key end
    if not ok then core.error(string.format("%s: unknown option '%s' (it takes %s)", where, tostring(key), takes)) end
  end
  return opts
end

local function finish(t, o)
  if o.requires_grad then t:requires_grad(true) end
  return t
end

function dm.is_tensor(x)
  return getmetatable(x) == core.metatable
end

-- Creation. Every function takes an options table: dtype (default "f32"),
-- device (default "cpu"), requires_grad.
function dm.empty(shape, opts)
  local o = opts_of(opts, "empty", CREATE)
  return finish(core.empty(shape, o.dtype, o.device), o)
end

local function full(where, shape, value, opts)
  local o = opts_of(opts, where, CREATE)
  return finish(core.full(shape, value, o.dtype, o.device), o)
end
function dm.full(shape, value, opts) return full("full", shape, value, opts) end
function dm.zeros(shape, opts) return full("zeros", shape, 0, opts) end
function dm.ones(shape, opts) return full("ones", shape, 1, opts) end

function dm.arange(start, stop, step, opts)
  -- the options may follow any of the numbers: arange(n, opts), arange(a, b, opts)
  if type(stop) == "table" then stop, step, opts = nil, nil, stop
  elseif type(step) == "table" then step, opts = nil, step end
  if stop == nil then start, stop = 0, start end
  local o = opts_of(opts, "arange", CREATE)
  return finish(core.arange(start, stop, step or 1, o.dtype, o.device), o)
end

-- Random draws come from Philox-4x32-10 addressed by (seed, offset): with
-- {seed = s} the draw is reproducible by itself (offset defaults to 0);
-- without, the global generator (dm.manual_seed) is used and advanced.
local function draw(shape, opts, normal, where)
  local o = opts_of(opts, where, DRAW)
  return finish(core.rand(shape, o.dtype, o.device, normal, o.seed, o.offset), o)
end
function dm.rand(shape, opts) return draw(shape, opts, false, "rand") end
function dm.randn(shape, opts) return draw(shape, opts, true, "randn") end

function dm.tensor(data, opts)
  local o = opts_of(opts, "tensor", CREATE)
  return finish(core.tensor(data, o.dtype, o.device), o)
end

local function like(name, fill, known)
  dm[name .. "_like"] = function(x, opts)
    local o = opts_of(opts, name .. "_like", known)
    if not dm.is_tensor(x) then core.error(name .. "_like: takes a tensor, got " .. type(x)) end
    return fill(x:shape(), {dtype = o.dtype or x.dtype, device = o.device or x.device,
                            requires_grad = o.requires_grad, seed = o.seed, offset = o.offset})
  end
end
like("zeros", dm.zeros, CREATE); like("ones", dm.ones, CREATE); like("empty", dm.empty, CREATE)
like("rand", dm.rand, DRAW); like("randn", dm.randn, DRAW)

function dm.manual_seed(n) core.manual_seed(n) end
function dm.rng_state() return core.rng_state() end
function dm.set_rng_state(seed, offset) core.rng_state(seed, offset) end

-- Dims: 1-based, negative from the end. Returns the 0-based dim for the core.
local function dim0(self, d, where)
  local n = self:dim()
  if math.type(d) ~= "integer" then
    core.error(string.format("%s: dim must be an integer, got %s", where or "dim", tostring(d)))
  end
  local pos = d < 0 and n + d + 1 or d
  if pos < 1 or pos > math.max(n, 1) then
    core.error(string.format("%s: dim %d is out of range for a tensor of %d dims", where or "dim", d, n))
  end
  return pos - 1
end
T._dim0 = dim0

-- Devices and dtypes: x:to("cuda"), x:to("bf16"), x:to{device = "cuda", dtype = "bf16"}.
local devices = {cpu = true, cuda = true, meta = true}
function T.to(self, target)
  if type(target) == "table" then
    local t = self
    if target.device then t = t:to(target.device) end
    if target.dtype then t = t:to(target.dtype) end
    return t
  end
  if devices[target] then return self:_to_device(target) end
  return self:_cast(target)
end
function T.cuda(self) return self:_to_device("cuda") end
function T.cpu(self) return self:_to_device("cpu") end

-- Grad mode.
local function with_grad_mode(on, fn, ...)
  local before = core.grad_enabled()
  core.set_grad_enabled(on)
  local res = table.pack(pcall(fn, ...))
  core.set_grad_enabled(before)
  if not res[1] then error(res[2], 0) end
  return table.unpack(res, 2, res.n)
end
function dm.no_grad(fn, ...) return with_grad_mode(false, fn, ...) end
function dm.enable_grad(fn, ...) return with_grad_mode(true, fn, ...) end
function dm.grad_enabled() return core.grad_enabled() end

-- The tape: backward() frees it; a step that ends without one calls clear().
dm.autograd = {
  clear = core.tape_clear,
  size = core.tape_size,
}

-- Steps: dm.scope(fn, ...) runs fn and then drops every tensor handed to Lua
-- inside it, except those it returns (also inside a returned table) and those
-- passed to dm.keep. Dropping releases the reference at once: memory that
-- nothing else holds comes back without the garbage collector. When the
-- outermost scope ends and nothing it returns still has a graph, the tape is
-- cleared too, so a step without a backward leaves nothing behind.
local function holds_graph(v)
  return dm.is_tensor(v) and not v:is_freed() and v:requires_grad() and not v.is_leaf
end

function dm.scope(fn, ...)
  local depth = core.scope_begin()
  local res = table.pack(pcall(fn, ...))
  core.scope_end(depth, table.unpack(res, 2, res.n))
  if not res[1] then error(res[2], 0) end
  if depth == 1 then
    local graph = false
    for i = 2, res.n do graph = graph or holds_graph(res[i]) end
    if not graph then core.tape_clear() end
  end
  return table.unpack(res, 2, res.n)
end

-- Keep a tensor made inside a scope (optimiser state, a cache) past its end.
function dm.keep(t) return core.keep(t) end

-- Memory: dm.memory() for the host, dm.memory("cuda") for a device. Fields:
-- current (= allocated), peak, count (live blocks), reserved, device_allocs.
function dm.memory(device) return core.memory(device) end
function dm.reset_peak(device) core.reset_peak(device) end

-- |a - b| <= atol + rtol * |b| everywhere (NaN never passes). Shapes must match.
function dm.allclose(a, b, opts)
  if not (dm.is_tensor(a) and dm.is_tensor(b)) then
    core.error(string.format("allclose: takes two tensors, got %s and %s", type(a), type(b)))
  end
  local o = opts_of(opts, "allclose", {"rtol", "atol"})
  local rtol, atol = o.rtol or 1e-5, o.atol or 1e-8
  if type(rtol) ~= "number" or type(atol) ~= "number" then
    core.error(string.format("allclose: rtol and atol must be numbers, got %s and %s", type(rtol), type(atol)))
  end
  local sa, sb = a:shape(), b:shape()
  if #sa ~= #sb then return false end
  for i = 1, #sa do if sa[i] ~= sb[i] then return false end end
  if a:numel() == 0 then return true end
  return dm.no_grad(function()
    local a64, b64 = a:to("f64"), b:to("f64")
    local ok = (a64 - b64):abs():le(b64:abs() * rtol + atol)
    return ok:to("f64"):min():item() == 1
  end)
end

-- The registered ops: name, doc, n_in, n_out, attrs, differentiable.
function dm.ops() return core.ops() end

end
