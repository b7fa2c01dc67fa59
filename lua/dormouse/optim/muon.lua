--[[
Muon over one group of matrices [m, n] and banks [E, m, n] (vm/ops/optim.c):

  buf <- mu buf + g ;  u = g + mu buf (Nesterov) or buf
  O   =  NS5(u)       each matrix on its own; every matrix of one shape is
                      stacked and iterated with batched products
  O   <- O normalised by column, row or both (normalize: Muon+, arXiv 2602.21545; "none" by default)
  p   <- p (1 - lr wd) - lr 0.2 sqrt(max(m, n)) O

NS5: X = u / (||u||_F + 1e-7), then 5 Newton-Schulz steps X <- aX + (bA + cA^2)X
with A = X X^T on the smaller side, (a, b, c) = (3.4445, -4.7750, 2.0315), or
the per-step Polar Express coefficients. It runs in ns_dtype: bf16 on the
GPU, f32 on the CPU by default. The momentum buffers are f32, or bf16
(momentum_dtype): half their memory, rounded once a step, to nearest or
(bf16_stochastic) up with the probability of the value's place between its
two bf16 neighbours, from random bits keyed by the group's name, the step
and the element (vm/core/sround.h), so a resume rounds the same way.
]]
local core = require "dormouse.core"
local groups = require "dormouse.optim.groups"

-- clips_inside: the gradients reach the momentum pass unclipped, with the
-- global norm's sum and the clip (at.clip), and are clipped as they are read
local Muon = {kind = "muon", device_scalars = true, clips_inside = true}
Muon.__index = Muon

-- hp: {lr, momentum, nesterov, weight_decay, ns_steps, coeffs, ns_dtype, momentum_dtype, normalize}
function Muon.new(name, entries, hp)
  local mdtype = hp.momentum_dtype or "f32"
  local dtypes = {momentum = mdtype == "bf16_stochastic" and "bf16" or mdtype}
  local self = setmetatable(groups.new_group(name, entries, {"momentum"}, dtypes), Muon)
  for _, k in ipairs {"lr", "momentum", "nesterov", "weight_decay", "ns_steps", "coeffs", "ns_dtype", "normalize"} do
    self[k] = hp[k]
  end
  self.sround = mdtype == "bf16_stochastic"
  self.sround_salt = groups.salt(name)
  -- a module's per-matrix update scales (MoE's experts under model.moe.update_by_load), false: none
  local scales, any = {}, false
  for i, e in ipairs(entries) do
    local m = e.module
    scales[i] = m and m.muon_scales and m:muon_scales(e.name:match("([^.]+)$")) or false
    any = any or scales[i] ~= false
  end
  self.scales = any and scales or nil
  return self
end

-- t: the 1-based count of updates (the rounding's step when at has no step_at)
-- at: device scalars {lr_at, step_at, sumsq_at} read when the kernels run (optim/init.lua), or nil
function Muon:update(mult, t, at)
  at = at or {}
  core.muon_step(self.params, self.state.momentum, {
    lr = self.lr * mult, momentum = self.momentum, nesterov = self.nesterov,
    weight_decay = self.weight_decay, ns_steps = self.ns_steps, coeffs = self.coeffs,
    ns_dtype = self.ns_dtype, lr_at = at.lr_at, sumsq_at = at.sumsq_at, clip = at.clip, normalize = self.normalize,
    momentum_sround = self.sround, sround_salt = self.sround_salt, step = t, step_at = self.sround and at.step_at or nil,
    scales = self.scales,
  })
end

return Muon
