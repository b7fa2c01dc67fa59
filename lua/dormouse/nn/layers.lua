--[[
The general layers: Linear, RMSNorm, Embedding.
]]
return function(nn, dm)

local Linear = nn.class("Linear")
function Linear:init(d_in, d_out, opts)
  opts = opts or {}
  self.d_in, self.d_out = d_in, d_out
  local std = opts.std or d_in ^ -0.5
  -- opts.weight: the initial weight [d_out, d_in], drawn by the caller (MSA draws from its own generator)
  self:param("weight", opts.weight or opts.zero and nn.init.zeros({d_out, d_in}) or nn.init.normal({d_out, d_in}, std))
  if opts.bias then self:param("bias", nn.init.zeros({d_out})) end
end
function Linear:forward(x)
  local y = self:project(x, self.weight)
  if self.bias then y = y + nn.like(self.bias, y) end
  return y
end
nn.Linear = Linear

local RMSNorm = nn.class("RMSNorm")
function RMSNorm:init(d, opts)
  self.eps = (opts and opts.eps) or 1e-6
  self:param("gain", nn.init.ones({d}))
end
function RMSNorm:forward(x) return dm.rmsnorm(x, nn.like(self.gain, x), {eps = self.eps}) end
-- h + y and the norm of that sum in y's dtype, in one op (dm.add_rmsnorm; nn.residual's next)
function RMSNorm:add_forward(h, y) return dm.add_rmsnorm(h, y, nn.like(self.gain, y), self.eps) end
nn.RMSNorm = RMSNorm

local Embedding = nn.class("Embedding")
function Embedding:init(n, d, opts)
  self:param("weight", nn.init.normal({n, d}, (opts and opts.std) or 1))
end
function Embedding:forward(ids) return dm.embedding(ids, self.weight) end
nn.Embedding = Embedding

end
