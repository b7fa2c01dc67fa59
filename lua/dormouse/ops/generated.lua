--[[
The ops whose descriptors give them their Lua function (vm/core/ops.h: .lua,
.args, .attrs). Such an op has no Lua file of its own:

  dm.NAME(inputs..., attributes...)    DM_LUA_FN
  dm.NAME(inputs..., {name = value})   the attributes by name instead
  x:NAME(...)                          DM_LUA_METHOD: that, and a method of its first input

The arguments come in the order of the descriptor's args ("x [E, m, n], row [E,
m, 1]": each name, then its shape for the docs), each a tensor (or nil where
the descriptor makes it optional; "b:number": a number too, which becomes a
0-dim tensor of the other such input's dtype and device); an attribute named
in args takes that place ("x, dim, idx"). Then the rest of the attributes in
the order of attrs, or one table of them by name. Each attribute is what its
kind says (vm/core/ops.h, dm_attr_decl): a number, a whole number, a boolean,
a dim (1-based, negative from the end, of the first input), a position
(1-based), a dtype's name, one of an enum's words, or a list (a table, or the
numbers themselves when it comes last: x:reshape(2, 3)). An attribute left out
takes the descriptor's default (the op fills it in); one without a default is
required. An attribute declared "@v" is v from Lua and no argument (base@1:
positions count from 1). `dormouse meta FILE` writes the editor lines (LuaLS)
of these functions from the same descriptors (generated.luals); `make` writes
build/meta/ops.lua, which .luarc.json reads.
]]
local M = {}

