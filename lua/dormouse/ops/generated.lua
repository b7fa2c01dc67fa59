--[[
The ops whose descriptors give them their Lua function (vm/core/ops.h: .lua,
.args). Such an op has no Lua file of its own:

  dm.NAME(inputs..., attributes...)    DM_LUA_FN
  dm.NAME(inputs..., {name = value})   the attributes by name instead
  x:NAME(...)                          DM_LUA_METHOD: that, and a method of its first input

The inputs come in the order of the descriptor's args ("x [E, m, n], row [E,
m, 1]": each name, then its shape for the docs), each a tensor (or nil where
the descriptor makes it optional), then the attributes in the order of its
attrs, an enum attribute by its spelling ("format=a|b"), or one table of
them by name. A trailing attribute left out is the op's default; one left
out before a given one is an error. `dormouse meta FILE` writes the editor lines (LuaLS)
of these functions from the same descriptors (generated.luals); `make`
writes build/meta/ops.lua, which .luarc.json reads.
]]
local M = {}

-- "x [E, m, n], row [E, m, 1]" → {{name = "x", shape = "[E, m, n]"}, {name = "row", ...}}
function M.parse_args(args)
  local inputs, at = {}, 1
  while at <= #args do
    local name, stop = args:match("^%s*([%a_][%w_]*)()", at)
    if not name then error(string.format("args '%s': expected a name at %d", args, at), 0) end
    local shape, after = args:match("^%s*(%b[])()", stop)
    inputs[#inputs + 1] = {name = name, shape = shape}
    at = after or stop
    local comma = args:match("^%s*,()", at)
    if comma then at = comma
    elseif args:match("^%s*$", at) then break
    else error(string.format("args '%s': expected ',' at %d", args, at), 0) end
  end
  return inputs
end

-- the descriptor's promises checked once, at load: a defect here is the op's, not a caller's
local function check(op, inputs)
  local function bad(msg) error(string.format("op %s: %s", op.name, msg), 0) end
  if op.n_in < 0 then bad("a variadic op takes its own Lua function") end
  if #inputs ~= op.n_in then bad(string.format("args names %d inputs, the op takes %d", #inputs, op.n_in)) end
  if op.attrs:find("list=", 1, true) then bad("an op with a list attribute takes its own Lua function") end
end

-- the attributes given by name in opts, placed in args after the n_in inputs
local function named(core, op, args, n_in, opts)
  local at = {}
  for i, name in ipairs(op.attr_names) do at[name] = i end
  for key, v in pairs(opts) do
    if not at[key] then
      core.error(string.format("%s: unknown option '%s' (it takes %s)", op.name, tostring(key),
                               #op.attr_names > 0 and table.concat(op.attr_names, ", ") or "none"))
    end
    args[n_in + 1 + at[key]] = v
  end
end

local function wrapper(core, op, inputs)
  local n_in, names = op.n_in, op.attr_names
  local most = n_in + #names
  local tensor_mt = core.metatable
  return function(...)
    local args = table.pack(op.name, ...)
    local n = args.n - 1
    while n > 0 and args[n + 1] == nil do n = n - 1 end      -- trailing nils are arguments left out
    local opts = args[n_in + 2]
    if n == n_in + 1 and type(opts) == "table" and getmetatable(opts) ~= tensor_mt then
      args[n_in + 2] = nil
      named(core, op, args, n_in, opts)
      n = most
      while n > 0 and args[n + 1] == nil do n = n - 1 end
    end
    for i, input in ipairs(inputs) do
      local v = args[i + 1]
      if v ~= nil and getmetatable(v) ~= tensor_mt then
        core.error(string.format("%s: %s (input %d of %s) must be a tensor%s, got %s", op.name, input.name, i,
                                 op.args, op.optional[i] and " or nil" or "", type(v)))
      end
    end
    if n > most then
      core.error(string.format("%s: takes %d tensors (%s) and %d attributes (%s), got %d arguments", op.name,
                               n_in, op.args, #names, table.concat(names, ", "), n))
    end
    for i, input in ipairs(inputs) do
      if args[i + 1] == nil and not op.optional[i] then
        core.error(string.format("%s: %s (input %d of %s) is missing", op.name, input.name, i, op.args))
      end
    end
    local attrs, last = {}, 0
    for i = 1, #names do if args[n_in + 1 + i] ~= nil then last = i end end
    for i = 1, last do
      local v = args[n_in + 1 + i]
      if v == nil then
        core.error(string.format("%s: %s is left out but %s is given", op.name, names[i], names[last]))
      end
      attrs[i] = v
    end
    args[n_in + 2] = attrs
    return core.call(table.unpack(args, 1, n_in + 2))
  end
end

-- the ops with a generated function, each with its inputs
function M.ops(core)
  local list = {}
  for _, op in ipairs(core.ops()) do
    if op.lua then
      local inputs = M.parse_args(op.args or "")
      check(op, inputs)
      list[#list + 1] = {op = op, inputs = inputs}
    end
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
    dm[name] = wrapper(core, g.op, g.inputs)
    if g.op.lua == "method" then
      if rawget(T, name) ~= nil and not made_here(rawget(T, name)) then error(string.format("op %s: Tensor:%s exists already", name, name), 0) end
      T[name] = dm[name]
    end
  end
end

-- the LuaLS type of attribute i of op
local function attr_type(op, name)
  local words = op.spellings[name]
  if not words then return "number" end
  local quoted = {}
  for i, w in ipairs(words) do quoted[i] = string.format("%q", w) end
  return table.concat(quoted, "|")
end

local function lines_of(op, inputs, self)
  local out, params = {"---" .. op.doc .. (op.doc:find("%.$") and "" or ".")}, {}
  for i, input in ipairs(inputs) do
    if not (self and i == 1) then
      out[#out + 1] = string.format("---@param %s%s dormouse.Tensor%s", input.name, op.optional[i] and "?" or "",
                                    input.shape and " " .. input.shape or "")
      params[#params + 1] = input.name
    end
  end
  for _, name in ipairs(op.attr_names) do
    out[#out + 1] = string.format("---@param %s? %s", name, attr_type(op, name))
    params[#params + 1] = name
  end
  for _ = 1, op.n_out do out[#out + 1] = "---@return dormouse.Tensor" end
  if #op.attr_names > 0 then                       -- the attributes by name
    local fields, args = {}, {}
    for _, name in ipairs(op.attr_names) do fields[#fields + 1] = name .. "?: " .. attr_type(op, name) end
    for i, input in ipairs(inputs) do
      if not (self and i == 1) then args[#args + 1] = input.name .. (op.optional[i] and "?" or "") .. ": dormouse.Tensor" end
    end
    args[#args + 1] = "opts: {" .. table.concat(fields, ", ") .. "}"
    local rets = {}
    for _ = 1, op.n_out do rets[#rets + 1] = "dormouse.Tensor" end
    out[#out + 1] = string.format("---@overload fun(%s%s): %s", self and "self: dormouse.Tensor, " or "",
                                  table.concat(args, ", "), table.concat(rets, ", "))
  end
  out[#out + 1] = string.format("function %s%s(%s) end", self and "Tensor:" or "dm.", op.name,
                                table.concat(params, ", "))
  return table.concat(out, "\n")
end

-- the editor lines of every generated function, a LuaLS meta file
function M.luals(core)
  local parts = {"---@meta dormouse_ops\n-- Written by `dormouse meta` from the ops' descriptors (vm/ops/*.c); not by hand.\n" ..
                 "---@class dormouse\nlocal dm = {}\n---@class dormouse.Tensor\nlocal Tensor = {}"}
  for _, g in ipairs(M.ops(core)) do
    parts[#parts + 1] = lines_of(g.op, g.inputs, false)
    if g.op.lua == "method" then parts[#parts + 1] = lines_of(g.op, g.inputs, true) end
  end
  return table.concat(parts, "\n\n") .. "\n"
end

return M
