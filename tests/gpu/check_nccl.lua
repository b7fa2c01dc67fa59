--[[
NCCL in a job of one rank (kernels/nccl.c, lua/dormouse/dist.lua): the
communicator starts, a sum and a mean over the ranks leave each dtype's
values as they are (one rank), a captured CUDA graph holds the collective
and replays it, the refusals name the tensor; then tiny trains 20 steps in
graph mode with DORMOUSE_NCCL=1 (the step's collectives inside the graph)
and ends where the plain process ends, within its float32 rounding.

  dormouse run tests/gpu/check_nccl.lua      (DORMOUSE_NCCL_LIB names libnccl.so.2 off the loader's path)
]]
local dm = require "dormouse"
local core = require "dormouse.core"
local common = require "tests.gpu.common"

if not common.gpu_or_skip(dm.cuda, "check_nccl") then return end
core.dist_init()
local started, info = core.nccl_start()
if not started then
  print("check_nccl skipped: " .. tostring(info))
  return
end
local checks = common.checks("check_nccl")

checks.check("a sum and a mean over one rank keep every dtype's values", function()
  for _, dtype in ipairs {"f32", "bf16", "f64", "i64", "i32"} do
    local t = dm.arange(1, 1001, 1, {dtype = dtype, device = "cuda"})
    local want = t:clone()
    core.nccl_reduce({t}, false)
    assert(common.rel(t, want) == 0, dtype .. ": a sum changed the values")
    if dtype ~= "i64" and dtype ~= "i32" then
      core.nccl_reduce({t, want:clone()}, true)
      assert(common.rel(t, want) == 0, dtype .. ": a mean changed the values")
    end
  end
  return "NCCL " .. info
end)

checks.check("a captured graph holds the collective and replays it", function()
  local t = dm.keep(dm.full({4096}, 3, {device = "cuda"}))
  local g = dm.cuda.graph(function()
    t:mul_(2)
    core.nccl_reduce({t}, false)
  end)
  g:replay()
  g:replay()
  dm.cuda.synchronize()
  local v = t:cpu():totable()[1]
  local nodes = g:nodes()
  g:free()
  assert(v == 12, "two replays of x2 from 3 give " .. tostring(v))
  return nodes .. " nodes"
end)

checks.check("refuses a host tensor, a strided one and the mean of integers, naming them", function()
  local function refused(fn, want)
    local ok, err = pcall(fn)
    assert(not ok and tostring(err):find(want, 1, true), "expected '" .. want .. "', got " .. tostring(err))
  end
  refused(function() core.nccl_reduce({dm.zeros({4})}, false) end, "must be a contiguous cuda tensor")
  refused(function() core.nccl_reduce({dm.zeros({4, 4}, {device = "cuda"}):transpose(1, 2)}, false) end,
          "must be a contiguous cuda tensor")
  refused(function() core.nccl_reduce({dm.zeros({4}, {dtype = "i64", device = "cuda"})}, true) end,
          "the mean over the ranks takes a float tensor")
end)

core.nccl_finalize()

-- the training step with its collectives in the graph, against the plain process
checks.check("tiny trains in graph mode with DORMOUSE_NCCL=1 as the plain process does", function()
  local bin = arg and arg[-1]
  local dir = os.tmpname()
  os.remove(dir)
  core.mkdirs(dir)
  local function run(env, name)
    local p = assert(io.popen(string.format("cd '%s' && %s '%s' run '%s/experiments/tiny.lua' --quiet --sample 0 " ..
                                            "--set steps=20 --set graph=true --set eval.every=0 --set log.every=10 " ..
                                            "--set name=%s 2>&1", dir, env, bin, os.getenv("PWD"), name)))
    local out = p:read("a")
    local _, _, code = p:close()
    assert(code == 0, out)
    local f = assert(io.open(dir .. "/runs/" .. name .. "/log.txt"))
    local log = f:read("a")
    f:close()
    return log, tonumber(log:match("step +20 +loss ([%d.]+)"))
  end
  local log, with = run("DORMOUSE_NCCL=1", "nccl")
  local _, plain = run("", "plain")
  core.remove_tree(dir)
  assert(log:find("dist: NCCL", 1, true), "no NCCL line:\n" .. log)
  assert(log:find("graph: the step is captured", 1, true), "not captured:\n" .. log)
  assert(with and plain and math.abs(with - plain) <= 2e-3 * plain,
         string.format("step 20's window loss %s with NCCL, %s without", tostring(with), tostring(plain)))
  return string.format("step 20's window loss %.4f with NCCL, %.4f without", with, plain)
end)

checks.finish()
