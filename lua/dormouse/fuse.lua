--[[
dm.fuse — elementwise expressions fused into one pass.

  local fuse = require "dormouse.fuse"          -- dm.fuse once init.lua loads it
  local f = fuse("silu(a) * b")
  local y = f(a, b)                              -- or f{a = a, b = b}

The expression names its inputs (identifiers; positional arguments follow
the order in which they first appear, or opts.inputs = {"b", "a"}). The
inputs broadcast against each other, must share one float dtype and one
device; a number stands for a scalar of the tensors' dtype. The language:

  + - * /  and unary -        a ^ 2, x ^ -0.5     (the exponent is a number)
  < <= > >= == ~=             0 or 1, in the inputs' dtype
  exp log sqrt rsqrt tanh sigmoid silu softplus abs relu     (one argument)
  where(c, x, y)              x where c is nonzero, else y
  numbers: 1, 0.5, 1e-3; parentheses; precedence as in Lua (-a^2 is -(a^2))

The backward is derived symbolically (f.derivatives shows d out / d input,
simplified) and runs as one more fused kernel, so autograd works: every
input that requires grad gets its gradient, summed over the dims it was
broadcast along. Comparisons have a zero derivative; the backward itself is
not differentiable.

The CPU evaluates the expression in double for every element (the oracle);
on CUDA the same tree is CUDA source (f.source, f.backward_source),
compiled once per dtype with NVRTC for the device and cached on disk under
$XDG_CACHE_HOME/dormouse/nvrtc (or ~/.cache/dormouse/nvrtc); DM_DEBUG=4
prints it. dm.fuse returns the same op for the same expression.
]]
local lpeg = require "lpeg"
local core = require "dormouse.core"

local P, R, S, C, Cc, Cp, Cmt, Ct = lpeg.P, lpeg.R, lpeg.S, lpeg.C, lpeg.Cc, lpeg.Cp, lpeg.Cmt, lpeg.Ct

local OP, KIND = core.fuse_codes()
local FUNCS = {"exp", "log", "sqrt", "rsqrt", "tanh", "sigmoid", "silu", "softplus", "abs", "relu"}
local IS_FUNC = {where = true}
for _, name in ipairs(FUNCS) do IS_FUNC[name] = true end

