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

local function cast_banks(self, cd)
  return {Ug = self.Ug:to(cd), Uu = self.Uu:to(cd), cg = self.cg:to(cd), cu = self.cu:to(cd), D = self.D:to(cd)}
end

-- A new forward pass of the model: its routing counts start again, and the
-- expert banks' compute-dtype copies are made here, once for the pass's
-- iterations (both here, so that they outlive a checkpointed iteration's scope).
-- update_balance (after the backward) ends the pass. A caller that never
-- starts one gets fresh copies at every call.
function MoE:new_pass()
  if dm.recomputing() then return end          -- a checkpoint around the whole pass: the forward's state stands
  self.counts = dm.zeros({self.experts}, {dtype = "i64", device = self.lfb_bias.device})
  self.weights = nil
  if nn.compute_dtype ~= "f32" and self.Ug.dtype == "f32" then self.weights = cast_banks(self, nn.compute_dtype) end
end

local function end_pass(self) self.weights = nil end

-- The pass's copies freed at once: only for a pass whose every use was
-- checkpointed (no tape holds them; the recomputation casts its own).
function MoE:drop_weights()
  if self.weights then
    for _, t in pairs(self.weights) do t:free() end
    self.weights = nil
  end
end

-- The expert banks in the compute dtype, cast once per forward pass and
-- shared by its iterations (the same weights each time): one bf16 copy of
-- the banks is saved for backward, not one per iteration. As under autocast,
-- the iterations' gradients meet in that copy's dtype, then flow to the f32
-- masters. On the CPU (or in f32) the masters themselves.
function MoE:compute_weights(x)
  local cd = nn.compute_dtype
  if cd == "f32" or x.dtype ~= "f32" then
    return {Ug = self.Ug, Uu = self.Uu, cg = self.cg, cu = self.cu, D = self.D}
  end
  -- a checkpointed iteration run again in the backward casts afresh: the copies
  -- it reads must be on its own tape for the gradients to reach the masters
  if self.weights and not dm.recomputing() then return self.weights end
  return cast_banks(self, cd)
end

-- The routed experts' products (bf16 tensor-core kernels on the GPU) and their
-- gated combine, in the weights' dtype; the result in x's.
local function routed_experts(self, W, x, perm, offsets, inv, w)
  local xs = x:to(W.D.dtype)
  local rows = dm.moe_experts(xs, perm, offsets, W.Ug, W.Uu, W.cg, W.cu, W.D, self.top_k)
  return dm.moe_combine(rows, inv, w:to(W.D.dtype)):to(x.dtype)
end

-- The step's intermediates (routing, expert rows, the shared expert) are
-- dropped when it returns (dm.scope); what backward needs the tape holds.
function MoE:forward(u)
  local B, T, d = u:size(1), u:size(2), u:size(3)
  local x = u:reshape({B * T, d})
  local W = self:compute_weights(x)
  local out, counts = dm.scope(function()
    local idx, w, counts = dm.moe_route(self.router:forward(x), self.lfb_bias, self.top_k)
    local perm, offsets, inv = dm.moe_sort(idx, self.experts)
    local routed = routed_experts(self, W, x, perm, offsets, inv, w)
    local shared = self.sd:forward(dm.silu_mul(self.sg:forward(x) * self.scg, self.su:forward(x) * self.scu))
    return self.write:forward(routed + shared), counts
  end)
  if not dm.recomputing() then                 -- summed over the step's iterations, each counted once
    -- without new_pass the first call's counts are the sum: kept out of the scope
    -- it returns to (a checkpointed call's ends with it)
    if self.counts then self.counts:add_(counts) else self.counts = dm.keep(counts) end
  end
  return out:reshape({B, T, d})
end

-- Loss-free balancing, on the whole step's counts (every iteration's routing):
-- lfb_bias[e] += gamma · sign(mean_load − load[e]). Returns the counts used.
function MoE:update_balance()
  end_pass(self)
  local counts = self.counts
  if not counts then return nil end
  self.counts = nil
  dm.no_grad(function() dm.moe_balance_(self.lfb_bias, counts, self.gamma) end)   -- on the device, no sync
  return counts
end

nn.MoE = MoE

end
