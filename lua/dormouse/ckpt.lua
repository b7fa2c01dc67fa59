--[[
Checkpoints: tensors in safetensors files, everything else in a Lua table.

  local ckpt = require "dormouse.ckpt"
  ckpt.save_tensors("w.safetensors", {["embed.weight"] = w}, {note = "any strings"})
  local tensors, metadata = ckpt.load_tensors("w.safetensors")

A training checkpoint is a directory RUN_DIR/ckpt-STEP/ holding

  model.safetensors   the parameters, by name
  optim.safetensors   the optimiser state, by name
  meta.lua            `return {...}`: the caller's meta table (resolved config,
                      data position, ...) with three fields filled in:
                        step   the step number
                        rng    {seed = s, offset = o}, dm.rng_state() at save
                               time unless the caller gave meta.rng
                        files  {[file] = {size = bytes, xxh64 = "16 hex digits"}}
  meta.xxh64          the xxh64 of meta.lua itself (16 hex digits and a newline)

  ckpt.save(run_dir, step, {model = ..., optim = ..., meta = ...}, {keep = K})
  local parts = ckpt.load(ckpt.latest(run_dir))    -- parts.model, parts.optim, parts.meta

The directory is written as ckpt-STEP.tmp and renamed into place, so a
directory named ckpt-STEP is always complete; ckpt.latest ignores anything
else. One writer per run directory: save first clears what an interrupted
save left (a temporary goes; a step moved aside to be replaced comes back).
Loading checks every file's size and checksum first, and reads meta.lua as
data: text only, an empty environment, a bounded amount of work.
]]
local core = require "dormouse.core"

local ckpt = {}

local FILES = {"model.safetensors", "optim.safetensors"}
local META = "meta.lua"
local META_SUM = "meta.xxh64"

-- Errors point at the caller's line, not at this library.
local function fail(fmt, ...)
  local level = 2
  while true do
    local info = debug.getinfo(level, "S")
    if not info or not info.source:find("/dormouse/", 1, true) then break end
    level = level + 1
  end
  error(string.format(fmt, ...), level)
end

---------------------------------------------------------------------------------------------
-- Tensor files.

-- Write {name = tensor} (any device but meta, any strides) and optional
-- {key = "string value"} metadata to a safetensors file.
function ckpt.save_tensors(path, tensors, metadata)
  core.ckpt_save_tensors(path, tensors, metadata)
end

-- Read a safetensors file: {name = tensor} (contiguous, on the CPU), metadata.
function ckpt.load_tensors(path)
  return core.ckpt_load_tensors(path)
end

-- A file's XXH64 (16 hex digits) and size in bytes.
function ckpt.checksum(path)
  return core.file_checksum(path)
end

---------------------------------------------------------------------------------------------
-- Lua values as Lua source: numbers round-trip exactly (integers stay
-- integers, floats keep every bit, -0.0 its sign), strings are escaped,
-- tables nest. Functions, userdata (tensors too) and cycles are refused.

local reserved = {}
for w in ([[and break do else elseif end false for function goto if in local nil not or
            repeat return then true until while]]):gmatch("%a+") do reserved[w] = true end

local function is_name(k)
  return type(k) == "string" and k:match("^[%a_][%w_]*$") ~= nil and not reserved[k]
end

local function number_literal(x)
  if math.type(x) == "integer" then
    -- the lexer reads 9223372036854775808 as a float, so the smallest integer is spelled out
    if x == math.mininteger then return "(-9223372036854775807-1)" end
    return string.format("%d", x)
  end
  if x ~= x then return "(0/0)" end
  if x == math.huge then return "(1/0)" end
  if x == -math.huge then return "(-1/0)" end
  local s
  for _, digits in ipairs {15, 16, 17} do      -- the shortest that reads back exactly; 17 always does
    s = string.format("%." .. digits .. "g", x)
    if tonumber(s) == x then break end
  end
  if not s:find("[.eE]") then s = s .. ".0" end  -- stays a float when read back
  return s
end

local function string_literal(s)
  return (string.format("%q", s):gsub("\\\n", "\\n"))
end

local key_rank = {number = 1, string = 2, boolean = 3}
local function key_order(a, b)
  local ta, tb = type(a), type(b)
  if ta ~= tb then return key_rank[ta] < key_rank[tb] end
  if ta == "boolean" then return not a and b end
  return a < b
end

