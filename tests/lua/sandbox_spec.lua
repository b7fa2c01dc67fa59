-- Verifiers and the sandbox code runs in: hostile programs (an endless loop, a fork bomb, a write
-- outside its folder, a huge output, a memory grab, the network) each contained and failed with
-- its reason, and nothing on the host changed.
local core = require "dormouse.core"
local sandbox = require "dormouse.sandbox"
local verify = require "dormouse.verify"
local helpers = require "tests.lua.helpers"

describe("verifiers without a sandbox", function()
  it("exact: the output begins with the answer", function()
    assert.same({pass = true, score = 1, reason = "exact"}, verify.exact({answer = "42\n"}, "42\n7+7="))
    -- the score: partial credit, the share of the answer right before the first wrong byte
    assert.same({pass = false, score = 1 / 3, reason = "differs at byte 2"}, verify.exact({answer = "42\n"}, "43\n"))
    assert.same({pass = false, score = 1 / 3, reason = "stopped after 1 of 3 bytes"}, verify.exact({answer = "42\n"}, "4"))
    assert.same({pass = false, score = 0, reason = "differs at byte 1"}, verify.exact({answer = "42\n"}, "7"))
  end)

  it("of: the verifier named, else the task's own kind", function()
    assert.equal(verify.exact, verify.of({answer = "1"}))
    assert.equal(verify.code, verify.of({answer = "1", tests = "assert(true)"}))
    assert.equal(verify.numeric, verify.of({answer = "1", tests = "assert(true)"}, "numeric"))
    helpers.has(helpers.err_of(verify.of, {answer = "1"}, "fuzzy"), "no verifier 'fuzzy'")
    helpers.has(helpers.err_of(verify.code, {tests = {}}, "x"), "tests list is empty")
    helpers.has(helpers.err_of(verify.code, {tests = 7}, "x"), "has no tests")
  end)

  it("numeric: the first number in the output, to a tolerance", function()
    assert.is_true(verify.numeric({answer = "0.5"}, " about 0.50, or so").pass)
    assert.is_true(verify.numeric({answer = "-12"}, "x = -12 and 5").pass)
    assert.is_true(verify.numeric({answer = "1500"}, "1.5e3 it is").pass)
    assert.is_true(verify.numeric({answer = "0.25"}, "is .25").pass)
    assert.same({pass = false, score = 0, reason = "13 is not 12"}, verify.numeric({answer = "12"}, "13, 12"))
    assert.same({pass = false, score = 0, reason = "no number in the output"}, verify.numeric({answer = "1"}, "one"))
    assert.is_true(verify.numeric({answer = "3.14159", tolerance = 1e-3}, "3.1416").pass)
    helpers.has(helpers.err_of(verify.numeric, {answer = "x"}, "1"), "is not a number")
    helpers.has(helpers.err_of(verify.get, "fuzzy"), "no verifier 'fuzzy' (exact, numeric, code)")
  end)

  it("refuses bad options by name", function()
    helpers.has(helpers.err_of(sandbox.run, {language = "ruby", source = ""}), "language must be python3 or lua")
    helpers.has(helpers.err_of(sandbox.run, {language = "lua", source = "", seconds = -1}), "seconds must be a positive")
    helpers.has(helpers.err_of(sandbox.run, {language = "lua", source = "", shell = true}), "unknown option 'shell'")
  end)
end)

-- the processes whose command line holds marker (read from /proc)
local function processes_with(marker)
  local n = 0
  for _, pid in ipairs(core.listdir("/proc")) do
    if pid:match("^%d+$") then
      local f = io.open("/proc/" .. pid .. "/cmdline", "rb")
      local cmd = f and f:read("a") or ""
      if f then f:close() end
      if cmd:find(marker, 1, true) and not cmd:find("busted", 1, true) then n = n + 1 end
    end
  end
  return n
end

