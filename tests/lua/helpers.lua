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

-- A new empty directory (its path).
function helpers.tmpdir()
  local p = os.tmpname()
  os.remove(p)
  os.execute("mkdir -p '" .. p .. "'")
  return p
end

return helpers
