--[[
The training step as one CUDA graph (config key `graph = true`).

  local gs = graphstep.new(run, {warmup = 2})   -- run: cfg, model, opt, loader, device
  for step = ... do
    local r = gs:step(step)                     -- {lr, lr_mult}; nothing is read back
    if log_now then local w = gs:window() end   -- the window's sums, read once
  end

A step is: the batch copied into the graph's input buffers, the step's
learning rates written into the optimiser's device scalars, then

  loss = model(x).loss ; backward ; balance the experts ; clip ; the NaN
  firewall ; update ; the loss, norm and routing counts added to device sums

run eagerly for the first `warmup` steps (every buffer, matrix-product plan
and compiled kernel comes to exist), then captured once and replayed. The
firewall decides on the device (a non-finite gradient norm skips the update
in the kernels), so no step waits for the host; the sums are read at log
time. Everything the step reads that changes per step is in device memory:
the inputs, the learning rates, the update count.
]]
local dm = require "dormouse"
local core = require "dormouse.core"
local schema = require "dormouse.schema"
local pieces = require "dormouse.step"

local graphstep = {}
local GraphStep = {}
GraphStep.__index = GraphStep

local function fail(fmt, ...) error(string.format(fmt, ...), 0) end

local function kept_zeros(shape, dtype, device)
  return dm.keep(dm.zeros(shape, {dtype = dtype, device = device}))
end

--[[ Why the step of run r (cfg, device, model) cannot be captured, or nil: the one list of
graph mode's preconditions, for graph = true's refusal (graphstep.new) and for the log line of
a run whose default falls back to eager steps (train.graph_mode). opts.eager: the device is not
asked for (the eager form runs anywhere). ]]
function graphstep.why_not(r, opts)
  local cfg = r.cfg
  if r.device ~= "cuda" and not (opts and opts.eager) then
    return string.format("graph = true needs the cuda device (this run is on %s)", r.device)
  end
  if cfg.rl and cfg.rl.k > 0 then
    return "rl.k > 0: each step samples from the model before its update (dormouse.rl)"
  end
  if require("dormouse.dist").active() then
    return "a data-parallel job: its collectives (MPI, on the host) are not in the captured step"
  end
  if cfg.grad_accum ~= 1 then
    return string.format("a captured step takes one micro-batch: grad_accum must be 1, got %d", cfg.grad_accum)
  end
  if cfg.model.segment and cfg.model.segment < cfg.seq then
    return string.format("a captured step is one pass: model.segment = %d splits seq = %d into segments",
                         cfg.model.segment, cfg.seq)
  end
  local engram = r.model and r.model.block and r.model.block.engram
  if engram and engram.ram then
    return "a captured step needs the Engram tables on the device (engram.ram = true keeps them in host memory)"
  end
  if schema.qat_changes(cfg) then
    return "model.moe.qat changes the experts' products during the run; a captured graph holds one"
  end
end

-- Eager steps before the capture, by default: the first step's allocations settle in the second
graphstep.WARMUP = 2

--[[ opts.warmup: eager steps before the capture (>= 1; default graphstep.WARMUP).
opts.eager: never capture (the same work, eagerly: what the CPU tests check). ]]
function graphstep.new(r, opts)
  opts = opts or {}
  local cfg = r.cfg
  local why = graphstep.why_not(r, opts)
  if why then fail("%s (set graph = false)", why) end
  local warmup = opts.eager and math.huge or opts.warmup or graphstep.WARMUP
  if warmup < 1 then fail("graph: at least one eager step must come before the capture, got warmup = %s", warmup) end
  local self = setmetatable({r = r, warmup = warmup, done = 0}, GraphStep)
  r.opt:scalars()
  if r.model.set_static then r.model:set_static(true) end     -- Engram's padded lookups
  local dev = r.device
  self.sum = {loss = kept_zeros({1}, "f64", dev), norm = kept_zeros({1}, "f64", dev),
              zero = kept_zeros({1}, "f64", dev)}
  self.t0 = r.opt:sync().t
  return self
end

