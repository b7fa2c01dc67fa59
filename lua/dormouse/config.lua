--[[
Experiment configs: a Lua file returning a table, checked against
dormouse.schema, defaults filled in, `--set key=value` overrides applied.

  local config = require "dormouse.config"
  local cfg, info = config.load("experiments/b1.lua", {"optim.muon_lr=2e-4", "steps=10"})
  cfg.model.d                      --> 2048
  cfg.model.dd                     --> error: config has no key 'model.dd' (did you mean 'model.d'?)

Errors name the source (the file, or the --set argument), the full dotted
key, and what was expected against what was found. Every error of a file is
reported at once, one per line. A resolved table is strict: reading a key
the schema does not know is an error, not a nil.
]]
local lpeg = require "lpeg"
local schema = require "dormouse.schema"

local config = {}
local show, got = schema.show, schema.got

---------------------------------------------------------------- helpers

local function copy(v)
  if type(v) ~= "table" then return v end
  local out = {}
  for k, x in pairs(v) do out[k] = copy(x) end
  return out
end

local function equal(a, b)
  if type(a) ~= "table" or type(b) ~= "table" then return a == b end
  for k, v in pairs(a) do
    if not equal(v, b[k]) then return false end
  end
  for k in pairs(b) do
    if a[k] == nil then return false end
  end
  return true
end
config.equal = equal

