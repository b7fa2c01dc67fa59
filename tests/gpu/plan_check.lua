--[[
dormouse plan against the GPU (issue: "checked against measured peaks on the
H200 for at least three shapes: within 10%"). For b1 at B x T = 2x1024,
4x1024, 8x1024, and 8x1024 with engram.ram: the plan's predicted peak (meta
device, lua/dormouse/plan.lua), then one real training step on the GPU
(plan.step: forward, backward, balancing, clipping, update, zero_grad, the
trainer's allocations) after a warm-up step, with dm.memory("cuda").peak reset
just before it. One line a shape: predicted, measured, their ratio, and the
allocator's blocks against what it reserved. Everything is freed between shapes.
  dormouse run tests/gpu/plan_check.lua
  DRY=1 dormouse run tests/gpu/plan_check.lua     (the script itself, small shapes on the CPU)
]]
local dm = require "dormouse"
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
  for _, g in ipairs(opt.groups) do
    for _, slot in ipairs(g.slots) do for _, t in ipairs(g.state[slot]) do t:free() end end
  end
  for _, p in ipairs(model:named_parameters()) do p.tensor:free() end
  for _, b in ipairs(model:named_buffers()) do b.tensor:free() end
  collectgarbage()
  if DEVICE == "cuda" then dm.cuda.empty_cache() end
  m.left = dm.memory(DEVICE).current - before
  return m
end

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
