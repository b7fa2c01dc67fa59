--[[
Sparse Adam for the Engram tables (spec/model.md): each step only the rows
the batch touched are updated, and the moments of the other rows are neither
read nor written (vm/engram.h, kernel "engram_adam").

The table is not a leaf of the tape: its module hands over the step's rows
and their gradient (module:sparse_grad() → rows [U] i64, grads [U, de]),
so the table's dense gradient (1.6 GB at b1) is never made. A group entry's
module must have sparse_grad; one without gradient this step is left alone.
]]
local dm = require "dormouse"
local groups = require "dormouse.optim.groups"

local SparseAdam = {kind = "sparse_adam"}
SparseAdam.__index = SparseAdam

-- hp: {lr, betas = {b1, b2}, eps}
function SparseAdam.new(name, entries, hp)
  local self = setmetatable(groups.new_group(name, entries, {"m", "v"}), SparseAdam)
  self.lr, self.betas, self.eps, self.weight_decay = hp.lr, hp.betas, hp.eps, 0
  return self
end

-- The gradients clipping and the firewall must see: one per entry with a step's rows.
function SparseAdam:grads()
  local out = {}
  for _, e in ipairs(self.entries) do
    local _, g = e.module:sparse_grad()
    if g then out[#out + 1] = g end
  end
  return out
end

function SparseAdam:update(mult, t)
  for i, e in ipairs(self.entries) do
    local rows, g = e.module:sparse_grad()
    if rows then
      local p = self.params[i]
      if g.device ~= p.device then g = g:to(p.device) end        -- a table in host memory
      if rows.device ~= p.device then rows = rows:to(p.device) end
      dm.no_grad(dm.engram_adam, p, self.state.m[i], self.state.v[i], rows, g,
                 {lr = self.lr * mult, betas = self.betas, eps = self.eps, step = t})
    end
  end
end

function SparseAdam:zero_grad()
  for _, e in ipairs(self.entries) do e.module:clear_sparse() end
end

return SparseAdam
