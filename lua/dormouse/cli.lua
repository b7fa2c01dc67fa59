--[[
The command line: `dormouse run|repl|test|version|help`. main.c hands argv
here (argv[0] is the binary) with the folder that holds lua/.
]]
local core = require "dormouse.core"

local cli = {}

local usage = [[
usage: dormouse <command> [arguments]

  run FILE.lua [args...]   run a script with the library loaded (arg as in lua); a file
                           that returns a config trains it (--set k=v, --resume runs/NAME)
  repl [FILE.lua | RUN]    an interactive session; FILE is run in it first, a run
                           directory (runs/NAME[/ckpt-STEP]) loads its model and probes
  test [busted args...]    run the Lua test suite (tests/lua/*_spec.lua) with Busted;
                           --shard K/N: only the spec files K, K + N, ... (of the sorted list)
  version                  print the version
  help                     this text

With no command, dormouse opens the REPL.
Environment: DM_DEBUG=1..4 (debug ladder, docs/debugging.md), DORMOUSE_HOME
(the folder holding lua/), LUA_PATH (searched before the library when set).]]

-- The runtime's own frames (this file, the library's wrappers, the core's C
-- functions, xpcall, the C entry) are noise in a user's traceback: the
-- message already names the user's line.
local function runtime_frame(line)
  return line:find("^%s*%S*lua/dormouse/[%w_/]+%.lua:") or line:find("%[C%]: in %?")
      or line:find("%[C%]: in function 'dormouse%.core%.") or line:find("in function 'xpcall'")
      or line:find("%(%.%.%.tail calls%.%.%.%)")
end

-- Only the frames are filtered: the message is kept whole, whatever it names.
local function clean_traceback(tb)
  local msg, frames = tb:match("^(.*)\nstack traceback:\n(.*)$")
  if not msg then return tb end
  local out = {}
  for line in frames:gmatch("[^\n]+") do
    if not runtime_frame(line) then out[#out + 1] = line end
  end
  if #out == 0 then return msg end
  return msg .. "\nstack traceback:\n" .. table.concat(out, "\n")
end

local function on_error(msg)
  if type(msg) ~= "string" then msg = "(error object is a " .. type(msg) .. " value)" end
  return clean_traceback(debug.traceback(msg, 2))
end
cli.on_error = on_error          -- an xpcall handler: the message and the user's frames

-- Run a chunk; print file:line: message and a traceback on error. Returns an
-- exit code, then fn's results. (fn is called by xpcall itself, so a script's
-- frame reads "in main chunk" in a traceback.)
function cli.protect(fn, ...)
  local res = table.pack(xpcall(fn, on_error, ...))
  if res[1] then return 0, table.unpack(res, 2, res.n) end
  io.stderr:write(res[2], "\n")
  return 1
end

local function set_arg(argv, first)
  local a = {[-1] = argv[0]}
  for i = first, #argv do a[i - first] = argv[i] end
  _G.arg = a
  return table.unpack(a, 1, #a)
end

-- Further commands live in lua/dormouse/commands/NAME.lua, each returning
-- {summary = "one line", run = function(argv, cli) ... return exit_code end}.
function cli.command(name)
  if not name:match("^[%w_-]+$") then return nil end
  name = name:gsub("%-", "_")                       -- post-train is commands/post_train.lua
  local path = package.searchpath("dormouse.commands." .. name, package.path)
  if not path then return nil end
  local mod = require("dormouse.commands." .. name)
  return function(argv) return mod.run(argv, cli) end
end

--[[ A command's --help: its usage, then, when that is one line, what the header comment of its
file (lua/dormouse/commands/NAME.lua, NAME as typed with - for _) says after its synopsis: what it
does, its flags and their defaults. One text, written once, read by --help and the source alike. ]]
function cli.help_text(name, usage)
  if usage:find("\n") then return usage end
  local path = package.searchpath("dormouse.commands." .. name:gsub("%-", "_"), package.path)
  local f = path and io.open(path, "r")
  local src = f and f:read("a") or ""
  if f then f:close() end
  local eq, body = src:match("^%-%-%[(=*)%[\n(.-)%]%1%]")
  if not body then return usage end
  local rest = body:match("^.-\n%s*\n(.*)$")          -- after the synopsis's paragraph
  return rest and usage .. "\n\n" .. rest:gsub("%s+$", "") or usage
end

--[[ The frame of a command in commands/: parse(argv) → args (an error: the message and the usage
on stderr, exit 2; args.help: the usage, exit 0), then body(args) (an error: its message on stderr
without its Lua position, exit 1; else body's exit code, 0 when none). ]]
function cli.framed(name, usage, parse, body)
  return function(argv)
    local ok, args = pcall(parse, argv)
    if not ok then
      io.stderr:write("dormouse ", name, ": ", tostring(args), "\n", usage, "\n")
      return 2
    end
    if args.help then print(cli.help_text(name, usage)) return 0 end
    local done, code = pcall(body, args)
    if not done then
      -- the messages name the file, key or value; the Lua line they were raised on is noise here
      io.stderr:write("dormouse ", name, ": ", (tostring(code):gsub("^[^\n]-%.lua:%d+: ", "")), "\n")
      return 1
    end
    return code or 0
  end
end

-- the names of the commands in commands/, sorted
local function extra_names()
  local names = {}
  local dir = (cli.root or ".") .. "/lua/dormouse/commands"
  for _, file in ipairs(require("dormouse.core").listdir(dir) or {}) do
    local name = file:match("^([%w_]+)%.lua$")
    if name then names[#names + 1] = name end
  end
  table.sort(names)
  return names
end

local function extra_commands()
  local lines = {}
  for _, name in ipairs(extra_names()) do
    local ok, mod = pcall(require, "dormouse.commands." .. name)
    if ok and type(mod) == "table" then
      local left = name:gsub("_", "-") .. " " .. (mod.args or "")
      lines[#lines + 1] = #left <= 24 and string.format("  %-24s %s", left, mod.summary or "")
                          or string.format("  %s\n  %-24s %s", left, "", mod.summary or "")   -- a long one: its own line
    end
  end
  return #lines > 0 and "\n" .. table.concat(lines, "\n") or ""
end

local commands = {}

-- A file that returns a table is an experiment: it is trained (see
-- dormouse/experiment.lua). Any other file is a script.
-- the help of the built-in commands (those of commands/ carry their own)
local HELP = {
  run = [==[
usage: dormouse run FILE.lua [--set KEY=VALUE ...] [--resume RUN | --init RUN] [--overwrite] [--quiet] [--sample N]
                   [--stress [--stress-lr K] [--stress-steps N]]

Runs a Lua script with the library loaded. A script that returns a config (an experiment file,
experiments/*.lua) is trained: runs/NAME/ gets its log, metrics, report and checkpoints.
  --set KEY=VALUE    override any config key (dormouse config FILE lists them); repeatable
  --resume RUN       continue runs/NAME (its newest checkpoint) or runs/NAME/ckpt-STEP
  --init RUN         a new run from the model weights of runs/NAME or runs/NAME/ckpt-STEP (a fine-tune;
                     the same as --set init=RUN): optimiser, schedule, data and step start fresh
  --overwrite        replace a run folder that holds checkpoints (default: refused)
  --quiet            no progress bar (the log lines still print)
  --sample N         bytes sampled after the run (default 200; 0 = none)
  --stress           N guarded steps at K times the learning rates instead of the run; nothing written
  --stress-lr K      default 2
  --stress-steps N   default 50
example: dormouse run experiments/small.lua --set steps=2000 --set seed=3]==],
  repl = [==[
usage: dormouse repl [FILE.lua | RUN [--trust]]

An interactive Lua session with the library loaded (readline; history in ~/.dormouse_history).
FILE.lua is run in it first. On a run (runs/NAME or runs/NAME/ckpt-STEP) its model and config are
loaded with the probes: sample, loss, experts, ... (docs/repl.md). A run whose config names its
model file by a path opens only with --trust: that file is code.
example: dormouse repl runs/demo]==],
  version = [==[
usage: dormouse version

Prints the version of dormouse and of the Lua it embeds.
example: dormouse version]==],
  help = [==[
usage: dormouse help [COMMAND]

Without COMMAND, every command with one line on each; with it, that command's help (the same as
dormouse COMMAND --help).
example: dormouse help sweep]==],
  test = [==[
usage: dormouse test [--shard K/N] [SPEC.lua ...] [busted's flags]

Runs the Busted suite (tests/lua/*_spec.lua, from the repository root), or the spec files named,
or the K-th of N parts of it (--shard K/N). Busted's own flags follow (busted --help).
example: dormouse test tests/lua/model_spec.lua]==],
}

-- a built-in command's help on stdout (dormouse run FILE --help: the experiment asks for run's)
function cli.show_help(name) print(HELP[name]) return 0 end

local function wants_help(argv)
  for i = 2, #argv do if argv[i] == "--help" or argv[i] == "-h" then return true end end
  return false
end

function commands.run(argv)
  if argv[2] == "--help" or argv[2] == "-h" then print(HELP.run) return 0 end
  local file = argv[2]
  if not file then
    io.stderr:write("dormouse run: which file? usage: dormouse run FILE.lua [args...]\n")
    return 2
  end
  local chunk, err = require("dormouse.config").loadfile(file)
  if not chunk then
    -- a syntax error already starts with file:line; a missing file gets our name
    io.stderr:write(err:find("^cannot open") and "dormouse run: " or "", err, "\n")
    return 1
  end
  local results = table.pack(cli.protect(chunk, set_arg(argv, 2)))
  local code = results[1]
  results = table.pack(table.unpack(results, 2, results.n))
  if code ~= 0 or not (results.n == 1 and type(results[1]) == "table") then return code end
  if rawget(results[1], "arms") and rawget(results[1], "base") then
    io.stderr:write(string.format("dormouse run: %s describes a seed sweep; run it with: dormouse sweep %s " ..
                                  "[--set KEY=VALUE ...]\n", file, file))
    return 2
  end
  -- A refusal (a config error, a resume that does not match) is a message; an
  -- error located in code (file:line:) shows its traceback too.
  local ok, e = xpcall(require("dormouse.experiment").run, function(m)
    m = tostring(m)
    local located = m:match("^[^%s:]+:%d+:")
    return located and clean_traceback(debug.traceback(m, 2)) or m
  end, file, results[1], argv, cli)
  if ok then return 0 end
  io.stderr:write(e, "\n")
  return 1
end

function commands.repl(argv)
  if wants_help(argv) then print(HELP.repl) return 0 end
  return require("dormouse.repl").main(argv[2], cli, argv[3])
end

--[[ --shard K/N in a test command line: the spec files of tests/lua whose place in the sorted
list is K mod N (1-based), for running the suite as N processes side by side (ctest itself
runs each spec file as a test of its own). The flag and its value are replaced by
the files. ]]
local function shard(argv)
  for i = 2, #argv do
    if argv[i] == "--shard" then
      local k, n = tostring(argv[i + 1]):match("^(%d+)/(%d+)$")
      k, n = tonumber(k), tonumber(n)
      if not k or n < 1 or k < 1 or k > n then
        return nil, string.format("test: --shard takes K/N with 1 <= K <= N, got '%s'", tostring(argv[i + 1]))
      end
      local files = {}
      local names, why = core.listdir("tests/lua")
      if not names then
        return nil, "test: --shard lists tests/lua from the repository root, which is not here (" .. tostring(why) .. ")"
      end
      for _, name in ipairs(names) do
        if name:match("_spec%.lua$") then files[#files + 1] = "tests/lua/" .. name end
      end
      table.sort(files)
      local out = {[0] = argv[0]}
      for j = 1, i - 1 do out[#out + 1] = argv[j] end
      for j = i + 2, #argv do out[#out + 1] = argv[j] end
      for j, f in ipairs(files) do
        if (j - 1) % n == k - 1 then out[#out + 1] = f end
      end
      if #out == #argv - 2 then return nil, string.format("test: shard %d of %d has no spec file", k, n) end
      return out
    end
  end
  return argv
end

function commands.test(argv)
  if argv[2] == "--help" or argv[2] == "-h" then print(HELP.test) return 0 end
  local why
  argv, why = shard(argv)
  if not argv then
    io.stderr:write("dormouse: ", why, "\n")
    return 2
  end
  set_arg(argv, 1)                 -- busted's own arguments start at arg[1]
  _G.arg[0] = "busted"
  require("busted.runner")({standalone = false})
  return 0
end

function commands.version(argv)
  if argv and wants_help(argv) then print(HELP.version) return 0 end
  print("dormouse " .. core.version .. " (" .. _VERSION .. ")")
  return 0
end

-- the usage with every command, those of commands/ after the built-in ones
local function full_usage() return (usage:gsub("(\n  help[^\n]*)", "%1" .. extra_commands(), 1)) end

-- dormouse help [COMMAND]: the whole usage, or one command's help (its --help)
function commands.help(argv)
  local name = argv and argv[2]
  if not name then print(full_usage()) return 0 end
  if name == "--help" or name == "-h" then print(HELP.help) return 0 end
  if HELP[name] then print(HELP[name]) return 0 end
  local run = cli.command(name)
  if not run then
    io.stderr:write(string.format("dormouse help: no command '%s'\n", name))
    return 2
  end
  return run({[0] = argv[0], name, "--help"})
end

-- the nearest command name to a mistyped one, when it is near
local function nearest_command(name)
  local config = require "dormouse.config"
  local best, score
  local all = {"run", "repl", "test", "version", "help"}
  for _, n in ipairs(extra_names()) do all[#all + 1] = n end
  for _, n in ipairs(all) do
    local d = config.distance(name, n)
    if not score or d < score then best, score = n, d end
  end
  return score and score <= math.max(1, #name // 3) and best or nil
end

function cli.main(argv, root)
  cli.root = root
  require("dormouse.config").root = root or "."
  local cmd = argv[1]
  if cmd == nil then return commands.repl(argv) end
  if cmd == "--help" or cmd == "-h" then cmd = "help" end
  if cmd == "--version" then cmd = "version" end
  local run = commands[cmd] or cli.command(cmd)
  if not run then
    local near = nearest_command(cmd)
    io.stderr:write("dormouse: unknown command '", cmd, "'", near and " (did you mean '" .. near .. "'?)" or "",
                    "\n\n", full_usage(), "\n")
    return 2
  end
  return run(argv)
end

return cli
