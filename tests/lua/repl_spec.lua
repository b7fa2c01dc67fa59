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
    has(out, "{batch = ", "_name = \"Dormouse\"", "still here")
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

  it("say so for a model without experts or Engram", function()
    local code, _, err = repl({"experts('In the beginning')", "engram('In the beginning')"}, "'" .. runs .. "/st'")
    assert.equal(0, code, err)
    has(err, "experts(): this model (stack) has no routed experts", "engram(): this model (stack) has no Engram layer")
  end)
end)