-- Every dotted key of the schema, sections and leaves, in schema order.
local all_keys = {}
local function collect(section)
  for _, node in ipairs(section.order) do
    all_keys[#all_keys + 1] = node.key
    if node.section then collect(node) end
  end
end
collect(schema.root)

---------------------------------------------------------------- did you mean

-- Optimal string alignment distance: insertions, deletions, substitutions,
-- and a swap of two neighbours, each costing 1.
local function distance(a, b)
  local d = {}
  for i = 0, #a do d[i] = {[0] = i} end
  for j = 0, #b do d[0][j] = j end
  for i = 1, #a do
    for j = 1, #b do
      local cost = a:byte(i) == b:byte(j) and 0 or 1
      local v = math.min(d[i - 1][j] + 1, d[i][j - 1] + 1, d[i - 1][j - 1] + cost)
      if i > 1 and j > 1 and a:byte(i) == b:byte(j - 1) and a:byte(i - 1) == b:byte(j) then
        v = math.min(v, d[i - 2][j - 2] + 1)
      end
      d[i][j] = v
    end
  end
  return d[#a][#b]
end
config.distance = distance

local function last_part(key) return key:match("([^.]*)$") end

-- The nearest valid key among the dotted names of the same section (all
-- names when the first part is no section). A right name at the wrong depth
-- (model.lfb_gamma for model.moe.lfb_gamma) is one step away.
function config.suggest(key, extra)
  local top = key:match("^([^.]+)%.")
  local scope = top and schema.nodes[top] and schema.nodes[top].section and top .. "." or ""
  local best, best_score
  local cands = all_keys
  if extra and #extra > 0 then
    cands = table.move(all_keys, 1, #all_keys, 1, {})
    table.move(extra, 1, #extra, #cands + 1, cands)
  end
  for _, cand in ipairs(cands) do
    if cand:sub(1, #scope) == scope and cand ~= key then
      local score = math.min(distance(key, cand), distance(last_part(key), last_part(cand)) + 1)
      if not best_score or score < best_score then best, best_score = cand, score end
    end
  end
  return best
end

local function unknown_key(key, extra)
  local near = config.suggest(key, extra)
  return "unknown key '" .. key .. "'" .. (near and " (did you mean '" .. near .. "'?)" or "")
end

---------------------------------------------------------------- strict tables

-- Reading a key the schema does not know raises; a known key that is nil reads nil.
local function strict(t, section)
  for _, node in ipairs(section.order) do
    if node.section then strict(rawget(t, node.name), node) end
  end
  return setmetatable(t, {__index = function(_, k)
    if section.children[k] then return nil end
    local key = (section.key == "" and "" or section.key .. ".") .. tostring(k)
    local near = config.suggest(key)
    error("config has no key '" .. key .. "'" .. (near and " (did you mean '" .. near .. "'?)" or ""), 2)
  end})
end

---------------------------------------------------------------- resolve

-- Check raw against a section of the schema, filling defaults into out.
local function resolve_section(section, raw, out, errs, extra)
  local unknown = {}
  for k in pairs(raw) do
    if type(k) ~= "string" then
      unknown[#unknown + 1] = (section.key == "" and "the top level" or section.key)
        .. ": unexpected list entry [" .. show(k) .. "] (a section takes named keys)"
    elseif not section.children[k] then
      unknown[#unknown + 1] = unknown_key((section.key == "" and "" or section.key .. ".") .. k, extra)
    end
  end
  table.sort(unknown)
  table.move(unknown, 1, #unknown, #errs + 1, errs)
  for _, node in ipairs(section.order) do
    local v = raw[node.name]
    if node.section then
      if v == nil then v = {} end
      if type(v) ~= "table" then
        errs[#errs + 1] = node.key .. ": expected a table (the section: " .. node.doc .. "), got " .. got(v)
      else
        out[node.name] = {}
        resolve_section(node, v, out[node.name], errs, extra)
      end
    elseif v == nil then
      out[node.name] = copy(node.default)
    else
      local value, err, at = node.type:check(v)
      if err then errs[#errs + 1] = node.key .. (at or "") .. ": " .. err end
      out[node.name] = value
    end
  end
end

local function set_key(cfg, key, value)
  local t = cfg
  local parts = {}
  for part in key:gmatch("[^.]+") do parts[#parts + 1] = part end
  for i = 1, #parts - 1 do t = rawget(t, parts[i]) end
  rawset(t, parts[#parts], value)
end

local function first_leaf(section)
  local node = section.order[1]
  return node.section and first_leaf(node) or node
end

-- One override onto a resolved table; returns an error message or nil.
local function apply_override(cfg, key, value, form, text, S)
  local node = S.nodes[key]
  if not node then return unknown_key(key, S.keys) end
  if node.section then
    return "'" .. key .. "' is a section; set one of its keys, such as '" .. first_leaf(node).key .. "'"
  end
  -- A bare --set name=2024 means the text when the key takes text.
  if node.type:takes_strings() and (form == "number" or form == "boolean") then
    value = text:match("^%s*(.-)%s*$")
  end
  local v, err, at = node.type:check(value)
  if err then return key .. (at or "") .. ": " .. err end
  set_key(cfg, key, v)
end

local function raise(errs, source)
  for i, e in ipairs(errs) do errs[i] = source .. ": " .. e end
  error(table.concat(errs, "\n"), 0)
end

-- overrides: a list of "key=value" strings (parsed as on the command line)
-- and/or a map of dotted keys to Lua values; returns a list of
-- {key, value, form, text, source}.
local function normalise_overrides(overrides)
  local list = {}
  if overrides == nil then return list end
  assert(type(overrides) == "table", "overrides must be a table")
  for _, s in ipairs(overrides) do
    local key, text = config.split_set(s)
    local ok, value, form = pcall(config.parse_value, text)
    if not ok then error("--set " .. s .. ": " .. value, 0) end
    list[#list + 1] = {key = key, value = value, form = form, text = text, source = "--set " .. s}
  end
  local keys = {}
  for k in pairs(overrides) do
    if type(k) == "string" then keys[#keys + 1] = k end
  end
  table.sort(keys)
  for _, k in ipairs(keys) do
    local v = overrides[k]
    list[#list + 1] = {key = k, value = v, form = "lua", text = tostring(v), source = "override " .. k .. " = " .. show(v)}
  end
  return list
end

---------------------------------------------------------------- a model's own keys

-- Where models/ is: the library's root (the cli sets it).
config.root = "."

-- The file model.arch names: a path as it is, else models/ARCH.lua under root (default config.root).
-- How long a FIFO a user names may take to show its writer (config.read_text): 10 s, or the
-- environment's DORMOUSE_FIFO_WAIT_MS
config.FIFO_WAIT_MS = math.tointeger(tonumber(os.getenv("DORMOUSE_FIFO_WAIT_MS") or "")) or 10000

--[[ The text of a file a user names to be read (a script, an experiment, a prompt): a regular file,
or a FIFO whose writer shows within FIFO_WAIT_MS (`dormouse run /dev/stdin` from a pipe; one that
nobody writes would wait forever). nil and why for anything else (a folder, a device), and for a
missing file (`missing` then true). ]]
function config.read_text(path)
  local core = require "dormouse.core"
  local kind = core.file_kind(path)
  if kind == "a FIFO" then
    local text, why = core.read_fifo(path, config.FIFO_WAIT_MS)
    if not text then return nil, string.format("%s is %s", path, why) end
    return text
  end
  if kind ~= "file" then return nil, string.format("%s is %s, not a file", path, kind), kind == "missing" end
  local f, err = io.open(path, "rb")
  if not f then return nil, err end
  local text = f:read("a")
  f:close()
  return text
end

-- loadfile of a Lua file a user names (config.read_text's rules); a missing file gets loadfile's message
function config.loadfile(path, ...)                 -- mode, env as loadfile takes them (an env given as nil is nil)
  local kind = require("dormouse.core").file_kind(path)
  if kind == "file" or kind == "missing" then return loadfile(path, ...) end
  local text, why = config.read_text(path)
  if not text then return nil, "cannot open " .. why end
  return load(text, "@" .. path, ...)
end

function config.model_path(arch, root)
  return arch:find("/") and arch or (root or config.root) .. "/models/" .. arch .. ".lua"
end

--[[ The schema a config resolves against: the runtime's, with the model
file's own keys under model when the file declares them (it returns
{keys = {rows}, build = function(model_cfg) ... end} instead of the bare
function; docs/models.md). The arch comes from the overrides, else the raw
table, else the default. A file that is not there adds nothing (building
the model reports it, with the names models/ holds). ]]
local function schema_for(raw, ovs)
  local runtime = {root = schema.root, nodes = schema.nodes}
  local arch = type(raw.model) == "table" and rawget(raw.model, "arch") or nil
  for _, o in ipairs(ovs) do if o.key == "model.arch" then arch = o.value end end
  if arch == nil then arch = schema.nodes["model.arch"].default end
  if type(arch) ~= "string" then return runtime end          -- the type check says what is wrong
  local path = config.model_path(arch)
  if require("dormouse.core").file_kind(path) == "missing" then return runtime end
  local chunk, err = config.loadfile(path)
  if not chunk then error(err, 0) end
  local ok, made = pcall(chunk)
  if not ok then error(tostring(made):find(path, 1, true) and made or path .. ": " .. tostring(made), 0) end
  if type(made) ~= "table" or made.keys == nil then return runtime end
  if type(made.keys) ~= "table" then error(path .. ": keys must be a list of {name, type, default, doc}", 0) end
  return schema.with_model_keys(made.keys, path)
end

--[[
config.resolve(raw, source_name [, overrides]) -> cfg, info
raw: the table an experiment returns. source_name names it in errors
("experiments/b1.lua"); a name ending in .lua also gives the default run
name. info = {source, overridden = {key = the --set text}, derived = {name = true}}.
]]
---------------------------------------------------------------- retired keys

local noted = {}

-- a retired key's note, once a process
local function note_retired(key, where)
  if noted[key] then return end
  noted[key] = true
  io.stderr:write(string.format("config: %s (%s) is retired and ignored: %s\n", key, where, schema.retired[key]))
end

-- raw without the retired keys it names (a copy where it names one), each noted once on stderr
local function without_retired(raw, source)
  local out = raw
  for key in pairs(schema.retired) do
    local parent, t, name = nil, out, nil
    for part in key:gmatch("[^.]+") do
      parent, name = t, part
      t = type(t) == "table" and rawget(t, part) or nil
    end
    if t ~= nil and parent then
      if out == raw then out = copy(raw) end        -- the caller's table stays as it is
      local p = out
      for part in key:gmatch("([^.]+)%.") do p = p[part] end
      p[name] = nil
      note_retired(key, "in " .. source)
    end
  end
  return out
end

function config.resolve(raw, source_name, overrides)
  local source = source_name or "config"
  if type(raw) ~= "table" then
    error(source .. ": a config must be a table, got " .. got(raw), 0)
  end
  raw = without_retired(raw, source)
  local cfg, errs = {}, {}
  local ovs = normalise_overrides(overrides)
  for i = #ovs, 1, -1 do
    if schema.retired[ovs[i].key] then
      note_retired(ovs[i].key, ovs[i].source)
      table.remove(ovs, i)
    end
  end
  local S = schema_for(raw, ovs)
  resolve_section(S.root, raw, cfg, errs, S.keys)
  if #errs > 0 then raise(errs, source) end

  local info = {source = source, overridden = {}, derived = {}, schema = S}
  if cfg.name == nil then
    cfg.name = source:match("([^/\\]+)%.lua$") or "run"
    info.derived.name = true
  end

  for _, o in ipairs(ovs) do
    local err = apply_override(cfg, o.key, o.value, o.form, o.text, S)
    if err then errs[#errs + 1] = o.source .. ": " .. err
    else info.overridden[o.key] = o.source; info.derived[o.key] = nil end
  end
  if #errs > 0 then error(table.concat(errs, "\n"), 0) end

  for _, check in ipairs(schema.checks) do
    local err = check(cfg)
    if err then errs[#errs + 1] = err end
  end
  if #errs > 0 then raise(errs, #ovs > 0 and source .. " with its overrides" or source) end
  return strict(cfg, S.root), info
end

---------------------------------------------------------------- load

--[[
config.load(path [, overrides]) -> cfg, info
Runs the experiment file in its own environment (globals readable, its own
globals kept to itself) and resolves the table it returns.
]]
function config.load(path, overrides)
  if type(path) ~= "string" then
    error("config.load: expected the path of an experiment file, got " .. got(path), 2)
  end
  local kind = require("dormouse.core").file_kind(path)
  if kind == "missing" then error(string.format("cannot open experiment file %s: No such file or directory", path), 0) end
  local env = setmetatable({}, {__index = _G})
  local chunk, err = config.loadfile(path, "t", env)
  if not chunk then error(err, 0) end                  -- "path:line: message"
  local results = table.pack(pcall(chunk))
  if not results[1] then
    local msg = results[2]
    if type(msg) ~= "string" then msg = path .. ": raised a " .. type(msg) .. " value" end
    if not msg:find(path, 1, true) then msg = path .. ": " .. msg end
    error(msg, 0)
  end
  if results.n < 2 then
    error(path .. ": the file returned nothing; an experiment ends with `return { ... }`", 0)
  end
  if type(results[2]) ~= "table" then
    error(path .. ": an experiment must return a table, got " .. got(results[2]), 0)
  end
  return config.resolve(results[2], path, overrides)
end

---------------------------------------------------------------- --set values

--[[
The value grammar of --set: 12, -2, 1e-3, .5, true, false, nil, "text" or
'text' (with \ escapes), bare text, and lists {1, 2, 3} or 1,2,3. A scalar
ends at a comma, a closing brace or the end; what is not a number, a
boolean or nil is text.
]]
local NIL = setmetatable({}, {__tostring = function() return "nil" end})
local far                                -- the furthest position reached, for the error offset

local value_grammar
do
  local P, R, S, C, Cc, Cs, Ct = lpeg.P, lpeg.R, lpeg.S, lpeg.C, lpeg.Cc, lpeg.Cs, lpeg.Ct
  local mark = P(function(_, i) if i > far then far = i end return i end)
  local sp = S" \t"^0
  local stop = #(sp * (S",}" + -1))
  local digits = R"09"^1
  local sign = S"+-"^-1
  local exponent = S"eE" * sign * digits
  local float = sign * (digits * "." * R"09"^0 + "." * digits) * exponent^-1 + sign * digits * exponent
  local number = (C(float + sign * digits) * stop) / function(s) return tonumber(s), "number" end
  local function word(w, v, form) return P(w) * stop * Cc(v, form) end
  local keyword = word("true", true, "boolean") + word("false", false, "boolean") + word("nil", NIL, "nil")
  local escapes = {n = "\n", t = "\t"}
  local function quoted(q)
    local char = (P"\\" * C(1)) / function(c) return escapes[c] or c end + (1 - S(q .. "\\"))
    return P(q) * Cs(char^0) * P(q) * Cc("string")
  end
  local bare = C((1 - S",{}\"' \t") * (1 - S",{}")^0) / function(s) return s:match("^(.-)%s*$"), "string" end
  local scalar = sp * (number + keyword + quoted('"') + quoted("'") + bare) * sp * mark
  local elem = scalar / function(v) return v end      -- drop the form inside lists
  local items = elem * ("," * mark * elem)^0
  local braced = "{" * mark * sp * Ct(items^-1) * sp * P","^-1 * sp * "}" * mark * Cc("list")
  local bare_list = Ct(elem * ("," * mark * elem)^1) * Cc("list")
  value_grammar = sp * (braced + bare_list + scalar) * sp * -1
end

local forms = '12, -2, 1e-3, .5, true, false, nil, "text", text, {1, 2}, 1,2'

-- config.parse_value(text) -> value, form ("number", "boolean", "nil", "string", "list"); raises on bad text.
function config.parse_value(text)
  if text:match("^%s*$") then
    error("empty value; write '' for the empty string, or nil", 0)
  end
  far = 1
  local value, form = value_grammar:match(text)
  if form == nil then
    error(("cannot parse the value %s at offset %d (forms: %s)"):format(show(text), far - 1, forms), 0)
  end
  if form == "list" then
    for i, v in ipairs(value) do
      if v == NIL then error("nil cannot be an entry of a list (entry " .. i .. " of " .. show(text) .. ")", 0) end
    end
  end
  if value == NIL then return nil, "nil" end
  return value, form
end

-- "a.b=v" -> "a.b", "v"
function config.split_set(s)
  local key, text = tostring(s):match("^([^=]*)=(.*)$")
  if not key then
    error("--set " .. tostring(s) .. ": expected KEY=VALUE, such as --set optim.muon_lr=1e-3", 0)
  end
  key = key:match("^%s*(.-)%s*$")
  for part in (key .. "."):gmatch("([^.]*)%.") do
    if not part:match("^[%a_][%w_]*$") then
      error("--set " .. s .. ": '" .. key .. "' is not a dotted key such as optim.muon_lr", 0)
    end
  end
  return key, text
end

---------------------------------------------------------------- the command line

--[[
config.parse_args(argv, first [, flags]) -> {file, overrides, flags}
Reads argv[first..]: one experiment file, any number of --set KEY=VALUE
(or --set=KEY=VALUE), and the flags named in `flags`: name -> true for a
bare --name, name -> "METAVAR" for --name VALUE or --name=VALUE. Default
flags: {resume = "DIR"}. out.flags[name] is true or the value.
]]
function config.parse_args(argv, first, flags)
  flags = flags or {resume = "DIR"}
  local out = {overrides = {}, flags = {}}
  local set_at = {}                          -- key -> the --set that gave it
  local i = first or 1
  local function known()
    local names = {"--set KEY=VALUE"}
    local sorted = {}
    for name in pairs(flags) do sorted[#sorted + 1] = name end
    table.sort(sorted)
    for _, name in ipairs(sorted) do
      names[#names + 1] = "--" .. name .. (flags[name] == true and "" or " " .. flags[name])
    end
    return table.concat(names, ", ")
  end
  while i <= #argv do
    local a = argv[i]
    local name, inline = a:match("^%-%-([^=]+)=(.*)$")
    name = name or a:match("^%-%-(.+)$")
    if name == "set" then
      local s = inline
      if not s then
        i = i + 1
        s = argv[i]
        if s == nil then error("--set needs KEY=VALUE, such as --set optim.muon_lr=1e-3", 0) end
      end
      local key = config.split_set(s)                  -- the form is checked now, the key at load
      if set_at[key] then                 -- which one was meant cannot be known: say so rather than pick
        error(string.format("--set %s is given twice (%s, then %s): give it once", key, set_at[key], s), 0)
      end
      set_at[key] = s
      out.overrides[#out.overrides + 1] = s
    elseif name then
      local kind = flags[name]
      if not kind then error("unknown flag --" .. name .. " (flags: " .. known() .. ")", 0) end
      if kind == true then
        if inline then error("--" .. name .. " takes no value", 0) end
        out.flags[name] = true
      else
        local v = inline
        if not v then
          i = i + 1
          v = argv[i]
          if v == nil or v:match("^%-%-") then error("--" .. name .. " needs a value", 0) end
        end
        out.flags[name] = v
      end
    elseif a:match("^%-") and a ~= "-" then
      error("unknown flag " .. a .. " (flags: " .. known() .. ")", 0)
    elseif out.file then
      error("one experiment file expected, got '" .. out.file .. "' and '" .. a .. "'", 0)
    else
      out.file = a
    end
    i = i + 1
  end
  return out
end

---------------------------------------------------------------- diff

local progress = {}
for _, leaf in ipairs(schema.leaves) do
  if leaf.progress then progress[#progress + 1] = leaf.key end
end
-- Keys a resume may change: how far a run goes and how it is observed.
config.progress_keys = progress

-- Keys a resume may change too: how the optimiser's state is stored (its state converted on load).
config.form_keys = {}
for _, leaf in ipairs(schema.leaves) do
  if leaf.form then config.form_keys[#config.form_keys + 1] = leaf.key end
end

-- The model keys a run started from a checkpoint's weights (init) may change.
config.tune_keys = {}
for _, leaf in ipairs(schema.leaves) do
  if leaf.tune then config.tune_keys[#config.tune_keys + 1] = leaf.key end
end

local function flatten(t, prefix, out)
  for k, v in pairs(t) do
    local key = prefix .. tostring(k)
    local node = schema.nodes[key]
    local leaf_value = type(v) ~= "table" or (node and not node.section)
                       or (not node and next(v) ~= nil and schema.is_list(v))
    if leaf_value then out[key] = v else flatten(v, key .. ".", out) end
  end
  return out
end

local function as_set(keys)
  local set = {}
  for k, v in pairs(keys) do
    if type(k) == "number" then set[v] = true else set[k] = v end
  end
  return set
end

local function ignored(set, key)
  if set[key] then return true end
  for i = #key, 1, -1 do                               -- a section ignores all it holds
    if key:sub(i, i) == "." and set[key:sub(1, i - 1)] then return true end
  end
  return false
end

--[[
config.diff(a, b [, ignore]) -> {{key =, a =, b =}, ...} in schema order
(keys the schema does not know last, sorted). ignore: a list or set of
dotted keys or sections; default config.progress_keys; {} compares all.
]]
function config.diff(a, b, ignore)
  local skip = as_set(ignore or progress)
  for key in pairs(schema.retired) do skip[key] = true end
  local fa, fb = flatten(a, "", {}), flatten(b, "", {})
  local keys, seen = {}, {}
  for _, f in ipairs {fa, fb} do
    for k in pairs(f) do
      if not seen[k] and not ignored(skip, k) then seen[k] = true; keys[#keys + 1] = k end
    end
  end
  local function rank(k)
    local node = schema.nodes[k]
    return node and node.index or math.huge
  end
  table.sort(keys, function(x, y)
    local rx, ry = rank(x), rank(y)
    if rx ~= ry then return rx < ry end
    return x < y
  end)
  local out = {}
  for _, k in ipairs(keys) do
    if not equal(fa[k], fb[k]) then out[#out + 1] = {key = k, a = fa[k], b = fb[k]} end
  end
  return out
end

-- Lines for a diff: "  optim.muon_lr: 0.001 (checkpoint) vs 0.002 (this run)".
function config.format_diff(d, label_a, label_b)
  local lines = {}
  for _, e in ipairs(d) do
    lines[#lines + 1] = ("  %s: %s (%s) vs %s (%s)"):format(e.key, show(e.a), label_a or "a", show(e.b), label_b or "b")
  end
  return table.concat(lines, "\n")
end

---------------------------------------------------------------- describe

local function sections(section, list)
  list[#list + 1] = section
  for _, node in ipairs(section.order) do
    if node.section then sections(node, list) end
  end
  return list
end

--[[
config.describe(cfg [, info]) -> text: every key with its value, aligned,
grouped by section, the doc line as a comment; `*` marks a value that
differs from the default (shown in the comment), [--set] one set on the
command line.
]]
-- A plain deep copy of a resolved config (no strict metatables), for files and checkpoints.
function config.plain(cfg) return copy(cfg) end

--[[ config.upgrade(raw) -> a copy of a checkpoint's config naming every key of schema.introduced:
what the code did before the key existed, where the checkpoint does not name it. ]]
function config.upgrade(raw)
  local out = copy(raw)
  if type(out) ~= "table" then return out end
  for key, was in pairs(schema.introduced) do
    local t, path = out, {}
    for part in key:gmatch("[^.]+") do path[#path + 1] = part end
    for i = 1, #path - 1 do
      if type(t[path[i]]) ~= "table" then t = nil; break end
      t = t[path[i]]
    end
    if t and t[path[#path]] == nil then
      local ok, v = pcall(function() if type(was) == "function" then return was(raw) end return was end)
      if ok then t[path[#path]] = v end
    end
  end
  return out
end

function config.describe(cfg, info)
  info = info or {overridden = {}, derived = {}}
  local rows, wkey, wval = {}, 0, 0
  local S = info.schema or schema_for(cfg, {})                 -- a model's own keys too
  for _, section in ipairs(sections(S.root, {})) do
    local leaves = {}
    for _, node in ipairs(section.order) do
      if not node.section then leaves[#leaves + 1] = node end
    end
    if #leaves > 0 then
      rows[#rows + 1] = {header = section.key == "" and "run" or section.key .. ": " .. section.doc}
      local t = cfg
      for part in section.key:gmatch("[^.]+") do t = rawget(t, part) end
      for _, leaf in ipairs(leaves) do
        local v = rawget(t, leaf.name)
        local differs = not equal(v, leaf.default) and not (info.derived or {})[leaf.key]
        local note = differs and " (default " .. show(leaf.default) .. ")" or ""
        if (info.overridden or {})[leaf.key] then note = note .. " [--set]" end
        local row = {key = leaf.key, value = show(v), mark = differs and "*" or " ", doc = leaf.doc .. note}
        rows[#rows + 1] = row
        wkey = math.max(wkey, #row.key)
        wval = math.min(math.max(wval, #row.value), 24)
      end
    end
  end
  local n = 0
  for _ in pairs(info.overridden or {}) do n = n + 1 end
  local out = {("-- %s%s, resolved; * marks a value that differs from the default")
               :format(info.source or "config", n > 0 and " with " .. n .. " override" .. (n > 1 and "s" or "") or "")}
  for _, row in ipairs(rows) do
    if row.header then
      out[#out + 1] = ""
      out[#out + 1] = "-- " .. row.header
    else
      out[#out + 1] = ("%-" .. wkey .. "s = %-" .. wval .. "s %s -- %s"):format(row.key, row.value, row.mark, row.doc)
    end
  end
  return table.concat(out, "\n") .. "\n"
end

return config
