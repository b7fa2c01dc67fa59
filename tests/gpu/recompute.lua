--[[
Activation checkpointing on the GPU (model.recompute = true): the small
preset with the same weights and batch, recompute off and on, in f32 and in
bf16 products. The forward is the same computation, so the loss and the
routing counts agree bit for bit; the gradients agree to rounding (the
block's inner contributions are added in another order, and the GPU's
embedding backward adds atomically). In bf16 the recomputation casts the
expert banks afresh (the pass's copies were dropped), which must give the
same bits. Then b1's forward+backward at B 8, T 1024 with and without it:
the peak allocated memory of each, and the ms a step.
  dormouse run tests/gpu/recompute.lua
DRY=1 runs the script on the CPU (tiny, f32 only; its times mean nothing).
]]
local dm = require "dormouse"
local common = require "tests.gpu.common"
local nn = require "dormouse.nn"
local core = require "dormouse.core"
local config = require "dormouse.config"
local train = require "dormouse.train"

local DRY = os.getenv("DRY") ~= nil
if not DRY and not common.gpu_or_skip(dm.cuda, "recompute") then return end
local DEVICE = DRY and "cpu" or "cuda"
local checks = common.checks("recompute")
local check = checks.check

local function sync() if not DRY then dm.cuda.synchronize() end end

local function build(file, compute, recompute)
  local cfg = config.load(file, {"model.recompute=" .. tostring(recompute)})
  dm.manual_seed(cfg.seed)
  return nn.build({device = DEVICE, compute_dtype = compute}, train.build_model, cfg, ".")
end

local run = common.loss_and_grads

local corpus = dm.data.open(dm.data.default_corpus(), {eval_bytes = 4096})
local file = DRY and "experiments/tiny.lua" or "experiments/small.lua"
local x, prefix = corpus:batch(7, {batch = 4, seq = 128, seed = 3, ctx = 4})
x, prefix = x:to(DEVICE), prefix:to(DEVICE)

for _, case in ipairs(DRY and {{"f32", 1e-5}} or {{"f32", 1e-5}, {"bf16", 1e-2}}) do
  local compute, tol = case[1], case[2]
  check(file .. ", " .. compute .. " products: recompute gives the loss and counts bit for bit, gradients within "
        .. tol, function()
    local plain = build(file, compute, false)
    local again = build(file, compute, true)
    dm.no_grad(function()
      local src = {}
      for _, p in ipairs(plain:named_parameters()) do src[p.name] = p.tensor end
      for _, p in ipairs(again:named_parameters()) do p.tensor:copy_(src[p.name]) end
    end)
    local l1, c1, g1, r1 = run(plain, x, prefix)
    local l2, c2, g2, r2 = run(again, x, prefix)
    assert(l1 == l2, string.format("losses differ: %.9g vs %.9g", l1, l2))
    assert(dm.allclose(c1:cpu(), c2:cpu(), {rtol = 0, atol = 0}), "routing counts differ")
    assert(dm.allclose(r1:cpu(), r2:cpu(), {rtol = 0, atol = 0}), "Engram rows differ")
    local worst, where, n = 0, "none", 0
    for name, g in pairs(g1) do
      assert(g2[name], name .. " has no gradient with recompute")
      local e = common.rel(g2[name], g)
      if e > worst then worst, where = e, name end
      n = n + 1
    end
    assert(worst <= tol, string.format("%s: relative error %.3g over %g", where, worst, tol))
    return string.format("loss %.6f, %d gradients, worst %.2g (%s)", l1, n, worst, where)
  end)
end

if not DRY then
  local bx, bp = corpus:batch(1, {batch = 8, seq = 1024, seed = 1, ctx = 4})
  bx, bp = bx:cuda(), bp:cuda()
  local function b1(recompute)
    local m = build("experiments/b1.lua", "bf16", recompute)
    local times, loss = {}, nil
    dm.reset_peak("cuda")
    for i = 1, 4 do
      dm.scope(function()
        sync()
        local t0 = core.now()
        local out = m:forward(bx, bp)
        out.loss:backward()
        loss = out.loss:item()
        m:zero_grad()
        m.block.engram:clear_sparse()
        m:update_balance()
        sync()
        times[i] = core.now() - t0
      end)
    end
    table.sort(times)
    local peak = dm.memory("cuda").peak
    m = nil
    collectgarbage(); collectgarbage()
    dm.cuda.empty_cache()
    return times[2] * 1e3, peak / 2 ^ 30, loss
  end
  check("b1 at B 8, T 1024 (bf16 products): forward+backward with and without recompute", function()
    local ms0, gib0, l0 = b1(false)
    local ms1, gib1, l1 = b1(true)
    assert(l0 == l1, string.format("losses differ: %.9g vs %.9g", l0, l1))
    assert(gib1 < gib0, string.format("recompute's peak %.2f GiB is not below %.2f", gib1, gib0))
    return string.format("off: %.1f ms, peak %.2f GiB; on: %.1f ms (%+.0f%%), peak %.2f GiB (loss %.5f both)",
                         ms0, gib0, ms1, 100 * (ms1 / ms0 - 1), gib1, l0)
  end)
end

corpus:close()
checks.finish()
