--[[
What the GPU check scripts share (they run where there is no Busted):
require "tests.gpu.common" from the repository root.
]]
local common = {}

-- max |a - b| / max |b|, both on the CPU in f64; NaN gives math.huge
function common.rel(a, b, floor)
  a, b = a:detach():cpu():to("f64"), b:detach():cpu():to("f64")
  local den = math.max(b:abs():max():item(), floor or 0)   -- floor: below it, error is measured against it
  local num = (a - b):abs():max():item()
  if num ~= num then return math.huge end
  return den > 0 and num / den or num
end

-- One forward+backward of a model of the family: its loss (a number), the
-- routing counts of the pass (update_balance), every parameter's gradient
-- by name (the Engram table's sparse one under block.engram.table) and the
-- Engram rows. The model's tensors stay where they are.
function common.loss_and_grads(m, x, prefix)
  local out = m:forward(x, prefix)
  out.loss:backward()
  local grads = {}
  for _, p in ipairs(m:named_parameters()) do grads[p.name] = p.tensor.grad end
  local rows, g = m.block.engram:sparse_grad()
  grads["block.engram.table"] = g
  return out.loss:item(), m:update_balance(), grads, rows
end

-- False, after one loud line, when there is no CUDA device.
function common.gpu_or_skip(cuda, what)
  local ok, why = cuda.is_available()
  if not ok then print((what or "GPU checks") .. " skipped: no CUDA device (" .. tostring(why) .. ")") end
  return ok
end

--[[ A script's checks: check(name, fn) runs fn protected and prints one line
("ok  name[: what fn returned]  (seconds)" or "FAIL name: error"); finish()
prints "LABEL: N passed, M failed" and exits 1 when one failed. ]]
function common.checks(label)
  local passed, failed = 0, 0
  local self = {}
  function self.check(name, fn)
    local t0 = os.clock()
    local ok, res = pcall(fn)
    if ok then passed = passed + 1 else failed = failed + 1 end
    local detail = ok and (res ~= nil and ": " .. tostring(res) or "") or ": " .. tostring(res)
    print(string.format("%s %s%s  (%.1fs)", ok and "ok  " or "FAIL", name, detail, os.clock() - t0))
    io.stdout:flush()
  end
  function self.finish()
    print(string.format("%s: %d passed, %d failed", label, passed, failed))
    io.stdout:flush()
    if failed > 0 then os.exit(1, true) end
  end
  return self
end

--[[ The routed experts at b1's shapes (bench_moe.lua, prof_moe.lua): router
logits, bf16 banks on the GPU; x.forward() runs moe_experts on them.
routing "random" (the default): normal logits, about 16 rows an expert;
"skewed", as real training reaches: expert 1 first for 80% of the tokens (40%
of the assignments) and experts 2 to 101 never chosen. ]]
-- with fp8 true, x.forward reads the factors as fp8 banks (dm.bank_fp8's codes, the factors' places
-- stand-ins: model.moe.fp8's products)
function common.moe_b1(dm, routing, fp8)
  local N, E, K, D, R, F = 8192, 1024, 2, 2048, 64, 5461
  local function bf16(shape, seed, scale)
    return dm.randn(shape, {seed = seed, dtype = "bf16", device = "cuda"}):mul(scale or 1)
  end
  local logits = dm.randn({N, E}, {seed = 1, dtype = "f32", device = "cuda"})
  if routing == "skewed" then
    logits:narrow(1, 1, N * 4 // 5):narrow(2, 1, 1):fill_(10)
    logits:narrow(2, 2, 100):fill_(-10)
  elseif routing ~= nil and routing ~= "random" then
    error("moe_b1: routing is \"random\" or \"skewed\", got " .. tostring(routing))
  end
  local idx = dm.moe_route(logits, nil, K)
  local x = {N = N, E = E, K = K, D = D, R = R, F = F}
  x.perm, x.offsets = dm.moe_sort(idx, E)
  x.u = bf16({N, D}, 2)
  x.ug, x.uu = bf16({E, D, R}, 3, D ^ -0.5), bf16({E, D, R}, 4, D ^ -0.5)
  x.cg, x.cu = dm.ones({E, R}, {dtype = "bf16", device = "cuda"}), dm.ones({E, R}, {dtype = "bf16", device = "cuda"})
  x.dw = bf16({E, R, F}, 5, R ^ -0.5)
  x.gy = bf16({N * K, F}, 6)
  x.params = {x.u, x.ug, x.uu, x.cg, x.cu, x.dw}
  function x.forward() return dm.moe_experts(x.u, x.perm, x.offsets, x.ug, x.uu, x.cg, x.cu, x.dw, K) end
  if fp8 then
    local codes = {}
    for name, w in pairs {Ug = x.ug, Uu = x.uu, D = x.dw} do codes[name] = {dm.bank_fp8(w, "bf16")} end
    function x.forward()
      return dm.moe_experts(x.u, x.perm, x.offsets, dm.stand_in(x.ug, "bf16"), dm.stand_in(x.uu, "bf16"), x.cg, x.cu,
                            dm.stand_in(x.dw, "bf16"), K, codes)
    end
  end
  return x
end

return common
