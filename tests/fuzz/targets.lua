-- What the Lua fuzz targets (fuzz_lua.c) run on each input; errors are refusals.
local ckpt = require "dormouse.ckpt"
local config = require "dormouse.config"

local targets = {}

-- a checkpoint's meta.lua, then its config as the repl resolves it
function targets.meta(text)
  local meta = ckpt.deserialize(text, "fuzz/meta.lua")
  if type(meta) == "table" and type(meta.config) == "table" then config.resolve(meta.config, "fuzz/meta.lua") end
end

-- one --set KEY=VALUE a line, parsed as the command line is and resolved over the defaults
function targets.config(text)
  local argv = {"run", "fuzz.lua"}
  for line in text:gmatch("[^\n]+") do argv[#argv + 1] = "--set"; argv[#argv + 1] = line end
  local args = config.parse_args(argv, 3)
  config.resolve({}, "experiments/fuzz.lua", args.overrides)
end

return targets