local function path_of(path, k)
  if is_name(k) then return path .. "." .. k end
  return path .. "[" .. (type(k) == "string" and string_literal(k) or tostring(k)) .. "]"
end

local serialize

local function table_literal(t, path, indent, open)
  if open[t] then fail("ckpt: cannot serialize %s: the table contains itself", path) end
  open[t] = true
  local items, n = {}, 0
  while t[n + 1] ~= nil do                       -- the array part, positionally
    n = n + 1
    items[n] = serialize(t[n], path .. "[" .. n .. "]", indent .. "  ", open)
  end
  local keys = {}
  for k in pairs(t) do
    if not (math.type(k) == "integer" and k >= 1 and k <= n) then
      if not key_rank[type(k)] then fail("ckpt: cannot serialize %s: a %s key", path, type(k)) end
      keys[#keys + 1] = k
    end
  end
  table.sort(keys, key_order)
  for _, k in ipairs(keys) do
    local key = is_name(k) and k or "[" .. serialize(k, path, "", open) .. "]"
    items[#items + 1] = key .. " = " .. serialize(t[k], path_of(path, k), indent .. "  ", open)
  end
  open[t] = nil
  if #items == 0 then return "{}" end
  local inline = "{" .. table.concat(items, ", ") .. "}"
  if #inline + #indent <= 80 and not inline:find("\n") then return inline end
  return "{\n" .. indent .. "  " .. table.concat(items, ",\n" .. indent .. "  ") .. ",\n" .. indent .. "}"
end

function serialize(v, path, indent, open)
  local tv = type(v)
  if tv == "number" then return number_literal(v) end
  if tv == "string" then return string_literal(v) end
  if tv == "boolean" then return tostring(v) end
  if tv == "table" then return table_literal(v, path, indent, open) end
  fail("ckpt: cannot serialize %s: a %s", path, tv == "userdata" and "userdata (a tensor?)" or tv)
end

-- The Lua source of a value; `name` (default "value") names it in errors.
function ckpt.serialize(v, name)
  return serialize(v, name or "value", "", {})
end

local MAX_WORK = 10000000       -- VM instructions; a table literal takes a few per value
local MAX_TEXT = 64 << 20       -- bytes: a run's meta.lua is a few KB
local MAX_MEMORY = 256 << 20    -- bytes of Lua memory its run may take: the text's values and some

-- Read back what ckpt.serialize wrote ("return " .. literal): as data, with no
-- access to any environment, no string methods (("x"):rep(n) would reach them
-- through the strings' metatable), a bounded amount of text and work, and a
-- ceiling on memory (concatenation is an operator: "s .. s" doubles in one
-- instruction). `name` names the source.
function ckpt.deserialize(text, name)
  name = name or "value"
  if #text > MAX_TEXT then fail("%s: corrupted: %d bytes, over the %d a table literal may have", name, #text, MAX_TEXT) end
  local chunk, err = load(text, "=" .. name, "t", {})
  if not chunk then fail("%s: corrupted: %s", name, err) end
  local co = coroutine.create(chunk)
  local work = 0
  debug.sethook(co, function()
    work = work + 1000
    if work > MAX_WORK then error("too much work for a table literal", 0) end
  end, "", 1000)
  local strings = getmetatable("")
  local methods = strings.__index
  strings.__index = nil                -- for the literal's run only; it runs to its end before this goes on
  core.memory_limit(MAX_MEMORY)
  local ok, value = coroutine.resume(co)
  core.memory_limit(nil)
  strings.__index = methods
  if not ok and value == "not enough memory" then
    fail("%s: corrupted: reading it takes more than the %d MB a table literal may", name, MAX_MEMORY >> 20)
  end
  if not ok then fail("%s: corrupted: %s", name, tostring(value)) end
  if type(value) ~= "table" then fail("%s: corrupted: expected a table, got %s", name, type(value)) end
  return value
end

local function read_file(path)
  local f, err = io.open(path, "rb")
  if not f then fail("%s", err) end
  local text = f:read("a")
  f:close()
  return text
end

---------------------------------------------------------------------------------------------
-- Checkpoint directories.

local function join(dir, name) return dir .. "/" .. name end

-- whether the folder lists the name (opening it could block: a FIFO)
local function exists(path)
  local dir, name = path:match("^(.*)/([^/]+)$")
  for _, n in ipairs(core.listdir(dir or ".") or {}) do
    if n == (name or path) then return true end
  end
  return false
end

-- a checkpoint folder and its files (through the C core: no shell, links not followed)
local function remove_dir(dir)
  local ok, err = pcall(core.remove_tree, dir)
  if not ok then fail("ckpt: %s", tostring(err)) end
end

-- The complete checkpoints in run_dir, oldest first: {{step = n, path = ...}, ...}
function ckpt.list(run_dir)
  local out = {}
  for _, name in ipairs(core.listdir(run_dir) or {}) do
    local step = name:match("^ckpt%-(%d+)$")
    local path = join(run_dir, name)
    if step and exists(join(path, META)) then out[#out + 1] = {step = math.tointeger(tonumber(step)), path = path} end
  end
  table.sort(out, function(a, b) return a.step < b.step end)
  return out
end

-- The newest complete checkpoint: its path and step, or nil when there is none.
function ckpt.latest(run_dir)
  local all = ckpt.list(run_dir)
  local last = all[#all]
  if last then return last.path, last.step end
  return nil
end

local function check_tensors(what, t)
  if t == nil then return {} end
  if type(t) ~= "table" then fail("ckpt.save: %s must be a table {name = tensor}, got a %s", what, type(t)) end
  return t
end

local function meta_with(parts, step, files)
  local meta = {}
  for k, v in pairs(parts.meta or {}) do meta[k] = v end
  if meta.step ~= nil and meta.step ~= step then
    fail("ckpt.save: meta.step is %s but the step is %d", tostring(meta.step), step)
  end
  meta.step = step
  if meta.rng == nil then
    local seed, offset = core.rng_state()
    meta.rng = {seed = seed, offset = offset}
  end
  meta.files = files
  return meta
end

-- Leftovers of an interrupted save: a temporary is dropped; a checkpoint
-- moved aside to be replaced goes back if its replacement never arrived; a
-- folder under a final name without its meta.lua (two writers once raced
-- there; a save renames complete folders only) is no checkpoint and goes, said.
local function recover(run_dir)
  for _, name in ipairs(core.listdir(run_dir) or {}) do
    local path = join(run_dir, name)
    if name:match("^ckpt%-%d+%.tmp$") then remove_dir(path) end
    if name:match("^ckpt%-%d+$") and core.listdir(path) and not exists(join(path, META)) then
      remove_dir(path)
      io.stderr:write(string.format("ckpt: removed %s: an incomplete checkpoint (no %s) under a final name\n",
                                    path, META))
    end
    local final = name:match("^(ckpt%-%d+)%.old$")
    if final then
      if core.listdir(join(run_dir, final)) then remove_dir(path)
      else os.rename(path, join(run_dir, final)) end
    end
  end
end

-- the three files, into a fresh directory
local function write_files(dir, step, tensors, parts)
  core.mkdirs(dir)
  local files = {}
  for i, file in ipairs(FILES) do
    local path = join(dir, file)
    core.ckpt_save_tensors(path, tensors[i], {producer = "dormouse " .. core.version, step = tostring(step)},
                           i == 1 and parts.model_as or nil)
    local sum, size = core.file_checksum(path)
    files[file] = {size = size, xxh64 = sum}
  end
  local meta = meta_with(parts, step, files)
  core.write_file(join(dir, META), "return " .. ckpt.serialize(meta, "meta") .. "\n")
  core.write_file(join(dir, META_SUM), (core.file_checksum(join(dir, META))) .. "\n")
  core.fsync_dir(dir)
end

local function rename(from, to)
  local ok, err = os.rename(from, to)
  if not ok then fail("ckpt.save: cannot rename %s to %s: %s", from, to, err) end
end

-- Write run_dir/ckpt-STEP/ from parts = {model = tensors, optim = tensors, meta = table[, model_as =
-- {name = file dtype}: the model's u8 codes written as F8_E4M3 (banks.lua)]};
-- with opts.keep = K, keep only the newest K checkpoints. Returns the directory.
function ckpt.save(run_dir, step, parts, opts)
  if math.type(step) ~= "integer" or step < 0 then fail("ckpt.save: step must be a non-negative integer, got %s", tostring(step)) end
  if type(parts) ~= "table" then fail("ckpt.save: parts must be a table {model = ..., optim = ..., meta = ...}") end
  if parts.meta ~= nil and type(parts.meta) ~= "table" then fail("ckpt.save: meta must be a table, got a %s", type(parts.meta)) end
  opts = opts or {}
  local keep = opts.keep
  if keep ~= nil and (math.type(keep) ~= "integer" or keep < 1) then
    fail("ckpt.save: keep must be an integer >= 1, got %s", tostring(keep))
  end
  local tensors = {check_tensors("model", parts.model), check_tensors("optim", parts.optim)}

  core.mkdirs(run_dir)
  recover(run_dir)
  local final = join(run_dir, "ckpt-" .. step)
  local tmp, old = final .. ".tmp", final .. ".old"
  local ok, err = pcall(write_files, tmp, step, tensors, parts)
  if not ok then
    pcall(remove_dir, tmp)
    error(err, 0)
  end
  local replacing = core.listdir(final) ~= nil              -- saving a step again
  if replacing then rename(final, old) end
  rename(tmp, final)
  if replacing then remove_dir(old) end
  core.fsync_dir(run_dir)
  if keep then
    -- renamed first, so that a kill in the middle never leaves a partial checkpoint that looks complete
    -- (recover drops the .tmp left behind)
    local all = ckpt.list(run_dir)
    for i = 1, #all - keep do
      local doomed = all[i].path .. ".tmp"
      rename(all[i].path, doomed)
      remove_dir(doomed)
    end
  end
  return final
end

-- Read a checkpoint directory after checking every file's size and checksum
-- against meta.lua: {model = tensors, optim = tensors, meta = table}.
-- meta.lua against its recorded checksum (refusing what is not a regular file before reading it)
local warned_unsummed = false
local function check_meta_sum(dir, meta_path)
  local sum = core.file_checksum(meta_path)
  local sum_path = join(dir, META_SUM)
  if not exists(sum_path) then
    if not warned_unsummed then        -- checkpoints of earlier versions: said once, then read as before
      io.stderr:write(string.format("ckpt: %s has no %s (an earlier version's checkpoint): its meta.lua " ..
                                    "is read without a checksum\n", dir, META_SUM))
      warned_unsummed = true
    end
    return
  end
  core.file_checksum(sum_path)         -- a regular file too
  local want = read_file(sum_path):match("^(%x+)\n?$")
  if want ~= sum then
    fail("%s: corrupted: checksum mismatch (%s records xxh64 %s, the file has %s)", meta_path, META_SUM,
         tostring(want), sum)
  end
end

-- the fields every checkpoint's meta holds, each checked with a message naming it
local function check_meta_fields(meta, meta_path)
  if math.type(meta.step) ~= "integer" or meta.step < 0 then
    fail("%s: corrupted: step must be an integer >= 0, got %s", meta_path, tostring(meta.step))
  end
  if type(meta.files) ~= "table" then fail("%s: corrupted: no files table", meta_path) end
end

-- A checkpoint's meta table alone, its checksum and fields checked (the tensors not read).
function ckpt.load_meta(dir)
  if type(dir) ~= "string" then fail("ckpt.load: expected a checkpoint directory, got %s", tostring(dir)) end
  local meta_path = join(dir, META)
  check_meta_sum(dir, meta_path)
  local meta = ckpt.deserialize(read_file(meta_path), meta_path)
  check_meta_fields(meta, meta_path)
  return meta
end

function ckpt.load(dir)
  local meta = ckpt.load_meta(dir)
  local meta_path = join(dir, META)
  for _, file in ipairs(FILES) do
    local want, path = meta.files[file], join(dir, file)
    if type(want) ~= "table" then fail("%s: corrupted: no checksum recorded for %s", meta_path, file) end
    if math.type(want.size) ~= "integer" then        -- "430104", a string, once read as a mismatch with 430104
      fail("%s: corrupted: files[%q].size must be an integer, got %s %s", meta_path, file, type(want.size),
           tostring(want.size))
    end
    local sum, size = core.file_checksum(path)
    if size ~= want.size then
      fail("%s: %s: meta.lua records %s bytes, the file has %d", path,
           size < (tonumber(want.size) or 0) and "truncated" or "wrong size", tostring(want.size), size)
    end
    if sum ~= want.xxh64 then
      fail("%s: corrupted: checksum mismatch (meta.lua records xxh64 %s, the file has %s)", path, tostring(want.xxh64), sum)
    end
  end
  return {
    model = (core.ckpt_load_tensors(join(dir, FILES[1]))),
    optim = (core.ckpt_load_tensors(join(dir, FILES[2]))),
    meta = meta,
  }
end

return ckpt
