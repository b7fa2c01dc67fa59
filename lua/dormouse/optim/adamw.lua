--[[
AdamW over one group, as one fused multi-tensor update (vm/ops/optim.c, kernel
"adamw"):

  m  <- b1 m + (1 - b1) g          v <- b2 v + (1 - b2) g^2
  p  <- p (1 - lr wd) - lr m^ / (sqrt(v^) + eps),   m^ = m / (1 - b1^t),  v^ = v / (1 - b2^t)

t counts the updates applied (skipped steps do not count). Gradients are
read from each parameter's .grad (f32 or bf16); a parameter without one is
left alone.

With moments = "8bit" (optim.adamw_moments) m and sqrt(v) are kept in 8 bits a
value with an f32 scale a block of 256 (vm/core/code8.h, kernel "adamw_8bit"):
slots m8 and v8 (u8 codes, the parameter's shape: v8 codes sqrt(v)) and
m_scale and v_scale (f32, one a block), 25.4% of the f32 moments' memory.
Each step decodes them, steps in f32 and encodes them again, rounding
stochastically (random bits keyed by the group's name, the parameter, the
update's count and the element: a resume rounds as the run would have).
]]
local core = require "dormouse.core"
local groups = require "dormouse.optim.groups"

local AdamW = {kind = "adamw", device_scalars = true}
AdamW.__index = AdamW

local CODE8_BLOCK = 256            -- DM_CODE8_BLOCK (vm/core/code8.h): the values a scale covers
local function block() return CODE8_BLOCK end

-- hp: {lr, betas = {b1, b2}, eps, weight_decay, moments ("f32" or "8bit")}
function AdamW.new(name, entries, hp)
  local self
  if hp.moments == "8bit" then
    self = setmetatable(groups.code8_group(name, entries, block), AdamW)
  else
    self = setmetatable(groups.new_group(name, entries, {"m", "v"}), AdamW)
  end
  self.lr, self.betas, self.eps, self.weight_decay = hp.lr, hp.betas, hp.eps, hp.weight_decay
  return self
end

-- one update at lr * mult; t is the 1-based count of updates
-- at: device scalars {lr_at, step_at, sumsq_at} read when the kernels run (optim/init.lua), or nil
function AdamW:update(mult, t, at)
  at = at or {}
  local hp = {lr = self.lr * mult, beta1 = self.betas[1], beta2 = self.betas[2], eps = self.eps,
              weight_decay = self.weight_decay, step = t, lr_at = at.lr_at, step_at = at.step_at,
              sumsq_at = at.sumsq_at}
  if self.code8 then
    hp.salt = self.salt
    local s = self.state
    core.adamw_8bit_step(self.params, s.m8, s.m_scale, s.v8, s.v_scale, hp)
  else
    core.adamw_step(self.params, self.state.m, self.state.v, hp)
  end
end

-- a checkpoint's state in this group's form (groups.code8_adapt: f32 moments to 8 bits and back)
function AdamW:adapt_state(tbl) return groups.code8_adapt(self, tbl, block) end

return AdamW
