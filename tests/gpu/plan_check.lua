--[[
dormouse plan against the GPU (issue: "checked against measured peaks on the
H200 for at least three shapes: within 10%"). For b1 at B x T = 2x1024,
4x1024, 8x1024, and 8x1024 with engram.ram: the plan's predicted peak (meta
device, lua/dormouse/plan.lua), then one real training step on the GPU
(plan.step: forward, backward, balancing, clipping, update, zero_grad, the
trainer's allocations) after a warm-up step, with dm.memory("cuda").peak reset
just before it. One line a shape: predicted, measured, their ratio, and the
allocator's blocks against what it reserved. Everything is freed between shapes.
First, op by op, the kernels' scratch: the peak of one forward and backward of
each op that takes scratch, planned on the meta device for plan.CARD, against
the same call on the GPU (each kernel sizes its dm_scratch with the function
its op charges to the plan, vm/ops/<family>.h): equal to the byte.
  dormouse run tests/gpu/plan_check.lua
  DRY=1 dormouse run tests/gpu/plan_check.lua     (the script itself, small shapes on the CPU)
]]
local dm = require "dormouse"
local core = require "dormouse.core"
local common = require "tests.gpu.common"
local nn = require "dormouse.nn"
local optim = require "dormouse.optim"
local config = require "dormouse.config"
local train = require "dormouse.train"
local plan = require "dormouse.plan"

local DRY = os.getenv("DRY") ~= nil
local DEVICE = DRY and "cpu" or "cuda"
if not DRY and not common.gpu_or_skip(dm.cuda, "plan_check") then return end

local checks = common.checks("plan_check")
local GiB = 2 ^ 30

local file = DRY and "experiments/small.lua" or "experiments/b1.lua"
local shapes = DRY and {{2, 128}, {4, 128}, {4, 256}}      -- (on the CPU the tables stay with the rest)
                   or {{2, 1024}, {4, 1024}, {8, 1024}, {8, 1024, ram = true},
                       {8, 1024, ram = true, small_card = true}}
-- the settings for a 16 GB card (docs/training.md): the block recomputed, bf16 momentum
local SMALL_CARD = {"model.recompute=true", "optim.momentum_dtype=bf16"}
-- on the CPU everything is f32 (Module:project), and so is Newton-Schulz there
local dry_sets = DRY and {"dtype=f32", "optim.ns_dtype=f32"} or {}

local function sync() if DEVICE == "cuda" then dm.cuda.synchronize() end end

local corpus = dm.data.open(dm.data.default_corpus(), {eval_bytes = 4096})

-- the measured peak of one step of cfg on the device, over what was allocated before the model
local function measure(cfg)
  local before = dm.memory(DEVICE).current
  dm.manual_seed(cfg.seed)
  local model = nn.build({device = DEVICE, compute_dtype = cfg.dtype}, train.build_model, cfg, ".")
  local opt = optim.new(model, cfg.optim, cfg.schedule, cfg.steps, {quiet = true})
  local orders = cfg.model.engram.orders
  local ctx = #orders > 0 and orders[#orders] - 1 or 0
  local k = 0
  local function next_batch()            -- as the trainer: the loader's host batch, copied to the device
    k = k + 1
    local x, prefix = corpus:batch(k, {batch = cfg.batch, seq = cfg.seq, seed = cfg.seed, ctx = ctx})
    if DEVICE ~= "cpu" then return x:to(DEVICE), prefix:to(DEVICE) end
    return x, prefix
  end
  plan.step(model, opt, next_batch, cfg.grad_accum)        -- the warm-up
  sync()
  local at = dm.memory(DEVICE).current
  dm.reset_peak(DEVICE)
  plan.step(model, opt, next_batch, cfg.grad_accum)
  sync()
  local mem = dm.memory(DEVICE)
  local m = {peak = mem.peak - before, reserved = mem.reserved, held = at - before}
  local engram = model.block and model.block.engram
  if engram and engram.host then engram.host:close() end       -- (engram.ram: its host table's threads)
  opt:free()
  for _, p in ipairs(model:named_parameters()) do p.tensor:free() end
  for _, b in ipairs(model:named_buffers()) do b.tensor:free() end
  collectgarbage()
  if DEVICE == "cuda" then dm.cuda.empty_cache() end
  m.left = dm.memory(DEVICE).current - before
  return m
end

-- ---- the kernels' scratch, op by op --------------------------------------------------------------

-- what each case runs: inputs made by make(device), then fn(inputs) forward and backward
local op_cases = {
  {"cross_entropy", function(dev)
    return {dm.zeros({8 * 1024 + 5, 256}, {device = dev, dtype = "bf16"}):requires_grad(true),
            dm.zeros({8 * 1024 + 5}, {device = dev, dtype = "u8"})}
  end, function(a) return dm.cross_entropy(a[1], a[2]) end},
  {"rmsnorm with a gain", function(dev)
    return {dm.zeros({8 * 1024 + 3, 2048}, {device = dev, dtype = "bf16"}):requires_grad(true),
            dm.zeros({2048}, {device = dev, dtype = "bf16"}):requires_grad(true)}
  end, function(a) return dm.rmsnorm(a[1], a[2]):sum() end},
  {"causal_conv1d", function(dev)
    return {dm.zeros({8, 1024, 2048}, {device = dev, dtype = "bf16"}):requires_grad(true),
            dm.zeros({2048, 4}, {device = dev, dtype = "bf16"}):requires_grad(true)}
  end, function(a) return dm.causal_conv1d(a[1], a[2], {silu = true}):sum() end},
  {"kda chunked", function(dev)
    local q = function() return dm.zeros({8, 1024, 32, 64}, {device = dev, dtype = "bf16"}):requires_grad(true) end
    return {q(), q(), q(), dm.zeros({8, 1024, 32, 64}, {device = dev}):requires_grad(true),
            dm.zeros({8, 1024, 32}, {device = dev, dtype = "bf16"}):requires_grad(true)}
  end, function(a) return dm.kda(a[1], a[2], a[3], a[4], a[5]):sum() end},
  {"kda recurrent", function(dev)
    local q = function() return dm.zeros({3, 100, 5, 64}, {device = dev}):requires_grad(true) end
    return {q(), q(), q(), q(), dm.zeros({3, 100, 5}, {device = dev}):requires_grad(true)}
  end, function(a) return dm.kda(a[1], a[2], a[3], a[4], a[5], {algo = "recurrent"}):sum() end},
  {"kda_gate", function(dev)
    return {dm.zeros({8, 1024, 2048}, {device = dev, dtype = "bf16"}):requires_grad(true),
            dm.zeros({32}, {device = dev}):requires_grad(true), dm.zeros({2048}, {device = dev}):requires_grad(true)}
  end, function(a) return dm.kda_gate(a[1], a[2], a[3]):sum() end},
}

-- the peak of one forward and backward of a case on dev, over what its inputs hold
local function op_peak(dev, make, fn)
  local inputs = make(dev)
  collectgarbage()
  sync()
  local base = dm.memory(dev).current
  dm.reset_peak(dev)
  dm.scope(function() fn(inputs):backward() end)
  sync()
  local peak = dm.memory(dev).peak - base
  for _, t in ipairs(inputs) do t.grad = nil; t:free() end
  collectgarbage()
  return peak
end

for _, case in ipairs(op_cases) do
  local name, make, fn = case[1], case[2], case[3]
  checks.check("scratch of " .. name, function()
    core.plan_card(plan.CARD)
    local ok, planned = pcall(op_peak, "meta", make, fn)
    core.plan_card(nil)
    assert(ok, planned)
    local scratch = (planned - op_peak("meta", make, fn)) / 2 ^ 20
    if DRY then return string.format("planned scratch %.1f MiB (not measured: the CPU's kernels take other)", scratch) end
    local measured = op_peak(DEVICE, make, fn)
    assert(measured == planned, string.format("planned %d bytes, measured %d (%+d)", planned, measured,
                                              measured - planned))
    return string.format("peak %.1f MiB planned and measured, of it the kernels' scratch %.1f MiB",
                         planned / 2 ^ 20, scratch)
  end)
end
if DEVICE == "cuda" then dm.cuda.empty_cache() end

-- ---- the training step --------------------------------------------------------------------------

for _, shape in ipairs(shapes) do
  local B, T = shape[1], shape[2]
  local sets = {"batch=" .. B, "seq=" .. T, "model.engram.ram=" .. tostring(shape.ram == true)}
  for _, s in ipairs(dry_sets) do sets[#sets + 1] = s end
  if shape.small_card then for _, s in ipairs(SMALL_CARD) do sets[#sets + 1] = s end end
  local name = string.format("%s B %d x T %d%s%s", file:match("([%w_]+)%.lua$"), B, T, shape.ram and " engram.ram" or "",
                             shape.small_card and " " .. table.concat(SMALL_CARD, " ") or "")
  checks.check(name, function()
    local cfg = config.load(file, sets)
    local r = plan.report(cfg)
    if DRY then r.peak = r.seen end            -- without the CUDA kernels' scratch: the CPU's differs
    local m = measure(cfg)
    assert(m.left == 0, string.format("%d bytes still allocated after the shape", m.left))
    local ratio = m.peak / r.peak
    assert(math.abs(ratio - 1) <= 0.10, string.format("measured %.3f GiB, predicted %.3f GiB: ratio %.3f",
                                                      m.peak / GiB, r.peak / GiB, ratio))
    return string.format("predicted %.3f GiB, measured %.3f GiB, ratio %.4f (peak in the %s; blocks %.3f GiB, " ..
                         "reserved %.3f GiB; held between steps %.3f GiB; the plan without kernel scratch " ..
                         "%.3f GiB)", r.peak / GiB, m.peak / GiB, ratio, r.phase, r.blocks / GiB, m.reserved / GiB,
                         m.held / GiB, r.seen / GiB)
  end)
end

corpus:close()
checks.finish()
