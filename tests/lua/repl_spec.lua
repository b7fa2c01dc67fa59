local helpers = require "tests.lua.helpers"
local has = helpers.has
-- `dormouse repl` with its input on a pipe: not a terminal, so it reads
-- stdin plainly (no prompt, no banner, no history) and prints what it would
-- print to a person.

local bin = arg and arg[-1]
assert(bin and io.open(bin, "rb"), "repl_spec: cannot find the dormouse binary (arg[-1] = " .. tostring(bin) .. ")")

local function tmp(text)
  local path = os.tmpname()
  local f = assert(io.open(path, "w"))
  f:write(text or "")
  f:close()
  return path
end

local function read(path)
  local f = assert(io.open(path, "r"))
  local s = f:read("a")
  f:close()
  os.remove(path)
  return s
end

-- Feed lines to the REPL; returns its exit code, stdout and stderr.
local function repl(lines, extra)
  local input, errfile = tmp(table.concat(lines, "\n") .. "\n"), tmp()
  local home = os.tmpname()       -- a HOME of its own: nothing touches the user's history
  os.remove(home)
  assert(os.execute("mkdir '" .. home .. "'"))
  local p = assert(io.popen(string.format("HOME='%s' '%s' repl %s <'%s' 2>'%s'", home, bin, extra or "",
                                          input, errfile)))
  local out = p:read("a")
  local _, _, code = p:close()
  os.remove(input)
  local history = io.open(home .. "/.dormouse_history")
  if history then history:close() end
  os.execute("rm -rf '" .. home .. "'")
  return code, out, read(errfile), history ~= nil
end

describe("dormouse repl on a pipe", function()
  it("says a bare name that is not there rather than printing nil (a misspelling)", function()
    local code, out, err = repl {"sampel", "x = 3", "x"}
    assert.equal(0, code)
    has(err, "sampel: no such name here (not a variable, a probe or a library function)")
    assert.equal("3\n", out)
  end)

  it("prints expressions: numbers, strings, tables and tensors with their shape", function()
    local code, out, err = repl {
      "1 + 1",
      "'hello'",
      "{1, 2, name = 'x'}",
      "dm.ones({2, 3})",
      "1, 'two'",
    }
    assert.equal(0, code)
    assert.equal("", err)
    assert.equal(table.concat({
      "2",
      "hello",
      '{1, 2, name = "x"}',
      "tensor([[ 1.0000,  1.0000,  1.0000],",
      "        [ 1.0000,  1.0000,  1.0000]], shape=[2, 3], dtype=f32, device=cpu)",
      "1\ttwo",
      "",
    }, "\n"), out)
  end)

  it("runs statements without printing, and globals persist across lines", function()
    local _, out, err = repl {
      "x = dm.arange(4)",
      "y = x * 2",
      "print('sum', y:sum():item())",
      "y:shape()",
    }
    assert.equal("", err)
    assert.equal("sum\t12.0\n{4}\n", out)
  end)

  it("continues a multi-line function definition", function()
    local _, out, err = repl {
      "function double(t)",
      "  local two = 2",
      "  return t * two",
      "end",
      "double(dm.tensor({1, 2})):totable()",
      "for i = 1, 2 do",
      "  print('line', i)",
      "end",
    }
    assert.equal("", err)
    assert.equal("{2.0, 4.0}\nline\t1\nline\t2\n", out)
  end)

  it("prints an error and goes on", function()
    local code, out, err = repl {
      "error('first problem')",
      "dm.zeros({2, 3}) + dm.zeros({4})",
      "local = 1",
      "function f() error('inside f') end",
      "f()",
      "dm.zeros({2, 3}):sum(3)",
      "'still here'",
    }
    assert.equal(0, code)
    assert.equal("still here\n", out)
    has(err, "repl:1: first problem", "repl:1: add: shapes [2, 3] and [4] do not broadcast",
        "repl:1: <name> expected near '='", "repl:1: inside f", "repl:1: in global 'f'",
        "repl:1: sum: dim 3 is out of range")
    for _, noise in ipairs {"repl.lua", "cli.lua", "lua/dormouse/", "[C]: in ?", "xpcall"} do
      assert.is_falsy(err:find(noise, 1, true), "should not contain [" .. noise .. "]:\n" .. err)
    end
  end)

  it("runs a backward and shows the gradient", function()
    local _, out, err = repl {
      "w = dm.tensor({1, 2, 3}, {requires_grad = true})",
      "loss = (w * w):sum()",
      "loss:backward()",
      "w.grad",
    }
    assert.equal("", err)
    assert.equal("tensor([ 2.0000,  4.0000,  6.0000], shape=[3], dtype=f32, device=cpu)\n", out)
  end)

  it("runs a file first, whose globals the session sees; no history is written off a terminal", function()
    local file = tmp("greeting = 'hi from the file'\n")
    local code, out, err, history = repl({"greeting"}, "'" .. file .. "'")
    os.remove(file)
    assert.equal(0, code)
    assert.equal("", err)
    assert.equal("hi from the file\n", out)
    assert.is_false(history)
  end)

  it("an error in that file ends the session with exit 1", function()
    local file = tmp("local x = nil\nx.y = 1\n")
    local code, out, err = repl({"1 + 1"}, "'" .. file .. "'")
    os.remove(file)
    assert.equal(1, code)
    assert.equal("", out)
    has(err, file .. ":2: attempt to index a nil value")
  end)
end)

