--[[
Engram tables in host memory on the GPU (issue 5, item 3): tiny and small
train 23 steps with device tables and with host tables (model.engram.ram =
true: a dm.HostTable gathers each step's rows on the host, the next batch's
while the step runs, and applies the gradient with a host Adam). The losses
agree within 1e-4 over the first 3 steps and 1% after (the same rows, the same Adam formula), every step after
the first found its prefetch, and each mode's ms a step is printed. Both
runs start from the same table (the device run's, copied to the host); the
host Adam (no FMA) and the GPU's (FMA) differ in the last bit, which 20
steps of training grow.
  dormouse run tests/gpu/engram_ram.lua
DRY=1 runs the script on the CPU, tiny only (ram forced there; its times mean nothing).
]]
local dm = require "dormouse"
local common = require "tests.gpu.common"
local nn = require "dormouse.nn"
local core = require "dormouse.core"
local config = require "dormouse.config"
local train = require "dormouse.train"

local DRY = os.getenv("DRY") ~= nil
if DRY then nn.Engram.ram_on_cpu = true
elseif not common.gpu_or_skip(dm.cuda, "engram_ram") then return end
local DEVICE = DRY and "cpu" or "cuda"

local checks = common.checks("engram_ram")
local check = checks.check
local WARM, STEPS = 3, 20

local function sync() if not DRY then dm.cuda.synchronize() end end

-- the run-like table train.step works on (as `dormouse bench` builds it), on DEVICE
local function setup(file, ram)
  return train.prepare(config.load(file, {"device=" .. DEVICE, "model.engram.ram=" .. tostring(ram)}))
end

-- WARM + STEPS steps: the losses, and the ms a step of the last STEPS
local function steps(r)
  local losses, t0 = {}, nil
  for i = 1, WARM + STEPS do
    if i == WARM + 1 then sync(); t0 = core.now() end
    r.step = r.step + 1
    losses[i] = train.step(r).loss
  end
  sync()
  return losses, (core.now() - t0) * 1e3 / STEPS
end

local files = DRY and {"experiments/tiny.lua"} or {"experiments/tiny.lua", "experiments/small.lua"}
for _, file in ipairs(files) do
  local name = file:match("([%w_]+)%.lua$")
  -- The first steps agree closely; later ones within 1% only: the host Adam rounds without FMA,
  -- the device's embedding gradient adds atomically (no two GPU runs give the same bits), and
  -- training amplifies both (seen: 2.5e-5 at step 4, 2e-3 by step 23 on tiny).
  check(name .. ": host tables train like device tables (3 steps within 1e-4, then 1%), the prefetch used", function()
    local dev = setup(file, false)
    local ram = setup(file, true)
    local e = ram.model.block.engram
    assert(e.ram and e.host, "the ram run has no host table")
    assert(e.table.device == "cpu", "the ram run's table is on " .. e.table.device)
    -- one start: randn drawn on the host and on the GPU differ in the last bit (logf, sinf)
    dm.no_grad(function() e.table:copy_(dev.model.block.engram.table) end)
    local l_dev, ms_dev = steps(dev)
    local l_ram, ms_ram = steps(ram)
    local worst = 0
    for i = 1, #l_dev do
      local d = math.abs(l_ram[i] - l_dev[i])
      worst = math.max(worst, d)
      assert(d <= (i <= 3 and 1e-4 or 1e-2 * math.abs(l_dev[i])),
             string.format("losses differ by %.3g at step %d (step losses %s vs %s)", d, i,
                           table.concat(l_dev, " "), table.concat(l_ram, " ")))
    end
    local c = e:counters()
    assert(c.prefetch_used == WARM + STEPS - 1 and c.prefetch_missed == 1,
           string.format("prefetch used %d, missed %d", c.prefetch_used, c.prefetch_missed))
    local table_rel = common.rel(e.table, dev.model.block.engram.table)
    dev.loader:close(); ram.loader:close()
    return string.format("%d steps, max |loss diff| %.2e, table rel %.2e; device tables %.2f ms/step, " ..
                         "host tables %.2f ms/step (%+.1f%%); last step: %d lookups, %d rows (%.3f unique), " ..
                         "gather %.2f ms, wait %.3f ms, apply %.2f ms, %d threads",
                         #l_dev, worst, table_rel, ms_dev, ms_ram, 100 * (ms_ram / ms_dev - 1), c.lookups,
                         c.unique, c.unique_fraction, c.gather_ms, c.wait_ms, c.apply_ms, e.host:threads())
  end)
end

checks.finish()
