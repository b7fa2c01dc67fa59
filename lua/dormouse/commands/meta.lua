--[[
dormouse meta FILE

Writes the editor lines (LuaLS) of the functions the ops' descriptors give
them (lua/dormouse/ops/generated.lua) to FILE, its folder made as needed,
through a temporary name (FILE "-": standard output; a device or FIFO is
written through, a symlink's target replaced, never the link). `make` writes build/meta/ops.lua, which
.luarc.json reads beside lua/meta.
example: dormouse meta build/meta/ops.lua
]]
local core = require "dormouse.core"
local generated = require "dormouse.ops.generated"

local usage = "usage: dormouse meta FILE"

local function parse(argv)
  local file
  for i = 2, #argv do
    local a = argv[i]
    if a == "--help" or a == "-h" then return {help = true} end
    if a:sub(1, 1) == "-" and a ~= "-" then error("unknown option " .. a, 0) end
    if file then error("one FILE, got " .. file .. " and " .. a, 0) end
    file = a
  end
  if not file then error("FILE is missing", 0) end
  return {file = file}
end

local function body(args)
  local dir = args.file:match("^(.*)/[^/]*$")
  if dir and dir ~= "" then core.mkdirs(dir) end
  require "dormouse"                        -- the generated functions checked as they install
  io.stdout:flush()
  core.write_output(args.file, generated.luals(core))
  return 0
end

return {
  summary = "write the LuaLS lines of the ops' generated functions to FILE",
  args = "FILE",
  run = function(argv, cli) return cli.framed("meta", usage, parse, body)(argv) end,
}