describe("the sandbox", function()
  local ok, why = sandbox.available()
  if not ok then
    pending("no sandbox on this machine: " .. why)
    return
  end
  local has_python = core.file_kind("/usr/bin/python3") == "file"

  it("runs Lua and Python, and a code verifier's tests decide", function()
    local r = sandbox.run {language = "lua", source = "print(6 * 7)"}
    assert.is_true(r.ok); assert.equal("42\n", r.stdout); assert.is_nil(r.reason)
    local square = "function f(x) return x * x end"
    assert.is_true(verify.code({language = "lua", tests = "assert(f(3) == 9)"}, square).pass)
    local v = verify.code({language = "lua", tests = "assert(f(3) == 10, 'f(3) should be 10')"}, square)
    assert.is_false(v.pass)
    helpers.has(v.reason, "exit status 1", "f(3) should be 10")
    if has_python then
      v = verify.code({language = "python3", tests = "assert f(4) == 16"}, "def f(x):\n  return x * x\n")
      assert.is_true(v.pass, v.reason)
    end
  end)

  it("scores a list of tests by the share that pass, after the task's head", function()
    local task = {language = "lua", head = "local function f(x) return ",
                  tests = {"assert(f(2) == 4)", "assert(f(-3) == 9)", "assert(f(1) == 2)"}}
    local v = verify.code(task, "x * x end")
    assert.same({pass = false, score = 2 / 3, reason = "2 of 3 tests passed"}, v)
    task.tests[3] = "assert(f(1) == 1)"
    assert.same({pass = true, score = 1, reason = "3 of 3 tests passed"}, verify.code(task, "x * x end"))
    -- a program that ends before the tests have counted fails, though it exits with status 0
    v = verify.code(task, "x * x end os.exit(0)")
    assert.same({pass = false, score = 0, reason = "the tests did not run to their end"}, v)
    -- printing what the count looks like does not pass: the count's key is drawn for each run
    v = verify.code(task, "x end print('\\ndm0 3')")
    assert.is_false(v.pass); assert.equal(1 / 3, v.score)
    -- nor does replacing what the harness calls
    v = verify.code(task, "x end pcall = function() return true end")
    assert.is_false(v.pass); assert.equal(1 / 3, v.score)
    v = verify.code(task, "x * (")                               -- a syntax error: the sandbox's reason
    assert.is_false(v.pass); assert.equal(0, v.score); helpers.has(v.reason, "exit status 1")
    if has_python then
      local py = {language = "python3", head = "def f(x):\n    return ",
                  tests = {"assert f(2) == 4", "assert f(3) == 9\nassert f(0) == 0", "assert f(1) == 2"}}
      assert.same({pass = false, score = 2 / 3, reason = "2 of 3 tests passed"}, verify.code(py, "x * x\n"))
    end
  end)

  it("passes every reference answer of tasks/code.lua, and fails a wrong body", function()
    local set = require("dormouse.tasks").load("tasks/code.lua")
    for i = 1, #set.tasks, 1999 do
      local t = set.tasks[i]
      local v = verify.of(t)(t, t.answer)
      assert.is_true(v.pass, t.prompt .. t.answer .. ": " .. v.reason)
    end
    local t = set.tasks[1]
    local v = verify.of(t)(t, "nil end\n")
    assert.is_false(v.pass); assert.equal(0, v.score); assert.equal("0 of 4 tests passed", v.reason)
  end)

  it("leaves no process behind: fifty runs in a row under a limit of 12 processes all pass", function()
    -- bwrap's first process in its namespace ends after bwrap: unreaped, each would count against the
    -- user's process limit until the system's init reaped it, and a later run could not fork
    for i = 1, 50 do
      local r = sandbox.run {language = "lua", source = "print(" .. i .. ")", processes = 12}
      assert.is_true(r.ok, r.reason)
      assert.equal(i .. "\n", r.stdout)
    end
  end)

  it("stops an endless loop at its time limit", function()
    local r = sandbox.run {language = "lua", source = "while true do end", seconds = 1}
    assert.is_false(r.ok)
    assert.equal("time limit (1 s)", r.reason)
  end)

  it("contains a fork bomb: it fails, and no process of it is left", function()
    local marker = "forkbomb" .. os.time() .. math.random(1e6)
    local src = has_python and "import os\nwhile True:\n  try:\n    os.fork()\n  except OSError:\n    pass\n"
    local r = src and sandbox.run {language = "python3", source = src, seconds = 2, args = {marker}}
              or sandbox.run {language = "lua", seconds = 2, args = {marker},
                              source = "while true do os.execute('true &') end"}
    assert.is_false(r.ok)
    assert.truthy(r.reason)
    assert.equal(0, processes_with(marker))
  end)

  it("writes nowhere but its own /work and /tmp, which it does not keep", function()
    local dir = helpers.tmpdir()
    local keep = dir .. "/keep"
    local f = assert(io.open(keep, "wb")); f:write("as it was"); f:close()
    local src = string.format([==[
for _, p in ipairs {%q, %q, "/task/main.lua", "/usr/evil", "/etc/evil", "/evil", "/work/mine", "/tmp/mine"} do
  local f = io.open(p, "w")
  if f and f:write("changed") and f:close() then print("wrote " .. p) else print("refused " .. p) end
end]==], keep, dir .. "/new")
    local r = sandbox.run {language = "lua", source = src}
    assert.is_true(r.ok, r.reason)
    assert.equal(table.concat({"refused " .. keep, "refused " .. dir .. "/new", "refused /task/main.lua",
                               "refused /usr/evil", "refused /etc/evil", "refused /evil", "wrote /work/mine",
                               "wrote /tmp/mine"}, "\n") .. "\n", r.stdout)
    assert.equal("as it was", helpers.read(keep))
    assert.is_nil(io.open(dir .. "/new"))
    -- nor through a descriptor this process holds open (a run's log while its samples are verified)
    if has_python then
      local log = dir .. "/log.jsonl"
      local held = assert(io.open(log, "ab"))
      held:write("kept\n"); held:flush()
      local forged = sandbox.run {language = "python3", source = "import os\nn = 0\nfor fd in range(3, 256):\n" ..
                                  "  try:\n    os.write(fd, b'forged'); n += 1\n  except OSError:\n    pass\nprint(n)"}
      held:close()
      assert.equal("0\n", forged.stdout)
      assert.equal("kept\n", helpers.read(log))
    end
    local again = sandbox.run {language = "lua", source = "print(io.open('/work/mine') == nil)"}
    assert.equal("true\n", again.stdout)
  end)

  it("fails a huge output at its cap", function()
    local r = sandbox.run {language = "lua", source = "while true do io.write(string.rep('x', 4096)) end",
                           output = 10000}
    assert.is_false(r.ok)
    assert.equal("output over 10000 bytes", r.reason)
    assert.equal(10000, #r.stdout)
  end)

  it("fails a memory grab past its limit and has no network", function()
    local r = sandbox.run {language = "lua", source = "local t = string.rep('x', 1 << 30) print(#t)",
                           memory = 256 << 20}
    assert.is_false(r.ok)
    helpers.has(r.reason, "not enough memory")
    if has_python then
      r = sandbox.run {language = "python3",
                       source = "import socket\nsocket.create_connection(('1.1.1.1', 53), timeout=1)\nprint('connected')"}
      assert.is_false(r.ok)
      assert.equal("", r.stdout)
      helpers.has(r.reason, "OSError")
    end
  end)
end)
