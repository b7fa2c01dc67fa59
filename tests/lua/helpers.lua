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

-- m32 and m64 (a model and its float64 cast) give the same loss and gradients to rtol 1e-4 on
-- forward(m) (a function returning the loss); returns the parameters' names, in order
function helpers.grads_match(m32, m64, forward)
  local dm = require "dormouse"
  local names = {}
  dm.scope(function()
    local l32 = forward(m32)
    l32:backward()                                  -- one backward per tape: run them in turn
    local l64 = forward(m64)
    l64:backward()
    assert.is_true(math.abs(l32:item() - l64:item()) <= 1e-4 * math.abs(l64:item()))
    local p64 = {}
    for _, p in ipairs(m64:named_parameters()) do p64[p.name] = p.tensor end
    for _, p in ipairs(m32:named_parameters()) do
      names[#names + 1] = p.name
      local g32, g64 = p.tensor.grad, p64[p.name].grad
      if g32 then
        local err = (g32:to("f64") - g64):abs():max():item()
        assert.is_true(err <= 1e-4 * g64:abs():max():item() + 1e-7, p.name)
      end
    end
  end)
  return names
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

-- the records of a run's metrics.jsonl (run_dir/metrics.jsonl) of one kind ("log", "eval"), in order
function helpers.metrics(run_dir, kind)
  local json = require "dormouse.json"
  local out = {}
  for line in io.lines(run_dir .. "/metrics.jsonl") do
    local r = json.decode(line)
    if r.kind == kind then out[#out + 1] = r end
  end
  return out
end

-- a file's bytes, or nil when it cannot be opened
function helpers.read(path)
  local f = io.open(path, "rb")
  if not f then return nil end
  local s = f:read("a")
  f:close()
  return s
end

-- a command of lua/dormouse/commands (dormouse NAME ...) in this process: its exit code, what it
-- printed and what it wrote on stderr
function helpers.command(name, ...)
  local printed, said, saved, saved_err = {}, {}, _G.print, io.stderr
  _G.print = function(...) printed[#printed + 1] = table.concat({...}, "\t") end
  io.stderr = {write = function(_, ...) for _, v in ipairs {...} do said[#said + 1] = v end end}
  local ok, code = pcall(require("dormouse.commands." .. name).run, {[0] = "dormouse", name, ...},
                         require("dormouse.cli"))
  _G.print, io.stderr = saved, saved_err
  assert(ok, code)
  return code, table.concat(printed, "\n"), table.concat(said)
end

-- n lower-case letters without zero bytes and without repeats of 12 bytes (a window's place in
-- them is unique), from seed (default 1)
function helpers.text(n, seed)
  local out, x = {}, seed or 1
  for i = 1, n do
    x = (x * 1103515245 + 12345) % 2147483648
    out[i] = string.char(97 + (x >> 16) % 26)
  end
  return table.concat(out)
end

-- a shell command line the test wrote itself: its exit code and its stdout and stderr together
function helpers.sh(cmd)
  local p = assert(io.popen(cmd .. " 2>&1"))
  local out = p:read("a")
  local _, _, code = p:close()
  return code, out
end

return helpers
