local helpers = require "tests.lua.helpers"
local has = helpers.has
-- The `dormouse` command line, run as a child process: exit codes, error
-- reports, `arg`, and the small commands.

-- The binary running this suite: arg[-1] as `dormouse test` sets it (as
-- invoked: build/dormouse from a fresh clone, an absolute path under ctest).
local bin = arg and arg[-1]
assert(bin and io.open(bin, "rb"), "cli_spec: cannot find the dormouse binary (arg[-1] = " .. tostring(bin) .. ")")

local dir = os.tmpname()
os.remove(dir)
assert(os.execute("mkdir -p '" .. dir .. "'"))

local function write(name, text)
  local path = dir .. "/" .. name
  local f = assert(io.open(path, "w"))
  f:write(text)
  f:close()
  return path
end

local function read(path)
  local f = assert(io.open(path, "r"))
  local s = f:read("a")
  f:close()
  return s
end

-- Run the binary with a shell-quoted argument string; returns exit code, stdout, stderr.
local function dormouse(args, env)
  local errfile = dir .. "/stderr"
  local p = assert(io.popen(string.format("%s'%s' %s 2>'%s' </dev/null", env or "", bin, args, errfile)))
  local out = p:read("a")
  local _, _, code = p:close()
  return code, out, read(errfile)
end

-- the folder the specs run in (the repository root); $PWD may be ctest's, not it
local root = assert(io.popen("pwd")):read("l")

local function lacks(s, ...)
  for _, part in ipairs {...} do
    assert.is_falsy(s:find(part, 1, true), "should not contain [" .. part .. "]:\n" .. s)
  end
end

teardown(function() os.execute("rm -rf '" .. dir .. "'") end)

