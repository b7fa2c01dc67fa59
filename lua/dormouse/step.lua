--[[
dormouse.step — the training step, written once: every form of it (the
trainer's eager and captured steps, the planner's step on the meta device,
the reinforcement step, `dormouse bench`) runs Step:body.

  local s = step.new(r, {capture = true})  -- r: cfg, model, opt, loader, device
  for n = first, last do
    local res = s:run(n)                   -- {lr, lr_mult, events}; nothing is read back
    if log_now then local w = s:window(steps) end   -- the window's sums, read once
  end

A step is the step's learning rates written into the optimiser's device
scalars (Optimizer:prepare), the model's before_step, then Step:body:

  for each micro-batch:  loss = model(x).loss ; backward of its weight times it
                         (by segments of model.segment bytes when rows are longer)
  a data-parallel job:   the gradients averaged over the ranks
  balance the experts ; the model's step counters ; clip ; the NaN firewall ;
  update ; the loss, the norm, the arms' terms and the routing counts added to
  sums on the device

then the model's after_step (the arms that act on the weights). The
firewall decides on the device: a non-finite loss or gradient norm skips the update
in the kernels, so no step waits for the host; the window's sums, the
applied steps and the skips are read at log time (Step:window), and
Step:skipped reads the last step's verdict when a checkpoint needs it.

Eager (the default), the body runs as it is. With opts.capture it runs
eagerly for the first `warmup` steps (every buffer, matrix-product plan and
compiled kernel comes to exist), is then captured once as a CUDA graph and
replayed; everything it reads that changes per step is in device memory
(the batch's input buffers, the learning rates, the update count). The
planner runs the body on the meta device (plan.step), and reinforcement
learning hands it its own forward and backward (Step:run's opts.backward).
]]
local dm = require "dormouse"
local core = require "dormouse.core"
local schema = require "dormouse.schema"
local segments = require "dormouse.segments"
local instrument = require "dormouse.instrument"
local dist = require "dormouse.dist"

local step = {}
local Step = {}
Step.__index = Step

local function fail(fmt, ...) error(string.format(fmt, ...), 0) end

local function kept_zeros(shape, dtype, device)
  return dm.keep(dm.zeros(shape, {dtype = dtype, device = device}))
end

local function no_mark() end

---------------------------------------------------------------- the pieces

--[[ One micro-batch: the forward of x, prefix and the backward of its loss
weighted by `scale`. mark(phase), when given, is called with "forward" and
"backward" as each ends. mask: the batch's loss mask (records), or nil. add_counts: the step's
routing counts continue from an earlier micro-batch's (grad_accum > 1), so that the balance and
model.moe.update_by_load see the whole step's rows.
Returns the forward's out. ]]
function step.micro_batch(model, x, prefix, scale, mark, mask, add_counts)
  mark = mark or no_mark
  local out = model:forward(x, prefix, {mask = mask, counts = add_counts and "add" or nil})
  mark("forward")
  ;(scale == 1 and out.loss or out.loss * scale):backward()
  mark("backward")
  return out
end

-- The experts' balance after a step's backward: the routing counts and the drops (nil without MoE);
-- in a data-parallel job on every rank's counts, summed
function step.balance(model)
  if model.update_balance then return model:update_balance(dist.reduces() and dist.sum_ or nil) end
end

--[[ The weights of a step's micro-batches: 1 / grad_accum each, or under loss masks (records) each
one's share of the step's scored targets, so that the step's loss is the mean over all of them as one
batch's would be (a micro-batch of short responses counts for less). masks: the micro-batches'
masks (u8 tensors, read: one read a micro-batch of records) or nil. ]]
function step.micro_weights(masks, n)
  local w = {}
  local total, counts = 0, {}
  for i = 1, n do
    counts[i] = masks and masks[i] and masks[i]:to("f64"):sum():item() or 1
    total = total + counts[i]
  end
  for i = 1, n do w[i] = total > 0 and counts[i] / total or 1 / n end
  return w
end

---------------------------------------------------------------- capture

--[[ Why the step of run r (cfg, device, model) cannot be captured, or nil: the one list of
the captured form's preconditions, for its refusal (step.new) and for the log line of a run
whose default falls back to eager steps (train.graph_mode). opts.uncaptured: the device is
not asked for (the captured form's work, run eagerly, runs anywhere). ]]
function step.why_not_capture(r, opts)
  local cfg = r.cfg
  if r.device ~= "cuda" and not (opts and opts.uncaptured) then
    return string.format("graph = true needs the cuda device (this run is on %s)", r.device)
  end
  if cfg.rl and cfg.rl.k > 0 then
    return "rl.k > 0: each step samples from the model before its update (dormouse.rl)"
  end
  if dist.size > 1 and not dist.nccl then
    return "a data-parallel job without NCCL: its collectives (MPI, on the host) are not in the captured step"
  end
  local engram = r.model and r.model.block and r.model.block.engram
  if dist.size > 1 and engram then
    return "a data-parallel job with Engram: the tables' sparse gradients are gathered through the host"
  end
  if cfg.grad_accum ~= 1 then
    return string.format("a captured step takes one micro-batch: grad_accum must be 1, got %d", cfg.grad_accum)
  end
  if cfg.model.segment and cfg.model.segment < cfg.seq then
    return string.format("a captured step is one pass: model.segment = %d splits seq = %d into segments",
                         cfg.model.segment, cfg.seq)
  end
  if engram and engram.ram then
    return "a captured step needs the Engram tables on the device (engram.ram = true keeps them in host memory)"
  end
  if schema.qat_changes(cfg) then
    return "model.moe.qat changes the experts' products during the run; a captured graph holds one"
  end
end

-- Eager steps before the capture, by default: the first step's allocations settle in the second
step.WARMUP = 2

---------------------------------------------------------------- the step

--[[ The step of run r: r.cfg, r.model, r.opt, r.loader (next() -> x, prefix, k, mask on the
CPU, or on the model's device), r.device.
opts.capture: capture the body as a CUDA graph after opts.warmup eager steps (>= 1, default
step.WARMUP) and replay it; refused, naming why, where it cannot (step.why_not_capture).
opts.uncaptured (with capture): the captured form's work (input buffers, static shapes) run
eagerly and never captured: what the CPU tests check. ]]
function step.new(r, opts)
  opts = opts or {}
  local cfg = r.cfg
  local self = setmetatable({r = r, done = 0, capture = opts.capture or false}, Step)
  if self.capture then
    local why = step.why_not_capture(r, opts)
    if why then fail("%s (set graph = false)", why) end
    self.warmup = opts.uncaptured and math.huge or opts.warmup or step.WARMUP
    if self.warmup < 1 then
      fail("graph: at least one eager step must come before the capture, got warmup = %s", self.warmup)
    end
    self.buffers = {}                                -- the batch's input buffers, made by the first batch
    if r.model.set_static then r.model:set_static(true) end     -- Engram's padded lookups
  end
  self.grad_accum = cfg.grad_accum or 1
  self.segment = cfg.model and cfg.model.segment
  self.records = cfg.data and cfg.data.records
  r.opt:scalars()
  local dev = r.device
  self.sum = {loss = kept_zeros({1}, "f64", dev), norm = kept_zeros({1}, "f64", dev),
              zero = kept_zeros({1}, "f64", dev), last = kept_zeros({1}, "f64", dev)}
  self.t0 = r.opt:sync().t
  return self
end

-- the next batch from the loader, on the run's device: x, prefix, mask (records only, else nil)
function Step:next_batch()
  local r = self.r
  local x, prefix, _, mask = r.loader:next()
  if x.device ~= r.device then x, prefix, mask = x:to(r.device), prefix:to(r.device), mask and mask:to(r.device) end
  return x, prefix, mask
end

-- The captured form: the batch copied into its input buffers (outside the graph, before a replay)
function Step:fill_buffers()
  local b, r = self.buffers, self.r
  local x, prefix, _, mask = r.loader:next()
  if not b.x then
    b.x = dm.keep(dm.empty(x:shape(), {dtype = x.dtype, device = r.device}))
    b.prefix = dm.keep(dm.empty(prefix:shape(), {dtype = prefix.dtype, device = r.device}))
    if mask then b.mask = dm.keep(dm.empty(mask:shape(), {dtype = mask.dtype, device = r.device})) end
  end
  b.x:copy_(x)
  b.prefix:copy_(prefix)
  if mask then b.mask:copy_(mask) end
end

--[[ The step's micro-batches: their number, their weights and take(i) -> x, prefix, mask on the
run's device. Records over several micro-batches are all read first, their masks deciding the
weights; a corpus's are read one at a time (host Engram tables prefetch the batch after the one
being computed). ]]
function Step:micro_batches()
  local b = self.buffers
  if b then return 1, {1}, function() return b.x, b.prefix, b.mask end end
  local n, read, masks = self.grad_accum, {}, {}
  if self.records and n > 1 then
    for i = 1, n do
      read[i] = table.pack(self:next_batch())
      masks[i] = read[i][3]
    end
  end
  local weights = step.micro_weights(#masks > 0 and masks or nil, n)
  return n, weights, function(i)
    if read[i] then return read[i][1], read[i][2], read[i][3] end
    return self:next_batch()
  end
end

--[[ The forward and backward of the step's micro-batches. Returns the step's loss (a one-element
f64 tensor on the device, the micro-batches' weighted sum) and the arms' terms by name, weighted
the same way. ]]
function Step:forward_backward(mark)
  local model = self.r.model
  local loss, extras = nil, {}
  local n, weights, take = self:micro_batches()
  for i = 1, n do
    local x, prefix, mask = take(i)
    mark("data")
    local l, terms
    if self.segment and x:size(2) - 1 > self.segment then        -- by segments, the state carried
      l, terms = segments.backward(model, x, prefix, self.segment, weights[i], mark, mask, i > 1)
    else
      local out = step.micro_batch(model, x, prefix, weights[i], mark, mask, i > 1)
      l, terms = out.loss, out.extras
    end
    local part = l:detach():to("f64")
    if weights[i] ~= 1 then part = part * weights[i] end
    loss = loss and loss + part or part
    for name, v in pairs(terms or {}) do
      local term = v:detach():to("f64")
      if weights[i] ~= 1 then term = term * weights[i] end
      extras[name] = extras[name] and extras[name] + term or term
    end
  end
  return loss, extras
end

-- a counter as the window keeps it: a number, or a one-element tensor kept on the device
local function kept(v, old)
  if not dm.is_tensor(v) then return v end
  if old ~= v and dm.is_tensor(old) and not old:is_freed() then old:free() end
  return dm.keep(v)
end

--[[ The step after its backward, as every form takes it: loss (a one-element tensor) and
extras (the arms' terms by name: one-element tensors or numbers) are the step's. ]]
function Step:finish(loss, extras)
  local r, sum = self.r, self.sum
  local model, device = r.model, r.device
  if dist.reduces() then                             -- a data-parallel job: every rank's rows in the step
    dist.average_grads(r.opt)
    loss = dist.sum_(loss:clone()) * (1 / dist.size)
  end
  local counts, drops = step.balance(model)
  if model.step_counters then                        -- the model's own counters of the step (Engram's rows)
    local c = model:step_counters(dist.active() and dist or nil)
    self.counters = self.counters or {}
    for name, v in pairs(c or {}) do
      local old = self.counters[name] or {}
      self.counters[name] = {rows = kept(v.rows, old.rows), lookups = v.lookups}
    end
  end
  r.opt:step_async(loss)                             -- a non-finite loss or norm skips the update
  r.opt:zero_grad()
  local ok = r.opt.dev.sumsq:lt(math.huge)           -- false for inf and NaN: a skipped step
  sum.loss:add_(dm.where(ok, loss, sum.zero))
  sum.last:copy_(loss)                               -- the step's own, applied or not (Step:last)
  for name, v in pairs(extras or {}) do              -- an arm's own terms, summed as the loss is
    if not dm.is_tensor(v) then v = dm.tensor({v}, {dtype = "f64"}):to(device) end
    sum.extras = sum.extras or {}
    if not sum.extras[name] then sum.extras[name] = kept_zeros({1}, "f64", device) end
    sum.extras[name]:add_(dm.where(ok, v:to("f64"), sum.zero))
  end
  sum.norm:add_(dm.where(ok, r.opt.dev.sumsq:sqrt(), sum.zero))
  for key, t in pairs {counts = counts, drops = drops} do   -- the routing counts and drops, summed on the device
    if not sum[key] then sum[key] = kept_zeros(t:shape(), t.dtype, t.device) end
    sum[key]:add_(t)
  end
end

--[[ The step's work on the device, run eagerly or captured. backward(mark), when given,
replaces the micro-batches' forward and backward (reinforcement learning) and returns the
loss and the extras as Step:forward_backward does. mark(phase), when given, is called as
each phase ends: "data", "forward", "backward" (by micro-batch and segment); Step:run
closes "optimiser" after the update and the model's after_step. ]]
function Step:body(backward, mark)
  mark = mark or no_mark
  local loss, extras
  if backward then loss, extras = backward(mark) else loss, extras = self:forward_backward(mark) end
  self:finish(loss, extras)
end

--[[ One training step n; returns {lr, lr_mult, events = model:after_step's or nil}.
opts.backward: the step's own forward and backward (Step:body); opts.mark: the phases as
Step:body names them ("data" holds the batch and the step's learning rates), and
"optimiser" as the step ends. ]]
function Step:run(n, opts)
  local r = self.r
  local backward, mark = opts and opts.backward, opts and opts.mark
  if self.buffers then self:fill_buffers() end
  local res = r.opt:prepare(n)
  if r.model.before_step and r.model:before_step(n, r.cfg.steps) and self.graph then
    error(string.format("graph: the model's step changed at step %d after it was captured (model.moe.qat's " ..
                        "format); run with graph = false", n), 0)
  end
  if self.graph then
    self.graph:replay()
    self.replays = self.replays + 1
  elseif not self.capture or self.done < self.warmup then
    dm.scope(function() self:body(backward, mark) end)
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
  -- the arms that act on the weights, outside a capture (their step numbers decide): in place,
  -- so a graph reads the new values where it reads the parameters
  if r.model.after_step then res.events = r.model:after_step(n) end
  if mark then mark("optimiser") end
  return res
end

--[[ The window since the last call, read from the device and reset:
{loss = sum over applied steps, applied, skips, grad_norm = sum over applied
steps, counts = summed routing counts (a tensor) or nil, drops = the
assignments dropped at capacity (a number) or nil, extras = the arms' terms
summed by name or nil, engram = the last step's {rows, unique_frac} or nil}. ]]
function Step:window(steps)
  local sum = self.sum
  local t = self.r.opt:sync().t
  local w = {loss = sum.loss:item(), grad_norm = sum.norm:item(), applied = t - self.t0}
  w.skips = steps - w.applied
  w.counts = sum.counts and sum.counts:clone()
  w.drops = sum.drops and sum.drops:sum():item()
  for name, v in pairs(sum.extras or {}) do
    w.extras = w.extras or {}
    w.extras[name] = v:item()
    v:zero_()
  end
  local e = self.counters and self.counters.engram
  if e then
    local rows = dm.is_tensor(e.rows) and e.rows:item() or e.rows
    w.engram = {rows = rows, unique_frac = rows / math.max(e.lookups, 1)}
  end
  self.t0 = t
  sum.loss:zero_()                 -- not mul_(0): a non-finite sum would stay NaN
  sum.norm:zero_()
  if sum.counts then sum.counts:zero_() end
  if sum.drops then sum.drops:zero_() end
  return w
end

-- Whether the NaN firewall skipped the last step (its clipping sum, read from the device)
function Step:skipped() return not instrument.finite(self.r.opt.dev.sumsq:item()) end

-- The last step's loss and gradient norm, read from the device, whether it was applied or skipped
function Step:last()
  return {loss = self.sum.last:item(), grad_norm = math.sqrt(self.r.opt.dev.sumsq:item())}
end

-- KDA's forward passes by path the replays ran (after the first), which the op's counters never saw
function Step:kda_passes()
  if not self.kda_step then return 0, 0 end
  return self.replays * self.kda_step[1], self.replays * self.kda_step[2]
end

-- The captured graph's nodes (0 before a capture).
function Step:nodes() return self.graph and self.graph:nodes() or 0 end

-- Whether the step is captured (or will be, after its warm-up)
function Step:captured() return self.capture end

-- Give back the graph, the input buffers and the sums (the step is not run again)
function Step:free()
  if self.graph then self.graph:free() end
  self.graph = nil
  if self.capture and self.r.model.set_static then self.r.model:set_static(false) end
  local function free(t) if dm.is_tensor(t) and not t:is_freed() then t:free() end end
  for _, t in pairs(self.buffers or {}) do free(t) end
  for key, t in pairs(self.sum) do
    if key == "extras" then for _, e in pairs(t) do free(e) end else free(t) end
  end
  if not self.capture then                         -- (a captured step's counters live in the graph's pool)
    for _, c in pairs(self.counters or {}) do free(c.rows) end
  end
  self.buffers, self.sum, self.counters = nil, {}, nil
end

step.Step = Step
return step
