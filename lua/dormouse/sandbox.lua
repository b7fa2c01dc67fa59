--[[
dormouse.sandbox — running a program the model wrote where it can harm
nothing: bubblewrap (Debian's `bubblewrap`) with no network and no other
namespace shared, a read-only system (/usr and what links into it), the
program's files read-only at /task, a fresh writable /work and /tmp in memory,
and limits on wall time, memory, processes, file size and output.

  local sandbox = require "dormouse.sandbox"
  local ok, why = sandbox.available()
  local r = sandbox.run {language = "python3", source = "print(1 + 1)", seconds = 2}
  -- {ok = true, status = 0, stdout = "2\n", stderr = "", seconds = 0.04}
  -- a failure: ok = false and reason: "time limit (2 s)", "output over 65536 bytes",
  --   "exit status 1: MemoryError", "killed by SIGKILL", ...

Options: language ("python3" or "lua": python3 or lua5.4 from /usr/bin), source
(the program, bytes), args (a list of strings after the file; no shell sees them),
seconds (wall time, default 2), memory (bytes of address space, default 512 MiB),
processes (default 64), output (bytes kept of stdout and of stderr, default 64
KiB; more fails the run), disk (bytes of /work and /tmp each, default 64 MiB).

Run as root, the program runs as a user of this process's own (2,000,000,000 plus
its pid, a number no account uses), so that the processes limit counts the
sandbox's processes only: a fork bomb meets it and then the time limit, and
never eats the quota of another process's sandboxes (two runs verifying code at
once) or of a user of the system. Past the time limit or the output cap the whole sandbox is killed (its
PID namespace goes with bubblewrap), and the call returns once every process
of it has ended. Nothing on the host is writable from
inside; the host folder the program is read from is removed after the run.
]]
local core = require "dormouse.core"

local sandbox = {}

local LANGUAGES = {
  python3 = {program = "python3", file = "main.py", package = "python3-minimal"},
  lua = {program = "lua5.4", file = "main.lua", package = "lua5.4"},
}

local DEFAULTS = {seconds = 2, memory = 512 << 20, processes = 64, output = 65536, disk = 64 << 20}
local SANDBOX_UID = 2000000000 + core.pid()   -- the program's user when this process is root (above)

local SIGNALS = {[6] = "SIGABRT", [9] = "SIGKILL", [11] = "SIGSEGV (a memory fault)", [24] = "SIGXCPU (the CPU time limit)",
                 [25] = "SIGXFSZ (the file size limit)"}

-- the program's path in the system folders the sandbox binds, or nil
local function system_program(name)
  for _, dir in ipairs {"/usr/local/bin", "/usr/bin", "/bin"} do
    if core.file_kind(dir .. "/" .. name) == "file" then return dir .. "/" .. name end
  end
end

