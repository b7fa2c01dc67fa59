--[[
Segments: rows longer than model.segment run as segments of that many bytes,
each pass carrying the model's state (every iteration's KDA state and
convolution inputs) from the one before. The loss and the gradient are those
of the whole rows, exactly; only the boundary states and one segment's
activations are alive at a time (docs/training.md, "Long sequences").

  segments.split(x, prefix, len, mask)     (mask: or nil)
                                    → {{x = [B, n+1], prefix = [B, P], n = n, w = share,
                                       mask = the mask's [B, n] or nil}, ...}
  segments.evaluate(model, x, prefix, len, opts)
                                    → the pass's {fin, periter, fin_D} as numbers, the
                                      segments' means weighted by their shares (no
                                      gradient; opts.depths, opts.mask)
  segments.backward(model, x, prefix, len, scale, mark, mask)   (mark, mask: or nil)
                                    → the whole rows' loss (a one-element tensor on the
                                      model's device: the caller reads it) and the arms'
                                      terms; the gradient of scale · loss is added into
                                      the parameters' (mark(phase), when given: as each
                                      forward and backward ends, as train.step's;
                                      mask: the targets scored, as the model's
                                      opts.mask)
  segments.free(state)              frees a pass's out.state now
  segments.each(state, fn)          fn(i, key, tensor) for each tensor of a state

What a pass keeps grows with its number of segments by the boundary states
alone: the first sweep keeps the state at every boundary (each iteration's KDA
state and convolution inputs: models/dormouse.lua, docs/training.md), and the
backward frees each as it passes it. What the optimiser reads is folded into
one running sum as each segment's backward ends (the model's fold_sparse).

The backward runs the segments forward without a tape, keeping the state at
each boundary, then walks them from the last: each is run again on a tape
from its saved state (a leaf), and the backward of its share of the loss
plus <its final state, that state's gradient from the segment after> gives
the gradient of the state it started from, which the segment before takes.
]]
local dm = require "dormouse"

local segments = {}

