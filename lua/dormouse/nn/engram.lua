--[[
Engram — hashed byte n-gram memory (spec/model.md):

  e_t   = the rows of the n-grams ending at t, one per order and hash head
  kx    = W_k e_t ,  vx = W_v e_t
  alpha = sigmoid( dot(rmsnorm(u_t), rmsnorm(kx_t)) / sqrt(d) )
  vt    = alpha · vx
  out   = vt + silu( causal_conv(rmsnorm(vt)) )      kernel 4, dilation = max order, zero-initialised
]]
return function(nn, dm)

local Engram = nn.class("Engram")

function Engram:init(d, opts)
  self.layout = dm.engram_layout {orders = opts.orders, heads = opts.heads or 1, rows = opts.rows}
  self.width = opts.width
  local subtables = #opts.orders * (opts.heads or 1)
  self.n_sub = subtables
  -- The table is a parameter that the tape never sees whole: each forward reads
  -- its touched rows into a compact leaf, and the optimiser's sparse Adam
  -- updates those rows alone (sparse_grad below). Its dense gradient is never made.
  -- opts.ram keeps the table (and so its Adam moments) in host memory: each
  -- step copies its touched rows to the device and their gradient back.
  self.ram = opts.ram and nn.device ~= "cpu"
  local device = nn.device
  if self.ram then nn.device = "cpu" end
  self:param("table", nn.init.normal({self.layout.total_rows, opts.width}, opts.std or 0.02))
  nn.device = device
  self.table:requires_grad(false)
  self.entries = {}
  self:child("wk", nn.Linear(subtables * opts.width, d))
  self:child("wv", nn.Linear(subtables * opts.width, d))
  self:child("norm", nn.RMSNorm(d))
  self:param("conv", nn.init.zeros({d, 4}))
  self.dilation = opts.orders[#opts.orders]
end

-- The table rows this batch reads: [B, T, subtables].
function Engram:rows(x, prefix) return dm.engram_index(x, prefix, self.layout) end

-- The rows x touches: distinct rows, each lookup's place among them, and those
-- rows as a compact leaf [U, width]. The iterations of one forward share them
-- (the same x), so their gradients meet in one compact.grad.
function Engram:lookup(x, prefix)
  local c = self.current
  if c and c.x == x then return c end
  local rows, inverse = dm.engram_unique(self:rows(x, prefix))
  if self.ram then rows = rows:to("cpu") end
  local compact = dm.no_grad(dm.embedding, rows, self.table)
  if self.ram then compact = compact:to(x.device) end
  c = {x = x, rows = rows, inverse = inverse, compact = compact}
  if dm.grad_enabled() then
    compact:requires_grad(true)
    self.entries[#self.entries + 1] = c
  end
  self.current = c
  return c
end

-- This step's sparse gradient: rows [U] and grads [U, width], summed over the
-- micro-batches of the step; nil when there is none.
function Engram:sparse_grad()
  local rows, grads = {}, {}
  for _, c in ipairs(self.entries) do
    local g = c.compact.grad
    if g then rows[#rows + 1], grads[#grads + 1] = c.rows, g end
  end
  if #rows == 0 then return nil end
  if #rows == 1 then return rows[1], grads[1] end
  local all_rows, inverse = dm.engram_unique(dm.cat(rows, 1))
  return all_rows, dm.engram_sparse_grad(dm.cat(grads, 1), inverse, all_rows:size(1))
end

function Engram:clear_sparse()
  self.entries, self.current = {}, nil
end

function Engram:forward(u, x, prefix)
  local B, T = u:size(1), u:size(2)
  local c = self:lookup(x, prefix)
  local e = dm.embedding(c.inverse, c.compact):reshape({B, T, self.n_sub * self.width})
  local kx, vx = self.wk:forward(e), self.wv:forward(e)
  local alpha = dm.engram_alpha(u, kx)
  local vt = vx * alpha:unsqueeze(-1)
  return vt + dm.causal_conv1d(self.norm:forward(vt), self.conv, {dilation = self.dilation}):silu()
end

nn.Engram = Engram

end
