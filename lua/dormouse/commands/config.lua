--[[
dormouse config [FILE.lua] [--set KEY=VALUE ...] [--diff OTHER.lua]

Prints an experiment's resolved config, one key per line, grouped by
section, with its doc line; `*` marks a value that differs from the
default. Without a file, prints the defaults. With --diff, prints only the
keys where OTHER.lua differs (progress keys included).
example: dormouse config experiments/b1.lua --set model.engram.ram=true
]]
local config = require "dormouse.config"

local usage = "usage: dormouse config [FILE.lua] [--set KEY=VALUE ...] [--diff OTHER.lua]"

local function fail(msg, code)
  io.stderr:write(msg, "\n")
  return code
end

local function run(argv)
  local ok, args = pcall(config.parse_args, argv, 2, {diff = "OTHER.lua", help = true})
  if not ok then return fail("dormouse config: " .. args .. "\n" .. usage, 2) end
  if args.flags.help then io.write(require("dormouse.cli").help_text("config", usage), "\n"); return 0 end

  local cfg, info
  ok, cfg, info = pcall(function()
    if args.file then return config.load(args.file, args.overrides) end
    return config.resolve({}, "defaults", args.overrides)
  end)
  if not ok then return fail(cfg, 1) end

  if args.flags.diff then
    local other_ok, other = pcall(config.load, args.flags.diff)
    if not other_ok then return fail(other, 1) end
    local d = config.diff(cfg, other, {})
    if #d == 0 then io.write("no differences\n") return 0 end
    io.write(config.format_diff(d, args.file or "defaults", args.flags.diff), "\n")
    return 0
  end
  io.write(config.describe(cfg, info))
  return 0
end

return {
  summary = "print an experiment's resolved config (defaults filled, --set applied)",
  args = "FILE [--set k=v]",
  run = run,
}
