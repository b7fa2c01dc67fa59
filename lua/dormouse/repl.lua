--[[
The REPL: readline with history in ~/.dormouse_history (each line appended
as it is entered), Tab completing the session's names (dm.ra<Tab>,
x:su<Tab>), expressions printed as they are typed, statements run,
incomplete chunks continued on the next line. Ctrl-C drops the line being
typed, or stops the line that runs ("interrupted"), and the session goes
on; Ctrl-D leaves. `dm` is loaded; help() lists what there is.
]]
local core = require "dormouse.core"
local dm = require "dormouse"

local repl = {}

-- a value as the REPL prints it: tables to four levels ({...} below, and for a table met again
-- on the way down), strings quoted inside them
local function show(v, depth, seen)
  depth, seen = depth or 0, seen or {}
  local mt = type(v) == "table" and getmetatable(v)
  if dm.is_tensor(v) or type(v) ~= "table" or (mt and rawget(mt, "__tostring")) then
    return type(v) == "string" and depth > 0 and string.format("%q", v) or tostring(v)
  end
  if depth > 3 or seen[v] then return "{...}" end
  seen[v] = true
  -- raw reads: a table whose __index raises on a missing key (a resolved config) prints too
  local parts, n = {}, 0
  while rawget(v, n + 1) ~= nil do n = n + 1; parts[n] = show(rawget(v, n), depth + 1, seen) end
  local keys = {}
  for k in next, v do
    if not (math.type(k) == "integer" and k >= 1 and k <= n) then keys[#keys + 1] = k end
  end
  table.sort(keys, function(a, b) return tostring(a) < tostring(b) end)
  for _, k in ipairs(keys) do
    local key = type(k) == "string" and k:match("^[%a_][%w_]*$") and k or "[" .. show(k, 4, seen) .. "]"
    parts[#parts + 1] = key .. " = " .. show(rawget(v, k), depth + 1, seen)
  end
  seen[v] = nil                                  -- a table met twice side by side prints twice; a cycle once
  if #parts > 40 then parts = {table.concat(parts, ", ", 1, 40), "... (" .. #parts .. " entries)"} end
  return "{" .. table.concat(parts, ", ") .. "}"
end
repl.show = show

local help_text = [[
dm is the library. Try:
  x = dm.randn({4, 8}, {seed = 1})            a tensor (printed with shape, dtype, device)
  w = dm.zeros({8, 3}, {requires_grad = true})
  loss = x:matmul(w):square():mean(); loss:backward(); w.grad
  dm.ops()                                     every op with its doc
  dm.memory()                                  host memory: current, peak, count
Lines that are expressions print their value; an unfinished line continues.
Tab completes names (dm.ra<Tab>, x:su<Tab>). Ctrl-C drops the line being typed
or stops the one running; Ctrl-D leaves.]]

local function history_path()
  local home = os.getenv("HOME")
  return home and home .. "/.dormouse_history"
end

-- The names a word before the cursor may complete to: "dm.ra" -> {"dm.rand", "dm.randn", ...};
-- after ":" the methods only. Lookups never raise (a strict config's __index does on a missing key).
local function keys_of(v, out, depth)
  if depth > 3 then return end
  if type(v) == "table" then for k in next, v do if type(k) == "string" then out[k] = rawget(v, k) end end end
  local mt = (type(v) == "table" or type(v) == "userdata") and getmetatable(v)
  local index = dm.is_tensor(v) and core.methods or type(mt) == "table" and rawget(mt, "__index")
  if type(index) == "table" and index ~= v then keys_of(index, out, depth + 1) end
end

local function completions(env, word)
  local head, sep, part = word:match("^(.-)([.:]?)([%a_]?[%w_]*)$")
  if not head or (sep == "" and head ~= "") then return {} end
  local v = env
  if sep ~= "" then
    for name in (head .. "."):gmatch("([^.]*)%.") do
      if not name:match("^[%a_][%w_]*$") then return {} end
      local ok, got = pcall(function() return v[name] end)
      if not ok or got == nil then return {} end
      v = got
    end
  end
  local names = {}
  keys_of(v, names, 0)
  local out = {}
  for k, val in pairs(names) do
    if k:sub(1, #part) == part and k:match("^[%a_][%w_]*$") and not (k:match("^_") and part == "")
       and (sep ~= ":" or type(val) == "function") then
      out[#out + 1] = head .. sep .. k
    end
  end
  table.sort(out)
  return out
end
repl.completions = completions

local function reader(tty, env)
  if tty then
    local hist = history_path()
    if hist then core.read_history(hist) end
    core.set_completer(function(word) return completions(env, word) end)
    return function(prompt) return core.readline(prompt) end, function(line)
      if line:match("%S") then core.add_history(line, hist, 1000) end
    end
  end
  return function() return io.read("l") end, function() end
end

-- A line that is an expression list is run as `return pack(line)`: its calls
-- are then arguments rather than tail calls, so an error inside one still
-- names repl:1. Returns the function and whether it packs its results.
local function compile(chunk, env)
  local fn, err = load("return " .. chunk, "=repl", "t", env)
  if fn then
    local packed = load("local pack = ...; return pack(" .. chunk .. "\n)", "=repl", "t", env)
    if packed then return packed, nil, true end
    return fn
  end
  return load(chunk, "=repl", "t", env)
end

local function is_dir(path)
  local f = io.open(path .. "/.", "r")
  if f then f:close() return true end
  return false
end

-- `dormouse repl runs/NAME[/ckpt-STEP]`: the model of a checkpoint and its probes.
local function checkpoint_env(env, path, cli, trust)
  local probe = require "dormouse.probe"
  local model, cfg, dir, step = probe.load(path, cli.root, {trust = trust})
  local helpers = probe.env(model, cfg)
  for k, v in pairs(helpers) do if k ~= "help_text" then env[k] = v end end
  env.help = function() print(help_text .. "\n\nThis checkpoint:\n" .. helpers.help_text) end
  print(string.format("loaded %s (step %d): %s parameters; help() lists the probes", dir, step,
                      require("dormouse.human").count(model:n_params())))
end

-- file: a script, or a run's folder; flag "--trust": run a model file the checkpoint names by its path
function repl.main(file, cli, flag)
  local env = setmetatable({dm = dm, help = function() print(help_text) end}, {__index = _G})
  local tty = core.isatty(0)
  if flag ~= nil and flag ~= "--trust" then
    io.stderr:write("dormouse repl: unknown option '", tostring(flag), "' (usage: dormouse repl [FILE | runs/NAME " ..
                    "[--trust]])\n")
    return 2
  end
  if file and is_dir(file) then
    local ok, err = pcall(checkpoint_env, env, file, cli, flag == "--trust")
    if not ok then io.stderr:write(tostring(err), "\n"); return 1 end
    file = nil
  end
  if file then
    local chunk, err = require("dormouse.config").loadfile(file, "t", env)
    if not chunk then io.stderr:write(err, "\n"); return 1 end
    if cli.protect(chunk) ~= 0 then return 1 end
  end
  if tty then print("dormouse " .. dm.version .. " — help() for a start, Ctrl-D to leave") end
  local read, remember = reader(tty, env)
  if tty then core.repl_interrupts(true) end
  local buffer = nil
  while true do
    local line = read(buffer and ">> " or "> ")
    if line == false then           -- Ctrl-C at the prompt: the line (and an unfinished chunk) dropped
      buffer = nil
      goto continue
    end
    if not line then break end
    buffer = buffer and buffer .. "\n" .. line or line
    local fn, err, packed = compile(buffer, env)
    if not fn and err:match("<eof>$") then goto continue end
    remember(buffer)
    if not fn then
      io.stderr:write(err, "\n")
    else
      local res = table.pack(xpcall(fn, cli.on_error, table.pack))
      if res[1] and packed then res = table.pack(true, table.unpack(res[2], 1, res[2].n)) end
      if not res[1] then
        -- the typed line itself is no news: a traceback shows only the functions it called
        -- nor is the error function: a traceback with no frame of the user's left is dropped
        local msg = res[2]:gsub("\n%s*repl:%d+: in main chunk", ""):gsub("\n%s*%[C%]: in function 'error'", "")
                          :gsub("\nstack traceback:$", "")
        io.stderr:write(msg, "\n")
      elseif res.n == 2 and res[2] == nil and buffer:match("^%s*[%a_][%w_]*%s*$") then
        -- a bare name that is nil: most often a misspelling, said rather than printed as nil
        io.stderr:write(string.format("%s: no such name here (not a variable, a probe or a library function)\n",
                                      buffer:match("[%a_][%w_]*")))
      elseif res.n > 1 then
        -- printing is protected too: a value whose printer raises ends nothing but its line
        local ok, text = pcall(function()
          local out = {}
          for i = 2, res.n do out[#out + 1] = show(res[i]) end
          return table.concat(out, "\t")
        end)
        if ok then print(text) else io.stderr:write("cannot print the result: ", tostring(text), "\n") end
        io.stdout:flush()                  -- in order with stderr when both go to one pipe
      end
    end
    buffer = nil
    ::continue::
  end
  if tty then
    core.repl_interrupts(false)
    print()
  end
  return 0
end

return repl
