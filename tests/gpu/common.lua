--[[
What the GPU check scripts share (they run where there is no Busted):
require "tests.gpu.common" from the repository root.
]]
local common = {}

-- max |a - b| / max |b|, both on the CPU in f64; NaN gives math.huge
function common.rel(a, b)
  a, b = a:detach():cpu():to("f64"), b:detach():cpu():to("f64")
  local den = b:abs():max():item()
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

return common
