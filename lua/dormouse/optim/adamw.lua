--[[
AdamW over one group, as one fused multi-tensor update (vm/ops/optim.c, kernel
"adamw"):

  m  <- b1 m + (1 - b1) g          v <- b2 v + (1 - b2) g^2
  p  <- p (1 - lr wd) - lr m^ / (sqrt(v^) + eps),   m^ = m / (1 - b1^t),  v^ = v / (1 - b2^t)

t counts the updates applied (skipped steps do not count). Gradients are
read from each parameter's .grad (f32 or bf16); a parameter without one is
left alone.
]]
local core = require "dormouse.core"
local groups = require "dormouse.optim.groups"

local AdamW = {kind = "adamw", device_scalars = true}
AdamW.__index = AdamW

-- hp: {lr, betas = {b1, b2}, eps, weight_decay}
function AdamW.new(name, entries, hp)
  local self = setmetatable(groups.new_group(name, entries, {"m", "v"}), AdamW)
  self.lr, self.betas, self.eps, self.weight_decay = hp.lr, hp.betas, hp.eps, hp.weight_decay
  return self
end

-- one update at lr * mult; t is the 1-based count of updates
-- at: device scalars {lr_at, step_at, sumsq_at} read when the kernels run (optim/init.lua), or nil
function AdamW:update(mult, t, at)
  at = at or {}
  core.adamw_step(self.params, self.state.m, self.state.v, {
    lr = self.lr * mult, beta1 = self.betas[1], beta2 = self.betas[2], eps = self.eps,
    weight_decay = self.weight_decay, step = t,
    lr_at = at.lr_at, step_at = at.step_at, sumsq_at = at.sumsq_at,
  })
end

return AdamW
