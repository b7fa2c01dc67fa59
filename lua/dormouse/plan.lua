--[[
dormouse.plan — the peak device memory of a training step, predicted without
a GPU, and the largest batch × seq that fits a given memory
(`dormouse plan EXPERIMENT --memory 16GiB`, docs/training.md).

The prediction runs the real code on the meta device, whose tensors have
shapes and no memory and whose kernels do nothing: the model and its
optimiser are built there, then one training step runs as the trainer takes
it (plan.step: forward over the micro-batches with the tape recording,
backward, the balancing, clipping and every group's update, zero_grad),
while the meta allocator's trace (vm/core/alloc.h) counts every byte: the most
allocated at once, in bytes as asked (the units of dm.memory("cuda").peak)
and in blocks of the CUDA caching allocator. A second run of the same step
stops at the allocation that reached the peak and sorts what is live there
by what holds it (vm/lua/plan.c): parameters, gradients, optimiser states,
the activations each op saved for backward, the rest of the step's tensors.

What the meta device cannot see is modelled, each with its source:
  - the scratch the CUDA kernels take for themselves (dm_scratch in
    kernels/*.cu): with the planned card set (core.plan_card, plan.CARD), an
    op on the meta device hands what its kernel would take to the trace, sized
    by the function in its family's header that the kernel sizes it with
    (vm/ops/<family>.h), where the kernel would take it: the trace's peak
    holds a scratch only where it is live, and the table shows it only then;
  - memory outside the allocator: cuBLASLt's workspace (plan.OUTSIDE).
With engram.ram the tables and their Adam moments live in host memory: the
step is planned with the tables on the device and their bytes, which are held
all the time, are then taken out of the device's and shown apart.

  local plan = require "dormouse.plan"
  local r = plan.report(cfg, {memory = plan.parse_memory("16GiB")})
  print(plan.format(r))
]]
local dm = require "dormouse"
local core = require "dormouse.core"
local nn = require "dormouse.nn"
local optim = require "dormouse.optim"
local config = require "dormouse.config"
local train = require "dormouse.train"
local segments = require "dormouse.segments"
local pieces = require "dormouse.step"

local plan = {}

local GiB = 2 ^ 30

---------------------------------------------------------------- sizes

local units = {B = 1, KB = 1e3, MB = 1e6, GB = 1e9, TB = 1e12,
               KiB = 2 ^ 10, MiB = 2 ^ 20, GiB = 2 ^ 30, TiB = 2 ^ 40}

-- "16GiB", "16000MiB", "12.5GB", "1.5 TiB" -> bytes (an integer); raises on anything else.
function plan.parse_memory(text)
  local s = tostring(text)
  local num, unit = s:match("^%s*(%d*%.?%d+)%s*(%a+)%s*$")
  local n = tonumber(num)
  if not n or not units[unit] or n <= 0 then
    error(string.format("bad memory size '%s': expected a number and a unit, such as 16GiB, 16000MiB " ..
                        "or 12.5GB (units B, KB, MB, GB, TB, KiB, MiB, GiB, TiB)", s), 0)
  end
  return math.floor(n * units[unit])
end

local function gib(bytes) return string.format("%.2f", bytes / GiB) end
local function size(bytes)
  if bytes >= GiB then return gib(bytes) .. " GiB" end
  return string.format("%.2f MiB", bytes / 2 ^ 20)
end

---------------------------------------------------------------- the step

--[[ One optimiser step as the trainer takes it (dormouse.step's Step:body), with the
same allocations and no value read back, so that it runs on the meta device as on
the GPU: next_batch() -> x, prefix on the model's device; grad_accum
micro-batches of forward and backward, by segments of `segment` bytes when
the rows are longer; the balancing; the global norm's clipping and every
group's update (decided on the device, as the trainer's); zero_grad.
mark(phase), when given, is called as "forward", "backward" and "optimiser"
begin. Everything the step makes is released at its end (dm.scope). ]]
local NEXT = {data = "forward", forward = "backward"}     -- (a backward's end leaves it open)

function plan.step(model, opt, next_batch, grad_accum, mark, segment)
  mark = mark or function() end
  local r = {cfg = {grad_accum = grad_accum, model = {segment = segment}, steps = 1}, model = model, opt = opt,
             device = opt.params[1].device, loader = {next = function() return next_batch() end}}
  local s = pieces.new(r)
  opt:prepare(1)
  local open = "forward"
  mark(open)
  local ok, err = pcall(dm.scope, function()   -- Step:body's two halves, the optimiser's phase opened between
    local loss, extras = s:forward_backward(function(ended)
      local phase = NEXT[ended]
      if phase and phase ~= open then open = phase; mark(phase) end
    end)
    mark("optimiser")
    s:finish(loss, extras)
  end)
  s:free()
  if not ok then error(err, 0) end
end

---------------------------------------------------------------- what the meta device cannot see

-- Taken from the driver apart from the caching allocator: not in dm.memory, but on the card.
plan.OUTSIDE = {
  {name = "cuBLASLt workspace", where = "kernels/gemm.c, DM_GEMM_WORKSPACE", bytes = core.gemm_workspace()},
}

-- The planned card (an H200's, as sm_90 H100s): its SMs, and the most dynamic shared memory a block
-- may opt in to (cudaDevAttrMaxSharedMemoryPerBlockOptin = 227 KiB). The kernels' scratch follows them.
plan.CARD = {sm_count = 132, smem_optin = 232448}

---------------------------------------------------------------- a planning session

local Session = {}
Session.__index = Session


-- fn's modules built on the meta device in `compute`, and the generator put back
local function on_meta(compute, fn)
  local seed, offset = dm.rng_state()
  local res = table.pack(pcall(nn.build, {device = "meta", compute_dtype = compute}, fn))
  dm.set_rng_state(seed, offset)
  if not res[1] then error(res[2], 0) end
  return table.unpack(res, 2, res.n)
end

local function bytes_of(t) return t:numel() * core.dtype_size(t.dtype) end

--[[ The model and optimiser of cfg on the meta device. opts.root: the folder
holding models/ ("."). ]]
function plan.session(cfg, opts)
  opts = opts or {}
  local m = config.plain(cfg.model)
  local ram = m.engram.ram
  m.engram.ram = false                    -- planned on the device; the tables' bytes are moved out below
  local ocfg = config.plain(cfg.optim)
  ocfg.ns_dtype = ocfg.ns_dtype or require("dormouse.optim").ns_dtype_for("cuda")   -- planned for the card
  local self = setmetatable({cfg = cfg, m = m, ram = ram, compute = cfg.dtype, grad_accum = cfg.grad_accum,
                             ctx = train.engram_ctx(cfg), ns_dtype = ocfg.ns_dtype, segment = m.segment}, Session)
  collectgarbage()          -- meta tensors no one holds go now, not in the middle of a step
  core.meta_trace_reset()
  self.base = core.meta_trace()
  on_meta(self.compute, function()
    dm.manual_seed(cfg.seed)
    self.model = train.build_model({model = m}, opts.root or config.root)
    self.opt = optim.new(self.model, ocfg, cfg.schedule, cfg.steps, {quiet = true})
  end)
  self:sort_holders()
  return self
end

-- The groups the live bytes are sorted into (vm/lua/plan.c).
function Session:sort_holders()
  local host, params, grads = {}, {}, {}
  local engram = self.model.block and self.model.block.engram
  local on_host = {}
  if self.ram and engram then on_host[engram.table] = true end
  for _, p in ipairs(self.model:named_parameters()) do
    if on_host[p.tensor] then host[#host + 1] = p.tensor else params[#params + 1] = p.tensor end
    if p.tensor:requires_grad() then grads[#grads + 1] = p.tensor end
  end
  for _, b in ipairs(self.model:named_buffers()) do params[#params + 1] = b.tensor end
  local groups = {}
  for _, g in ipairs(self.opt.groups) do
    local list = {}
    for i, p in ipairs(g.params) do
      for _, slot in ipairs(g.slots) do
        local t = g.state[slot][i]
        if on_host[p] then host[#host + 1] = t else list[#list + 1] = t end
      end
    end
    groups[#groups + 1] = {name = "optimiser states: " .. g.name .. " " .. table.concat(g.slots, ", "),
                           tensors = list}
  end
  self.host_bytes, self.host_blocks = 0, 0
  for _, t in ipairs(host) do
    self.host_bytes = self.host_bytes + bytes_of(t)
    self.host_blocks = self.host_blocks + core.cuda_block_size(bytes_of(t))
  end
  self.groups = {{name = "host", tensors = host}, {name = "parameters and buffers", tensors = params},
                 {name = "gradients", tensors = grads, grads = true}}
  for _, g in ipairs(groups) do self.groups[#self.groups + 1] = g end
end

--[[ A step of T bytes by segments (model.segment): its number of segments S and
the rows the planner runs, three segments (the last as long as T's), or T when
S <= 3; nil when the step takes T whole. ]]
function Session:segments_of(T)
  local len = self.segment
  if not len or T <= len then return nil end
  local S = math.ceil(T / len)
  return S, S > 3 and 2 * len + (T - (S - 1) * len) or T
end

--[[ The state one segment hands the next at batch B, as a step by segments
keeps it at each boundary: {bytes, blocks} (blocks: in the caching
allocator's). Made by a forward of one segment on the meta device. ]]
function Session:boundary_state(B)
  if self.state_at and self.state_at.B == B then return self.state_at end
  local r = {B = B, bytes = 0, blocks = 0}
  on_meta(self.compute, function()
    dm.no_grad(function()
      dm.scope(function()
        local x = dm.zeros({B, self.segment + 1}, {dtype = "u8", device = "meta"})
        local prefix = dm.zeros({B, self.ctx}, {dtype = "u8", device = "meta"})
        local out = self.model:forward(x, prefix, {state = {}})
        segments.each(out.state or {}, function(_, _, t)
          r.bytes = r.bytes + bytes_of(t)
          r.blocks = r.blocks + core.cuda_block_size(bytes_of(t))
        end)
      end)
    end)
  end)
  self.state_at = r
  return r
end

--[[ One step at B × T on the meta device; watch_at: the allocation at which to
sort the live bytes; scratch: the CUDA kernels' scratch charged where they take
it (plan.CARD; false: none). Returns the phases in order, each {name, peak, at,
blocks} (bytes over the session's start, the allocation number within the step). ]]
function Session:run(B, T, watch_at, scratch)
  local S, rows = self:segments_of(T)
  local order = self:run_rows(B, rows or T, watch_at, scratch)
  if S and S > 3 then
    -- The step's peak is where its backward begins: the first sweep has kept the state at every
    -- boundary, S - 1 of them, and the backward frees them as it goes (a middle segment's holds
    -- its start's copy and its end's gradient besides). Three segments run here, the other S - 3
    -- are added to the forward and the backward (the optimiser's phase holds none). This assumes
    -- the Engram rows' running sum (Engram:fold) grows slower than the boundary states go: true
    -- of text, where most n-grams a segment reads were read before.
    local st = self:boundary_state(B)
    for _, p in ipairs(order) do
      if p.name == "forward" or p.name == "backward" then
        p.peak, p.blocks = p.peak + (S - 3) * st.bytes, p.blocks + (S - 3) * st.blocks
      end
    end
  end
  return order
end

-- One step at B × T as it runs (Session:run)
function Session:run_rows(B, T, watch_at, scratch)
  local phases, order, current = {}, {}, nil
  local function close()
    if not current then return end
    local t = core.meta_trace()
    local p = phases[current]
    if not p then
      p = {name = current}
      phases[current] = p
      order[#order + 1] = p
    end
    if not p.peak or t.peak > p.peak then p.peak, p.at = t.peak, t.peak_at end
    p.blocks = math.max(p.blocks or 0, t.blocks_peak)
  end
  local function mark(name)
    close()
    current = name
    core.meta_trace_mark()
  end
  local function next_batch()             -- the loader's bytes, as the trainer copies them to the device
    local x = dm.zeros({B, T + 1}, {dtype = "u8", device = "meta"})
    return x, dm.zeros({B, self.ctx}, {dtype = "u8", device = "meta"})
  end
  core.meta_trace_reset()
  if watch_at then core.meta_watch(watch_at, self.groups) end
  if scratch then core.plan_card(plan.CARD) end
  local ok, err = pcall(on_meta, self.compute, function()
    plan.step(self.model, self.opt, next_batch, self.grad_accum, mark, self.segment)
  end)
  core.plan_card(nil)
  close()
  if not ok then
    core.meta_watch(0)
    error(err, 0)
  end
  for _, p in ipairs(order) do
    p.peak = p.peak - self.base.current
    p.blocks = p.blocks - self.base.blocks
  end
  return order
end

--[[ The prediction at B × T: {peak (bytes as asked), blocks (in allocator
blocks), need (blocks and what is outside the allocator), phase, at}; the
device's bytes only (engram.ram tables taken out), the kernels' scratch
included. The peak is the largest of each phase's most. ]]
function Session:measure(B, T)
  local best = nil
  for _, p in ipairs(self:run(B, T, nil, true)) do
    local peak = p.peak - self.host_bytes
    if not best or peak > best.peak then
      best = {peak = peak, blocks = p.blocks - self.host_blocks, phase = p.name, at = p.at}
    end
  end
  local outside = 0
  for _, o in ipairs(plan.OUTSIDE) do outside = outside + o.bytes end
  best.outside = outside
  best.need = best.blocks + outside
  return best
end

-- The most the meta device sees at B × T without any kernel scratch (the device's bytes only).
function Session:seen(B, T)
  local seen = 0
  for _, p in ipairs(self:run(B, T)) do seen = math.max(seen, p.peak - self.host_bytes) end
  return seen
end

--[[ The live bytes at the peak of B × T, sorted by holder: the prediction with
`parts` (a kernel's scratch among them, kind "scratch", when the peak is
where one is taken), and `seen`, the same step's most without any kernel scratch. ]]
function Session:attribute(B, T)
  local r = self:measure(B, T)
  local at = r.at
  if at == 0 then            -- the phase's most was where it began: sort at the step's own peak
    local top
    for _, p in ipairs(self:run(B, T, nil, true)) do if not top or p.peak > top.peak then top = p end end
    at = top.at
  end
  self:run(B, T, at, true)
  local w = core.meta_watch_result()
  if not w then error("plan: the step made fewer allocations than the first run (" .. at .. ")", 0) end
  r.parts = {}
  for _, p in ipairs(w.parts) do
    local bytes = p.bytes
    if p.kind == "other" then bytes = bytes - self.base.current end      -- meta tensors from before the session
    if p.name ~= "host" then r.parts[#r.parts + 1] = {name = p.name, kind = p.kind, bytes = bytes} end
  end
  local S = self:segments_of(T)
  if S and S > 3 and (r.phase == "forward" or r.phase == "backward") then
    local st = self:boundary_state(B)
    r.parts[#r.parts + 1] = {name = string.format("boundary states of %d more segments (%s each)", S - 3,
                                                  size(st.bytes)), kind = "states", bytes = (S - 3) * st.bytes}
  end
  r.watched = w.current - self.base.current - self.host_bytes
  r.where, r.last = w.where, w.last
  r.seen = self:seen(B, T)
  return r
end

local function fits(self, B, T, memory)
  local r = self:measure(B, T)
  return r.need <= memory, r
end

--[[ The largest B × T whose need fits `memory` bytes: seq a power of two from
64 (or the config's seq), batch an integer; of equal ones, the config's seq,
else the longest. Returns {batch, seq, tokens, need,
by_seq = {{seq, batch, tokens, need}, ...}}, or nil and the smallest need. ]]
function Session:propose(memory)
  local seqs, seen = {}, {}
  for e = 6, 20 do seqs[#seqs + 1] = 2 ^ e | 0 end
  seqs[#seqs + 1] = self.cfg.seq
  table.sort(seqs)
  local by_seq, best, smallest = {}, nil, nil
  for _, T in ipairs(seqs) do
    if not seen[T] then
      seen[T] = true
      local ok, r = fits(self, 1, T, memory)
      smallest = smallest or {seq = T, need = r.need}
      if not ok then break end
      local lo, lo_r, hi = 1, r, nil        -- lo fits; hi does not
      local B = 2
      while not hi do
        local ok2, r2 = fits(self, B, T, memory)
        if ok2 then lo, lo_r = B, r2 else hi = B end
        if B >= 2 ^ 24 then break end
        B = B * 2
      end
      hi = hi or lo + 1
      while hi - lo > 1 do
        local mid = (lo + hi) // 2
        local ok2, r2 = fits(self, mid, T, memory)
        if ok2 then lo, lo_r = mid, r2 else hi = mid end
      end
      local row = {seq = T, batch = lo, tokens = lo * T, need = lo_r.need}
      by_seq[#by_seq + 1] = row
      local tie = best and row.tokens == best.tokens and best.seq ~= self.cfg.seq   -- (the longer seq wins)
      if not best or row.tokens > best.tokens or tie then best = row end
    end
  end
  if not best then return nil, smallest end
  return {batch = best.batch, seq = best.seq, tokens = best.tokens, need = best.need, by_seq = by_seq}
end

-- Free the model and the optimiser's state now.
function Session:close()
  self.opt:free()
  for _, p in ipairs(self.model:named_parameters()) do p.tensor:free() end
  for _, b in ipairs(self.model:named_buffers()) do b.tensor:free() end
end

---------------------------------------------------------------- the report

--[[ The plan of cfg: its table at cfg.batch × cfg.seq and, with opts.memory
(bytes), the proposal. opts.root: the folder holding models/. ]]
function plan.report(cfg, opts)
  opts = opts or {}
  local s = plan.session(cfg, opts)
  local ok, r = pcall(function()
    local r = s:attribute(cfg.batch, cfg.seq)
    r.name, r.batch, r.seq, r.grad_accum, r.dtype, r.ns_dtype = cfg.name, cfg.batch, cfg.seq, cfg.grad_accum,
                                                                  cfg.dtype, s.ns_dtype
    r.segment = cfg.model.segment
    r.segments = s:segments_of(cfg.seq)
    r.state = r.segments and s:boundary_state(cfg.batch) or nil
    r.host = s.ram and s.host_bytes or nil
    if opts.memory then
      r.memory = opts.memory
      r.fits = r.need <= opts.memory
      local p, smallest = s:propose(opts.memory)
      r.proposal = p
      r.smallest = smallest
    end
    return r
  end)
  s:close()
  if not ok then error(r, 0) end
  return r
end

local labels = {
  flowing = "gradients on their way back (tape)",
  ["leaf gradients"] = "gradients of leaves outside the model",
  leaves = "leaves outside the model (Engram rows read)",
  other = "other tensors the step holds",
}

--[[ The rows of the table: {label, bytes, op = true for the ops under the
saved activations}; empty rows are left out. ]]
function plan.rows(r)
  local rows, saved, saved_total = {}, {}, 0
  for _, p in ipairs(r.parts) do
    if p.kind == "saved" then
      saved[#saved + 1] = p
      saved_total = saved_total + p.bytes
    end
  end
  table.sort(saved, function(a, b) return a.bytes > b.bytes or (a.bytes == b.bytes and a.name < b.name) end)
  local placed = false
  for _, p in ipairs(r.parts) do
    if p.kind == "saved" then
      if not placed then
        rows[#rows + 1] = {label = "activations saved for backward", bytes = saved_total}
        for _, q in ipairs(saved) do rows[#rows + 1] = {label = q.name, bytes = q.bytes, op = true} end
        placed = true
      end
    elseif p.bytes ~= 0 then
      local label = p.kind == "scratch" and "kernel scratch: " .. p.name or labels[p.name] or p.name
      rows[#rows + 1] = {label = label, bytes = p.bytes}
    end
  end
  return rows
end

local W = 76     -- the label column

function plan.format(r)
  local out = {}
  local function say(fmt, ...) out[#out + 1] = string.format(fmt, ...) end
  local unit, scale = "GiB", GiB                   -- MiB for a model under a GiB
  if r.need < GiB then unit, scale = "MiB", 2 ^ 20 end
  local function line(label, bytes, share)
    local pct = share and string.format(" %6.1f%%", 100 * bytes / r.peak) or ""
    say("%-" .. W .. "s %8.2f%s", label, bytes / scale, pct)
  end
  say("%s: batch %d x seq %d, grad_accum %d; products in %s, Newton-Schulz in %s", r.name, r.batch, r.seq,
      r.grad_accum, r.dtype, r.ns_dtype)
  if r.segments then
    say("by %d segments of %d (model.segment): a boundary state of %s kept for each; the step's peak where " ..
        "its backward begins, all of them alive", r.segments, r.segment, size(r.state.bytes))
  end
  say("the peak: in the %s, at allocation %d of the step (%s, in %s)", r.phase, r.at, size(r.last),
      r.where ~= "" and r.where or "no op")
  say("")
  say("%-" .. W .. "s %8s %7s", "device memory at the peak", unit, "share")
  for _, row in ipairs(plan.rows(r)) do line(row.op and "  " .. row.label or row.label, row.bytes, true) end
  say("%s", string.rep("-", W + 17))
  line("predicted peak: bytes allocated, as dm.memory(\"cuda\").peak", r.peak)
  line("the same in the caching allocator's blocks", r.blocks)
  for _, o in ipairs(plan.OUTSIDE) do line("outside the allocator: " .. o.name .. " (" .. o.where .. ")", o.bytes) end
  line("device memory needed", r.need)
  if r.host then line("in host memory (engram.ram): Engram tables, their Adam moments", r.host) end
  if r.memory then
    say("")
    say("in %s: batch %d x seq %d %s", size(r.memory), r.batch, r.seq, r.fits and "fits" or "does not fit")
    if not r.fits then
      say("to keep batch x seq: --set model.engram.ram=true (the tables in host memory), model.recompute=true, " ..
          "optim.momentum_dtype=bf16; experiments/b1_16gb.lua sets all three for b1")
    end
    local p = r.proposal
    if not p then return table.concat(out, "\n") end
    say("proposal: batch %d x seq %d = %d tokens a micro-batch (needs %s)", p.batch, p.seq, p.tokens, size(p.need))
    say("%8s %8s %10s %10s", "seq", "batch", "tokens", "needs " .. unit)
    for _, row in ipairs(p.by_seq) do
      say("%8d %8d %10d %10.2f%s", row.seq, row.batch, row.tokens, row.need / scale, row.seq == p.seq and "  <" or "")
    end
  end
  return table.concat(out, "\n")
end

-- Why there is no proposal: the smallest shape tried and what it needs.
function plan.nothing_fits(r)
  local s = r.smallest
  return string.format("nothing fits in %s: even batch 1 x seq %d needs %s", size(r.memory), s.seq, size(s.need))
end

-- The report as plain data for --json: bytes throughout.
function plan.plain(r)
  local rows = {}
  for _, row in ipairs(plan.rows(r)) do
    rows[#rows + 1] = {category = row.label, bytes = row.bytes, share = row.bytes / r.peak, saved_by_op = row.op}
  end
  return {experiment = r.name, batch = r.batch, seq = r.seq, grad_accum = r.grad_accum, dtype = r.dtype,
          ns_dtype = r.ns_dtype, phase = r.phase, segments = r.segments,
          state_bytes_per_segment = r.state and r.state.bytes, peak_bytes = r.peak, blocks_bytes = r.blocks,
          outside_bytes = r.outside, need_bytes = r.need, host_bytes = r.host, rows = rows,
          memory_bytes = r.memory, fits = r.fits, proposal = r.proposal}
end

return plan
