--[[
Activation checkpointing (vm/ops/recompute.c):

  local y = dm.recompute(function(x) return block:forward(x) end, x)

computes fn(x) without keeping its activations: the tape gets one node that
saves only the inputs, and the backward runs fn again, on a nested tape,
to get the gradients through it (and into the parameters fn reads). Memory
for the price of a second forward. fn returns one tensor and computes the
same thing both times; while it runs the second time dm.recomputing() is
true, so that state it keeps (routing counts, say) counts the step once.
The intermediates of each run are dropped as it returns (dm.scope).
]]
return function(dm, core)

-- fn's first result, its other tensors dropped (a scope that, unlike
-- dm.scope at the outermost level, never clears the tape it runs beside)
local function scoped(fn, ...)
  local depth = core.scope_begin()
  local res = table.pack(pcall(fn, ...))
  core.scope_end(depth, res[2])
  if not res[1] then error(res[2], 0) end
  return res[2]
end

function dm.recompute(fn, ...)
  if type(fn) ~= "function" then
    core.error(string.format("recompute: expected a function, got %s", type(fn)))
  end
  return core.recompute(function(...) return scoped(fn, ...) end, ...)
end

function dm.recomputing() return core.recomputing() end

-- the name it had: an error that gives the new one (dm.ckpt is the checkpoint files)
function dm.checkpoint()
  core.error("dm.checkpoint(fn, ...) is now dm.recompute(fn, ...) (activation recompute; dm.ckpt reads and " ..
             "writes checkpoint files)")
end

end
