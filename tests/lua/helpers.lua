-- Helpers the Busted specs share: require "tests.lua.helpers" (specs run from the repository root).
local assert = require "luassert"

local helpers = {}

-- The message of the error fn(...) raises; fails the spec when it raises none.
function helpers.err_of(fn, ...)
  local ok, msg = pcall(fn, ...)
  assert.is_false(ok, "expected an error")
  return tostring(msg)
end

-- Every part is in msg (plain substrings).
function helpers.has(msg, ...)
  for _, part in ipairs {...} do
    assert.is_truthy(msg:find(part, 1, true), "message lacks [" .. part .. "]:\n" .. msg)
  end
end

-- A file's whole text.
function helpers.read(path)
  local f = assert(io.open(path, "rb"))
  local s = f:read("a")
  f:close()
  return s
end

-- A new empty directory (its path).
function helpers.tmpdir()
  local p = os.tmpname()
  os.remove(p)
  os.execute("mkdir -p '" .. p .. "'")
  return p
end

-- experiments/tiny.lua with a spec's default overrides, then the test's own (later ones win)
function helpers.tiny(defaults, overrides)
  local o = {}
  for _, s in ipairs(defaults) do o[#o + 1] = s end
  for _, s in ipairs(overrides or {}) do o[#o + 1] = s end
  return (require("dormouse.config").load("experiments/tiny.lua", o))
end

-- train.run without a progress bar or a word on stdout (the log file still gets every line)
function helpers.run_quiet(cfg, opts)
  opts.quiet, opts.silent, opts.root = true, true, "."
  return require("dormouse.train").run(cfg, opts)
end

-- a file's bytes, or nil when it cannot be opened
function helpers.read(path)
  local f = io.open(path, "rb")
  if not f then return nil end
  local s = f:read("a")
  f:close()
  return s
end

-- a shell command line the test wrote itself: its exit code and its stdout and stderr together
function helpers.sh(cmd)
  local p = assert(io.popen(cmd .. " 2>&1"))
  local out = p:read("a")
  local _, _, code = p:close()
  return code, out
end

return helpers
