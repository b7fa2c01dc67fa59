--[[
optim — the optimisers of docs/model.md: Muon for the hidden matrices and
expert banks, AdamW for embeddings, head, gains, biases, router, scales and
gates, Adam for the Engram tables; global-norm clipping, whose finiteness
check is the NaN firewall's; and the learning-rate schedule.

  local optim = require "dormouse.optim"
  local opt = optim.new(model, cfg.optim, cfg.schedule, cfg.steps)
  for step = 1, cfg.steps do
    ... loss:backward()
    local r = opt:step(step)        -- {grad_norm, lr, lr_mult, skipped}
    opt:zero_grad()
  end
  opt:state()       -- {name = tensor} for optim.safetensors
  opt:load_state(t) -- and back

opt:step is the one update read back at once. The training step
(dormouse.step, eager or captured as one CUDA graph) takes it without
reading anything: opt:prepare(step) writes the step's learning rates into
device scalars (before a replay, never captured), opt:step_async(loss)
clips, decides the firewall and updates there (capturable), and opt:sync()
reads back the count of applied updates and the last norm (at log time).

A step: the schedule's multiplier for `step`; the global gradient norm (and
clipping to cfg.clip); when the norm (or the step's loss, given) is not
finite nothing is updated and the step is reported skipped; else every
group updates at its lr times the multiplier. Parameters are f32 masters;
their state lives on their device.
]]
local dm = require "dormouse"
local core = require "dormouse.core"
local groups = require "dormouse.optim.groups"
local nn = require "dormouse.nn"
local profile = require "dormouse.profile"
local schedule = require "dormouse.optim.schedule"
local AdamW = require "dormouse.optim.adamw"
local Muon = require "dormouse.optim.muon"
local SparseAdam = require "dormouse.optim.sparse"

local optim = {groups = groups, schedule = schedule, AdamW = AdamW, Muon = Muon}

local function fail(fmt, ...) core.error(string.format(fmt, ...)) end

--[[ cfg.optim's keys, their defaults and their types: the schema's (lua/dormouse/schema.lua,
the config section optim), read, not copied. ns_dtype's default (nil there: by device) is false
here, so that the settings table holds every key. ]]
local schema = require "dormouse.schema"
local LEAVES = {}
optim.defaults = {}
for _, leaf in ipairs(schema.nodes.optim.order) do
  LEAVES[leaf.name] = leaf
  local v = leaf.default
  if type(v) == "table" then v = {table.unpack(v)} end
  if v == nil then v = false end
  optim.defaults[leaf.name] = v
end

