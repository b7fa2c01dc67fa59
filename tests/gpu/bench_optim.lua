--[[
The optimiser step of b1 on the GPU, by part: each Muon shape group's whole
update (momentum, Newton-Schulz, apply) and its Newton-Schulz alone, the
gradient norm and clipping, AdamW, and the whole step as the trainer takes it
(opt:prepare + opt:step_async). Each line gives ms (median of REPS, the
device synchronised around each) and, for the memory-bound parts, the bytes
they must move at the least and the fraction of the copy bandwidth that
reaches (measured in the same run).
  dormouse run tests/gpu/bench_optim.lua
  DRY=1 dormouse run tests/gpu/bench_optim.lua       (the script on the CPU, tiny; times mean nothing)
  DM_ONLY=64x5461 ncu ... dormouse run tests/gpu/bench_optim.lua
                       one Muon update of that shape group, once, and nothing else (for a kernel profiler)
]]
local dm = require "dormouse"
local common = require "tests.gpu.common"
local core = require "dormouse.core"
local nn = require "dormouse.nn"
local config = require "dormouse.config"
local train = require "dormouse.train"
local optim = require "dormouse.optim"

local DRY = os.getenv("DRY") ~= nil
if not DRY and not common.gpu_or_skip(dm.cuda, "bench_optim") then return end
local DEVICE = DRY and "cpu" or "cuda"
local REPS = DRY and 2 or 5
local file = os.getenv("DM_BENCH_CONFIG") or (DRY and "experiments/tiny.lua" or "experiments/b1.lua")

local function sync() if not DRY then dm.cuda.synchronize() end end

local function time(fn)
  local t = {}
  for i = 1, REPS + 1 do
    sync()
    local t0 = core.now()
    fn()
    sync()
    t[i] = (core.now() - t0) * 1e3
  end
  table.remove(t, 1)                     -- the first call warms up (allocator, cuBLAS plans)
  table.sort(t)
  return t[(#t + 1) // 2]
end

local sets = {"device=" .. DEVICE}
if DRY then sets[#sets + 1] = "dtype=f32" end
local cfg = config.load(file, sets)
dm.manual_seed(cfg.seed)
local model = nn.build({device = DEVICE, compute_dtype = DRY and "f32" or cfg.dtype}, train.build_model, cfg, ".")
local opt = optim.new(model, cfg.optim, cfg.schedule, cfg.steps, {quiet = true})
for i, e in ipairs(model:named_parameters()) do
  if e.name ~= "block.engram.table" then e.tensor.grad = dm.randn(e.tensor:shape(), {seed = i, device = DEVICE}) * 1e-3 end
end

-- the copy ceiling: one f32 tensor of 256 MiB copied
local src = dm.randn({64, 1024, 1024}, {device = DEVICE})
local dst = dm.zeros({64, 1024, 1024}, {device = DEVICE})
local copy_ms = time(function() dst:copy_(src) end)
local copy_gbs = 2 * 4 * src:numel() / copy_ms / 1e6
src:free(); dst:free()

local rows = {}
local function row(name, ms, bytes, note)
  rows[#rows + 1] = {name = name, ms = ms, bytes = bytes, note = note or ""}
end

local muon
for _, g in ipairs(opt.groups) do if g.kind == "muon" then muon = g end end
local hp = {lr = 1e-9, momentum = muon.momentum, nesterov = muon.nesterov, weight_decay = 0,
            ns_steps = muon.ns_steps, coeffs = muon.coeffs, ns_dtype = muon.ns_dtype}
local mom_bytes = muon.state.momentum[1].dtype == "bf16" and 2 or 4

-- Muon's members by matrix shape (the kernels group them so)
local by_shape, order = {}, {}
for i, p in ipairs(muon.params) do
  local s = p:shape()
  local key = s[#s - 1] .. "x" .. s[#s]
  if not by_shape[key] then by_shape[key] = {params = {}, bufs = {}, names = {}, stack = 0}; order[#order + 1] = key end
  local b = by_shape[key]
  b.params[#b.params + 1] = p
  b.bufs[#b.bufs + 1] = muon.state.momentum[i]
  b.names[#b.names + 1] = muon.entries[i].name
  b.stack = b.stack + (#s == 3 and s[1] or 1)
end

local only = os.getenv("DM_ONLY")
if only then
  local b = by_shape[only] or error("DM_ONLY: no Muon group of shape " .. only .. " (" .. table.concat(order, ", ") .. ")")
  sync()
  core.muon_step(b.params, b.bufs, hp)
  sync()
  print("bench_optim: one update of the Muon group " .. only)
  return
end

local muon_sum = 0
for _, key in ipairs(order) do
  local b = by_shape[key]
  local n = 0
  for _, p in ipairs(b.params) do n = n + p:numel() end
  local ms = time(function() core.muon_step(b.params, b.bufs, hp) end)
  muon_sum = muon_sum + ms
  -- at the least: the gradient read, the momentum read and written, the parameter read and written
  row(string.format("muon %s x %d", key, b.stack), ms, n * (4 + 2 * mom_bytes + 8), table.concat(b.names, " "))
  local m, c = tonumber(key:match("^(%d+)")), tonumber(key:match("x(%d+)$"))
  local x = dm.randn({b.stack, m, c}, {device = DEVICE})
  local ns_ms = time(function() core.newton_schulz(x, hp.ns_steps, hp.coeffs, hp.ns_dtype) end)
  -- (core.newton_schulz lays the stack out unpadded: the 5,461-column groups show cuBLAS's
  -- unaligned kernels here, which the update itself no longer takes)
  row("  newton-schulz alone (unpadded)", ns_ms, nil)
  x:free()
end
row("muon, its groups summed", muon_sum, nil)

local grads = {}
for _, p in ipairs(opt.params) do if p.grad then grads[#grads + 1] = p.grad end end
local gn = 0
for _, g in ipairs(grads) do gn = gn + g:numel() end
local sumsq = dm.zeros({1}, {dtype = "f64", device = DEVICE})
row("gradient norm only (max_norm 0)", time(function() core.clip_grads_async(grads, 0, sumsq) end), 4 * gn)
row("norm and clipping (every gradient scaled)", time(function() core.clip_grads_async(grads, 1e-6, sumsq) end),
    4 * gn * 3)

-- the step as the trainer takes it
local step = 0
local whole = time(function()
  step = step + 1
  opt:prepare(step)
  opt:step_async()
end)
row("the whole step (prepare + step_async)", whole, nil)

print(string.format("bench_optim: %s on %s; copy ceiling %.0f GB/s; Muon momentum in %s, Newton-Schulz in %s",
                    file, DRY and "the CPU" or "the GPU", copy_gbs, muon.state.momentum[1].dtype, hp.ns_dtype))
print(string.format("%-44s %9s %10s %8s  %s", "part", "ms", "floor GB", "of copy", "members"))
for _, r in ipairs(rows) do
  local frac = r.bytes and string.format("%7.1f%%", 100 * (r.bytes / copy_gbs / 1e6) / r.ms) or ""
  print(string.format("%-44s %9.3f %10s %8s  %s", r.name, r.ms, r.bytes and string.format("%.2f", r.bytes / 1e9) or "",
                      frac, r.note))
end
