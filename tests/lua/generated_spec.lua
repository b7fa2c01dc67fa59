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
  local o = {name = "blend", doc = "a blend", attrs = "mode=add|mul,scale~1", attr_names = {"mode", "scale"},
             attr_decls = {{name = "mode", kind = "number", words = {"add", "mul"}, list = false},
                           {name = "scale", kind = "number", default = 1, list = false}},
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
    dm_.blend(A, nil, "mul")
    dm_.blend(A, B, "add")
    assert.same({n = 4, "blend", A, B, {"mul", 3}}, calls[1])
    assert.same({n = 4, "blend", A, nil, {"mul"}}, calls[2])
    assert.same({n = 4, "blend", A, B, {"add"}}, calls[3])
    has(err_of(dm_.blend, A, B), "blend: mode is missing")                 -- no default: required
  end)

  it("takes the attributes by name in a table after the inputs", function()
    local core, calls = fake_core({op()})
    local dm_ = {}
    generated.install(dm_, {}, core)
    dm_.blend(A, B, {mode = "add"})
    dm_.blend(A, nil, {mode = "mul", scale = 2})
    assert.same({n = 4, "blend", A, B, {"add"}}, calls[1])
    assert.same({n = 4, "blend", A, nil, {"mul", 2}}, calls[2])
    has(err_of(dm_.blend, A, B, {}), "blend: mode is missing")
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
    has(err_of(generated.install, {}, {}, fake_core({op({args = "a, b, mode", attr_decls = {
          {name = "mode", kind = "number", fixed = 1, list = false}}})})), "op blend: args names mode, which Lua does not pass")
    has(err_of(generated.install, {}, {}, fake_core({op({attr_decls = {{name = "shape", kind = "number", list = true},
                                                                        {name = "scale", kind = "number", list = false}}})})),
        "op blend: the list attribute is the last argument")
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
              "---@param mode \"add\"|\"mul\"\n---@param scale? number\n---@return dormouse.Tensor\n" ..
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

describe("the descriptors' attribute kinds, on the ops themselves", function()
  local x = dm.tensor({{1, 5, 2}, {7, 0, 3}})
  local same = function(a, b) assert.is_true(dm.allclose(a, b, {rtol = 0, atol = 0})) end

  it("dims count from 1, negative from the end; an absent one is the declared default", function()
    same(x:sum(2), x:sum(-1))
    same(x:sum(), dm.tensor(18))                                   -- every dim
    assert.same({2, 1}, x:sum(2, true):size())
    same(x:softmax(), x:softmax(2))                                -- the last
    same(x:squeeze(), x)
    assert.same({2, 3, 1}, x:unsqueeze(-1):size())                 -- a new dim: 1..n+1
    assert.same({1, 2, 3}, x:unsqueeze(1):size())
    same(x:permute(-1, 1), x:permute{2, 1})
    same(x:transpose(1, -1), x:t())
    same(x:narrow(2, 2, 2), dm.tensor({{5, 2}, {0, 3}}))          -- a 1-based start
    has(err_of(function() return x:sum(1, 1) end), "sum: keepdim must be true or false, got 1")
    has(err_of(function() return x:max(1, 1) end), "max: keepdim must be true or false, got 1")
    same(dm.tensor(3):softmax(), dm.tensor(1))                     -- a 0-dim tensor's only dim
    has(err_of(function() return x:reshape(6, nil, 1) end), "reshape: shape entry 2 must be an integer, got nil")
    same(x:gather(nil, dm.tensor({{3}, {1}}):long(), {dim = 2}), dm.tensor({{2}, {7}}))   -- by name, placed early
    has(err_of(function() return x:sum(3) end), "sum: dim 3 is out of range for a tensor of 2 dims")
  end)

  it("positions come back from 1 (base@1), and go in from 1", function()
    same(x:argmax(2), dm.tensor({2, 1}):long())
    assert.equal(4, x:argmax():item())
    local idx = dm.tensor({{3}, {1}}):long()
    same(x:gather(2, idx), dm.tensor({{2}, {7}}))
    same(dm.gather(x, 2, idx), x:gather(2, idx))
    same(x:index_select(1, dm.tensor({2}):long()), dm.tensor({{7, 0, 3}}))
  end)

  it("a list as a table or as its numbers, or by name; a dtype by its name; a number beside a tensor", function()
    same(x:reshape(3, 2), x:reshape{3, 2})
    same(x:reshape({shape = {3, 2}}), x:reshape{3, 2})
    same(x:reshape(6), x:reshape{6})
    assert.equal("f64", dm.cast(x, "f64").dtype)
    has(err_of(dm.cast, x, "f65"), "cast: unknown dtype 'f65' (f32 f64 bf16 f16 i32 i64 u8)")
    same(dm.maximum(2, x), x:maximum(2))
    same(dm.where(x:gt(2), x, 0), dm.tensor({{0, 5, 0}, {7, 0, 3}}))
    same(x:clamp(nil, 2), dm.tensor({{1, 2, 2}, {2, 0, 2}}))      -- lo's default: open
    same(x:norm(), x:norm(2))
    same(x:norm(1, 2), dm.tensor({8, 10}))
    same(dm.matmul(x, x, {transpose_b = true}), x:matmul(x:t()))
  end)

  it("the op fills in a default the call leaves out, and refuses a required attribute left out", function()
    same(dm.core.call("softmax", x), x:softmax())
    same(dm.core.call("sum", x), x:sum())
    has(err_of(dm.core.call, "pow", x, {}), "pow: the attribute p is missing")
    has(err_of(dm.quantize, x), "quantize: format is missing (one of fp8_e4m3|nvfp4|ternary|binary)")
    has(err_of(dm.core.call, "narrow", x, {1, 0}), "narrow: the attribute len is missing")
  end)

  it("are what core.ops() says each attribute is", function()
    local by = {}
    for _, op in ipairs(dm.core.ops()) do by[op.name] = op end
    assert.same({name = "dim", kind = "dim", default = -1, list = false}, by.sum.attr_decls[1])
    assert.same({name = "base", kind = "number", default = 0, fixed = 1, list = false}, by.argmax.attr_decls[3])
    assert.same({name = "perm", kind = "dim", list = true}, by.permute.attr_decls[1])
    assert.same({"mean", "sum", "none"}, by.cross_entropy.attr_decls[2].words)
    assert.equal(0, by.cross_entropy.attr_decls[2].default)       -- the word's place: mean
  end)

  it("give most ops their function and editor lines", function()
    local n, made = 0, 0
    for _, op in ipairs(dm.core.ops()) do
      n = n + 1
      if op.lua then made = made + 1 end
    end
    assert.is_true(made / n >= 0.75, string.format("%d of %d ops take their function from the descriptor", made, n))
    -- the recipe counts them: an op added anywhere is counted there too
    local f = assert(io.open("docs/architecture.md"))
    local text = f:read("a"):gsub("%s+", " ")
    f:close()
    local said_made, said_n = text:match("(%d+) of the (%d+) ops take their function this way")
    assert.same({made, n}, {tonumber(said_made), tonumber(said_n)},
                "docs/architecture.md's count of the ops that take their function from the descriptor")
  end)
end)