-- the settings of an optim table (the resolved config section, or a plain table): every key, checked
local function settings(cfg)
  cfg = cfg or {}
  if type(cfg) ~= "table" then fail("optim: the config must be a table, got a %s", type(cfg)) end
  local names = {}
  for key in pairs(optim.defaults) do names[#names + 1] = key end
  table.sort(names)
  for key in pairs(cfg) do
    if optim.defaults[key] == nil then
      fail("optim: unknown key '%s' (%s)", tostring(key), table.concat(names, ", "))
    end
  end
  local o = {}
  for key, v in pairs(optim.defaults) do      -- rawget: a resolved config raises on keys it lacks
    local given = rawget(cfg, key)
    if given == false and v == false then given = nil end     -- false: the default's "by device"
    if given == nil then
      o[key] = v
    else
      local value, err, at = LEAVES[key].type:check(given)
      if err then fail("optim: %s%s: %s", key, at or "", err) end
      o[key] = value
    end
  end
  return o
end

local function entries_of(model)
  if type(model) == "table" and model.named_parameters then return model:named_parameters() end
  if type(model) == "table" then return model end
  fail("optim.new: expected a module or a list of {name, tensor} entries, got a %s", type(model))
end

-- Newton-Schulz's dtype when optim.ns_dtype is nil: bf16 on the GPU, f32 on the CPU
function optim.ns_dtype_for(device) return device == "cpu" and "f32" or "bf16" end

local Optimizer = {}
Optimizer.__index = Optimizer

--[[ model: a module (its named_parameters()) or a list of {name = , tensor = ,
module = } entries; ocfg: the config's `optim` section; scfg: its `schedule`
section; steps: the run's total updates. opts.quiet: do not print the groups. ]]
function optim.new(model, ocfg, scfg, steps, opts)
  local o = settings(ocfg)
  local entries = entries_of(model)
  if #entries == 0 then fail("optim.new: the model has no parameters") end
  for _, e in ipairs(entries) do
    if e.tensor.dtype ~= "f32" then
      fail("optim.new: parameter '%s' is %s; the optimisers update f32 masters", e.name, e.tensor.dtype)
    end
  end
  local self = setmetatable({clip = o.clip, t = 0, params = {}, groups = {}}, Optimizer)
  self.lr_mult = schedule.new(scfg, steps)
  self.base_lr = o.adamw_lr
  for i, e in ipairs(entries) do self.params[i] = e.tensor end
  nn.compute_grads(self.params, o.grad_dtype == "compute")
  local ns_dtype = o.ns_dtype or optim.ns_dtype_for(entries[1].tensor.device)
  local by = groups.assign(entries, {gates = o.gates})
  if #by.muon > 0 then
    self.groups[#self.groups + 1] = Muon.new("muon", by.muon, {
      lr = o.muon_lr, momentum = o.momentum, nesterov = o.nesterov, weight_decay = o.weight_decay,
      ns_steps = o.ns_steps, coeffs = o.ns_coeffs, ns_dtype = ns_dtype, momentum_dtype = o.momentum_dtype,
      normalize = o.muon_plus})
  end
  if #by.adamw > 0 then
    self.groups[#self.groups + 1] = AdamW.new("adamw", by.adamw, {
      lr = o.adamw_lr, betas = o.betas, eps = o.eps, weight_decay = o.adamw_weight_decay,
      moments = o.adamw_moments})
  end
  if #by.engram > 0 then
    -- tables whose module hands over sparse gradients get the touched-rows Adam
    local sparse, dense = {}, {}
    for _, e in ipairs(by.engram) do
      local list = (e.module and e.module.sparse_grad) and sparse or dense
      list[#list + 1] = e
    end
    local hp = {lr = o.adamw_lr * o.engram_lr_mult, betas = o.betas, eps = o.eps, weight_decay = 0,
                dense = o.engram_adam == "dense"}
    if #sparse > 0 then
      self.groups[#self.groups + 1] = SparseAdam.new("engram", sparse, {lr = hp.lr, betas = hp.betas, eps = hp.eps,
                                                                        dense = hp.dense, moments = o.engram_moments})
    end
    if #dense > 0 then
      self.groups[#self.groups + 1] = AdamW.new(#sparse > 0 and "engram_dense" or "engram", dense, hp)
    end
  end
  self:scalars()   -- held from the start, as the state is (the planner counts them so)
  if not (opts and opts.quiet) then print(self:describe()) end
  return self
end

-- The groups as a table: group, tensors, parameters, lr, weight decay, names.
function Optimizer:describe()
  return groups.describe(self.groups)
end

--[[ One update at `step`, read back: {grad_norm, lr (adamw_lr times the multiplier), lr_mult,
skipped}. The optimiser's one step (prepare, then step_async: the clip and the NaN firewall
decided on the device), with the norm and the verdict read at once: for the tests and the
tools that look at every update. The training step (dormouse.step) reads them at log time. ]]
function Optimizer:step(step)
  local r = self:prepare(step)
  local before = self:sync().t
  self:step_async()
  local after = self:sync()
  r.grad_norm, r.skipped = after.grad_norm, after.t == before
  return r
end

-- Give back what the optimiser holds on its device: every group's state and the step's scalars
-- (the planner's sessions and the GPU checks, which build many in one process).
function Optimizer:free()
  for _, g in ipairs(self.groups) do
    for _, slot in ipairs(g.slots) do for _, t in ipairs(g.state[slot]) do t:free() end end
  end
  if self.dev then
    for _, at in ipairs(self.dev.at) do at.lr_at:free() end
    self.dev.lr:free(); self.dev.step:free(); self.dev.sumsq:free()
    self.dev = nil
  end
end

---------------------------------------------------------------- on the device

-- The step's scalars on the parameters' device: each group's lr, the count
-- of applied updates and the gradients' sum of squares.
function Optimizer:scalars()
  if not self.dev then
    local device = self.params[1].device
    self.dev = {
      lr = dm.keep(dm.zeros({#self.groups}, {dtype = "f64", device = device})),
      step = dm.keep(dm.full({1}, self.t, {dtype = "i64", device = device})),   -- (no host copy left to the GC)
      sumsq = dm.keep(dm.zeros({1}, {dtype = "f64", device = device})),
    }
    self.dev.at = {}
    for i, g in ipairs(self.groups) do
      self.dev.at[i] = {lr_at = dm.keep(self.dev.lr:narrow(1, i, 1)), step_at = self.dev.step,
                        sumsq_at = self.dev.sumsq, clip = g.clips_inside and self.clip or nil}
    end
  end
  return self.dev
end

-- Write step's learning rates into the device scalars; returns {lr, lr_mult}.
function Optimizer:prepare(step)
  local dev = self:scalars()
  local mult = self.lr_mult(step)
  local lrs = {}
  for i, g in ipairs(self.groups) do lrs[i] = g.lr * mult end
  dev.lr:copy_(dm.tensor(lrs, {dtype = "f64"}))
  self.mult = mult
  return {lr = self.base_lr * mult, lr_mult = mult}
end

--[[ Clip, check and update with no host read (the firewall decides on the device). loss (a
one-element tensor on the device, or nil): the step's; a non-finite one skips the step as a
non-finite norm does (it is folded into the norm's sum of squares as loss * 0). ]]
function Optimizer:step_async(loss)
  for _, g in ipairs(self.groups) do      -- refused before anything is updated
    if not g.device_scalars then
      fail("optim: group '%s' (%s) cannot take its scalars from the device yet, so its step cannot run " ..
           "without host reads", g.name, g.kind)
    end
  end
  local dev = self:scalars()
  local device = self.params[1].device
  profile.region("clip", "optim", device, function()
    local all, apart = self:grads_split()
    core.clip_grads_async(all, 0, dev.sumsq)
    if loss then dev.sumsq:add_(loss:to("f64") * 0) end     -- NaN or inf: not finite, the step skipped
    core.clip_scale(apart, self.clip, dev.sumsq)
    core.optim_tick(dev.step, dev.sumsq)
  end)
  self.async_steps = true                  -- self.t is behind dev.step until sync()
  for i, g in ipairs(self.groups) do
    profile.region(g.name, "optim", device, g.update, g, self.mult or 1, math.max(self.t, 1), dev.at[i])
  end
end

-- Read back what step_async kept on the device: {steps applied so far, the last norm}.
function Optimizer:sync()
  if not self.dev or self.params[1].device == "meta" then return {t = self.t} end   -- (meta: no values)
  self.t = math.tointeger(self.dev.step:item())
  self.async_steps = nil
  return {t = self.t, grad_norm = math.sqrt(self.dev.sumsq:item())}
end

-- The norm's gradients (every parameter's .grad and the sparse groups'
-- gradients of this step), and those of them clipped in a pass of their
-- own: all but the ones whose group clips them as it reads them (Muon: the
-- momentum kernel takes them unclipped, with the norm's sum).
function Optimizer:grads_split()
  if not self.clipped_inside then
    self.clipped_inside = {}
    for _, g in ipairs(self.groups) do
      if g.clips_inside then for _, p in ipairs(g.params) do self.clipped_inside[p] = true end end
    end
  end
  local all, apart = {}, {}
  for _, p in ipairs(self.params) do
    local g = p.grad
    if g then
      all[#all + 1] = g
      if not self.clipped_inside[p] then apart[#apart + 1] = g end
    end
  end
  for _, g in ipairs(self.groups) do
    if g.grads then
      for _, grad in ipairs(g:grads()) do all[#all + 1] = grad; apart[#apart + 1] = grad end
    end
  end
  return all, apart
end

-- What the global norm covers
function Optimizer:grads() return (self:grads_split()) end

function Optimizer:zero_grad()
  for _, p in ipairs(self.params) do p.grad = nil end
  for _, g in ipairs(self.groups) do if g.zero_grad then g:zero_grad() end end
end

-- {"<param>.m" = , "<param>.v" = , "<param>.momentum" = , step = i64 [1]}
function Optimizer:state()
  self:sync()
  local out = {step = dm.tensor({self.t}, {dtype = "i64"})}
  for _, g in ipairs(self.groups) do groups.state_into(g, out) end
  return out
end

local function shape_str(t) return "[" .. table.concat(t:shape(), ", ") .. "]" end

-- The inverse of state(): every key must be there with its shape, and no
-- other; all is checked before anything is copied.
function Optimizer:load_state(tbl)
  if type(tbl) ~= "table" then fail("optim state: expected a table of tensors, got a %s", type(tbl)) end
  local step = tbl.step
  if not dm.is_tensor(step) or step:numel() ~= 1 then fail("optim state: missing 'step' (a one-element tensor)") end
  local t = math.tointeger(step:item())
  if not t or t < 0 then fail("optim state: 'step' must hold an integer >= 0, got %s", tostring(step:item())) end
  for _, g in ipairs(self.groups) do            -- another form of a group's state (optim.adamw_moments)
    if g.adapt_state then tbl = g:adapt_state(tbl) end
  end
  local want = {}
  for _, g in ipairs(self.groups) do groups.state_into(g, want) end
  for key, dst in pairs(want) do
    local src = tbl[key]
    if not dm.is_tensor(src) then fail("optim state: missing '%s'", key) end
    if shape_str(src) ~= shape_str(dst) then
      fail("optim state '%s': shape %s but the parameter's is %s", key, shape_str(src), shape_str(dst))
    end
  end
  local extra = {}
  for key in pairs(tbl) do if key ~= "step" and not want[key] then extra[#extra + 1] = tostring(key) end end
  table.sort(extra)
  if #extra > 0 then
    fail("optim state: unexpected key '%s'%s (not a state of this optimiser's parameters)", extra[1],
         #extra > 1 and string.format(" and %d more", #extra - 1) or "")
  end
  for key, dst in pairs(want) do dst:copy_(tbl[key]) end
  self.t = t
  self.async_steps = nil
  if self.dev then self.dev.step:copy_(dm.tensor({t}, {dtype = "i64"})) end
end

return optim
