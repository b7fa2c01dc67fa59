--[[
The training step captured as one CUDA graph (graph = true) against the
eager step (issue 6, item 2): tiny and small, with Engram, from the same
weights and data, WARM + STEPS steps each. No two GPU runs give the same
bits (embedding's gradient adds atomically, and Adam turns a near-zero
gradient's sign into a full step), so the eager step runs twice to measure
that noise: over the first WARM steps the graph may differ from the eager
run by at most 10 times the two eager runs' difference plus 2e-4 of the
loss (the pair's difference is one draw of that noise: on small it has
come out anywhere from 0 to 1.5e-4, and the graph's from 3e-5 to 6e-4), and
the mean loss of the next STEPS by 1%; the graph was captured once and
replayed; and each mode's ms a step is printed.
  dormouse run tests/gpu/graph_step.lua
]]
local dm = require "dormouse"
local common = require "tests.gpu.common"
local core = require "dormouse.core"
local config = require "dormouse.config"
local train = require "dormouse.train"
local step = require "dormouse.step"

if not common.gpu_or_skip(dm.cuda, "graph_step") then return end
local checks = common.checks("graph_step")
local WARM, STEPS = 3, 30

local function setup(file)
  return train.prepare(config.load(file, {"device=cuda", "schedule.warmup=5"}))
end

for _, file in ipairs {"experiments/tiny.lua", "experiments/small.lua"} do
  local name = file:match("([%w_]+)%.lua$")
  checks.check(name .. ": the captured step trains as the eager one (within the eager runs' own noise)", function()
    local eager, again, graphed = setup(file), setup(file), setup(file)
    local gs = step.new(graphed, {capture = true})
    local le, la, lg, t = {}, {}, {}, {}
    for i = 1, WARM + STEPS do
      if i == WARM + 1 then dm.cuda.synchronize(); t.e = core.now() end
      eager.step = eager.step + 1
      le[i] = train.step(eager).loss
    end
    dm.cuda.synchronize()
    t.e = (core.now() - t.e) * 1e3 / STEPS
    for i = 1, WARM do again.step = again.step + 1; la[i] = train.step(again).loss end
    for i = 1, WARM + STEPS do
      if i == WARM + 1 then dm.cuda.synchronize(); t.g = core.now() end
      graphed.step = graphed.step + 1
      gs:run(graphed.step)
      if i <= WARM then lg[i] = gs:window(1).loss end      -- (reading waits for the device)
    end
    dm.cuda.synchronize()
    t.g = (core.now() - t.g) * 1e3 / STEPS
    local w = gs:window(STEPS)
    assert(gs:nodes() > 0, "no graph was captured")
    assert(w.applied == STEPS and w.skips == 0, string.format("%d applied, %d skipped", w.applied, w.skips))
    local worst, noise = 0, 0
    for i = 1, WARM do
      worst = math.max(worst, math.abs(lg[i] - le[i]))
      noise = math.max(noise, math.abs(la[i] - le[i]))
    end
    assert(worst <= 10 * noise + 2e-4 * le[1], string.format("first %d steps: graph differs by %.2e, two eager runs by %.2e " ..
           "(eager %s; graph %s)", WARM, worst, noise, table.concat(le, " ", 1, WARM), table.concat(lg, " ")))
    local mean_e = 0
    for i = WARM + 1, WARM + STEPS do mean_e = mean_e + le[i] / STEPS end
    local mean_g = w.loss / STEPS
    assert(math.abs(mean_g - mean_e) <= 1e-2 * mean_e,
           string.format("mean loss of steps %d..%d: %.5f eager, %.5f graph", WARM + 1, WARM + STEPS, mean_e, mean_g))
    local nodes = gs:nodes()
    gs:free()
    eager.loader:close(); again.loader:close(); graphed.loader:close()
    return string.format("first %d steps within %.1e (two eager runs: %.1e); mean loss of the next %d: %.5f eager, %.5f graph; " ..
                         "%d nodes; %.2f ms/step eager, %.2f graph (%.2fx)", WARM, worst, noise, STEPS, mean_e, mean_g,
                         nodes, t.e, t.g, t.e / t.g)
  end)
end
checks.finish()