describe("dormouse repl on a checkpoint", function()
  it("prints cfg and model (a strict config, a module) and the session goes on", function()
    local runs = os.tmpname()
    os.remove(runs)
    local run = require("tests.lua.helpers").run_quiet
    run(require("tests.lua.helpers").tiny({"steps=2", "eval.every=0", "checkpoint.every=2", "log.every=2",
                                           "schedule.warmup=1", "eval.windows=2", "eval.baseline={}", "name=p"}),
        {runs = runs})
    local code, out, err = repl({"cfg", "model", "print('still here')"}, "'" .. runs .. "/p'")
    os.execute("rm -rf '" .. runs .. "'")
    assert.equal(0, code, err)
    has(out, "{batch = ", "still here")
    -- the model prints as its module tree: a line a module, the parameters below it
    assert.truthy(out:match("\nDormouse%s+Dormouse%s+[%d.]+[KM]?[^\n]*\n"), out)
    assert.truthy(out:match("\n  block%s+%a+%s+[%d.]+[KM]?[^\n]*\n"), out)
    assert.truthy(out:match("\n      router%s+Linear%s+[%d.]+K?  weight %[%d+, %d+%]"), out)   -- its shapes
  end)

  it("runs no model file a checkpoint names by its path, unless --trust, and says what it runs", function()
    local runs = os.tmpname()
    os.remove(runs)
    helpers.run_quiet(helpers.tiny({"steps=1", "eval.every=0", "checkpoint.every=1", "log.every=1",
                                    "schedule.warmup=0", "eval.baseline={}", "name=evil"}), {runs = runs})
    local ckpt = runs .. "/evil/ckpt-1"
    local marker = runs .. "/ran"
    local payload = ckpt .. "/payload.lua"                -- a model file shipped beside the checkpoint
    local f = assert(io.open(payload, "w"))
    f:write(string.format("io.open(%q, 'w'):close()\nreturn dofile('models/dormouse.lua')\n", marker))
    f:close()
    local meta = helpers.read(ckpt .. "/meta.lua"):gsub('arch = "dormouse"', 'arch = "' .. payload .. '"')
    f = assert(io.open(ckpt .. "/meta.lua", "w")); f:write(meta); f:close()
    local core = require "dormouse.core"
    core.write_file(ckpt .. "/meta.xxh64", (core.file_checksum(ckpt .. "/meta.lua")) .. "\n")   -- re-summed
    local code, _, err = repl({"print(1)"}, "'" .. runs .. "/evil'")
    assert.equal(1, code)
    has(err, "model.arch names a model file by its path", payload, "--trust")
    assert.is_nil(io.open(marker), "the payload ran")
    local sample = assert(io.popen(string.format("'%s' sample '%s/evil' -n 2 2>&1", bin, runs)))
    has(sample:read("a"), "--trust")
    sample:close()
    assert.is_nil(io.open(marker), "the payload ran under sample")
    code, _, err = repl({"print(1)"}, "'" .. runs .. "/evil' --trust")
    assert.equal(0, code, err)
    has(err, "--trust: running the model file " .. payload)
    assert.truthy(io.open(marker), "with --trust the file runs")
    os.execute("rm -rf '" .. runs .. "'")
  end)
end)

