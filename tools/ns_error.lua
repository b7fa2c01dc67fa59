--[[ tools/ns_error.lua — how orthogonal Muon's update is after 3, 4 and 5 Newton-Schulz steps, on a
run's own momentum (the matrices Muon orthogonalises), for each coefficient set:

  dormouse run tools/ns_error.lua runs/NAME/ckpt-STEP [f32|bf16]

For each momentum matrix M (each expert's apart) of m x n, s = min(m, n): O = NS_k(M), and its
error is |G - I|_F / sqrt(s) with G the s x s Gram of O (O O^T when m <= n): the root mean square
of 1 - sigma^2 over O's singular values sigma, 0 when O is orthogonal. Prints
the mean and the largest error over the checkpoint's matrices, a row for each (coefficients,
steps). The question it answers first: does Muon need 5 steps (docs/arms.md, Newton-Schulz). ]]
local dm = require "dormouse"
local core = require "dormouse.core"

local point, dtype = arg[1], arg[2] or "f32"
if not point then error("usage: dormouse run tools/ns_error.lua runs/NAME/ckpt-STEP [f32|bf16]", 0) end
local c = dm.ckpt.load(point)

-- the checkpoint's Muon momentum as a list of [B, m, n] stacks (a 2-D matrix is a stack of one)
local stacks, names = {}, {}
for name, t in pairs(c.optim) do
  if name:match("%.momentum$") then names[#names + 1] = name end
end
table.sort(names)
for _, name in ipairs(names) do
  local t = c.optim[name]:to("f32")
  stacks[#stacks + 1] = t:dim() == 2 and t:unsqueeze(1) or t
end

local function errors(o)                          -- one error a matrix of the stack o [B, m, n]
  local m, n = o:size(2), o:size(3)
  local g = m <= n and o:matmul(o:transpose(2, 3)) or o:transpose(2, 3):matmul(o)
  local s = math.min(m, n)
  -- |G - I|^2 = |G|^2 - 2 trace(G) + s, and trace(G) = |O|^2
  local gg, oo = (g * g):sum(3):sum(2):totable(), (o * o):sum(3):sum(2):totable()
  local out = {}
  for b = 1, #gg do out[b] = math.sqrt(math.max(0, gg[b] - 2 * oo[b] + s) / s) end
  return out
end

print(string.format("%d momentum tensors of %s, Newton-Schulz in %s", #names, point, dtype))
print(string.format("%-14s %5s %10s %10s %8s", "coefficients", "steps", "mean err", "max err", "matrices"))
for _, coeffs in ipairs {"quintic", "polar_express"} do
  for steps = 3, 5 do
    local sum, top, count = 0, 0, 0
    for _, x in ipairs(stacks) do
      local o = core.newton_schulz(x, steps, coeffs, dtype):to("f32")
      for _, e in ipairs(errors(o)) do sum, top, count = sum + e, math.max(top, e), count + 1 end
    end
    print(string.format("%-14s %5d %10.4f %10.4f %8d", coeffs, steps, sum / count, top, count))
  end
end