describe("dormouse run", function()
  it("reports a core error as FILE:LINE: message with a traceback of the user's frames, exit 1", function()
    local script = write("shapes.lua", [[
local dm = require "dormouse"
local function forward(a)
  return a + dm.zeros({4})
end
local y = forward(dm.zeros({2, 3}))
print(y)
]])
    local code, out, err = dormouse("run '" .. script .. "'")
    assert.equal(1, code)
    assert.equal("", out)
    local first = err:match("^[^\n]*")
    assert.equal(script .. ":3: add: shapes [2, 3] and [4] do not broadcast", first)
    has(err, "stack traceback:", script .. ":3: in", script .. ":5: in main chunk")
    lacks(err, "cli.lua", "[C]: in ?", "lua/dormouse/", "dormouse.core", "xpcall")
  end)

  it("reports error() from a script the same way", function()
    local script = write("fail.lua", "local x = 1\nerror('no good: ' .. x)\n")
    local code, _, err = dormouse("run '" .. script .. "'")
    assert.equal(1, code)
    assert.equal(script .. ":2: no good: 1", err:match("^[^\n]*"))
    lacks(err, "cli.lua", "[C]: in ?")
  end)

  it("reports an error object that is not a string", function()
    local script = write("table_error.lua", "error({code = 3})\n")
    local code, _, err = dormouse("run '" .. script .. "'")
    assert.equal(1, code)
    has(err, "error object is a table value")
  end)

  it("reports a syntax error with file:line, exit 1", function()
    local script = write("syntax.lua", "local a = 1\nlocal b = = 2\n")
    local code, _, err = dormouse("run '" .. script .. "'")
    assert.equal(1, code)
    assert.equal(script .. ":2: unexpected symbol near '='", err:match("^[^\n]*"))
  end)

  it("sets arg as the stock lua does, and passes the arguments as ...", function()
    local script = write("args.lua", [[
print(arg[0], #arg, arg[1], arg[2], select("#", ...), ...)
print(arg[-1] ~= nil)
]])
    local code, out = dormouse("run '" .. script .. "' one 'two words'")
    assert.equal(0, code)
    assert.equal(script .. "\t2\tone\ttwo words\t2\tone\ttwo words\ntrue\n", out)
  end)

  it("loads the library, and passes an os.exit code through", function()
    local script = write("exit.lua", [[
local dm = require "dormouse"
io.write(tostring(dm.ones({2}):sum():item()))
os.exit(3)
]])
    local code, out = dormouse("run '" .. script .. "'")
    assert.equal(3, code)
    assert.equal("2.0", out)
  end)

  it("honours LUA_PATH for the user's modules", function()
    write("mymodule.lua", "return {answer = 42}\n")
    local script = write("use_module.lua", "print(require('mymodule').answer)\n")
    local code, out = dormouse("run '" .. script .. "'", "LUA_PATH='" .. dir .. "/?.lua;;' ")
    assert.equal(0, code)
    assert.equal("42\n", out)
  end)

  it("a missing file is a clear error, exit 1", function()
    local code, _, err = dormouse("run '" .. dir .. "/nope.lua'")
    assert.equal(1, code)
    has(err, "dormouse run:", "cannot open", "nope.lua")
  end)

  it("without a file, says which file and exits 2", function()
    local code, _, err = dormouse("run")
    assert.equal(2, code)
    has(err, "which file?", "usage: dormouse run FILE.lua")
  end)

  it("refuses a bad --sample and a key set twice before training, leaving no run folder", function()
    local code, _, err = dormouse("run experiments/tiny.lua --set name=cli-refused-sample --sample abc")
    assert.equal(1, code)
    has(err, "--sample must be an integer >= 0", "abc")
    code, _, err = dormouse("run experiments/tiny.lua --set name=cli-refused-twice --set steps=3 --set steps=4")
    assert.equal(1, code)
    has(err, "--set steps is given twice", "steps=3", "steps=4")
    assert.is_nil(io.open("runs/cli-refused-sample"))
    assert.is_nil(io.open("runs/cli-refused-twice"))
  end)
end)

describe("dormouse run --resume", function()
  it("takes the run's name from the folder it resumes", function()
    local cwd = dir .. "/resume-cwd"
    assert(os.execute("mkdir -p '" .. cwd .. "'"))
    local exe = bin:sub(1, 1) == "/" and bin or root .. "/" .. bin
    local exp = "'" .. root .. "/experiments/tiny.lua'"
    local run = string.format("cd '%s' && DORMOUSE_HOME='%s' '%s' run %s --quiet --sample 0 ", cwd,
                              root, exe, exp)
    local sets = "--set eval.every=0 --set checkpoint.every=10 --set eval.baseline='{}' "
    local sh = helpers.sh
    local code, out = sh(run .. sets .. "--set steps=20 --set name=resB")
    assert.equal(0, code, out)
    code, out = sh(run .. sets .. "--set steps=30 --resume runs/resB/")
    assert.equal(0, code, out)
    has(out, "resumed from runs/resB/ckpt-20 at step 20", "done: runs/resB, step 30")
  end)

  it("writes where it reads: a run in another folder goes on there, ./runs untouched", function()
    local cwd = dir .. "/resume-where"
    assert(os.execute("mkdir -p '" .. cwd .. "/elsewhere'"))
    local exe = bin:sub(1, 1) == "/" and bin or root .. "/" .. bin
    local sets = "--quiet --sample 0 --set eval.every=0 --set checkpoint.every=10 --set eval.baseline='{}' "
    local sh = helpers.sh
    local code, out = sh(string.format("cd '%s/elsewhere' && DORMOUSE_HOME='%s' '%s' run '%s/experiments/tiny.lua' %s" ..
                                       "--set steps=20 --set name=far", cwd, root, exe, root, sets))
    assert.equal(0, code, out)
    code, out = sh(string.format("cd '%s' && DORMOUSE_HOME='%s' '%s' run '%s/experiments/tiny.lua' %s--set steps=30 " ..
                                 "--resume elsewhere/runs/far", cwd, root, exe, root, sets))
    assert.equal(0, code, out)
    has(out, "resumed from elsewhere/runs/far/ckpt-20 at step 20", "done: elsewhere/runs/far, step 30")
    assert.is_nil(io.open(cwd .. "/runs/far/log.txt"), "nothing written under ./runs")
    assert.truthy(io.open(cwd .. "/elsewhere/runs/far/ckpt-30/meta.lua"))
    assert.truthy(io.open(cwd .. "/elsewhere/runs/far/ckpt-20/meta.lua"), "the run's own checkpoints kept")
  end)
end)

describe("an interrupted run", function()
  for _, sig in ipairs {"INT", "TERM"} do
    it("on SIG" .. sig .. " finishes its step, writes a checkpoint, says how to resume and exits 1", function()
      local cwd = dir .. "/sig-" .. sig
      assert(os.execute("mkdir -p '" .. cwd .. "'"))
      local exe = bin:sub(1, 1) == "/" and bin or root .. "/" .. bin
      local errfile = cwd .. "/stderr"
      -- the run in the background; the signal once its first log line is in log.txt
      local script = string.format([[
cd '%s' || exit 1
DORMOUSE_HOME='%s' exec '%s' run '%s/experiments/tiny.lua' --quiet --sample 0 --set name=sig --set steps=100000 --set log.every=1 --set eval.every=0 --set checkpoint.every=0 2>'%s' >/dev/null &
pid=$!
for i in $(seq 600); do grep -q '^step' runs/sig/log.txt 2>/dev/null && break; sleep 0.1; done
kill -%s $pid
wait $pid
echo "exit $?"
]], cwd, root, exe, root, errfile, sig)
      local p = assert(io.popen("bash '" .. write("sig-" .. sig .. ".sh", script) .. "'"))
      local out = p:read("a")
      p:close()
      assert.is_truthy(out:find("exit 1", 1, true), out)
      local err = read(errfile)
      local step = tonumber(err:match("SIG" .. sig .. ": the run stopped after step (%d+) with its checkpoint"))
      assert.is_truthy(step, err)
      has(err, "--resume runs/sig")
      assert.is_truthy(io.open(cwd .. "/runs/sig/ckpt-" .. step .. "/meta.lua"), "no checkpoint at step " .. step)
    end)
  end
end)

describe("a signal during the last step", function()
  it("is not dropped: the run completes with its checkpoint, says so and fails", function()
    local train = require "dormouse.train"
    local helpers = require "tests.lua.helpers"
    local runs = helpers.tmpdir()
    local pid = io.open("/proc/self/stat"):read("l"):match("^(%d+)")
    local setup = train.setup
    train.setup = function(...)                 -- SIGINT to this process during the 3rd (last) step
      local model, opt = setup(...)
      local forward, calls = model.forward, 0
      model.forward = function(m, ...)
        calls = calls + 1
        if calls == 3 then                      -- popen: system() would ignore SIGINT while kill runs
          local k = assert(io.popen("kill -INT " .. pid)); k:read("a"); k:close()
        end
        return forward(m, ...)
      end
      return model, opt
    end
    local ok, err = pcall(helpers.run_quiet, helpers.tiny({"name=last", "steps=3", "eval.every=0", "log.every=1",
                                                          "checkpoint.every=0", "eval.windows=2", "eval.baseline={}",
                                                          "schedule.warmup=1"}),
                          {runs = runs})
    train.setup = setup
    assert.is_false(ok)
    helpers.has(tostring(err), "SIGINT: the run had reached its last step (3) and is complete, with its checkpoint")
    assert.is_truthy(io.open(runs .. "/last/ckpt-3/meta.lua"))
    helpers.has(read(runs .. "/last/log.txt"), "SIGINT: the run had reached its last step")
  end)
end)

describe("a mapped corpus cut short by another program", function()
  it("ends the run with a message naming the file and exit 1, not a SIGBUS", function()
    local corpus = write("shrinking.txt", string.rep("abcdefgh", 1 << 17))        -- 1 MiB
    local script = write("shrink.lua", string.format([[
local data = require "dormouse.data"
local c = data.open(%q, {eval_bytes = 0})
print(c:bytes(0, 4))
local f = io.open(%q, "w")            -- truncated to 0 bytes, as another program would
f:close()
print(c:bytes(900000, 8))
print("not reached")
]], corpus, corpus))
    -- (under AddressSanitizer its own SIGBUS report would come first: the sanitizer build lets it pass)
    local code, out, err = dormouse("run '" .. script .. "'", "ASAN_OPTIONS=handle_sigbus=0 ")
    assert.equal(1, code)
    has(out, "abcd")
    lacks(out, "not reached")
    has(err, "corpus: '" .. corpus .. "' became shorter while it was being read", "resume once the corpus is whole")
  end)
end)

describe("the small commands", function()
  it("version", function()
    local code, out = dormouse("version")
    assert.equal(0, code)
    assert.truthy(out:match("^dormouse %d+%.%d+%.%d+ %(Lua 5%.4%)\n$"), out)
    assert.equal(out, select(2, dormouse("--version")))
  end)

  it("help lists the commands", function()
    local code, out = dormouse("help")
    assert.equal(0, code)
    has(out, "usage: dormouse <command>", "run FILE.lua", "repl", "test", "version", "help")
    assert.equal(out, select(2, dormouse("--help")))
  end)

  it("test --shard refuses a shard out of range, exit 2", function()
    for _, bad in ipairs {"3/2", "0/2", "two", ""} do
      local code, _, err = dormouse("test --shard '" .. bad .. "'")
      assert.equal(2, code)
      has(err, "test: --shard takes K/N with 1 <= K <= N, got '" .. bad .. "'")
    end
  end)

  it("an unknown command names it, prints the usage with every command and exits 2", function()
    local code, out, err = dormouse("frobnicate")
    assert.equal(2, code)
    assert.equal("", out)
    has(err, "unknown command 'frobnicate'", "usage: dormouse <command>", "\n  sweep ", "\n  sample ", "\n  bench ")
    assert.is_nil(err:find("did you mean", 1, true), err)
    code, _, err = dormouse("sampel")
    assert.equal(2, code)
    has(err, "unknown command 'sampel' (did you mean 'sample'?)")
  end)
end)

describe("dormouse plan from another folder", function()
  it("finds the model in the install's models/, as run does", function()
    local exe = bin:sub(1, 1) == "/" and bin or root .. "/" .. bin
    local code, out = helpers.sh(string.format("cd '%s' && DORMOUSE_HOME='%s' '%s' plan '%s/experiments/tiny.lua'",
                                               dir, root, exe, root))
    assert.equal(0, code, out)
    has(out, "peak")
  end)
end)

describe("standard output that cannot be written", function()
  it("is an error and a non-zero exit, not a silent exit 0", function()
    local code, _, err = dormouse("config experiments/tiny.lua >/dev/full")
    assert.equal(1, code)
    has(err, "writing to standard output failed")
    assert.equal(0, (dormouse("config experiments/tiny.lua >/dev/null")))
  end)
end)

describe("a FIFO named where a file is read", function()
  it("is read once its writer shows: dormouse run /dev/stdin from a pipe", function()
    local code, out = helpers.sh(string.format("echo 'print(6 * 7)' | '%s' run /dev/stdin", bin))
    assert.equal(0, code, out)
    has(out, "42")
  end)

  it("with no writer is refused, not waited on forever, by run, config, plan, sweep, repl, sample", function()
    local fifo = dir .. "/pipe.lua"
    assert(os.execute("mkfifo '" .. fifo .. "'"))
    for _, args in ipairs {"run '" .. fifo .. "'", "config '" .. fifo .. "'", "plan '" .. fifo .. "'",
                           "sweep '" .. fifo .. "'", "repl '" .. fifo .. "'",
                           "sample runs/none --prompt-file '" .. fifo .. "'"} do
      local code, out, err = dormouse(args, "DORMOUSE_FIFO_WAIT_MS=200 timeout 20 ")
      assert.is_true(code ~= 0 and code ~= 124, args .. ": exit " .. tostring(code))
      has(out .. err, fifo)
    end
    local code, _, err = dormouse("run '" .. fifo .. "'", "DORMOUSE_FIFO_WAIT_MS=200 ")
    assert.equal(1, code)
    has(err, "a FIFO nothing was written to in 200 ms (no writer?)")
    os.remove(fifo)
  end)
end)

describe("every command's help", function()
  local function help(args)
    local p = assert(io.popen(string.format("'%s' %s 2>&1", bin, args)))
    local out = p:read("a")
    local _, _, code = p:close()
    return code, out
  end

  it("is shown by COMMAND --help and by dormouse help COMMAND, with its flags, exit 0", function()
    local names = {"run", "repl", "test", "version", "help"}
    for _, file in ipairs(require("dormouse.core").listdir("lua/dormouse/commands")) do
      local name = file:match("^([%w_]+)%.lua$")
      names[#names + 1] = name and (name:gsub("_", "-"))          -- post-train is commands/post_train.lua
    end
    for _, name in ipairs(names) do
      for _, form in ipairs {name .. " --help", "help " .. name} do
        local code, out = help(form)
        assert.equal(0, code, form .. ": " .. out)
        assert.truthy(out:find("usage: dormouse " .. name, 1, true), form .. ": " .. out)
        assert.truthy(out:find("\nexample: dormouse ", 1, true), form .. " gives no example: " .. out)
      end
    end
    local code, out = help("run --help")
    assert.truthy(out:find("--sample N         bytes sampled after the run (default 200", 1, true), out)
    code, out = help("run experiments/tiny.lua --help")          -- an experiment asks for run's help
    assert.equal(0, code, out)
    assert.truthy(out:find("usage: dormouse run FILE.lua", 1, true), out)
    -- a command's help is its file's header comment: what it does, the flags' defaults
    code, out = help("sample --help")
    assert.truthy(out:find("streams N bytes (default 200) after the prompt", 1, true), out)
    code, out = help("help long")
    assert.truthy(out:find("(default 8192;", 1, true), out)
    code, out = help("help nope")
    assert.equal(2, code)
    assert.truthy(out:find("no command 'nope'", 1, true), out)
  end)
end)

describe("a finished run's log.txt", function()
  it("ends with the closing lines it printed, the sample's bytes escaped in both", function()
    local cwd = dir .. "/summary"
    assert(os.execute("mkdir -p '" .. cwd .. "'"))
    local exe = bin:sub(1, 1) == "/" and bin or root .. "/" .. bin
    local p = assert(io.popen(string.format("cd '%s' && DORMOUSE_HOME='%s' '%s' run '%s/experiments/tiny.lua' --quiet " ..
                                            "--sample 200 --set steps=2 --set schedule.warmup=1 --set eval.windows=2 2>&1",
                                            cwd, root, exe, root)))
    local out = p:read("a")
    local _, _, code = p:close()
    assert.equal(0, code, out)
    local log = read(cwd .. "/runs/tiny/log.txt")
    local closing = out:match("(done: runs/tiny, step 2\n.*)$")
    assert.truthy(closing, out)
    assert.truthy(closing:find("^done: runs/tiny, step 2\nheld%-out bpb_fin [%d.]+[^\n]*\nsample: .-\n" ..
                               "report: runs/tiny/report.html\n$"), closing)
    assert.equal(closing, log:sub(-#closing))          -- log.txt holds every closing line, the sample too
    -- an untrained model samples any byte: no control byte but tab and newline reaches the terminal raw
    -- (a BEL, an escape, a carriage return), nor a byte of broken UTF-8: each shows as \xNN
    assert.is_nil(closing:find("[%z\1-\8\11-\31\127]"), "a raw control byte in " .. closing)
    assert.truthy(utf8.len(closing), "broken UTF-8 in " .. closing)
    assert.truthy(closing:find("\\x%x%x"), "no escaped byte in 200 bytes of an untrained model: " .. closing)
  end)
end)