-- The step's work on the device; run eagerly or captured.
function GraphStep:body()
  local r, sum = self.r, self.sum
  local out = pieces.micro_batch(r.model, self.x, self.prefix, 1, nil, nil, self.mask)
  local counts, drops = pieces.balance(r.model)
  local lookup = r.model.block and r.model.block.engram and r.model.block.engram.current
  if lookup and lookup.n then                      -- the padded lookups' count, for the log line
    self.engram = {n = dm.keep(lookup.n), lookups = lookup.inverse:numel()}
  end
  r.opt:step_async()
  r.opt:zero_grad()
  local ok = r.opt.dev.sumsq:lt(math.huge)                   -- false for inf and NaN: a skipped step
  sum.loss:add_(dm.where(ok, out.loss:detach():to("f64"), sum.zero))
  for name, v in pairs(out.extras or {}) do            -- an arm's own terms, summed as the loss is
    sum.extras = sum.extras or {}
    if not sum.extras[name] then sum.extras[name] = kept_zeros({1}, "f64", v.device) end
    sum.extras[name]:add_(dm.where(ok, v:detach():to("f64"), sum.zero))
  end
  sum.norm:add_(dm.where(ok, r.opt.dev.sumsq:sqrt(), sum.zero))
  for key, t in pairs {counts = counts, drops = drops} do   -- the routing counts and drops, summed on the device
    if not sum[key] then sum[key] = kept_zeros(t:shape(), t.dtype, t.device) end
    sum[key]:add_(t)
  end
end

-- One training step; returns {lr, lr_mult, events = model:after_step's or nil}.
function GraphStep:step(step)
  local r = self.r
  local x, prefix, _, mask = r.loader:next()      -- mask: records' batches only
  if not self.x then               -- the input buffers, shaped by the first batch
    self.x = dm.keep(dm.empty(x:shape(), {dtype = x.dtype, device = r.device}))
    self.prefix = dm.keep(dm.empty(prefix:shape(), {dtype = prefix.dtype, device = r.device}))
    if mask then self.mask = dm.keep(dm.empty(mask:shape(), {dtype = mask.dtype, device = r.device})) end
  end
  self.x:copy_(x)
  self.prefix:copy_(prefix)
  if mask then self.mask:copy_(mask) end
  local res = r.opt:prepare(step)
  if r.model.before_step and r.model:before_step(step, r.cfg.steps) and self.graph then
    error(string.format("graph: the model's step changed at step %d after it was captured (model.moe.qat's " ..
                        "format); run with graph = false", step), 0)
  end
  if self.graph then
    self.graph:replay()
    self.replays = self.replays + 1
  elseif self.done < self.warmup then
    dm.scope(function() self:body() end)
  else
    dm.cuda.synchronize()
    dm.cuda.empty_cache()          -- the warm-up's blocks go back: the graph gets its own pool
    local c0, r0 = core.kda_passes()
    self.graph = dm.cuda.graph(function() self:body() end)
    local c1, r1 = core.kda_passes()
    self.kda_step, self.replays = {c1 - c0, r1 - r0}, 0   -- a replay's passes, which no C code counts
    self.graph:replay()
  end
  self.done = self.done + 1
  -- the arms that act on the weights, outside the capture (their step numbers decide): in place,
  -- so the graph reads the new values where it reads the parameters
  if r.model.after_step then res.events = r.model:after_step(step) end
  return res
end

--[[ The window since the last call, read from the device and reset:
{loss = sum over applied steps, applied, skips, grad_norm = sum over applied
steps, counts = summed routing counts (a tensor) or nil, drops = the
assignments dropped at capacity (a number) or nil, engram = the last
step's {rows, unique_frac} or nil}. ]]
function GraphStep:window(steps)
  local sum = self.sum
  local t = self.r.opt:sync().t
  local w = {loss = sum.loss:item(), grad_norm = sum.norm:item(), applied = t - self.t0}
  w.skips = steps - w.applied
  w.counts = sum.counts and sum.counts:clone()
  w.drops = sum.drops and sum.drops:sum():item()
  for name, t in pairs(sum.extras or {}) do
    w.extras = w.extras or {}
    w.extras[name] = t:item()
    t:zero_()
  end
  if self.engram then
    local rows = self.engram.n:item()
    w.engram = {rows = rows, unique_frac = rows / math.max(self.engram.lookups, 1)}
  end
  self.t0 = t
  sum.loss:zero_()                 -- not mul_(0): a non-finite sum would stay NaN
  sum.norm:zero_()
  if sum.counts then sum.counts:zero_() end
  if sum.drops then sum.drops:zero_() end
  return w
end

-- KDA's forward passes by path the replays ran (after the first), which the op's counters never saw
function GraphStep:kda_passes()
  if not self.kda_step then return 0, 0 end
  return self.replays * self.kda_step[1], self.replays * self.kda_step[2]
end

-- The captured graph's nodes (0 before the capture).
function GraphStep:nodes() return self.graph and self.graph:nodes() or 0 end

function GraphStep:free()
  if self.graph then self.graph:free() end
  self.graph = nil
  if self.r.model.set_static then self.r.model:set_static(false) end
end

graphstep.GraphStep = GraphStep
return graphstep
