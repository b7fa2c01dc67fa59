-- lua/dormouse/ops/generated.lua: the Lua functions and editor lines the ops' descriptors give them
local dm = require "dormouse"
local generated = require "dormouse.ops.generated"
local helpers = require "tests.lua.helpers"
local has, err_of = helpers.has, helpers.err_of

-- a core holding only `ops`, whose calls are recorded; its tensors are tables of metatable MT
local MT = {}
local function fake_tensor(name) return setmetatable({name = name}, MT) end
local A, B = fake_tensor("a"), fake_tensor("b")
local function fake_core(ops)
  local calls = {}
  return {
    metatable = MT,
    ops = function() return ops end,
    call = function(...) calls[#calls + 1] = table.pack(...); return "out" end,
    error = function(msg) error(msg, 0) end,
  }, calls
end

local function op(fields)
  local o = {name = "blend", doc = "a blend", attrs = "mode=add|mul,scale", attr_names = {"mode", "scale"},
             spellings = {mode = {"add", "mul"}}, n_in = 2, n_out = 1, optional = {false, true},
             lua = "function", args = "a [n], b [n]"}
  for k, v in pairs(fields or {}) do o[k] = v end
  return o
end

describe("generated.parse_args", function()
  it("reads names, each with its shape", function()
    assert.same({{name = "x", shape = "[E, m, n]"}, {name = "row", shape = "[E, m, 1]"}, {name = "s"}},
                generated.parse_args("x [E, m, n], row [E, m, 1], s"))
    assert.same({}, generated.parse_args(""))
  end)

  it("refuses what is not a list of names", function()
    has(err_of(generated.parse_args, "x [n] y"), "expected ','")
    has(err_of(generated.parse_args, "x, 3"), "expected a name")
  end)
end)

describe("a generated function", function()
  it("passes the inputs, then the attributes in order, leaving out the trailing ones", function()
    local core, calls = fake_core({op()})
    local dm_, T = {}, {}
    generated.install(dm_, T, core)
    assert.is_nil(T.blend)                                       -- a function, not a method
    assert.equal("out", dm_.blend(A, B, "mul", 3))
    dm_.blend(A, nil)
    dm_.blend(A, B, "add")
    assert.same({n = 4, "blend", A, B, {"mul", 3}}, calls[1])
    assert.same({n = 4, "blend", A, nil, {}}, calls[2])
    assert.same({n = 4, "blend", A, B, {"add"}}, calls[3])
  end)

  it("takes the attributes by name in a table after the inputs", function()
    local core, calls = fake_core({op()})
    local dm_ = {}
    generated.install(dm_, {}, core)
    dm_.blend(A, B, {mode = "add"})
    dm_.blend(A, nil, {mode = "mul", scale = 2})
    dm_.blend(A, B, {})
    assert.same({n = 4, "blend", A, B, {"add"}}, calls[1])
    assert.same({n = 4, "blend", A, nil, {"mul", 2}}, calls[2])
    assert.same({n = 4, "blend", A, B, {}}, calls[3])
    has(err_of(dm_.blend, A, B, {sclae = 3}), "blend: unknown option 'sclae' (it takes mode, scale)")
    has(err_of(dm_.blend, A, B, {scale = 3}), "blend: mode is left out but scale is given")   -- as in order
  end)

  it("names what is wrong: a missing input, too many arguments, an attribute left out before a given one", function()
    local core = fake_core({op()})
    local dm_ = {}
    generated.install(dm_, {}, core)
    has(err_of(dm_.blend, nil, B), "blend: a (input 1 of a [n], b [n]) is missing")
    has(err_of(dm_.blend, A, B, "add", 1, 5), "blend: takes 2 tensors (a [n], b [n]) and 2 attributes (mode, scale), got 5 arguments")
    dm_.blend(A, B, "add", 1, nil, nil)                            -- trailing nils are arguments left out
    has(err_of(dm_.blend, A, B, nil, 3), "blend: mode is left out but scale is given")
    has(err_of(dm_.blend, 1, B), "blend: a (input 1 of a [n], b [n]) must be a tensor, got number")
    has(err_of(dm_.blend, A, "add"), "blend: b (input 2 of a [n], b [n]) must be a tensor or nil, got string")
  end)

  it("is a method too when the descriptor says so, and never replaces one written by hand", function()
    local T = {}
    generated.install({}, T, fake_core({op({lua = "method"})}))
    assert.is_function(T.blend)
    has(err_of(generated.install, {blend = print}, {}, fake_core({op()})),
        "op blend: dm.blend is written by hand and generated from the descriptor")
    has(err_of(generated.install, {}, {blend = print}, fake_core({op({lua = "method"})})),
        "op blend: Tensor:blend exists already")
    generated.install({}, T, fake_core({op({lua = "method"})}))  -- its own, again: a reload of the library
  end)

  it("refuses a descriptor whose args do not name its inputs, or that it cannot call", function()
    has(err_of(generated.install, {}, {}, fake_core({op({args = "a [n]"})})), "op blend: args names 1 inputs, the op takes 2")
    has(err_of(generated.install, {}, {}, fake_core({op({n_in = -1})})), "op blend: a variadic op")
    has(err_of(generated.install, {}, {}, fake_core({op({attrs = "list=shape", attr_names = {"shape"}})})),
        "op blend: an op with a list attribute")
  end)

  it("is what dm.littlebit is: the op itself", function()
    local x, r, c = dm.randn({2, 3, 5}, {seed = 1}), dm.randn({2, 3, 1}, {seed = 2}), dm.randn({2, 1, 5}, {seed = 3})
    assert.is_true(dm.allclose(dm.littlebit(x, r, c), dm.core.call("littlebit", x, r, c), {rtol = 0, atol = 0}))
    has(err_of(dm.littlebit, x, r), "littlebit: col (input 3 of x [E, m, n], row [E, m, 1], col [E, 1, n]) is missing")
  end)
end)

describe("the generated editor lines", function()
  it("are a LuaLS meta file: each function with its doc, typed inputs and attributes", function()
    local text = generated.luals(fake_core({op({lua = "method"})}))
    assert.is_function(load(text))
    has(text, "---a blend.\n---@param a dormouse.Tensor [n]\n---@param b? dormouse.Tensor [n]\n" ..
              "---@param mode? \"add\"|\"mul\"\n---@param scale? number\n---@return dormouse.Tensor\n" ..
              "---@overload fun(a: dormouse.Tensor, b?: dormouse.Tensor, opts: {mode?: \"add\"|\"mul\", scale?: number}): " ..
              "dormouse.Tensor\nfunction dm.blend(a, b, mode, scale) end")
    has(text, "function Tensor:blend(b, mode, scale) end")
  end)

  it("are written by `dormouse meta FILE`, through a temporary name", function()
    local dir = os.tmpname()
    os.remove(dir)
    local file = dir .. "/meta/ops.lua"
    local cli = require "dormouse.cli"
    local run = cli.command("meta")
    assert.equal(0, run({[0] = "dormouse", "meta", file}))
    local f = assert(io.open(file))
    local text = f:read("a")
    f:close()
    assert.equal(generated.luals(dm.core), text)
    has(text, "function dm.littlebit(x, row, col) end")
    assert.equal(2, run({[0] = "dormouse", "meta"}))
    os.remove(file); os.remove(dir .. "/meta"); os.remove(dir)
  end)
end)
