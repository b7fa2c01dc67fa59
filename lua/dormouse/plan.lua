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
  - the scratch CUDA kernels take for themselves (dm_scratch in kernels/*.cu),
    op by op (plan.scratch): while an op runs on the meta device, its forward
    or its backward, its scratch is a meta allocation of its own
    (core.meta_scratch), so the trace's peak holds a scratch only where it is
    live and the table shows it only then. The optimiser's kernels are no ops:
    the largest of their scratch (a few KB) is added to that phase's peak;
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

--[[ One optimiser step as the trainer takes it on whole rows (train.lua, Run:train_step; a
step by segments is planned as one segment's: Session:run),
with the same allocations and no value read back, so that it runs on the meta
device as on the GPU: next_batch() -> x, prefix on the model's device;
grad_accum micro-batches of forward and backward; the balancing; the global
norm's clipping and every group's update (Optimizer:step, with the update
applied whatever the norm: on the meta device the norm has no value); zero_grad.
mark(phase), when given, is called as "forward", "backward" and "optimiser"
begin. Everything the step makes is released at its end (dm.scope). ]]
function plan.step(model, opt, next_batch, grad_accum, mark)
  mark = mark or function() end
  dm.scope(function()
    for _ = 1, grad_accum do
      mark("forward")
      local x, prefix = next_batch()
      train.micro_batch(model, x, prefix, 1 / grad_accum, false, function(phase)
        if phase == "forward" then mark("backward") end      -- the planner's marks open a phase
      end)
    end
    mark("optimiser")
    train.balance(model)
    core.clip_grads(opt:grads(), opt.clip)
    for _, g in ipairs(opt.groups) do g:update(1, 1) end
    opt:zero_grad()
  end)
end

---------------------------------------------------------------- what the meta device cannot see

-- Taken from the driver apart from the caching allocator: not in dm.memory, but on the card.
plan.OUTSIDE = {
  {name = "cuBLASLt workspace", where = "kernels/gemm.c WORKSPACE", bytes = 32 << 20},
}

-- The most dynamic shared memory a block may opt in to on sm_90 (H100, H200):
-- cudaDevAttrMaxSharedMemoryPerBlockOptin = 227 KiB. KDA keeps its state there when it fits.
local SMEM_OPTIN = 232448
local SM_COUNT = 132          -- the planned card's SMs (an H200's): dm_colsum's partials follow it
-- the kernels' own sizes, as their family headers define them (vm/ops/*.h; core.kernel_sizes)
local K = core.kernel_sizes()
local KDA_CHUNK = K.kda_chunk  -- the backward's checkpoint interval (the model sets none); the chunked kernels' chunk
local KC, KC_MIN_T, KC_MAXD = K.kda_chunk, K.kda_chunked_min_t, K.kda_cuda_chunk_maxd
local SUMSQ_CHUNK = K.sumsq_chunk      -- elements per block of the sums of squares (one partial each)
local BS_CHUNK = K.bucket_sort_chunk   -- keys per block of the bucket sort (a row of counters each)
local CONV_TL = K.conv_run     -- positions per run of the conv's weight gradient (a partial each)
local GATE_ROWS = K.kda_gate_rows      -- rows per run of kda_gate's backward (2 hd partial sums each)
local TC_RANKS = K.moe_tc_ranks        -- the ranks the tensor-core expert kernels take
local TC_TM, TC_GT, TC_FS, TC_DS = K.moe_tc_tm, K.moe_tc_gt, K.moe_tc_fs, K.moe_tc_ds

local function ceil_div(a, b) return (a + b - 1) // b end

local f32, i64, f64 = 4, 8, 8

-- dm_colsum's partial sums (kernels/model.cuh): rows summed per column in chunks, DM_COLSUM_PER_SM an SM
local function colsum(rows, cols)
  local chunks = math.max(1, math.min(SM_COUNT * K.colsum_per_sm // ceil_div(cols, 32),
                                      ceil_div(rows, K.colsum_min_rows), 65535))
  return f64 * chunks * cols
end

-- kda_gate's backward runs (kernels/kda.cu gate_rows_per): GATE_ROWS rows each, doubled until the grid fits
local function gate_runs(rows)
  local per = GATE_ROWS
  while ceil_div(rows, per) > 65535 do per = per * 2 end
  return ceil_div(rows, per)
end

-- dm_bucket_sort's counters (kernels/model.cuh): a row of nb per block of keys
local function bucket_sort(n, nb) return n > 0 and i64 * ceil_div(n, BS_CHUNK) * nb or 0 end

-- kernels/moe.cu tc_plan: the streaming kernels' units over nch chunks, and psize floats a partial slot
local function tc_units(E, rows, nch, psize)
  local ucap = (E + (rows // TC_TM + E) // TC_GT + 1) * nch
  local scap = psize > 0 and 2 * rows // (TC_GT * TC_TM) or 0
  return (i64 * (2 * (E + 1) + ucap + scap) + 15) // 16 * 16 + f32 * scap * psize
end

-- kernels/engram.cu radix_sort: its bucket offsets and one pass's counters
local function radix_sort(n) return i64 * 257 + bucket_sort(n, 256) end

--[[ The device scratch the CUDA kernels of one step take for themselves
(dm_scratch in kernels/*.cu: counted by dm.memory("cuda"), unseen on the meta
device). s: {B, T, d, heads, head_dim, experts, top_k, rank, ffn, n_sub (Engram
sub-tables, 0 without Engram), conv_width (the short convolutions' widest kernel), ram (Engram's rows are found on the host),
grad_accum, dtype (of the products), grads = {numel of each gradient the
clipping reads}, muon = {{stack, rows, cols} per Muon shape group},
kda_chunked (the build has the chunked KDA kernels: the kda op takes `algo`)}.
Returns
  ops: {{op, phase = "forward"|"backward", bytes, what, where}, ...}, what each
       op's forward or backward holds while it runs (the most of its calls: one
       entry an op and phase; a forward run again by a recompute takes it again);
  optimiser_ops: the same for the ops of the optimiser's phase (the Engram
       gradient summed over micro-batches);
  optimiser: {bytes, what, where}, the largest of the optimiser's kernels,
       which are no ops (clipping, Newton-Schulz).
Kernels whose scratch is a few scalars (the checks, Adam's and Muon's
constants) are left out. ]]
function plan.scratch(s)
  local B, T, H, dk = s.B, s.T, s.heads, s.head_dim
  local dv, hd, N = dk, s.heads * s.head_dim, s.B * s.T
  local bh = B * H            -- (batch, head) pairs: one block each
  local vec = 4 * dk + 3 * dv + 1 + 2 * 8 * dv          -- kda_vec_count (kernels/kda.cu), 8 warps
  local function state_in_smem(copies) return f32 * (vec + copies * dk * dv) <= SMEM_OPTIN end
  local nc, len = ceil_div(T, KDA_CHUNK), math.min(KDA_CHUNK, T)
  local chunked = s.kda_chunked and T >= KC_MIN_T and dk <= KC_MAXD and dv <= KC_MAXD
  local chunks = bh * ceil_div(T, KC)                      -- kc_front: tiles of KC x KC per chunk, and the decays
  local E, rows, R = s.experts, N * s.top_k, s.rank      -- MoE assignments, sorted by expert
  local tcap = ceil_div(rows, TC_TM) + E                  -- make_tiles: its tiles at most
  local tiles = i64 * (E + 1 + tcap)
  local tc = (s.dtype == "bf16" or s.dtype == "f16") and TC_RANKS[R] and s.d % 8 == 0   -- the tensor-core kernels
  local lookups = N * s.n_sub                             -- Engram rows read, one per sub-table
  local all = s.grad_accum * lookups
  local conv_c = math.max(hd, s.n_sub > 0 and s.d or 0)  -- KDA's convolutions over hd channels, Engram's over d
  local ops = {}
  local function op(name, phase, bytes, what, where)
    if bytes > 0 then ops[#ops + 1] = {op = name, phase = phase, bytes = bytes, what = what, where = where} end
  end
  if chunked then
    op("kda", "forward", f32 * chunks * (5 * KC * KC + KC), "kda chunked forward tiles",
       "kernels/kda_chunk.cu kc_front")
    op("kda", "backward", f32 * chunks * (16 * KC * KC + KC), "kda chunked backward tiles",
       "kernels/kda_chunk.cu kc_front")
  else
    op("kda", "forward", f32 * bh * dk * dv * (state_in_smem(1) and 0 or 1), "kda forward state",
       "kernels/kda.cu kda_forward")
    op("kda", "backward", f32 * bh * ((nc + len) * dk * dv + len * dv) +
       f32 * bh * 2 * dk * dv * (state_in_smem(2) and 0 or 1), "kda backward states", "kernels/kda.cu kda_backward")
  end
  op("kda_gate", "backward", f64 * hd + f64 * gate_runs(N) * 2 * hd, "kda_gate's channel sums",
     "kernels/kda.cu gate_backward")
  op("causal_conv1d", "backward", f64 * B * ceil_div(T, CONV_TL) * s.conv_width * conv_c, "causal_conv1d weight partials",
     "kernels/blocks.cu conv_bwd_runs")
  op("rmsnorm", "backward", math.max(colsum(N, s.d), colsum(N * H, dk)), "rmsnorm gain partials",
     "kernels/blocks.cu cuda_rownorm_bwd")
  op("cross_entropy", "forward", f64 * N, "cross-entropy partial sums", "kernels/blocks.cu cuda_ce")
  op("moe_route", "forward", i64 * (E + 1) + bucket_sort(rows, E), "moe_route counts", "kernels/moe.cu bucket_counts")
  op("moe_sort", "forward", bucket_sort(rows, E), "moe_sort counters", "kernels/moe.cu cuda_sort")
  if tc then
    local F, d = s.ffn, s.d
    op("moe_experts", "forward", 2 * rows * R + tiles + tc_units(E, rows, ceil_div(F, TC_FS), 0),
       "moe experts hidden rows", "kernels/moe.cu tc_forward")
    local sums = math.max(tc_units(E, rows, ceil_div(F, TC_FS), R * F), tc_units(E, rows, ceil_div(d, TC_DS), d * 2 * R),
                          f32 * tcap * 2 * R)
    op("moe_experts", "backward", (2 * 3 + f32 * 2) * rows * R + tiles + sums, "moe experts backward rows",
       "kernels/moe.cu tc_backward")
  else
    local c = s.dtype == "f64" and f64 or f32
    op("moe_experts", "forward", tiles, "moe expert tiles", "kernels/moe.cu experts_forward")
    op("moe_experts", "backward", 5 * c * rows * R + tiles, "moe experts backward rows",
       "kernels/moe.cu experts_backward")
  end
  if not s.ram then            -- (with the tables in host memory a host thread finds the rows)
    op("engram_unique", "forward", i64 * (6 * lookups + 2) + radix_sort(lookups), "engram_unique sort",
       "kernels/engram.cu")
  end
  local step_ops = ops
  ops = {}
  if s.grad_accum > 1 and s.n_sub > 0 then     -- Engram:sparse_grad sums the micro-batches' rows
    if not s.ram then
      op("engram_unique", "forward", i64 * (6 * all + 2) + radix_sort(all), "engram_unique of the step's rows",
         "kernels/engram.cu")
    end
    op("engram_sparse_grad", "forward", i64 * (6 * all + 1) + radix_sort(all), "engram_sparse_grad",
       "kernels/engram.cu")
  end
  local sumsq = 0
  for _, n in ipairs(s.grads) do sumsq = sumsq + ceil_div(n, SUMSQ_CHUNK) end
  local ns = 0
  for _, g in ipairs(s.muon) do          -- each matrix's slices' partials (f64) and its factor (f32)
    local pitch = ceil_div(g.cols, 8) * 8 -- the stack's rows, padded to 8 on CUDA (vm/ops/optim.c stack_pitch)
    ns = math.max(ns, f64 * g.stack * math.min(64, ceil_div(g.rows * pitch, 16384)) + f32 * g.stack)
  end
  local best = {bytes = 0, what = "none", where = ""}
  for _, k in ipairs {
    {f64 * math.max(sumsq, 1), "clipping's partial sums", "kernels/optim.cu cuda_sumsq"},
    {ns, "Newton-Schulz norm partials", "kernels/optim.cu cuda_ns_normalize"},
  } do
    if k[1] > best.bytes then best = {bytes = k[1], what = k[2], where = k[3]} end
  end
  return {ops = step_ops, optimiser_ops = ops, optimiser = best}
end

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

local dtype_bytes = {f64 = 8, i64 = 8, f32 = 4, i32 = 4, bf16 = 2, f16 = 2, u8 = 1}
local function bytes_of(t) return t:numel() * dtype_bytes[t.dtype] end

--[[ The model and optimiser of cfg on the meta device. opts.root: the folder
holding models/ ("."). ]]
function plan.session(cfg, opts)
  opts = opts or {}
  local m = config.plain(cfg.model)
  local ram = m.engram.ram
  m.engram.ram = false                    -- planned on the device; the tables' bytes are moved out below
  local ocfg = config.plain(cfg.optim)
  ocfg.ns_dtype = ocfg.ns_dtype or "bf16"  -- the GPU's default (optim.new picks by the parameters' device)
  local self = setmetatable({cfg = cfg, m = m, ram = ram, compute = cfg.dtype, grad_accum = cfg.grad_accum,
                             ctx = train.engram_ctx(cfg), ns_dtype = ocfg.ns_dtype, segment = m.segment}, Session)
  collectgarbage()          -- meta tensors no one holds go now, not in the middle of a step
  core.meta_trace_reset()
  self.base = core.meta_trace()
  on_meta(self.compute, function()
    dm.manual_seed(cfg.seed)
    self.model = train.build_model({model = m}, opts.root or ".")
    self.opt = optim.new(self.model, ocfg, cfg.schedule, cfg.steps, {quiet = true})
  end)
  self:sort_holders()
  return self
end

-- The groups the live bytes are sorted into (vm/lua/plan.c), and what the scratch model needs.
function Session:sort_holders()
  local host, params, grads, counts = {}, {}, {}, {}
  self.conv_width = 0          -- the widest short convolution's kernel (its weight [C, K], a conv* parameter)
  for _, p in ipairs(self.model:named_parameters()) do
    if p.name:match("conv[%w_]*$") and p.tensor:dim() == 2 then
      self.conv_width = math.max(self.conv_width, p.tensor:size(2))
    end
  end
  local engram = self.model.block and self.model.block.engram
  local on_host = {}
  if self.ram and engram then on_host[engram.table] = true end
  for _, p in ipairs(self.model:named_parameters()) do
    if on_host[p.tensor] then host[#host + 1] = p.tensor else params[#params + 1] = p.tensor end
    if p.tensor:requires_grad() then grads[#grads + 1] = p.tensor; counts[#counts + 1] = p.tensor:numel() end
  end
  for _, b in ipairs(self.model:named_buffers()) do params[#params + 1] = b.tensor end
  local groups = {}
  self.muon = {}
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
    if g.kind == "muon" then
      local by = {}
      for _, p in ipairs(g.params) do
        local sh = p:shape()
        local key = sh[#sh - 1] .. "x" .. sh[#sh]
        if not by[key] then                          -- one Newton-Schulz stack per matrix shape (vm/ops/optim.c)
          by[key] = {stack = 0, rows = sh[#sh - 1], cols = sh[#sh]}
          self.muon[#self.muon + 1] = by[key]
        end
        by[key].stack = by[key].stack + (#sh == 3 and sh[1] or 1)
      end
    end
  end
  self.host_bytes, self.host_blocks = 0, 0
  for _, t in ipairs(host) do
    self.host_bytes = self.host_bytes + bytes_of(t)
    self.host_blocks = self.host_blocks + core.cuda_block_size(bytes_of(t))
  end
  self.grad_counts = counts
  for _, op in ipairs(core.ops()) do
    if op.name == "kda" then self.kda_chunked = op.spellings.algo ~= nil end
  end
  self.groups = {{name = "host", tensors = host}, {name = "parameters and buffers", tensors = params},
                 {name = "gradients", tensors = grads, grads = true}}
  for _, g in ipairs(groups) do self.groups[#self.groups + 1] = g end
end

-- The scratch model's view of this model at B × T.
function Session:scratch(B, T)
  local m = self.m
  local engram = self.model.block and self.model.block.engram
  local grads = {table.unpack(self.grad_counts)}
  if engram then grads[#grads + 1] = B * T * engram.n_sub * engram.width * self.grad_accum end   -- every segment's
  -- the kernels see one segment's rows
  return plan.scratch {B = B, T = self:pass_rows(T), d = m.d, heads = m.heads, head_dim = m.head_dim, experts = m.experts,
                       top_k = m.top_k, rank = m.expert_rank, ffn = m.ffn, n_sub = engram and engram.n_sub or 0, ram = self.ram,
                       grad_accum = self.grad_accum, dtype = self.compute, grads = grads, muon = self.muon,
                       kda_chunked = self.kda_chunked, conv_width = self.conv_width}
end

--[[ One step at B × T on the meta device; watch_at: the allocation at which to
sort the live bytes; scratch: plan.scratch's ops, charged while they run (nil:
none). Returns the phases in order, each {name, peak, at, blocks} (bytes over
the session's start, the allocation number within the step). ]]
-- The rows a pass of a step of B × T sees: by segments (model.segment) a step holds one segment's
-- pass at a time, so its peak is that of a step at T = segment (the boundary states, a few MiB, aside)
function Session:pass_rows(T) return self.segment and math.min(T, self.segment) or T end

function Session:run(B, T, watch_at, scratch)
  T = self:pass_rows(T)
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
    if scratch then core.meta_scratch(name == "optimiser" and scratch.optimiser_ops or scratch.ops) end
    core.meta_trace_mark()
  end
  local function next_batch()             -- the loader's bytes, as the trainer copies them to the device
    local x = dm.zeros({B, T + 1}, {dtype = "u8", device = "meta"})
    return x, dm.zeros({B, self.ctx}, {dtype = "u8", device = "meta"})
  end
  core.meta_trace_reset()
  if watch_at then core.meta_watch(watch_at, self.groups) end
  local ok, err = pcall(on_meta, self.compute, function()
    plan.step(self.model, self.opt, next_batch, self.grad_accum, mark)
  end)
  close()
  core.meta_scratch(nil)
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

local NO_SCRATCH = {bytes = 0, what = "none", where = ""}

--[[ The prediction at B × T: {peak (bytes as asked), blocks (in allocator
blocks), need (blocks and what is outside the allocator), phase, at, scratch =
{bytes, what, where} (added to the trace: the optimiser's kernels that are no
ops, in that phase; the ops' scratch is in the trace already)}; the device's
bytes only (engram.ram tables taken out). The peak is the largest of each
phase's most (its scratch included). ]]
function Session:measure(B, T)
  local scratch = self:scratch(B, T)
  local best = nil
  for _, p in ipairs(self:run(B, T, nil, scratch)) do
    local s = p.name == "optimiser" and scratch.optimiser or NO_SCRATCH
    local peak = p.peak - self.host_bytes + s.bytes
    if not best or peak > best.peak then
      best = {peak = peak, blocks = p.blocks - self.host_blocks + (s.bytes > 0 and core.cuda_block_size(s.bytes) or 0),
              phase = p.name, at = p.at, scratch = s}
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
`parts` (the scratch of the ops open at the peak among them, kind "scratch"),
and `seen`, the same step's most without any kernel scratch. ]]
function Session:attribute(B, T)
  local r = self:measure(B, T)
  local scratch = self:scratch(B, T)
  local at = r.at
  if at == 0 then            -- the phase's most was where it began: sort at the step's own peak
    local top
    for _, p in ipairs(self:run(B, T, nil, scratch)) do if not top or p.peak > top.peak then top = p end end
    at = top.at
  end
  self:run(B, T, at, scratch)
  local w = core.meta_watch_result()
  if not w then error("plan: the step made fewer allocations than the first run (" .. at .. ")", 0) end
  r.parts = {}
  for _, p in ipairs(w.parts) do
    local bytes = p.bytes
    if p.kind == "other" then bytes = bytes - self.base.current end      -- meta tensors from before the session
    if p.name ~= "host" then r.parts[#r.parts + 1] = {name = p.name, kind = p.kind, bytes = bytes} end
  end
  if r.scratch.bytes > 0 then
    r.parts[#r.parts + 1] = {name = r.scratch.what .. " (" .. r.scratch.where .. ")", kind = "scratch",
                             bytes = r.scratch.bytes}
  end
  r.watched = w.current - self.base.current - self.host_bytes + r.scratch.bytes
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
  for _, g in ipairs(self.opt.groups) do
    for _, slot in ipairs(g.slots) do for _, t in ipairs(g.state[slot]) do t:free() end end
  end
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
  if r.segment and r.segment < r.seq then
    say("by segments of %d (model.segment): planned as one segment's pass, batch %d x seq %d; the boundary " ..
        "states aside", r.segment, r.batch, r.segment)
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
          ns_dtype = r.ns_dtype, phase = r.phase, peak_bytes = r.peak, blocks_bytes = r.blocks,
          outside_bytes = r.outside, need_bytes = r.need, host_bytes = r.host, rows = rows,
          memory_bytes = r.memory, fits = r.fits, proposal = r.proposal}
end

return plan
