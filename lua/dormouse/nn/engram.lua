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
  self:param("table", nn.init.normal({self.layout.total_rows, opts.width}, opts.std or 0.02))
  self:child("wk", nn.Linear(subtables * opts.width, d))
  self:child("wv", nn.Linear(subtables * opts.width, d))
  self:child("norm", nn.RMSNorm(d))
  self:param("conv", nn.init.zeros({d, 4}))
  self.dilation = opts.orders[#opts.orders]
end

-- The table rows this batch reads: [B, T, subtables].
function Engram:rows(x, prefix) return dm.engram_index(x, prefix, self.layout) end

function Engram:forward(u, x, prefix)
  local B, T = u:size(1), u:size(2)
  local e = dm.embedding(self:rows(x, prefix), self.table):reshape({B, T, self.n_sub * self.width})
  local kx, vx = self.wk:forward(e), self.wv:forward(e)
  local alpha = dm.engram_alpha(u, kx)
  local vt = vx * alpha:unsqueeze(-1)
  return vt + dm.causal_conv1d(self.norm:forward(vt), self.conv, {dilation = self.dilation}):silu()
end

nn.Engram = Engram

end
