--[[
nn — modules: named parameters, children, train/eval, a printed summary.

  local M = nn.class("Linear")
  function M:init(d_in, d_out) self:param("weight", nn.init.normal({d_out, d_in}, d_in^-0.5)) end
  function M:forward(x) return dm.linear(x, self.weight) end

A module's parameters are float32 masters on its device (module.device); its
compute dtype (module.compute_dtype, "f32" or "bf16") is the dtype its
branches' products run in. Both come from where it is built:

  local model = nn.build({device = "cuda", compute_dtype = "bf16"}, Model, cfg)

Outside nn.build a module is built on the CPU and computes in f32. Nothing
else sets them: nn holds no device or dtype that a forward reads.
]]
local dm = require "dormouse"
local core_metatable = require("dormouse.core").metatable
local human = require("dormouse.human").count      -- parameter counts as 1.23M

local nn = {}

-- where modules are built now: the innermost nn.build's, else the CPU in f32
local building = {device = "cpu", compute_dtype = "f32"}
local COMPUTE_DTYPES = require("dormouse.core").float_dtypes()   -- any floating-point dtype

--[[ nn.build(where, fn, ...) → fn(...)'s results, the modules fn makes built at
`where` = {device = ..., compute_dtype = ...} (a key left out: the enclosing
build's). Builds nest; each is undone as fn returns or raises. ]]
function nn.build(where, fn, ...)
  if type(where) ~= "table" then error("nn.build: where must be a table {device =, compute_dtype =}", 2) end
  for k in pairs(where) do
    if k ~= "device" and k ~= "compute_dtype" then error("nn.build: unknown key '" .. tostring(k) .. "'", 2) end
  end
  local cd = where.compute_dtype
  if cd ~= nil and not COMPUTE_DTYPES[cd] then
    error("nn.build: compute_dtype must be f32, bf16, f16 or f64, got " .. tostring(cd), 2)
  end
  local outer = building
  building = {device = where.device or outer.device, compute_dtype = cd or outer.compute_dtype}
  -- put back as fn returns or raises (a to-be-closed guard: an error keeps its traceback)
  local restore <close> = setmetatable({}, {__close = function() building = outer end})
  return fn(...)
end

-- the device and compute dtype modules are being built at (for an initialiser of a module's own)
function nn.building() return building.device, building.compute_dtype end

-- The module parameters (weak keys): nn.like caches their copies for a pass.
local is_param = setmetatable({}, {__mode = "k"})

local Module = {}
Module.__index = Module
nn.Module = Module

-- A class whose instances are modules: Class(...) calls init(...).
function nn.class(name, parent)
  local cls = setmetatable({}, {__index = parent or Module, __call = function(cls, ...)
    local self = setmetatable({_name = name, _params = {}, _children = {}, training = true,
                               device = building.device, compute_dtype = building.compute_dtype}, cls)
    self:init(...)
    return self
  end})
  cls.__index = cls
  cls.__name = name
  cls.__tostring = function(self) return self:summary() end   -- print(model): the module tree
  return cls
end

function Module:init() end

-- Register a parameter (a float tensor that requires grad) under a name.
function Module:param(name, t)
  assert(dm.is_tensor(t), "param " .. name .. ": a tensor is needed")
  t:requires_grad(true)
  is_param[t] = true
  self._params[#self._params + 1] = name
  self[name] = t
  return t
end

-- Register a buffer: state that is saved with the model but takes no gradient.
function Module:buffer(name, t)
  self._buffers = self._buffers or {}
  self._buffers[#self._buffers + 1] = name
  self[name] = t
  return t
end

function Module:child(name, m)
  self._children[#self._children + 1] = name
  self[name] = m
  return m
end

-- {name = "block.kda.q.weight", tensor = t, module = m}, in registration order.
function Module:named_parameters(prefix, out)
  out = out or {}
  prefix = prefix and prefix .. "." or ""
  for _, name in ipairs(self._params) do
    out[#out + 1] = {name = prefix .. name, tensor = self[name], module = self}
  end
  for _, name in ipairs(self._children) do self[name]:named_parameters(prefix .. name, out) end
  return out
end

function Module:named_buffers(prefix, out)
  out = out or {}
  prefix = prefix and prefix .. "." or ""
  for _, name in ipairs(self._buffers or {}) do out[#out + 1] = {name = prefix .. name, tensor = self[name]} end
  for _, name in ipairs(self._children) do self[name]:named_buffers(prefix .. name, out) end
  return out
end

-- {name = "block.moe", module = m} for this module ("" unless prefix) and every module under it, depth first.
function Module:named_modules(prefix, out)
  out = out or {}
  out[#out + 1] = {name = prefix or "", module = self}
  for _, name in ipairs(self._children) do
    self[name]:named_modules((prefix and prefix ~= "" and prefix .. "." or "") .. name, out)
  end
  return out
end

function Module:parameters()
  local list = {}
  for _, p in ipairs(self:named_parameters()) do list[#list + 1] = p.tensor end
  return list
end

function Module:n_params(filter)
  local n = 0
  for _, p in ipairs(self:named_parameters()) do
    if not filter or filter(p.name, p.tensor) then n = n + p.tensor:numel() end
  end
  return n
end

function Module:train(on)
  if on == nil then on = true end
  self.training = on
  for _, name in ipairs(self._children) do self[name]:train(on) end
  return self
end
function Module:eval() return self:train(false) end

-- The same module with its parameters and buffers in another dtype (a float64
-- twin for oracle tests, say). Float tensors only; integer buffers stay.
function Module:cast(dtype)
  for _, name in ipairs(self._params) do
    self[name] = dm.no_grad(function() return self[name]:to(dtype) end)
    self[name]:requires_grad(true)
    is_param[self[name]] = true
  end
  for _, name in ipairs(self._buffers or {}) do
    local b = self[name]
    if b.dtype == "f32" or b.dtype == "f64" then self[name] = b:to(dtype) end
  end
  for _, name in ipairs(self._children) do self[name]:cast(dtype) end
  return self
end

-- The tree's forward in another compute dtype from now on (f64 standing in for bf16 in tests, say)
function Module:compute_in(dtype)
  if not COMPUTE_DTYPES[dtype] then error("compute_in: f32, bf16, f16 or f64, got " .. tostring(dtype), 2) end
  self.compute_dtype = dtype
  for _, name in ipairs(self._children) do self[name]:compute_in(dtype) end
  return self
end

function Module:zero_grad()
  for _, p in ipairs(self:parameters()) do p.grad = nil end
end

-- One line a module: its name, class, the parameters below it, and its own parameters' shapes.
function Module:summary(name, depth, lines)
  lines = lines or {}
  depth = depth or 0
  local own = {}
  for _, p in ipairs(self._params) do own[#own + 1] = p .. " [" .. table.concat(self[p]:shape(), ", ") .. "]" end
  local indent = string.rep("  ", depth)
  local line = string.format("%-28s %-10s %10s", indent .. (name or self._name), self._name, human(self:n_params()))
  lines[#lines + 1] = #own > 0 and line .. "  " .. table.concat(own, "  ") or line
  for _, c in ipairs(self._children) do self[c]:summary(c, depth + 1, lines) end
  if depth == 0 then return table.concat(lines, "\n") end
end

-- Initialisers: tensors on the building device in float32, drawn from the global generator.
nn.init = {}
function nn.init.normal(shape, std)
  return dm.randn(shape, {device = building.device}):mul_(std)     -- in place: no second copy to collect
end
function nn.init.zeros(shape) return dm.zeros(shape, {device = building.device}) end
function nn.init.ones(shape) return dm.ones(shape, {device = building.device}) end
function nn.init.full(shape, v) return dm.full(shape, v, {device = building.device}) end
function nn.init.uniform(shape, lo, hi)
  local t = dm.rand(shape, {device = building.device})
  t:mul_(hi - lo)
  return t:add_(lo)
end

--[[ Activations between ops. With a compute dtype other than f32 (bf16),
the residual stream stays in f32 and each branch of the block runs in the
compute dtype from its input to its output: m:activation(x) is x in module
m's compute dtype (one cast on the way in), nn.like(p, x) a parameter in x's
dtype (the master itself when they agree; otherwise a cast on the tape, so
that the gradient reaches the f32 master). Tensors of other dtypes (f64
oracles) pass unchanged. ]]
function Module:activation(x)
  local dt = self:activation_dtype(x.dtype)
  return dt == x.dtype and x or x:to(dt)
end

-- the dtype m:activation gives a tensor of dtype dt
function Module:activation_dtype(dt)
  local cd = self.compute_dtype
  if cd ~= "f32" and dt == "f32" then return cd end
  return dt
end

-- the current forward pass (nn.pass): the compute-dtype copies of the parameters it has read
local current_pass = nil

--[[ nn.pass_once(p, tag, make): make(p), a tensor or a list of tensors derived from parameter p,
made once a pass under tag inside nn.pass and shared by the pass's iterations (so that their
gradients meet in it); outside a pass, or in a recomputed call (its copies must be on its own
tape), made afresh each time. ]]
function nn.pass_once(p, tag, make)
  if not (current_pass and is_param[p]) or dm.recomputing() then return make(p) end
  local key = current_pass.copies[tag] or {}
  current_pass.copies[tag] = key
  local made = key[p]
  if not made then
    made = make(p)
    if dm.is_tensor(made) then dm.keep(made)        -- outlives the branch's scope it is made in
    else for _, t in ipairs(made) do dm.keep(t) end end
    key[p] = made
  end
  return made
end

-- Parameters whose copies in bf16 keep their gradient in bf16 (optim.grad_dtype = "compute"): it
-- reaches the master with no widening pass, and the optimisers read it as it comes (they take f32 and
-- bf16 gradients). A parameter reached by two copies in a step has its gradients summed in f32 (the
-- autograd widens them).
local compute_grads = setmetatable({}, {__mode = "k"})
function nn.compute_grads(params, on)
  for _, p in ipairs(params) do compute_grads[p] = on or nil end
end

-- the dtype a copy of p in dt gives p's gradient in: dt where p keeps it (above), else nil (p's own)
function nn.copy_grad_dtype(p, dt)
  if compute_grads[p] and dt == "bf16" then return dt end
end

-- t in dtype dt: itself when it is one, else a cast (once a pass for a parameter inside nn.pass)
local function as_dtype(t, dt)
  if t.dtype == dt then return t end
  return nn.pass_once(t, dt, function(p) return dm.cast(p, dt, nn.copy_grad_dtype(p, dt)) end)
end

function nn.like(t, x) return as_dtype(t, x.dtype) end

-- Let a kept tensor go now (its memory back at once, not at the next collection)
function nn.release(t) core_metatable.__close(t) end

-- a parameter in the module's compute dtype (the expert banks' copies for the kernels)
function Module:compute(p) return as_dtype(p, self.compute_dtype) end

--[[ nn.pass(fn, ...): fn(...) as one forward pass of a model whose blocks read
the same parameters several times (the weight-shared block's iterations):
each parameter is cast to the compute dtype once for the pass, and its
iterations' gradients meet in that copy before they reach the f32 master (as
under autocast's cast cache). A recomputed call run again in the backward
casts afresh (its copies must be on its own tape). The pass's copies are let
go when fn returns; the tape holds what the backward needs. ]]
function nn.pass(fn, ...)
  if current_pass or dm.recomputing() then return fn(...) end
  local copies = {}
  local res = table.pack(pcall(nn.holding, copies, fn, ...))
  nn.release_copies(copies)
  if not res[1] then error(res[2], 0) end
  return table.unpack(res, 2, res.n)
end

--[[ nn.holding(copies, fn, ...): fn(...) as one pass whose parameters' copies (their casts to the
compute dtype, nn.pass_once's) go into `copies`, a table the caller keeps: passes run under the same
table share them, so generation, whose weights do not change from byte to byte, casts each parameter
once and not once a byte. nn.release_copies(copies) lets them go; a weight changed in between is not
seen by the copies (the caller's to know). ]]
function nn.holding(copies, fn, ...)
  if current_pass then return fn(...) end
  current_pass = {copies = copies}
  local res = table.pack(pcall(fn, ...))
  current_pass = nil
  if not res[1] then error(res[2], 0) end
  return table.unpack(res, 2, res.n)
end

function nn.release_copies(copies)
  local release = core_metatable.__close
  for tag, key in pairs(copies) do
    for _, made in pairs(key) do
      if dm.is_tensor(made) then release(made) else for _, t in ipairs(made) do release(t) end end
    end
    copies[tag] = nil
  end
end

--[[ nn.residual(h, norm, fn[, opts]): h + fn(norm(h)), a pre-norm residual
branch. The branch runs in the compute dtype from its norm's input
(norm:activation) to its output, which is added back in h's dtype; its
intermediates are dropped as it returns. More results of fn (a branch's
carried state, and the state at a position inside the pass: tables of
tensors) are returned as well, kept past the branch's scope.
opts.u: norm(h), made already (by the branch before, below). opts.next: the
norm of the branch after this one, whose input the sum is: the call returns
the sum, the next norm's output (that branch's opts.u), then fn's other
results. Where the branch's output is in the norm's dtype the sum and the norm
come from one op (dm.add_rmsnorm: the bits of the add, the casts and the norm
in one pass, forward and backward); else from those ops. ]]
function nn.residual(h, norm, fn, opts)
  local after = opts and opts.next
  local y, carried, carried_at = dm.scope(function()
    local out, state, state_at = fn(opts and opts.u or norm:forward(norm:activation(h)))
    return after and out or out:to(h.dtype), state, state_at
  end)
  if not after then return h + y, carried, carried_at end
  local s, u
  if y.dtype == after:activation_dtype(h.dtype) then
    s, u = after:add_forward(h, y)
  else          -- a branch whose output is not in the norm's dtype: the ops apart
    s = h + y:to(h.dtype)
    u = after:forward(after:activation(s))
  end
  return s, u, carried, carried_at
end

--[[ The cache a causal convolution would have returned after the first `at` positions of x
[B, T, C]: the last `len` inputs of `cache` (the `len` inputs before x; nil: zeros) then x's first
`at`. (A pass's state at a position inside it: dormouse.decode's verify passes.) ]]
function nn.conv_cache_at(cache, x, at, len)
  cache = cache or dm.zeros({x:size(1), len, x:size(3)}, {dtype = x.dtype, device = x.device})
  return dm.cat({cache, x}, 2):narrow(2, at + 1, len):contiguous()
end

--[[ A matrix product x [..., d_in] @ w^T, w [d_out, d_in], in the module's
compute dtype: an input already in it gives an output in it (bf16 between
ops); an f32 input under a bf16 compute dtype is cast in and its output cast
back. ]]
function Module:project(x, w)
  local cd = self.compute_dtype
  if cd ~= "f32" and x.dtype == "f32" then
    return dm.linear(x:to(cd), as_dtype(w, cd)):to("f32")
  end
  return dm.linear(x, nn.like(w, x))
end

-- a number for each table it is shown (weak keys): a stack's tag names its layers by these
local numbered = setmetatable({}, {__mode = "k"})
local last_number = 0
local function number_of(t)
  if not numbered[t] then last_number = last_number + 1; numbered[t] = last_number end
  return numbered[t]
end

--[[ nn.products(x, parts): the products of x [..., d_in] with several Linear layers that read it,
a list in the parts' order. A part is a layer, or {layer, scale = s}: the product's columns times
s [d_out] (a parameter). Each result is what layer:forward(x) gives (times s).
A pass without grad over one row (generation's one-byte step, where a product costs a launch more
than its work) makes them one product with the weights stacked, scales folded into their rows
before the cast to the compute dtype (in f32, or f64): the stack is made once a pass (nn.pass_once: a decoder's bytes share it)
and each result is a view of its columns (contiguous, at one row). Elsewhere, and for layers with a
bias, one product a layer. ]]
function nn.products(x, parts)
  local layers, scales, stackable = {}, {}, not dm.grad_enabled() and x:numel() == x:size(x:dim()) and #parts > 1
  for i, part in ipairs(parts) do
    layers[i] = part[1] or part
    scales[i] = part[1] and part.scale or nil
    if layers[i].bias then stackable = false end
  end
  local out = {}
  if not stackable then
    for i, layer in ipairs(layers) do
      local y = layer:forward(x)
      out[i] = scales[i] and y * nn.like(scales[i], y) or y
    end
    return out
  end
  local cd = layers[1].compute_dtype
  local dt = cd ~= "f32" and x.dtype == "f32" and cd or x.dtype
  local tag = {"stack", dt}
  for i, layer in ipairs(layers) do tag[#tag + 1] = number_of(layer) .. (scales[i] and "s" or "") end
  local stack = nn.pass_once(layers[1].weight, table.concat(tag, " "), function()
    local rows = {}
    for i, layer in ipairs(layers) do
      local w, scale = layer.weight, scales[i]
      if scale then                                   -- folded in f32, or f64 where either is
        local wide = (w.dtype == "f64" or scale.dtype == "f64") and "f64" or "f32"
        w = w:to(wide) * scale:to(wide):unsqueeze(2)
      end
      rows[i] = w:to(dt)
    end
    return dm.cat(rows, 1)
  end)
  local y = dm.linear(x:to(dt), stack):to(x.dtype)
  local at, last = 0, y:dim()
  for i, layer in ipairs(layers) do
    local n = layer.weight:size(1)
    out[i] = y:narrow(last, at + 1, n)
    at = at + n
  end
  return out
end

for _, layer in ipairs {"layers", "kda", "engram", "moe", "msa", "block"} do require("dormouse.nn." .. layer)(nn, dm) end

--[[ The targets of a pass over x [B, T+1]: the bytes x[:, 2..T+1] as i64 [B, T]. With a mask
[B, T] (1: the target is scored, 0: it is not: a record's prompt, data.records), the targets it
leaves out are nn.IGNORE, and `kept`, the number it keeps (an f32 scalar on x's device, at least 1),
is returned too. nn.cross_entropy(logits, targets, kept) is then the mean over the kept targets (0
where none is), else over all: every model's loss and its masked form are one function. ]]
nn.IGNORE = 256                              -- not a byte: cross_entropy's ignore_index
function nn.targets(x, mask)
  local T = x:size(2) - 1
  local targets = x:narrow(2, 2, T):to("i64")
  if mask == nil then return targets end
  if mask:size(1) ~= x:size(1) or mask:size(2) ~= T then
    error(string.format("forward: opts.mask must be [B, T] = [%d, %d] (one entry a target), got [%s]",
                        x:size(1), T, table.concat(mask:shape(), ", ")), 0)
  end
  local keep = mask:to("i64")
  local kept = mask:to("f32"):sum():clamp(1, math.huge)
  return targets * keep + (1 - keep) * nn.IGNORE, kept
end

--- nn.cross_entropy(logits [..., V], targets [...], kept): the mean cross-entropy (nn.targets)
function nn.cross_entropy(logits, targets, kept)
  local V = logits:size(-1)
  if kept == nil then return dm.cross_entropy(logits:reshape({-1, V}), targets:reshape({-1})) end
  local sum = dm.cross_entropy(logits:reshape({-1, V}), targets:reshape({-1}),
                               {ignore_index = nn.IGNORE, reduction = "sum"})
  return sum / kept:to(sum.dtype)
end

return nn
