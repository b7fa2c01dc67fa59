-- Small Lua functions to infer from examples: a comment gives f at three points and the prompt
-- opens the function,
--   -- f(2) == 7, f(5) == 16, f(-1) == -2
--   local function f(x) return
-- answered by "x * 3 + 1 end" and a newline. The answer is a reference solution (what supervised
-- fine-tuning reads); the verdict is the tests': the prompt (head), the model's output and four
-- assertions of f at other points, run in the sandbox (dormouse.verify's code verifier), so any body
-- that computes f passes, and a sample scores the share of the assertions it passes (rl.reward =
-- "score", dormouse post-train --verifier soft). The functions: sums, products, differences,
-- affine maps, max, min, squares, modulo, divisibility, floor division, distance, negation; a
-- quarter of two arguments. 20,000 tasks drawn by a fixed generator, so the file is the same
-- everywhere; data.records and dormouse post-train --env code read it.
local state = 20261207
local function draw(n)                     -- a linear congruential generator (Knuth's MMIX constants)
  state = state * 6364136223846793005 + 1442695040888963407
  return (state >> 33) % n
end

-- the body and f as Lua, of one argument x and the constants k, m
local ONE = {
  function(k) return "x + " .. k, function(x) return x + k end end,
  function(k) return "x * " .. k, function(x) return x * k end end,
  function(k) return k .. " - x", function(x) return k - x end end,
  function(k, m) return string.format("x * %d + %d", k, m), function(x) return x * k + m end end,
  function(k) return "math.max(x, " .. k .. ")", function(x) return math.max(x, k) end end,
  function(k) return "math.min(x, " .. k .. ")", function(x) return math.min(x, k) end end,
  function() return "x * x", function(x) return x * x end end,
  function(k) return "x % " .. k, function(x) return x % k end end,
  function(k) return "x % " .. k .. " == 0", function(x) return x % k == 0 end end,
  function(k) return "x // " .. k, function(x) return x // k end end,
  function(k) return "math.abs(x - " .. k .. ")", function(x) return math.abs(x - k) end end,
  function() return "-x", function(x) return -x end end,
}

-- the same of two arguments a and b
local TWO = {
  function() return "a + b", function(a, b) return a + b end end,
  function() return "a * b", function(a, b) return a * b end end,
  function() return "math.max(a, b)", function(a, b) return math.max(a, b) end end,
  function(k) return "(a + b) * " .. k, function(a, b) return (a + b) * k end end,
  function() return "a > b", function(a, b) return a > b end end,
}

local function arg() return draw(41) - 20 end          -- an argument: an integer in [-20, 20]

-- n calls of f at distinct points not in `taken`, as {"f(2) == 7", ...} (points marked taken)
local function calls(f, two, n, taken)
  local out = {}
  while #out < n do
    local a, b = arg(), two and arg() or nil
    local key = two and a .. "," .. b or tostring(a)
    if not taken[key] then
      taken[key] = true
      local value
      if two then value = f(a, b) else value = f(a) end
      out[#out + 1] = string.format("f(%s) == %s", (key:gsub(",", ", ")), tostring(value))
    end
  end
  return out
end

local tasks = {}
for i = 1, 20000 do
  local k, m = 2 + draw(11), 1 + draw(20)
  local two = draw(4) == 0
  local make = two and TWO[1 + draw(#TWO)] or ONE[1 + draw(#ONE)]
  local body, f = make(k, m)
  local taken = {}
  local shown = calls(f, two, 3, taken)
  local head = string.format("-- %s\nlocal function f(%s) return ", table.concat(shown, ", "), two and "a, b" or "x")
  local tests = {}
  for j, c in ipairs(calls(f, two, 4, taken)) do tests[j] = "assert(" .. c .. ")" end
  tasks[i] = {prompt = head, answer = body .. " end\n", head = head, tests = tests, language = "lua"}
end
return {name = "code", tasks = tasks}