-- bwrap's arguments around a program that reads its files from `dir` (bound at /task)
local function bwrap_argv(bwrap, dir, disk, command)
  local argv = {bwrap, "--unshare-all", "--die-with-parent", "--new-session", "--info-fd", "3",
                "--ro-bind", "/usr", "/usr"}
  for _, top in ipairs {"/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"} do   -- links into /usr, or folders
    for _, a in ipairs {"--ro-bind-try", top, top} do argv[#argv + 1] = a end
  end
  for _, a in ipairs {"--ro-bind-try", "/etc/alternatives", "/etc/alternatives",
                      "--ro-bind-try", "/etc/ld.so.cache", "/etc/ld.so.cache",
                      "--proc", "/proc", "--dev", "/dev",
                      "--size", string.format("%d", disk), "--tmpfs", "/tmp", "--size", string.format("%d", disk), "--tmpfs", "/work",
                      "--ro-bind", dir, "/task", "--remount-ro", "/", "--chdir", "/work",
                      "--clearenv", "--setenv", "PATH", "/usr/local/bin:/usr/bin:/bin", "--setenv", "HOME", "/work",
                      "--setenv", "LANG", "C.UTF-8", "--"} do
    argv[#argv + 1] = a
  end
  for _, a in ipairs(command) do argv[#argv + 1] = a end
  return argv
end

local function write_file(path, bytes)
  local f = assert(io.open(path, "wb"))
  f:write(bytes)
  f:close()
end

-- the last line of text that holds something, cut to n bytes
local function last_line(text, n)
  local last
  for line in text:gmatch("[^\n]+") do if line:match("%S") then last = line end end
  return last and (#last > n and last:sub(1, n) .. "..." or last)
end

-- what a run's end says: nil when it passed
local function reason_of(r, o)
  if r.timed_out then return string.format("time limit (%g s)", o.seconds) end
  if r.output_over then return string.format("output over %d bytes", o.output) end
  if r.status == 0 then return nil end
  -- what the program said last: Python's exception is its last line, Lua's error the line above its traceback
  local said = last_line(r.stderr:match("^(.-)\nstack traceback:") or r.stderr, 200)
  if r.status > 128 then
    local sig = r.status - 128
    return "killed by " .. (SIGNALS[sig] or "signal " .. sig) .. (said and ": " .. said or "")
  end
  return string.format("exit status %d%s", r.status, said and ": " .. said or "")
end

local function options(o)
  if type(o) ~= "table" then error("sandbox.run: expects a table of options", 3) end
  local known = {language = true, source = true, args = true, seconds = true, memory = true, processes = true,
                 output = true, disk = true}
  for k in pairs(o) do
    if not known[k] then error(string.format("sandbox.run: unknown option '%s'", tostring(k)), 3) end
  end
  local lang = LANGUAGES[o.language]
  if not lang then
    error(string.format("sandbox.run: language must be python3 or lua, got %s", tostring(o.language)), 3)
  end
  if type(o.source) ~= "string" then error("sandbox.run: source must be a string (the program)", 3) end
  local out = {language = o.language, source = o.source, args = o.args or {}}
  for k, v in pairs(DEFAULTS) do
    out[k] = o[k] or v
    if type(out[k]) ~= "number" or out[k] <= 0 then
      error(string.format("sandbox.run: %s must be a positive number, got %s", k, tostring(o[k])), 3)
    end
  end
  for i, a in ipairs(out.args) do
    if type(a) ~= "string" then error(string.format("sandbox.run: args[%d] must be a string", i), 3) end
  end
  return out, lang
end

-- The sandbox's first process ends only once every other one in its PID namespace has: wait for it
-- (and reap it: run_limited made it this process's child), so that nothing the program started
-- outlives the call, nor its zombie the user's process count
local function wait_first(r)
  local first = tonumber((r.info or ""):match('"child%-pid"%s*:%s*(%d+)'))
  if first and not core.wait_gone(first, 10) then
    error(string.format("sandbox: the sandbox's processes (its first, pid %d) still run 10 s after it was killed",
                        first), 3)
  end
  r.info = nil
end

--[[ The sandbox itself, checked once: bwrap is there and can make its namespaces here.
sandbox.available() → true, or false and why. ]]
local checked
function sandbox.available()
  if checked then return checked[1], checked[2] end
  local bwrap = system_program("bwrap")
  if not bwrap then
    checked = {false, "bubblewrap is not installed (the program bwrap; apt-get install bubblewrap)"}
    return false, checked[2]
  end
  local dir = core.make_temp_dir("dormouse-sandbox-")
  local r = core.run_limited(bwrap_argv(bwrap, dir, DEFAULTS.disk, {"/usr/bin/env", "true"}),
                             {seconds = 10, output = 4096, uid = SANDBOX_UID, info_fd = 3, memory = DEFAULTS.memory,
                              processes = DEFAULTS.processes, file_size = DEFAULTS.disk})   -- run's limits
  core.remove_tree(dir)
  wait_first(r)
  if r.status ~= 0 then
    checked = {false, "bubblewrap cannot make its sandbox here: " .. (last_line(r.stderr, 300) or
               "exit status " .. r.status)}
  else
    checked = {true}
  end
  return checked[1], checked[2]
end

--- sandbox.run(options) → {ok, status, stdout, stderr, seconds, reason (nil when ok)}
function sandbox.run(opts)
  local o, lang = options(opts)
  local ok, why = sandbox.available()
  if not ok then error("sandbox: " .. why, 2) end
  local interpreter = system_program(lang.program)
  if not interpreter then
    error(string.format("sandbox: %s needs the program %s under /usr/bin (apt-get install %s)", o.language,
                        lang.program, lang.package), 2)
  end
  local dir = core.make_temp_dir("dormouse-sandbox-")
  local done, r = pcall(function()
    write_file(dir .. "/" .. lang.file, o.source)
    local command = {interpreter, "/task/" .. lang.file}
    for _, a in ipairs(o.args) do command[#command + 1] = a end
    return core.run_limited(bwrap_argv(system_program("bwrap"), dir, o.disk, command), {
      seconds = o.seconds, output = o.output, memory = o.memory, processes = o.processes,
      file_size = o.disk, uid = SANDBOX_UID, info_fd = 3})
  end)
  core.remove_tree(dir)
  if not done then error(r, 0) end
  wait_first(r)
  r.reason = reason_of(r, o)
  r.ok = r.reason == nil
  return r
end

return sandbox
