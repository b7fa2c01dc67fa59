--[[
dormouse — tensors, autograd and models in Lua over a C and CUDA core.

  local dm = require "dormouse"
  local x = dm.randn({4, 8}, {seed = 1})

Positions are 1-based, as everywhere in Lua: dims (x:sum(1)), narrow starts,
and the indices that gather, index_select, scatter_add, max and argmax take
or return. Negative dims count from the end (-1 is the last). Byte values
and class ids (embedding ids, cross-entropy targets) are values, 0..255.
]]
local core = require "dormouse.core"

local dm = {core = core, version = core.version}
local T = core.methods

require("dormouse.tensor")(dm, T, core)
for _, family in ipairs {"elementwise", "reduce", "shape", "index", "matmul", "norm", "xent", "conv", "silu_mul",
                         "kda", "moe", "engram", "quant"} do
  require("dormouse.ops." .. family)(dm, T, core)
end
require("dormouse.ops.generated").install(dm, T, core)      -- the ops whose descriptors give their function

dm.data = require "dormouse.data"
dm.ckpt = require "dormouse.ckpt"
dm.config = require "dormouse.config"
dm.cuda = require "dormouse.cuda"
dm.cuda.graph = require "dormouse.graph"
dm.fuse = require "dormouse.fuse"
dm.profile = require "dormouse.profile"
require("dormouse.recompute")(dm, core)

-- Modules that themselves require "dormouse" load on first use: dm.optim, dm.nn.
setmetatable(dm, {__index = function(t, k)
  if k == "optim" or k == "nn" then
    local mod = require("dormouse." .. k)
    rawset(t, k, mod)
    return mod
  end
end})

-- Tensors to and from a safetensors file (the checkpoints' format, which other tools read):
-- dm.save(path, {name = tensor, ...} [, {key = "text", ...}]) writes it under a temporary name and
-- renames it (refused input leaves nothing on disk); dm.load(path) -> {name = tensor} on the CPU,
-- and the metadata.
function dm.save(path, tensors, metadata)
  if type(path) ~= "string" then error("dm.save: path must be a string, got " .. type(path), 2) end
  if type(tensors) ~= "table" then error("dm.save: " .. path .. ": tensors must be a table {name = tensor}", 2) end
  dm.ckpt.save_tensors(path, tensors, metadata)
end
function dm.load(path)
  if type(path) ~= "string" then error("dm.load: path must be a string, got " .. type(path), 2) end
  return dm.ckpt.load_tensors(path)
end

-- Seed sweeps with a verdict table: dm.sweep{base =, arms =, seeds =}.
function dm.sweep(spec) return require("dormouse.sweep").run(spec) end

return dm