--[[ x [B, T+1] (inputs 1..T, targets 2..T+1), prefix [B, P] the bytes before each
row: segment s of n bytes reads inputs a..a+n-1 (a = (s-1) len + 1) with their
targets, and the P bytes before a as its prefix. Its share w of the rows' loss
is n / T, or with a mask [B, T] (the targets scored: the model's opts.mask) its
scored targets over the rows' (read from the mask once). ]]
function segments.split(x, prefix, len, mask)
  local T, P = x:size(2) - 1, prefix:size(2)
  local whole = P > 0 and dm.cat({prefix, x}, 2) or x
  local out = {}
  for a = 1, T, len do
    local n = math.min(len, T - a + 1)
    out[#out + 1] = {x = x:narrow(2, a, n + 1), prefix = P > 0 and whole:narrow(2, a, P) or prefix, n = n,
                     w = n / T, mask = mask and mask:narrow(2, a, n)}
  end
  if mask then
    local per = dm.scope(function()           -- each segment's scored targets, in one read
      local counts = {}
      for i, seg in ipairs(out) do counts[i] = seg.mask:to("f32"):sum():reshape({1}) end
      return dm.cat(counts, 1):to("cpu"):totable()
    end)
    local all = 0
    for _, c in ipairs(per) do all = all + c end
    for i, seg in ipairs(out) do seg.w = all > 0 and per[i] / all or 0 end
  end
  return out
end

local function each_tensor(state, fn)
  for i, it in pairs(state) do
    for k, t in pairs(it) do fn(i, k, t) end
  end
end
segments.each = each_tensor

-- Free a state's tensors now (a pass's out.state; nil: nothing)
function segments.free(state) if state then each_tensor(state, function(_, _, t) t:free() end) end end
local free_state = segments.free

local function no_state(model)
  local name = model.cfg and model.cfg.arch or model._name or "this model"
  return string.format("model.segment: the forward of %s returns no state (out.state), so it cannot run by " ..
                       "segments; models/dormouse.lua and models/stack.lua carry it (docs/models.md)", name)
end

-- A forward's losses as numbers {fin, periter, fin_D} (periter and fin_D are optional: docs/models.md)
function segments.numbers(out)
  local r = {fin = out.fin:item(), periter = {}, fin_D = {}}
  for i, ce in ipairs(out.periter or {}) do r.periter[i] = ce:item() end
  for D, ce in pairs(out.fin_D or {}) do r.fin_D[D] = ce:item() end
  if out.measures then
    r.measures = {}
    for name, v in pairs(out.measures) do r.measures[name] = v:item() end
  end
  return r
end

-- One pass of a segment from state (nil: the rows' start) without a tape: the output, its state kept
-- (the state is returned apart: a scope keeps the tensors of a returned table two levels deep)
local function pass(model, seg, state, opts)
  local next_state, r = dm.scope(function()
    local out = model:forward(seg.x, seg.prefix, {state = state or {}, depths = opts and opts.depths, mask = seg.mask})
    if not out.state then error(no_state(model), 0) end
    return out.state, segments.numbers(out)
  end)
  r.state = next_state
  return r
end

-- The state a segment leaves, from state (nil: the rows' start), without a tape and reading no value
-- back (the backward's first sweep: nothing waits for the device)
local function state_after(model, seg, state)
  return dm.scope(function()
    local out = model:forward(seg.x, seg.prefix, {state = state or {}})
    if not out.state then error(no_state(model), 0) end
    return out.state
  end)
end

function segments.evaluate(model, x, prefix, len, opts)
  local total = {fin = 0, periter = {}, fin_D = {}}
  dm.no_grad(function()
    local state
    for _, seg in ipairs(segments.split(x, prefix, len, opts and opts.mask)) do
      local r = pass(model, seg, state, opts)
      free_state(state)
      state = r.state
      local w = seg.w
      total.fin = total.fin + r.fin * w
      for i, v in ipairs(r.periter) do total.periter[i] = (total.periter[i] or 0) + v * w end
      for D, v in pairs(r.fin_D) do total.fin_D[D] = (total.fin_D[D] or 0) + v * w end
    end
    free_state(state)
  end)
  return total
end

-- the state as leaves that take a gradient (copies: the saved state stays as it is)
local function leaves(state)
  local out = {}
  each_tensor(state, function(i, k, t)
    out[i] = out[i] or {}
    local leaf = t:clone()
    leaf:requires_grad(true)
    out[i][k] = leaf
  end)
  return out
end

-- sum + v, the two let go at once (a running sum over the segments holds one tensor, not one a segment)
local function add(sum, v)
  if not sum then return v end
  local total = sum + v
  sum:free()
  v:free()
  return total
end

-- add_counts: the step's routing counts continue from an earlier micro-batch's (grad_accum > 1)
function segments.backward(model, x, prefix, len, scale, mark, mask, add_counts)
  mark = mark or function() end
  local segs = segments.split(x, prefix, len, mask)
  local starts = {}                                  -- starts[s]: the state segment s begins from
  dm.no_grad(function()
    for s = 1, #segs - 1 do starts[s + 1] = state_after(model, segs[s], starts[s]) end
  end)
  mark("forward")
  local loss, grads = nil, nil                       -- loss: the row's, summed on the device; grads: the
                                                     -- gradient of segment s's final state
  local extras = {}                                  -- the arms' terms (out.extras), weighted by the segments' shares
  for s = #segs, 1, -1 do
    local seg = segs[s]
    local from = starts[s] and leaves(starts[s]) or nil
    local share, parts = dm.scope(function()
      -- the last segment starts the step's routing counts (the first micro-batch's); the others add theirs
      local out = model:forward(seg.x, seg.prefix, {state = from or {},
                                                    counts = (s < #segs or add_counts) and "add" or nil,
                                                    mask = seg.mask})
      if not out.state then error(no_state(model), 0) end
      local w = seg.w
      mark("forward")
      local objective = out.loss * (w * scale)
      if grads then
        each_tensor(grads, function(i, k, g)
          local t = out.state[i] and out.state[i][k]
          if t then objective = objective + (t * g):sum():to(objective.dtype) end
        end)
      end
      objective:backward()
      if model.fold_sparse then model:fold_sparse() end   -- the segment's sparse gradients into the step's sum
      mark("backward")
      local parts = {}
      for name, v in pairs(out.extras or {}) do parts[name] = v:detach() * w end
      -- this segment's share of the loss, its arms' terms, and what the model keeps for the step's end
      return out.loss:detach() * w, parts, model.held and model:held() or nil
    end)
    loss = add(loss, share)
    for name, v in pairs(parts) do extras[name] = add(extras[name], v) end
    free_state(grads)
    grads = nil
    if from then
      -- in a scope of its own: the handles read here (t.grad) would otherwise hold each
      -- segment's gradients until the step's end
      grads = dm.scope(function()
        local g = {}
        each_tensor(from, function(i, k, t)
          local tg = t.grad
          if tg then
            g[i] = g[i] or {}
            g[i][k] = tg:detach()
          end
        end)
        return g
      end)
      free_state(from)
      free_state(starts[s])
    end
  end
  free_state(grads)
  return loss, extras                                -- read by the caller (the step's one read of a value)
end

return segments
