-- bad indices in the model kernels: raised at the next synchronisation (default) or at the op (DM_DEBUG=1)
local dm = require "dormouse"
local common = require "tests.gpu.common"
local cuda = dm.cuda or require "dormouse.cuda"
if not common.gpu_or_skip(cuda) then return end
local debug_mode = (tonumber(os.getenv("DM_DEBUG") or "0") or 0) >= 1
local checks = common.checks(string.format("check_errors (DM_DEBUG=%s)", os.getenv("DM_DEBUG") or "0"))
local check = checks.check
local function expect_error(fn, ...)
  local ok, err = pcall(fn)
  err = tostring(err)
  assert(not ok, "no error")
  for _, s in ipairs {...} do assert(err:find(s, 1, true), "message: " .. err) end
  return err
end

check("cross_entropy target out of range", function()
  local x = dm.randn({8, 256}, {device = "cuda"})
  local t = dm.tensor({1, 2, 3, 4, 300, 6, 7, 8}, {dtype = "i64"}):cuda()
  if debug_mode then expect_error(function() return dm.cross_entropy(x, t) end, "target 300 at row 5 of 8", "256 classes")
  else expect_error(function() return dm.cross_entropy(x, t):item() end, "cross_entropy: index 300 is out of range", "size 256") end
  assert(dm.cross_entropy(x, dm.tensor({1, 2, 3, 4, 5, 6, 7, 8}, {dtype = "i64"}):cuda()):item() > 0)
end)
check("engram_adam with rows out of order changes nothing", function()
  local t, m, v = dm.randn({100, 8}, {device = "cuda"}), dm.zeros({100, 8}, {device = "cuda"}), dm.zeros({100, 8}, {device = "cuda"})
  local before = t:cpu()
  local rows = dm.tensor({3, 2}, {dtype = "i64"}):cuda()
  local g = dm.randn({2, 8}, {device = "cuda"})
  if debug_mode then expect_error(function() dm.engram_adam(t, m, v, rows, g, {lr = 0.1, step = 1}) end, "row 2 follows row 3")
  else expect_error(function() dm.engram_adam(t, m, v, rows, g, {lr = 0.1, step = 1}); return t:cpu() end, "engram_adam") end
  assert(dm.allclose(t:cpu(), before, {rtol = 0, atol = 0}), "the table changed")
end)
check("moe_sort with an expert id out of range", function()
  local idx = dm.tensor({{0, 1}, {2, 70}}, {dtype = "i64"}):cuda()
  expect_error(function() local p = dm.moe_sort(idx, 64); return p:cpu() end, "70", "64")
end)
-- offsets that decrease past the first thousand experts (the check's threads stride over them)
check("moe_experts with offsets that decrease", function()
  local E, N, k, d, r, F = 2000, 4, 2, 16, 16, 8
  local off = {}
  for e = 0, E do off[e + 1] = e <= 1500 and 0 or e == 1501 and 5 or e == 1502 and 3 or N * k end
  local perm = dm.tensor({0, 1, 2, 3, 4, 5, 6, 7}, {dtype = "i64"}):cuda()
  local offsets = dm.tensor(off, {dtype = "i64"}):cuda()
  local u = dm.randn({N, d}, {device = "cuda"})
  local ug, uu = dm.randn({E, d, r}, {device = "cuda"}), dm.randn({E, d, r}, {device = "cuda"})
  local cg, cu, dw = dm.ones({E, r}, {device = "cuda"}), dm.ones({E, r}, {device = "cuda"}), dm.randn({E, r, F}, {device = "cuda"})
  local function run(o) return dm.moe_experts(u, perm, o, ug, uu, cg, cu, dw, k) end
  if debug_mode then expect_error(function() return run(offsets) end, "offsets decrease at expert 1501 (5 then 3)")
  else expect_error(function() return run(offsets):cpu() end, "moe_experts: index 3 is out of range", "size 9") end
  for e = 1502, E do off[e + 1] = 7 end   -- no decrease now, but the last offset is not N * k
  local ends = dm.tensor(off, {dtype = "i64"}):cuda()
  if debug_mode then expect_error(function() return run(ends) end, "offsets run from 0 to 7")
  else expect_error(function() return run(ends):cpu() end, "moe_experts: index 7 is out of range") end
  for e = 1502, E do off[e + 1] = N * k end
  assert(run(dm.tensor(off, {dtype = "i64"}):cuda()):cpu():shape()[1] == N * k)
end)
check("engram_sparse_grad with an inverse entry out of range", function()
  local g = dm.randn({3, 4}, {device = "cuda"})
  local inv = dm.tensor({0, 5, 1}, {dtype = "i64"}):cuda()
  expect_error(function() return dm.engram_sparse_grad(g, inv, 2):cpu() end, "5", "2")
end)
check("the device works after the errors", function()
  assert(dm.ones({10}, {device = "cuda"}):sum():item() == 10)
end)
checks.finish()
