--[[
MoE — routed low-rank experts with a shared expert (spec/model.md):

  s      = sigmoid(W_r u)                      router scores, float32
  idx    = topk_k(s + lfb_bias)                the bias steers selection only
  w      = s[idx] / sum(s[idx])
  expert e:  y_e = D[e] (silu((U_g[e]^T u) c_g[e]) · (U_u[e]^T u) c_u[e])
  shared:    y_s = the same form at rank r_s
  out    = W_write( y_s + sum_{e in idx} w_e y_e )

Dispatch is dropless: assignments are sorted by expert and the expert products
run grouped, with per-expert offsets (no host sync). After each step
update_balance() moves lfb_bias towards equal load.
]]
return function(nn, dm)

local MoE = nn.class("MoE")

function MoE:init(d, opts)
  local E, r, F = opts.experts, opts.rank, opts.ffn
  self.experts, self.top_k, self.gamma = E, opts.top_k, opts.lfb_gamma or 1e-3
  self:child("router", nn.Linear(d, E))
  self:param("Ug", nn.init.normal({E, d, r}, d ^ -0.5))
  self:param("Uu", nn.init.normal({E, d, r}, d ^ -0.5))
  self:param("cg", nn.init.ones({E, r}))
  self:param("cu", nn.init.ones({E, r}))
  self:param("D", nn.init.normal({E, r, F}, r ^ -0.5))
  local rs = opts.shared_rank
  self:child("sg", nn.Linear(d, rs))
  self:child("su", nn.Linear(d, rs))
  self:param("scg", nn.init.ones({rs}))
  self:param("scu", nn.init.ones({rs}))
  self:child("sd", nn.Linear(rs, F))
  self:child("write", nn.Linear(F, d))
  self:buffer("lfb_bias", nn.init.zeros({E}))
end

-- The routed experts' products in the compute dtype (bf16 on the GPU: the
-- tensor-core kernels), with f32 masters cast at each use as for any matrix
-- product, so their gradients add up in f32; the combine too, its result in f32.
local function routed_experts(self, x, perm, offsets, inv, w)
  local cd = nn.compute_dtype
  if cd == "f32" or x.dtype ~= "f32" then
    local rows = dm.moe_experts(x, perm, offsets, self.Ug, self.Uu, self.cg, self.cu, self.D, self.top_k)
    return dm.moe_combine(rows, inv, w)
  end
  local rows = dm.moe_experts(x:to(cd), perm, offsets, self.Ug:to(cd), self.Uu:to(cd), self.cg:to(cd),
                              self.cu:to(cd), self.D:to(cd), self.top_k)
  return dm.moe_combine(rows, inv, w:to(cd)):to("f32")
end

function MoE:forward(u)
  local B, T, d = u:size(1), u:size(2), u:size(3)
  local x = u:reshape({B * T, d})
  local idx, w, counts = dm.moe_route(self.router:forward(x), self.lfb_bias, self.top_k)
  local perm, offsets, inv = dm.moe_sort(idx, self.experts)
  local routed = routed_experts(self, x, perm, offsets, inv, w)
  local shared = self.sd:forward(dm.silu_mul(self.sg:forward(x) * self.scg, self.su:forward(x) * self.scu))
  self.counts = self.counts and self.counts + counts or counts   -- summed over the step's iterations
  return self.write:forward(routed + shared):reshape({B, T, d})
end

-- Loss-free balancing, on the whole step's counts (every iteration's routing):
-- lfb_bias[e] += gamma · sign(mean_load − load[e]). Returns the counts used.
function MoE:update_balance()
  local counts = self.counts
  if not counts then return nil end
  self.counts = nil
  dm.no_grad(function() dm.moe_balance_(self.lfb_bias, counts, self.gamma) end)   -- on the device, no sync
  return counts
end

nn.MoE = MoE

end
