--[[
Sparse Adam for the Engram tables (docs/model.md): each step only the rows
the batch touched are updated, and the moments of the other rows are neither
read nor written (vm/ops/engram.h, kernel "engram_adam").

The table is not a leaf of the tape: its module hands over the step's rows
and their gradient (module:sparse_grad() → rows [U] i64, grads [U, de]),
so the table's dense gradient (1.6 GB at b1) is never made. A group entry's
module must have sparse_grad; one without gradient this step is left alone.

A table in host memory (Engram with ram: its module has host_table) is
updated by its dm.HostTable: the group's state m, v are handed to it at
creation (so checkpoints save and load them as for any table), and each
step's gradient [U, de] is copied back once and applied by the host's
multi-threaded sparse Adam, which also refreshes the rows of the next
batch's prefetch that the update changed.
]]
local dm = require "dormouse"
local core = require "dormouse.core"
local groups = require "dormouse.optim.groups"

local SparseAdam = {kind = "sparse_adam", device_scalars = true}
SparseAdam.__index = SparseAdam

local function row(t) return t:size(2) end          -- 8-bit moments: a scale a row

-- hp: {lr, betas = {b1, b2}, eps, dense, moments}. dense (optim.engram_adam = "dense", an option the
-- spec does not have): every row's moments decay and every row moves each step, as a dense Adam over
-- the table would, from the step's rows scattered into a dense gradient (the table's size, made
-- and dropped each step); the table must be on the device. moments = "8bit" (optim.engram_moments):
-- m and sqrt(v) in 8 bits with an f32 scale a row (vm/core/code8.h; kernel "engram_adam_8bit"), for
-- the sparse Adam of tables on the device.
function SparseAdam.new(name, entries, hp)
  local code8 = hp.moments == "8bit"
  local self = setmetatable(code8 and groups.code8_group(name, entries, row) or groups.new_group(name, entries, {"m", "v"}),
                            SparseAdam)
  self.lr, self.betas, self.eps, self.weight_decay = hp.lr, hp.betas, hp.eps, 0
  self.dense = hp.dense or false
  self.hosts = {}
  for i, e in ipairs(entries) do
    if e.module.ram and e.module.host_table then
      if code8 then
        core.error("optim: engram_moments = \"8bit\" keeps the moments beside tables on the device; the Engram " ..
                   "tables are in host memory (engram.ram = true), whose Adam keeps f32 moments")
      end
      self.hosts[i] = e.module:host_table(self.state.m[i], self.state.v[i])
    end
  end
  if code8 and self.dense then
    core.error("optim: engram_moments = \"8bit\" takes the tables' sparse Adam, not engram_adam = \"dense\"")
  end
  return self
end

-- this group's 8-bit moments of entry i, as the kernels take them
function SparseAdam:codes_of(i)
  local s = self.state
  return {m = s.m8[i], m_scale = s.m_scale[i], v = s.v8[i], v_scale = s.v_scale[i], salt = self.salt}
end

-- a checkpoint's state in this group's form (groups.code8_adapt: f32 moments to 8 bits and back)
function SparseAdam:adapt_state(tbl) return groups.code8_adapt(self, tbl, row) end

-- The gradients clipping and the firewall must see: one per entry with a step's rows.
function SparseAdam:grads()
  local out = {}
  for _, e in ipairs(self.entries) do
    local _, g = e.module:sparse_grad()
    if g then out[#out + 1] = g end
  end
  return out
end

-- Entry i's rows and gradient, at the host's values of lr·mult and step t.
function SparseAdam:apply(i, rows, g, mult, t)
  local host = self.hosts[i]
  if host then                     -- the rows named: they span every take (micro-batch) of the step
    core.hostable_apply(host._h, g, self.lr * mult, self.betas[1], self.betas[2], self.eps, t, rows)
    return
  end
  local p = self.params[i]
  if g.device ~= p.device then g = g:to(p.device) end        -- a table in host memory
  if rows.device ~= p.device then rows = rows:to(p.device) end
  if self.code8 then
    dm.no_grad(function()
      core.engram_adam_8bit(p, self:codes_of(i), rows, g, rows:numel(), self.lr * mult, self.betas[1], self.betas[2],
                          self.eps, t)
    end)
    return
  end
  dm.no_grad(dm.engram_adam, p, self.state.m[i], self.state.v[i], rows, g,
             {lr = self.lr * mult, betas = self.betas, eps = self.eps, step = t})
end

--[[ The same from device scalars {lr_at, step_at, sumsq_at} (the training step's, captured or
not): the static lookups' count n of real rows is read there too (nil: every row). A table in
host memory is updated by the host, which reads the firewall's verdict and the update count
from the device first (its rows' gradient is copied back then anyway). ]]
function SparseAdam:apply_at(i, rows, g, n, at, mult)
  if self.hosts[i] then
    if core.cuda_graph_capturing() then
      core.error("optim: the Engram tables are in host memory (engram.ram = true), which a captured step " ..
                 "(graph mode) cannot update; keep them on the device")
    end
    local sumsq = at.sumsq_at:item()
    if sumsq == sumsq and sumsq ~= math.huge then
      self:apply(i, rows, g, mult, math.tointeger(at.step_at:item()))
    end
    return
  end
  if self.code8 then
    core.engram_adam_8bit_at(self.params[i], self:codes_of(i), rows, g, n, self.betas[1], self.betas[2], self.eps,
                           at.lr_at, at.step_at, at.sumsq_at)
    return
  end
  core.engram_adam_at(self.params[i], self.state.m[i], self.state.v[i], rows, g, n, self.betas[1],
                      self.betas[2], self.eps, at.lr_at, at.step_at, at.sumsq_at)
end

-- Entry i as a dense Adam: the step's rows (none: a zero gradient) scattered into the table's
-- shape, then the fused AdamW over the whole table (weight decay 0); at: device scalars or nil.
function SparseAdam:apply_dense(i, rows, g, mult, t, at)
  if self.hosts[i] then
    core.error("optim: engram_adam = \"dense\" needs the Engram tables on the device (engram.ram = true " ..
               "keeps them in host memory)")
  end
  at = at or {}
  local p = self.params[i]
  dm.scope(function()
    local dense = dm.zeros(p:shape(), {device = p.device})
    if rows then
      -- row ids count from 0; scatter_add's positions from 1, as Lua's
      local idx = (rows:to("i64") + 1):reshape({-1, 1}):expand({rows:numel(), p:size(2)})
      dense = dm.no_grad(dm.scatter_add, dense, 1, idx, g:to(dense.dtype))
    end
    p.grad = dense
    core.adamw_step({p}, {self.state.m[i]}, {self.state.v[i]}, {
      lr = self.lr * mult, beta1 = self.betas[1], beta2 = self.betas[2], eps = self.eps, weight_decay = 0,
      step = t, lr_at = at.lr_at, step_at = at.step_at, sumsq_at = at.sumsq_at})
    p.grad = nil
  end)
end

-- at: device scalars (optim/init.lua's step_async), or nil: the host's values of mult and t
function SparseAdam:update(mult, t, at)
  for i, e in ipairs(self.entries) do
    local rows, g, n = e.module:sparse_grad()
    if self.dense then self:apply_dense(i, rows, g, mult, t, at)
    elseif rows and at then self:apply_at(i, rows, g, n, at, mult)
    elseif rows then self:apply(i, rows, g, mult, t) end     -- the host's lr and step (the tests' reference)
  end
end

function SparseAdam:zero_grad()
  for _, e in ipairs(self.entries) do e.module:clear_sparse() end
end

return SparseAdam
