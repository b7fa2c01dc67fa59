--[[
AdamW over one group, as one fused multi-tensor update (vm/ops/optim.c, kernel
"adamw"):

  m  <- b1 m + (1 - b1) g          v <- b2 v + (1 - b2) g^2
  p  <- p (1 - lr wd) - lr m^ / (sqrt(v^) + eps),   m^ = m / (1 - b1^t),  v^ = v / (1 - b2^t)

t counts the updates applied (skipped steps do not count). Gradients are
read from each parameter's .grad (f32 or bf16); a parameter without one is
left alone.

With moments = "q8" (optim.adamw_moments) m and sqrt(v) are kept in 8 bits a
value with an f32 scale a block of 256 (vm/core/q8.h, kernel "adamw_q8"):
slots m_q8 and v_q8 (u8 codes, the parameter's shape: v_q8 codes sqrt(v)) and
m_scale and v_scale (f32, one a block), about 26% of the f32 moments' memory.
Each step decodes them, steps in f32 and encodes them again, rounding
stochastically (random bits keyed by the group's name, the parameter, the
update's count and the element: a resume rounds as the run would have).
]]
local dm = require "dormouse"
local core = require "dormouse.core"
local groups = require "dormouse.optim.groups"

local AdamW = {kind = "adamw", device_scalars = true}
AdamW.__index = AdamW

local Q8_BLOCK = 256            -- DM_Q8_BLOCK (vm/core/q8.h)
local function blocks(t) return {(t:numel() + Q8_BLOCK - 1) // Q8_BLOCK} end

-- a 32-bit FNV-1a hash of s: the group's key for its rounding bits
local function fnv1a(s)
  local h = 2166136261
  for i = 1, #s do h = ((h ~ s:byte(i)) * 16777619) & 0xffffffff end
  return h
end

-- hp: {lr, betas = {b1, b2}, eps, weight_decay, moments ("f32" or "q8")}
function AdamW.new(name, entries, hp)
  local self
  if hp.moments == "q8" then
    self = setmetatable(groups.new_group(name, entries, {"m_q8", "m_scale", "v_q8", "v_scale"},
                                         {m_q8 = "u8", m_scale = "f32", v_q8 = "u8", v_scale = "f32"},
                                         {m_scale = blocks, v_scale = blocks}), AdamW)
    self.q8, self.salt = true, fnv1a(name)
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
  if self.q8 then
    hp.salt = self.salt
    local s = self.state
    core.adamw_q8_step(self.params, s.m_q8, s.m_scale, s.v_q8, s.v_scale, hp)
  else
    core.adamw_step(self.params, self.state.m, self.state.v, hp)
  end
end

--[[ A checkpoint's state (a table of "<param>.<slot>" tensors) in this group's form: f32 moments
packed into 8-bit codes for a q8 group, codes unpacked into f32 moments for an f32 one (a run
resumed with the other optim.adamw_moments). Returns a table that shares what it did not convert. ]]
function AdamW:adapt_state(tbl)
  local converted = {}        -- key -> its tensor in this form, or false: a key of the other form, dropped
  for i, e in ipairs(self.entries) do
    local k = e.name .. "."
    if self.q8 and not tbl[k .. "m_q8"] and dm.is_tensor(tbl[k .. "m"]) and dm.is_tensor(tbl[k .. "v"]) then
      local p = self.params[i]
      local function pack(values, signed)
        local codes = dm.zeros(p:shape(), {dtype = "u8"})
        local scales = dm.zeros(blocks(p), {dtype = "f32"})
        core.q8_pack(codes, scales, values:to("cpu"):to("f32"):contiguous(), signed, self.salt)
        return codes, scales
      end
      converted[k .. "m_q8"], converted[k .. "m_scale"] = pack(tbl[k .. "m"], true)
      converted[k .. "v_q8"], converted[k .. "v_scale"] = pack(tbl[k .. "v"]:to("cpu"):to("f32"):sqrt(), false)
      converted[k .. "m"], converted[k .. "v"] = false, false
    elseif not self.q8 and not tbl[k .. "m"] and dm.is_tensor(tbl[k .. "m_q8"]) then
      local function unpack(codes, scales, signed)
        local values = dm.zeros(codes:shape(), {dtype = "f32"})
        core.q8_unpack(values, codes:to("cpu"):contiguous(), scales:to("cpu"):contiguous(), signed)
        return values
      end
      converted[k .. "m"] = unpack(tbl[k .. "m_q8"], tbl[k .. "m_scale"], true)
      local r = unpack(tbl[k .. "v_q8"], tbl[k .. "v_scale"], false)
      converted[k .. "v"] = r * r
      for _, slot in ipairs {"m_q8", "m_scale", "v_q8", "v_scale"} do converted[k .. slot] = false end
    end
  end
  if next(converted) == nil then return tbl end
  local merged = {}
  for key, v in pairs(tbl) do merged[key] = v end
  for key, v in pairs(converted) do merged[key] = v or nil end
  return merged
end

return AdamW