-- "x [E, m, n], b:number [E]" → {{name = "x", shape = "[E, m, n]"}, {name = "b", number = true, shape = "[E]"}}
function M.parse_args(args)
  local entries, at = {}, 1
  while at <= #args do
    local name, stop = args:match("^%s*([%a_][%w_]*)()", at)
    if not name then error(string.format("args '%s': expected a name at %d", args, at), 0) end
    local entry = {name = name}
    local kind, after_kind = args:match("^:(%a+)()", stop)
    if kind then
      if kind ~= "number" then error(string.format("args '%s': unknown input kind '%s' (number)", args, kind), 0) end
      entry.number, stop = true, after_kind
    end
    local shape, after = args:match("^%s*(%b[])()", stop)
    entry.shape = shape
    entries[#entries + 1] = entry
    at = after or stop
    local comma = args:match("^%s*,()", at)
    if comma then at = comma
    elseif args:match("^%s*$", at) then break
    else error(string.format("args '%s': expected ',' at %d", args, at), 0) end
  end
  return entries
end

-- The function's parameters in Lua's order: the args' entries (inputs, and attributes named there), then
-- the other attributes Lua passes (not "@v") in the order of attrs. Checked once, at load: a defect here
-- is the op's, not a caller's.
local function signature(op)
  local function bad(msg) error(string.format("op %s: %s", op.name, msg), 0) end
  if op.n_in < 0 then bad("a variadic op takes its own Lua function") end
  local decl_of, params, inputs, placed = {}, {}, {}, {}
  for j, d in ipairs(op.attr_decls) do decl_of[d.name] = j end
  for _, e in ipairs(M.parse_args(op.args or "")) do
    local j = decl_of[e.name]
    if j then
      if op.attr_decls[j].fixed then bad(string.format("args names %s, which Lua does not pass", e.name)) end
      params[#params + 1] = {attr = j, name = e.name}
      placed[j] = true
    else
      inputs[#inputs + 1] = e
      params[#params + 1] = {input = #inputs, name = e.name, number = e.number, shape = e.shape}
    end
  end
  if #inputs ~= op.n_in then bad(string.format("args names %d inputs, the op takes %d", #inputs, op.n_in)) end
  for j, d in ipairs(op.attr_decls) do
    if not placed[j] and not d.fixed then params[#params + 1] = {attr = j, name = d.name} end
  end
  for k, p in ipairs(params) do
    if p.attr and op.attr_decls[p.attr].list and k ~= #params then bad("the list attribute is the last argument") end
  end
  return {params = params, inputs = inputs}
end

-- a table of attributes by name rather than a list attribute's values
local function is_options(v, param, decls, tensor_mt)
  if type(v) ~= "table" or getmetatable(v) == tensor_mt then return false end
  if param and param.attr and decls[param.attr].list then return next(v) ~= nil and v[1] == nil end
  return true
end

local function words_of(d) return table.concat(d.words, "|") end

-- attribute value v (given by Lua) in the op's units, by its declared kind
-- a value as a message shows it: numbers and booleans as they are, strings quoted, the rest by type
local function shown(v)
  if type(v) == "string" then return "'" .. v .. "'" end
  if type(v) == "number" or type(v) == "boolean" then return tostring(v) end
  return type(v) == "table" and "a table" or type(v)
end

local function convert(core, op, d, v, first)
  local function need(ok, what)
    if not ok then core.error(string.format("%s: %s must be %s, got %s", op.name, d.name, what, shown(v))) end
  end
  local function whole(x) return math.type(x) == "integer" or (type(x) == "number" and x == math.floor(x)) end
  if d.words then
    need(type(v) == "string", "one of " .. words_of(d))
    return v
  end
  local kind = d.kind
  if d.list then
    need(type(v) == "table", "a list of integers such as {2, 3}")
    local out = {}
    for i, x in ipairs(v) do
      if not whole(x) then
        core.error(string.format("%s: %s entry %d must be an integer, got %s", op.name, d.name, i, shown(x)))
      end
      out[i] = kind == "dim" and first:_dim0(math.tointeger(x) or x, op.name) or x
    end
    return out
  end
  if kind == "number" then need(type(v) == "number", "a number")
  elseif kind == "bool" then need(type(v) == "boolean", "true or false")
  elseif kind == "dtype" then
    local code = type(v) == "string" and core.dtype_code(v)
    if not code then
      core.error(string.format("%s: unknown dtype %s (%s)", op.name, shown(v), table.concat(core.dtype_names(), " ")))
    end
    return code
  else
    need(whole(v), kind == "int" and "a whole number" or "an integer")
    v = math.tointeger(v) or v
    if kind == "dim" then return first:_dim0(v, op.name)
    elseif kind == "pos" then return v - 1
    elseif kind == "newdim" then
      local n = first:dim()
      local place = v < 0 and n + 2 + v or v
      if place < 1 or place > n + 1 then
        core.error(string.format("%s: dim %d is out of range for a new dim among %d (1..%d, or negative)",
                                 op.name, v, n, n + 1))
      end
      return place - 1
    end
  end
  return v
end

-- the inputs given as numbers, as 0-dim tensors like the first such input given as a tensor
local function numbers_to_tensors(core, op, sig, values)
  local like
  for _, p in ipairs(sig.params) do
    if p.input and p.number and getmetatable(values[p.input]) == core.metatable then like = values[p.input]; break end
  end
  for _, p in ipairs(sig.params) do
    if p.input and p.number and type(values[p.input]) == "number" then
      if not like then
        local names = {}
        for _, q in ipairs(sig.params) do if q.input and q.number then names[#names + 1] = q.name end end
        core.error(string.format("%s: %s must be a tensor", op.name, table.concat(names, " or ")))
      end
      values[p.input] = core.full({}, values[p.input], like.dtype, like.device)
    end
  end
end

local function wrapper(core, op, sig)
  local params, decls, tensor_mt = sig.params, op.attr_decls, core.metatable
  local last_input = 0
  for k, p in ipairs(params) do if p.input then last_input = k end end
  local args_text = (op.args or ""):gsub(":number", "")
  local attr_list = {}
  for _, p in ipairs(params) do if p.attr then attr_list[#attr_list + 1] = p.name end end
  return function(...)
    local args = table.pack(...)
    local n = args.n
    while n > 0 and args[n] == nil do n = n - 1 end            -- trailing nils are arguments left out
    local given = {}                                            -- by param
    local last_param = params[#params]
    if last_param and last_param.attr and decls[last_param.attr].list and n >= #params
       and type(args[#params]) == "number" then                 -- a list given as its numbers
      local list = {}
      for k = #params, n do
        if args[k] == nil then
          core.error(string.format("%s: %s entry %d must be an integer, got nil", op.name, last_param.name, k - #params + 1))
        end
        list[#list + 1] = args[k]
      end
      given[#params] = list
      n = #params - 1
    elseif n == last_input + 1 and n <= #params + 1 and is_options(args[n], params[n], decls, tensor_mt) then
      local opts = args[n]
      n = n - 1
      for key, v in pairs(opts) do
        local at
        for k, p in ipairs(params) do if p.attr and p.name == key then at = k end end
        if not at then
          core.error(string.format("%s: unknown option '%s' (it takes %s)", op.name, tostring(key),
                                   #attr_list > 0 and table.concat(attr_list, ", ") or "none"))
        end
        given[at] = v
      end
    end
    if n > #params then
      core.error(string.format("%s: takes %d tensors (%s) and %d attributes (%s), got %d arguments", op.name,
                               op.n_in, args_text, #attr_list, table.concat(attr_list, ", "), n))
    end
    for k = 1, n do if args[k] ~= nil then given[k] = args[k] end end
    local values, attrs = {}, {}
    for k, p in ipairs(params) do
      local v = given[k]
      if p.input then
        local ok = v == nil and op.optional[p.input] or getmetatable(v) == tensor_mt or (p.number and type(v) == "number")
        if v == nil and not ok then
          core.error(string.format("%s: %s (input %d of %s) is missing", op.name, p.name, p.input, args_text))
        elseif not ok then
          core.error(string.format("%s: %s (input %d of %s) must be a tensor%s, got %s", op.name, p.name, p.input,
                                   args_text, p.number and " or a number" or op.optional[p.input] and " or nil" or "",
                                   type(v)))
        end
        values[p.input] = v
      end
    end
    numbers_to_tensors(core, op, sig, values)
    local first = values[1]
    local last = 0
    for j, d in ipairs(decls) do if d.fixed and not d.list then attrs[j] = d.fixed; last = j end end
    for k, p in ipairs(params) do
      if p.attr and given[k] ~= nil then
        local d = decls[p.attr]
        if d.list then attrs.list = convert(core, op, d, given[k], first)
        else attrs[p.attr] = convert(core, op, d, given[k], first); last = math.max(last, p.attr) end
      end
    end
    for j = 1, last do
      if attrs[j] == nil then
        local d = decls[j]
        if d.default == nil then
          local after
          for i = j + 1, last do if attrs[i] ~= nil and not decls[i].fixed then after = decls[i].name; break end end
          core.error(after and string.format("%s: %s is left out but %s is given", op.name, d.name, after)
                     or string.format("%s: %s is missing", op.name, d.name))
        end
        attrs[j] = d.default
      end
    end
    for k, p in ipairs(params) do
      local d = p.attr and decls[p.attr]
      if d and given[k] == nil and d.default == nil then
        core.error(string.format("%s: %s is missing%s", op.name, d.name, d.words and " (one of " .. words_of(d) .. ")" or ""))
      end
    end
    values[op.n_in + 1] = attrs
    return core.call(op.name, table.unpack(values, 1, op.n_in + 1))
  end
end

-- the default the descriptor of op_name declares for its attribute attr (for a function written by hand)
function M.default(core, op_name, attr)
  for _, op in ipairs(core.ops()) do
    if op.name == op_name then
      for _, d in ipairs(op.attr_decls) do
        if d.name == attr then return assert(d.default, op_name .. "." .. attr .. " declares no default") end
      end
    end
  end
  error(string.format("op %s has no attribute %s", op_name, attr), 0)
end

-- the ops with a generated function, each with its signature
function M.ops(core)
  local list = {}
  for _, op in ipairs(core.ops()) do
    if op.lua then list[#list + 1] = {op = op, sig = signature(op)} end
  end
  return list
end

-- whether f is a function this file made (the methods table outlives a reload of the library)
local here = debug.getinfo(1, "S").source
local function made_here(f) return type(f) == "function" and debug.getinfo(f, "S").source == here end

function M.install(dm, T, core)
  for _, g in ipairs(M.ops(core)) do
    local name = g.op.name
    if rawget(dm, name) ~= nil then
      error(string.format("op %s: dm.%s is written by hand and generated from the descriptor", name, name), 0)
    end
    dm[name] = wrapper(core, g.op, g.sig)
    if g.op.lua == "method" then
      if rawget(T, name) ~= nil and not made_here(rawget(T, name)) then error(string.format("op %s: Tensor:%s exists already", name, name), 0) end
      T[name] = dm[name]
    end
  end
end

-- the LuaLS type of an attribute
local LUALS_KIND = {number = "number", int = "integer", bool = "boolean", dim = "integer", newdim = "integer",
                    pos = "integer", dtype = "string"}
local function attr_type(d)
  if d.words then
    local quoted = {}
    for i, w in ipairs(d.words) do quoted[i] = string.format("%q", w) end
    return table.concat(quoted, "|")
  end
  if d.list then return "integer[]" end
  return LUALS_KIND[d.kind]
end

local function lines_of(op, sig, self)
  local out, names, typed = {"---" .. op.doc .. (op.doc:find("%.$") and "" or ".")}, {}, {}, {}
  for k, p in ipairs(sig.params) do
    if not (self and k == 1) then
      local name, ty, optional
      if p.input then
        name, optional = p.name, op.optional[p.input]
        ty = "dormouse.Tensor" .. (p.number and "|number" or "")
        out[#out + 1] = string.format("---@param %s%s %s%s", name, optional and "?" or "", ty, p.shape and " " .. p.shape or "")
      else
        local d = op.attr_decls[p.attr]
        name, optional, ty = p.name, d.default ~= nil, attr_type(d)
        if d.list and k == #sig.params then ty = ty .. "|integer" end
        out[#out + 1] = string.format("---@param %s%s %s", name, optional and "?" or "", ty)
      end
      names[#names + 1] = name
      typed[#typed + 1] = {name = name, optional = optional, ty = ty, input = p.input ~= nil}
    end
  end
  local last = sig.params[#sig.params]
  if last and last.attr and op.attr_decls[last.attr].list then
    out[#out + 1] = "---@param ... integer"
    names[#names + 1] = "..."
  end
  for _ = 1, op.n_out do out[#out + 1] = "---@return dormouse.Tensor" end
  local has_options = false
  for k, p in ipairs(sig.params) do if p.attr and not (self and k == 1) then has_options = true end end
  if has_options then                              -- the attributes after the inputs by name
    local args, last_input = {}, 0
    for k, p in ipairs(sig.params) do if p.input then last_input = k end end
    for k = (self and 2 or 1), last_input do
      local t = typed[k - (self and 1 or 0)]
      args[#args + 1] = t.name .. (t.optional and "?" or "") .. ": " .. t.ty
    end
    local opts = {}
    for k = last_input + 1, #sig.params do
      local d = op.attr_decls[sig.params[k].attr]
      opts[#opts + 1] = d.name .. "?: " .. attr_type(d)
    end
    if #opts > 0 then
      args[#args + 1] = "opts: {" .. table.concat(opts, ", ") .. "}"
      local rets = {}
      for _ = 1, op.n_out do rets[#rets + 1] = "dormouse.Tensor" end
      out[#out + 1] = string.format("---@overload fun(%s%s): %s", self and "self: dormouse.Tensor, " or "",
                                    table.concat(args, ", "), table.concat(rets, ", "))
    end
  end
  out[#out + 1] = string.format("function %s%s(%s) end", self and "Tensor:" or "dm.", op.name, table.concat(names, ", "))
  return table.concat(out, "\n")
end

-- the editor lines of every generated function, a LuaLS meta file
function M.luals(core)
  local parts = {"---@meta dormouse_ops\n-- Written by `dormouse meta` from the ops' descriptors (vm/ops/*.c); not by hand.\n" ..
                 "---@class dormouse\nlocal dm = {}\n---@class dormouse.Tensor\nlocal Tensor = {}"}
  for _, g in ipairs(M.ops(core)) do
    parts[#parts + 1] = lines_of(g.op, g.sig, false)
    if g.op.lua == "method" then parts[#parts + 1] = lines_of(g.op, g.sig, true) end
  end
  return table.concat(parts, "\n\n") .. "\n"
end

return M