-- ---- the tree ------------------------------------------------------------------------
-- {k = "num", v}, {k = "in", name, i}, {k = "neg", a}, {k = "bin", op, a, b},
-- {k = "pow", a, p}, {k = "fn", f, a}, {k = "dfn", f, a} (f' at a), {k = "where", c, x, y}

local function num(v) return {k = "num", v = v} end
local function neg(a) return {k = "neg", a = a} end
local function bin(op, a, b) return {k = "bin", op = op, a = a, b = b} end
local ZERO, ONE = num(0), num(1)

local CMP = {["<"] = true, ["<="] = true, [">"] = true, [">="] = true, ["=="] = true, ["~="] = true}
local PREC = {["+"] = 2, ["-"] = 2, ["*"] = 3, ["/"] = 3}

-- the shortest decimal that reads back as v
local function number_text(v)
  if v == math.floor(v) and math.abs(v) < 2^53 then return string.format("%d", v) end
  for digits = 1, 17 do
    local s = string.format("%." .. digits .. "g", v)
    if tonumber(s) == v then return s end
  end
end

-- the tree as an expression, with the parentheses precedence needs (f'(x) for a derivative)
local function show(n, outer)
  outer = outer or 0
  local s, prec
  if n.k == "num" then
    s, prec = number_text(n.v), n.v < 0 and 4 or 6
  elseif n.k == "in" then
    s, prec = n.name, 6
  elseif n.k == "neg" then
    s, prec = "-" .. show(n.a, 4.5), 4
  elseif n.k == "bin" then
    prec = CMP[n.op] and 1 or PREC[n.op]
    s = show(n.a, prec) .. " " .. n.op .. " " .. show(n.b, prec + 0.5)
  elseif n.k == "pow" then
    s, prec = show(n.a, 6) .. "^" .. number_text(n.p), 5
  elseif n.k == "where" then
    s, prec = string.format("where(%s, %s, %s)", show(n.c), show(n.x), show(n.y)), 6
  else
    s, prec = n.f .. (n.k == "dfn" and "'" or "") .. "(" .. show(n.a) .. ")", 6
  end
  return prec < outer and "(" .. s .. ")" or s
end

-- ---- parsing ---------------------------------------------------------------------------

local function fail(what)
  return Cmt(Cc(what), function(_, pos, w) error({pos = pos, what = "expected " .. w}, 0) end)
end
local function expect(p, what) return p + fail(what) end

local sp = S(" \t\r\n")^0
local function tok(p) return P(p) * sp end

local digits = R"09"^1
local number = Cp() * C((digits * ("." * R"09"^0)^-1 + "." * digits) *
                        (S"eE" * S"+-"^-1 * expect(digits, "digits in the number's exponent"))^-1) * sp /
  function(pos, text)
    local v = tonumber(text)
    if v == math.huge then error({pos = pos, what = "the number " .. text .. " is out of range"}, 0) end
    return num(v)
  end
local ident = C((R("az", "AZ") + "_") * (R("az", "AZ", "09") + "_")^0)

local function fold(ops)   -- left-associative: {a, op, b, op, c} → ((a op b) op c)
  local t = ops[1]
  for i = 2, #ops, 2 do t = bin(ops[i], t, ops[i + 1]) end
  return t
end

local function call(pos, name, args)
  if not args then
    if IS_FUNC[name] then error({pos = pos, what = "expected '(' after '" .. name .. "'"}, 0) end
    return {k = "in", name = name}
  end
  if not IS_FUNC[name] then
    error({pos = pos, what = "unknown function '" .. name .. "' (functions: " .. table.concat(FUNCS, " ") ..
           " where)"}, 0)
  end
  local want = name == "where" and 3 or 1
  if #args ~= want then
    error({pos = pos, what = string.format("%s takes %d argument%s, got %d", name, want, want > 1 and "s" or "", #args)}, 0)
  end
  if name == "where" then return {k = "where", c = args[1], x = args[2], y = args[3]} end
  return {k = "fn", f = name, a = args[1]}
end

local exponent = (tok"-" * number / function(n) return -n.v end) + (number / function(n) return n.v end)

local grammar = P{
  "top",
  top = sp * expect(lpeg.V"expr", "an operand") * expect(P(-1), "an operator or the end of the expression"),
  expr = Ct(lpeg.V"sum" * (C(tok"<=" + tok">=" + tok"==" + tok"~=" + tok"<" + tok">") / function(s)
           return (s:gsub("%s", "")) end * expect(lpeg.V"sum", "an operand"))^0) / fold,
  sum = Ct(lpeg.V"prod" * (C(S"+-") * sp * expect(lpeg.V"prod", "an operand"))^0) / fold,
  prod = Ct(lpeg.V"unary" * (C(S"*/") * sp * expect(lpeg.V"unary", "an operand"))^0) / fold,
  unary = tok"-" * expect(lpeg.V"unary", "an operand") / neg + lpeg.V"power",
  power = lpeg.V"atom" * (tok"^" * expect(exponent + tok"(" * exponent * expect(tok")", "')'"),
                                          "a number after '^' (the exponent is a constant)"))^-1 /
    function(a, p) if p then return {k = "pow", a = a, p = p} end return a end,
  atom = number + lpeg.V"name" + tok"(" * expect(lpeg.V"expr", "an operand") * expect(tok")", "')'"),
  name = Cp() * ident * sp * (tok"(" * Ct(expect(lpeg.V"expr", "an argument") *
                                         (tok"," * expect(lpeg.V"expr", "an argument"))^0) *
                             expect(tok")", "')' or ','"))^-1 / call,
}

local function parse(expr)
  local ok, tree = pcall(lpeg.match, grammar, expr)
  if ok then return tree end
  if type(tree) ~= "table" then error(tree, 0) end
  local line_start = 1
  for i = 1, tree.pos - 1 do if expr:sub(i, i) == "\n" then line_start = i + 1 end end
  local line = expr:match("[^\n]*", line_start)
  local col = tree.pos - line_start + 1
  core.error(string.format("dm.fuse: %s at column %d in '%s'\n  %s\n  %s^", tree.what, col, expr, line,
                           string.rep(" ", col - 1)))
end

-- ---- simplification and the derivative ---------------------------------------------------

local function is(n, v) return n.k == "num" and n.v == v end

local function finite(v) return v == v and v ~= math.huge and v ~= -math.huge end

local ARITH = {
  ["+"] = function(x, y) return x + y end, ["-"] = function(x, y) return x - y end,
  ["*"] = function(x, y) return x * y end, ["/"] = function(x, y) return x / y end,
  ["<"] = function(x, y) return x < y and 1 or 0 end, ["<="] = function(x, y) return x <= y and 1 or 0 end,
  [">"] = function(x, y) return x > y and 1 or 0 end, [">="] = function(x, y) return x >= y and 1 or 0 end,
  ["=="] = function(x, y) return x == y and 1 or 0 end, ["~="] = function(x, y) return x ~= y and 1 or 0 end,
}

-- constants folded, and x + 0, x * 1, x * 0, x / 1, 0 / x, x ^ 1, x ^ 0, --x removed
-- (x * 0 is taken as 0, as a symbolic derivative must: inf and NaN are not carried)
local simplify
local function make_bin(op, a, b)
  if a.k == "num" and b.k == "num" then
    local v = ARITH[op](a.v, b.v)
    if finite(v) then return num(v) end
  end
  if op == "+" then
    if is(a, 0) then return b end
    if is(b, 0) then return a end
    if b.k == "neg" then return make_bin("-", a, b.a) end
    if b.k == "num" and b.v < 0 then return make_bin("-", a, num(-b.v)) end
  elseif op == "-" then
    if is(b, 0) then return a end
    if is(a, 0) then return simplify(neg(b)) end
    if b.k == "neg" then return make_bin("+", a, b.a) end
    if b.k == "num" and b.v < 0 then return make_bin("+", a, num(-b.v)) end
  elseif op == "*" then
    if is(a, 0) or is(b, 0) then return ZERO end
    if is(a, 1) then return b end
    if is(b, 1) then return a end
    if is(a, -1) then return simplify(neg(b)) end
    if is(b, -1) then return simplify(neg(a)) end
  elseif op == "/" then
    if is(a, 0) then return ZERO end
    if is(b, 1) then return a end
  end
  return bin(op, a, b)
end

function simplify(n)
  if n.k == "neg" then
    local a = simplify(n.a)
    if a.k == "num" then return num(-a.v) end
    if a.k == "neg" then return a.a end
    return neg(a)
  elseif n.k == "bin" then
    return make_bin(n.op, simplify(n.a), simplify(n.b))
  elseif n.k == "pow" then
    local a = simplify(n.a)
    if n.p == 1 then return a end
    if n.p == 0 then return ONE end
    if a.k == "num" and finite(a.v ^ n.p) then return num(a.v ^ n.p) end
    return {k = "pow", a = a, p = n.p}
  elseif n.k == "where" then
    local c, x, y = simplify(n.c), simplify(n.x), simplify(n.y)
    if c.k == "num" then return c.v ~= 0 and x or y end
    if x.k == "num" and y.k == "num" and x.v == y.v then return x end
    return {k = "where", c = c, x = x, y = y}
  elseif n.k == "fn" or n.k == "dfn" then
    return {k = n.k, f = n.f, a = simplify(n.a)}
  end
  return n
end

-- d n / d (input i), simplified
local function derive(n, i)
  local k = n.k
  if k == "num" then return ZERO end
  if k == "in" then return n.i == i and ONE or ZERO end
  if k == "neg" then return simplify(neg(derive(n.a, i))) end
  if k == "bin" then
    if CMP[n.op] then return ZERO end
    local da, db = derive(n.a, i), derive(n.b, i)
    if n.op == "+" or n.op == "-" then return make_bin(n.op, da, db) end
    if n.op == "*" then return make_bin("+", make_bin("*", da, n.b), make_bin("*", n.a, db)) end
    -- (a / b)' = a' / b - a b' / b^2
    return make_bin("-", make_bin("/", da, n.b),
                    make_bin("/", make_bin("*", n.a, db), {k = "pow", a = n.b, p = 2}))
  end
  if k == "pow" then
    local inner = simplify({k = "pow", a = n.a, p = n.p - 1})
    return make_bin("*", make_bin("*", num(n.p), inner), derive(n.a, i))
  end
  if k == "fn" then return make_bin("*", {k = "dfn", f = n.f, a = n.a}, derive(n.a, i)) end
  if k == "where" then return simplify({k = "where", c = n.c, x = derive(n.x, i), y = derive(n.y, i)}) end
  error("dm.fuse: cannot differentiate a " .. k)
end

-- ---- the CPU program: postfix, {op, arg, op, arg, ...} -------------------------------------

local BIN_OP = {["+"] = "ADD", ["-"] = "SUB", ["*"] = "MUL", ["/"] = "DIV", ["<"] = "LT", ["<="] = "LE",
                [">"] = "GT", [">="] = "GE", ["=="] = "EQ", ["~="] = "NE"}

local function program(n, code)
  code = code or {}
  local function put(op, arg) code[#code + 1] = OP[op]; code[#code + 1] = arg or 0 end
  local k = n.k
  if k == "num" then put("CONST", n.v)
  elseif k == "in" then put("INPUT", n.i)
  elseif k == "neg" then program(n.a, code); put("NEG")
  elseif k == "bin" then program(n.a, code); program(n.b, code); put(BIN_OP[n.op])
  elseif k == "pow" then program(n.a, code); put("POW", n.p)
  elseif k == "fn" then program(n.a, code); put("UNARY", KIND[n.f])
  elseif k == "dfn" then program(n.a, code); put("DUNARY", KIND[n.f])
  else program(n.c, code); program(n.x, code); program(n.y, code); put("WHERE") end
  return code
end

-- ---- CUDA source ------------------------------------------------------------------------------

local function literal(v)
  local s = string.format("%.17g", v)
  if not s:find("[%.eEn]") then s = s .. ".0" end
  return "(T)" .. s
end

local C_BIN = {["+"] = "+", ["-"] = "-", ["*"] = "*", ["/"] = "/", ["<"] = "<", ["<="] = "<=", [">"] = ">",
               [">="] = ">=", ["=="] = "==", ["~="] = "!="}

-- statements computing n into `lines`, shared subtrees once; returns the C expression of n
local function emit(n, lines, memo)
  if n.k == "num" then return literal(n.v) end
  if n.k == "in" then return "x[" .. n.i .. "]" end
  local key = show(n)
  if memo[key] then return memo[key] end
  local e
  if n.k == "neg" then
    e = "-" .. emit(n.a, lines, memo)
  elseif n.k == "bin" then
    local a, b = emit(n.a, lines, memo), emit(n.b, lines, memo)
    e = CMP[n.op] and string.format("(%s %s %s) ? (T)1 : (T)0", a, C_BIN[n.op], b) or
        string.format("%s %s %s", a, C_BIN[n.op], b)
  elseif n.k == "pow" then
    local a = emit(n.a, lines, memo)
    local special = {[2] = "%s * %s", [3] = "%s * %s * %s", [0.5] = "sqrt(%s)", [-1] = "(T)1 / %s",
                     [-0.5] = "(T)1 / sqrt(%s)"}
    e = special[n.p] and string.format(special[n.p], a, a, a) or string.format("pow(%s, %s)", a, literal(n.p))
  elseif n.k == "fn" then
    e = string.format("dm_%s(%s)", n.f, emit(n.a, lines, memo))
  elseif n.k == "dfn" then
    local y = emit({k = "fn", f = n.f, a = n.a}, lines, memo)
    e = string.format("dm_d_%s(%s, %s)", n.f, emit(n.a, lines, memo), y)
  else
    e = string.format("%s != (T)0 ? %s : %s", emit(n.c, lines, memo), emit(n.x, lines, memo),
                      emit(n.y, lines, memo))
  end
  local name = "t" .. #lines
  lines[#lines + 1] = string.format("    const T %s = %s;", name, e)
  memo[key] = name
  return name
end

-- The kernel text after the prelude. dm_fargs must match kernels/nvrtc.c's struct:
-- the outputs' element strides in st[0 .. NOUT-1], the inputs' in st[NOUT ..].
local SKELETON = [==[
#define NIN $NIN
#define NOUT $NOUT
struct dm_fargs {
  long long n;
  long long shape[8];
  long long st[17][8];
  S *out[8];
  const S *in[9];
  int ndim;
  unsigned scalar;               /* bit k: input k is one value (the flat kernel) */
};

__device__ __forceinline__ void dm_eval(const T *x, T *o, unsigned want) {
$BODY
}

__device__ __forceinline__ unsigned dm_want(const dm_fargs &a) {
  unsigned want = 0;
#pragma unroll
  for (int k = 0; k < NOUT; k++) if (a.out[k]) want |= 1u << k;
  return want;
}

/* every operand contiguous (or one value), 16-byte aligned: V elements a step */
extern "C" __global__ void __launch_bounds__(256) dm_fused_flat(const dm_fargs a) {
  constexpr int V = 16 / sizeof(S);
  struct alignas(16) vec { S v[V]; };
  const unsigned want = dm_want(a);
  const long long nv = a.n / V, step = (long long)gridDim.x * blockDim.x;
  const long long first = blockIdx.x * (long long)blockDim.x + threadIdx.x;
  for (long long i = first; i < nv; i += step) {
    T x[V][NIN], o[V][NOUT];
#pragma unroll
    for (int k = 0; k < NIN; k++) {
      if (!a.in[k]) { for (int j = 0; j < V; j++) x[j][k] = 0; continue; }
      if ((a.scalar >> k) & 1) { T s = dm_ld(a.in[k][0]); for (int j = 0; j < V; j++) x[j][k] = s; continue; }
      vec w = ((const vec *)a.in[k])[i];
#pragma unroll
      for (int j = 0; j < V; j++) x[j][k] = dm_ld(w.v[j]);
    }
#pragma unroll
    for (int j = 0; j < V; j++) dm_eval(x[j], o[j], want);
#pragma unroll
    for (int k = 0; k < NOUT; k++) {
      if (!((want >> k) & 1)) continue;
      vec w;
#pragma unroll
      for (int j = 0; j < V; j++) w.v[j] = dm_st(o[j][k]);
      ((vec *)a.out[k])[i] = w;
    }
  }
  for (long long e = nv * V + first; e < a.n; e += step) {
    T x[NIN], o[NOUT];
#pragma unroll
    for (int k = 0; k < NIN; k++) x[k] = a.in[k] ? dm_ld(a.in[k][((a.scalar >> k) & 1) ? 0 : e]) : (T)0;
    dm_eval(x, o, want);
#pragma unroll
    for (int k = 0; k < NOUT; k++) if ((want >> k) & 1) a.out[k][e] = dm_st(o[k]);
  }
}

/* any strides: each element's offsets from its index over the merged dims */
extern "C" __global__ void __launch_bounds__(256) dm_fused_strided(const dm_fargs a) {
  const unsigned want = dm_want(a);
  const long long step = (long long)gridDim.x * blockDim.x;
  for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < a.n; i += step) {
    long long off[NIN + NOUT], r = i;
#pragma unroll
    for (int k = 0; k < NIN + NOUT; k++) off[k] = 0;
    for (int d = a.ndim - 1; d >= 0; d--) {
      long long q = d ? r / a.shape[d] : 0, c = r - q * a.shape[d];
      r = q;
#pragma unroll
      for (int k = 0; k < NIN + NOUT; k++) off[k] += c * a.st[k][d];
    }
    T x[NIN], o[NOUT];
#pragma unroll
    for (int k = 0; k < NIN; k++) x[k] = a.in[k] ? dm_ld(a.in[k][off[NOUT + k]]) : (T)0;
    dm_eval(x, o, want);
#pragma unroll
    for (int k = 0; k < NOUT; k++) if ((want >> k) & 1) a.out[k][off[k]] = dm_st(o[k]);
  }
}
]==]

-- the source of one direction: outputs[k] a tree (nil: that output is never computed)
local function cuda_source(expr, what, n_in, outputs, n_out)
  local body = {}
  for k = 1, n_out do
    local tree = outputs[k]
    if tree then
      local lines = {}
      local e = emit(tree, lines, {})
      body[#body + 1] = string.format("  if (want & %du) {\n%s%s    o[%d] = %s;\n  }", 1 << (k - 1),
                                      table.concat(lines, "\n"), #lines > 0 and "\n" or "", k - 1, e)
    else
      body[#body + 1] = string.format("  o[%d] = 0;", k - 1)
    end
  end
  local text = SKELETON:gsub("%$(%u+)", {NIN = tostring(n_in), NOUT = tostring(n_out),
                                         BODY = table.concat(body, "\n")})
  return string.format("/* dm.fuse: %s (%s) */\n%s%s", (expr:gsub("%*/", "* /")), what, core.fuse_cuda_prelude(),
                       text)
end

-- ---- the op -----------------------------------------------------------------------------------

local Fused = {}
Fused.__index = Fused

local function is_tensor(x) return getmetatable(x) == core.metatable end

function Fused:__tostring() return string.format("dm.fuse '%s' (%s)", self.expr, table.concat(self.inputs, ", ")) end

-- f(a, b, ...) or f{a = ..., b = ...}
function Fused:__call(...)
  local n = select("#", ...)
  local args = {...}
  local named = n == 1 and type(args[1]) == "table" and not is_tensor(args[1])
  if named then
    local given = args[1]
    args = {}
    for i, name in ipairs(self.inputs) do
      if given[name] == nil then core.error(string.format("%s: missing input '%s'", tostring(self), name)) end
      args[i] = given[name]
    end
    for key in pairs(given) do
      if self.index[key] == nil then
        core.error(string.format("%s: unknown input '%s'", tostring(self), tostring(key)))
      end
    end
    n = #self.inputs
  elseif n ~= #self.inputs then
    core.error(string.format("%s: takes %d input%s, got %d", tostring(self), #self.inputs,
                             #self.inputs == 1 and "" or "s", n))
  end
  local like
  for i = 1, n do
    local v = args[i]
    if is_tensor(v) then like = like or v
    elseif type(v) ~= "number" then
      core.error(string.format("%s: input '%s' must be a tensor or a number, got %s", tostring(self),
                               self.inputs[i], type(v)))
    end
  end
  if not like then core.error(tostring(self) .. ": needs at least one tensor input") end
  for i = 1, n do
    if type(args[i]) == "number" then args[i] = core.full({}, args[i], like.dtype, like.device) end
  end
  return core.call("fuse", args, {self.id})
end

local cache = {}

local function check_inputs(expr, names, order)
  local index = {}
  for i, name in ipairs(order) do
    if type(name) ~= "string" or not name:match("^[%a_][%w_]*$") or IS_FUNC[name] then
      core.error(string.format("dm.fuse: input %d of opts.inputs must be a name (not a function), got %s", i,
                               tostring(name)))
    end
    if index[name] then core.error(string.format("dm.fuse: input '%s' is listed twice", name)) end
    index[name] = i - 1
  end
  for _, name in ipairs(names) do
    if not index[name] then
      core.error(string.format("dm.fuse: '%s' uses '%s', which opts.inputs does not list", expr, name))
    end
  end
  return index
end

-- the inputs' names in order of first appearance, each node numbered
local function number_inputs(tree, names, seen)
  if tree.k == "in" then
    if not seen[tree.name] then seen[tree.name] = true; names[#names + 1] = tree.name end
    return
  end
  for _, key in ipairs {"a", "b", "c", "x", "y"} do
    if type(tree[key]) == "table" then number_inputs(tree[key], names, seen) end
  end
end

local function set_index(tree, index)
  if tree.k == "in" then tree.i = index[tree.name]; return end
  for _, key in ipairs {"a", "b", "c", "x", "y"} do
    if type(tree[key]) == "table" then set_index(tree[key], index) end
  end
end

local function fuse(expr, opts)
  if type(expr) ~= "string" then core.error("dm.fuse: expected an expression string, got " .. type(expr)) end
  opts = opts or {}
  if type(opts) ~= "table" then core.error("dm.fuse: options must be a table (of inputs), got " .. type(opts)) end
  for key in pairs(opts) do
    if key ~= "inputs" then core.error(string.format("dm.fuse: unknown option '%s' (it takes inputs)", tostring(key))) end
  end
  local key = expr .. "\0" .. table.concat(opts.inputs or {}, ",")
  if cache[key] then return cache[key] end
  local tree = parse(expr)
  local names = {}
  number_inputs(tree, names, {})
  local order = opts.inputs or names
  if #order == 0 then core.error(string.format("dm.fuse: '%s' has no inputs", expr)) end
  if #order > 8 then core.error(string.format("dm.fuse: '%s' has %d inputs; at most 8", expr, #order)) end
  local index = check_inputs(expr, names, order)
  set_index(tree, index)
  tree = simplify(tree)

  local g = {k = "in", name = "@g", i = #order}      -- the output's gradient (a name no input has)
  local derivatives, grads, bwd_programs = {}, {}, {}
  for i, name in ipairs(order) do
    local d = derive(tree, i - 1)
    derivatives[name] = show(d)
    local gi = make_bin("*", g, d)
    grads[i] = not is(gi, 0) and gi or nil
    bwd_programs[i] = grads[i] and program(grads[i]) or {}
  end
  local self = setmetatable({
    expr = expr, inputs = order, index = index, derivatives = derivatives, tree = show(tree),
    source = cuda_source(expr, "forward", #order, {tree}, 1),
    backward_source = cuda_source(expr, "backward", #order + 1, grads, #order),
  }, Fused)
  self.id = core.fuse_new(expr, #order, program(tree), bwd_programs, self.source, self.backward_source)
  cache[key] = self
  return self
end

return fuse
