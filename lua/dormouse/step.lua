--[[
A step's pieces, as every form of the step takes them (the eager step of train.lua, the captured
one of graphstep.lua, the planned one of plan.lua, the reinforcement step of rl.lua): one
micro-batch's forward and backward, the experts' balance after the backward, and the
micro-batches' weights.
]]
local instrument = require "dormouse.instrument"
local dist = require "dormouse.dist"

local step = {}

--[[ One micro-batch of a step, as every form of the step takes it (the eager step
of train.lua, the captured one of graphstep.lua and the planned one of plan.step): the
forward of x, prefix, and the backward of its loss weighted by `scale` (1 /
grad_accum). With `read` the loss is read back first and a non-finite one takes no
backward (the eager step's NaN firewall; the captured and the planned steps read
nothing). mark, when given, is called with "forward" and "backward" as each ends. mask: the
batch's loss mask (records), or nil.
Returns the forward's out and the loss read (nil without read). ]]
function step.micro_batch(model, x, prefix, scale, read, mark, mask)
  local out = model:forward(x, prefix, mask and {mask = mask} or nil)
  local l = read and out.loss:item() or nil
  if mark then mark("forward") end
  if not read or instrument.finite(l) then (scale == 1 and out.loss or out.loss * scale):backward() end
  if mark then mark("backward") end
  return out, l
end

-- The experts' balance after a step's backward: the routing counts and the drops (nil without MoE);
-- in a data-parallel job on every rank's counts, summed
function step.balance(model)
  if model.update_balance then return model:update_balance(dist.active() and dist.sum_ or nil) end
end

--[[ The weights of a step's micro-batches: 1 / grad_accum each, or under loss masks (records) each
one's share of the step's scored targets, so that the step's loss is the mean over all of them as one
batch's would be (a micro-batch of short responses counts for less). masks: the micro-batches'
masks (u8 tensors on the CPU) or nil. ]]
function step.micro_weights(masks, n)
  local w = {}
  local total, counts = 0, {}
  for i = 1, n do
    counts[i] = masks and masks[i] and masks[i]:to("f64"):sum():item() or 1
    total = total + counts[i]
  end
  for i = 1, n do w[i] = total > 0 and counts[i] / total or 1 / n end
  return w
end

return step