describe("the probes", function()
  local runs
  setup(function()
    runs = os.tmpname()
    os.remove(runs)
    local h = require("tests.lua.helpers")
    h.run_quiet(h.tiny({"steps=2", "eval.every=0", "checkpoint.every=2", "log.every=2", "schedule.warmup=1",
                        "eval.windows=2", "eval.baseline={}", "name=s"}), {runs = runs})
    h.run_quiet(h.tiny({"steps=2", "eval.every=0", "checkpoint.every=2", "log.every=2", "schedule.warmup=1",
                        "eval.windows=2", "eval.baseline={}", "name=st", "model.arch=stack", "model.ffn=64"}),
                {runs = runs})
  end)
  teardown(function() os.execute("rm -rf '" .. runs .. "'") end)

  it("print a sample once, and refuse bad arguments with the probe's name and no traceback", function()
    local code, out, err = repl({"sample('In', 5, {seed = 1})", "loss(42)", "tensor()", "print('on')"},
                                "'" .. runs .. "/s'")
    assert.equal(0, code, err)
    local lines = {}
    for l in out:gmatch("[^\n]+") do lines[#lines + 1] = l end
    assert.equal("on", lines[#lines])
    assert.equal(3, #lines, out)                 -- the banner, the sample streamed once, and "on"
    has(err, "loss(text): text must be a string, got number", "tensor(name): name must be a string")
    assert.is_nil(err:find("stack traceback", 1, true), err)
  end)

  it("refuse a bad count, an unknown option or a bad value at the caller's line, and give fin for every model",
     function()
    local code, out, err = repl({"sample('hi', -5)", "sample('hi', 3, {temp = 0.5})",
                                 "sample('hi', 3, {temperature = -1})", "print(loss('In the beginning').fin > 0)"},
                                "'" .. runs .. "/st'")
    assert.equal(0, code, err)
    has(err, "sample: n must be a whole number of bytes >= 1, got -5",
        "sample: unknown option 'temp' (options: return_text, seed, temperature, top_p)",
        "sample: temperature must be a finite number >= 0, got -1")
    assert.is_nil(err:find("probe.lua", 1, true), err)      -- the user's line, not the library's
    has(out, "true")                                          -- the stack model's fin, its fin_D empty
  end)

  it("say so for a model without experts or Engram", function()
    local code, _, err = repl({"experts('In the beginning')", "engram('In the beginning')"}, "'" .. runs .. "/st'")
    assert.equal(0, code, err)
    has(err, "experts(): no module of this model (stack) implements routing()",
        "engram(): no module of this model (stack) implements lookups()")
  end)

  it("reach any module that implements the protocol, by name when several do", function()
    local dm, nn, probe = require "dormouse", require "dormouse.nn", require "dormouse.probe"
    local Router = nn.class("Router")              -- a module of a new architecture, counting its own routing
    function Router:init(n) self.n = n end
    function Router:forward(x) self.counts = dm.tensor({self.n, 0, 1}, {dtype = "i64"}) end
    function Router:routing() return self.counts end
    local Two = nn.class("Two")
    function Two:init() self:child("a", Router(5)); self:child("b", Router(2)) end
    function Two:forward(x) self.a:forward(x); self.b:forward(x) end
    local one = nn.class("One")
    function one:init() self:child("only", Router(3)) end
    function one:forward(x) self.only:forward(x) end
    local cfg = {model = {arch = "mine", max_iter = 1}}
    local r = probe.env(one(), cfg).experts("abc")
    assert.equal(0.75, r.busiest)
    assert.equal(1, r.dead)
    assert.equal("1:3", r.top[1])
    local both = probe.env(Two(), cfg).experts("abc")
    assert.equal(5 / 6, both.a.busiest)
    assert.equal(2 / 3, both.b.busiest)
  end)
end)

describe("the REPL's helpers", function()
  local repl_mod = require "dormouse.repl"
  local probe = require "dormouse.probe"
  local dm = require "dormouse"

  it("complete names through tables, metatables and a tensor's methods, and never raise", function()
    local strict = setmetatable({model = {d = 8}}, {__index = function(_, k) error("no key " .. k) end})
    local env = setmetatable({dm = dm, y = dm.zeros({2}), cfg = strict}, {__index = _G})
    local c = repl_mod.completions
    assert.same({"dm.randn_like"}, c(env, "dm.randn_l"))
    assert.same({"y:sum_to"}, c(env, "y:sum_"))
    assert.same({"cfg.model"}, c(env, "cfg.mo"))
    assert.same({"cfg.model.d"}, c(env, "cfg.model."))
    assert.same({}, c(env, "cfg.nothing.x"))           -- the strict table's error stays inside
    assert.same({"print"}, c(env, "prin"))
    assert.same({}, c(env, "y:shape()."))               -- not a chain of names
  end)

  it("print tables four levels deep (a config's lists too), a cycle once", function()
    local show = repl_mod.show
    local cfg = require("dormouse.config").load("experiments/tiny.lua")
    assert.truthy(show(cfg.model):find("orders = {2, 3}", 1, true), show(cfg.model))
    local t = {a = {b = {c = {d = {e = 1}}}}, list = {2, 3}}
    t.self = t
    assert.equal("{a = {b = {c = {d = {...}}}}, list = {2, 3}, self = {...}}", show(t))
    assert.equal("{{1, 2}, {1, 2}}", show({{1, 2}, {1, 2}}))
  end)

  it("print a model's bytes: UTF-8 whole, anything else as \\xNN", function()
    local function shown(bytes)
      local out = {}
      local put, finish = require("dormouse.human").byte_printer(function(s) out[#out + 1] = s end)
      for i = 1, #bytes do put(bytes:sub(i, i)) end
      finish()
      return table.concat(out)
    end
    assert.equal("In the\tbeginning\n", shown("In the\tbeginning\n"))
    assert.equal("é → 𝄞", shown("é → 𝄞"))
    assert.equal("\\x1B[2J", shown("\27[2J"))                 -- no terminal control from a sample
    assert.equal("a\\x80b", shown("a\128b"))                  -- a stray continuation byte
    assert.equal("\\xC3a", shown("\195a"))                    -- a sequence cut by an ASCII byte
    assert.equal("\\xE2\\x86", shown("\226\134"))             -- cut by the end
    assert.equal("\\xC0\\x80", shown("\192\128"))             -- overlong
    assert.equal("\\xED\\xA0\\x80", shown("\237\160\128"))    -- a surrogate
    assert.equal("\\xFF\\x00", shown("\255\0"))
  end)
end)

-- A terminal: `script` (util-linux) gives the REPL a pseudo-terminal, and the keys go in with pauses
-- between them, as a person types (a Ctrl-C flushes what the line discipline has not yet delivered).
local function has_script() return os.execute("script -qec true /dev/null >/dev/null 2>&1") == true end

local function on_a_terminal(keys, home)
  local parts = {}
  for _, k in ipairs(keys) do
    if type(k) == "number" then parts[#parts + 1] = "sleep " .. k
    else parts[#parts + 1] = string.format("printf '%%b' '%s'", k:gsub("'", "'\\''")) end
  end
  local out = os.tmpname()
  -- `exec`: the REPL is the terminal's only process (script runs the command through $SHELL, and a
  -- shell left waiting as its parent would take the Ctrl-C too and end the session with 130).
  local cmd = string.format("(sleep 1; %s) | HOME='%s' timeout 60 script -qefc \"exec '%s' repl\" /dev/null >'%s' 2>&1",
                            table.concat(parts, "; sleep 0.4; "), home, bin, out)
  local ok, _, code = os.execute(cmd)
  local text = read(out):gsub("\27%[[%d;?]*%a", ""):gsub("\r", "")   -- as a terminal shows it
  return ok, "exit " .. tostring(code) .. "\n" .. text
end

describe("dormouse repl on a terminal", function()
  local home
  before_each(function()
    home = os.tmpname()
    os.remove(home)
    assert(os.execute("mkdir '" .. home .. "'"))
  end)
  after_each(function() os.execute("rm -rf '" .. home .. "'") end)

  it("Ctrl-C drops the line being typed, stops the line that runs, and the session goes on", function()
    if not has_script() then pending("no `script` here") return end
    local ok, out = on_a_terminal({"x = (1 +", "\\003", "print(40 + 2)\\n", "while true do end\\n", 1, "\\003",
                                   "print('still ' .. 'here')\\n", "\\004"}, home)
    assert.is_true(ok, out)
    has(out, "42", "interrupted", "still here")
    assert.is_nil(out:find("[string", 1, true), out)       -- the dropped line was never run
  end)

  it("Tab completes the session's names", function()
    if not has_script() then pending("no `script` here") return end
    local ok, out = on_a_terminal({"y = dm.zeros_l\\t", "(dm.ones({3}))\\n", "y:num\\t()\\n", "\\004"}, home)
    assert.is_true(ok, out)
    local f = assert(io.open(home .. "/.dormouse_history"))
    local hist = f:read("a")
    f:close()
    has(hist, "y = dm.zeros_like(dm.ones({3}))", "y:numel()")   -- the lines as completed
    assert.truthy(out:find("\n3\n", 1, true), out)
  end)

  it("Tab completes a path in a string past its folders, and an absolute one", function()
    if not has_script() then pending("no `script` here") return end
    assert(os.execute("mkdir -p '" .. home .. "/sub/dir' && touch '" .. home .. "/sub/dir/target_file.txt'"))
    local ok, out = on_a_terminal({"f = io.open(\"" .. home .. "/sub/di\t", "tar\t", ")\n",
                                   "print(f ~= nil)\n", "\004"}, home)
    assert.is_true(ok, out)
    local f = assert(io.open(home .. "/.dormouse_history"))
    local hist = f:read("a")
    f:close()
    has(hist, "f = io.open(\"" .. home .. "/sub/dir/target_file.txt\")")
    assert.truthy(out:find("\ntrue\n", 1, true), out)
  end)

  it("keeps a chunk of several lines as one history entry, in the next session too", function()
    if not has_script() then pending("no `script` here") return end
    local ok, out = on_a_terminal({"function sq(x)\n", "  return x * x\n", "end\n", "print(sq(7))\n", "\004"}, home)
    assert.is_true(ok, out)
    -- the next session: two steps back is the whole function, which defines sq again
    ok, out = on_a_terminal({"\027[A\027[A\n", "print(sq(5))\n", "\004"}, home)
    assert.is_true(ok, out)
    assert.truthy(out:find("\n25\n", 1, true), out)
    local f = assert(io.open(home .. "/.dormouse_history"))
    local hist = f:read("a")
    f:close()
    assert.truthy(hist:match("^#%d+\nfunction sq%(x%)\n  return x %* x\nend\n#%d+\nprint%(sq%(7%)%)\n"), hist)
  end)

  it("writes each line to the history as it is entered, so a killed session keeps its lines", function()
    if not has_script() then pending("no `script` here") return end
    local ok, out = on_a_terminal({"answer = 42\\n", "print('kept')\\n", "os.execute('kill -9 ' .. " ..
                                   "io.open('/proc/self/stat'):read('n'))\\n", 1}, home)
    local f = io.open(home .. "/.dormouse_history")
    local hist = f and f:read("a") or ""
    if f then f:close() end
    has(hist, "answer = 42", "print('kept')")
    assert.truthy(out:find("kept", 1, true), out)
    assert.is_not_true(ok)                                 -- it was killed, and wrote no history at exit
  end)
end)
