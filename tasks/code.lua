-- Small Lua functions to write: a comment says what f computes and the prompt opens the function,
--   -- x times 7, plus 3
--   local function f(x) return
-- answered by "x * 7 + 3 end" and a newline. The answer is a reference solution (what supervised
-- fine-tuning reads); the verdict is the tests': the prompt (head), the model's output and four
-- assertions on f run in the sandbox (dormouse.verify's code verifier), so any body that computes f
-- passes, and a sample scores the share of the assertions it passes (rl.reward = "score",
-- dormouse post-train --verifier soft). 20,000 tasks drawn by a fixed generator, so the file is the
-- same everywhere; data.records and dormouse post-train --env code read it.
local state = 20261207
local function draw(n)                     -- a linear congruential generator (Knuth's MMIX constants)
  state = state * 6364136223846793005 + 1442695040888963407
  return (state >> 33) % n
end

-- {what it says, the body, f as Lua} of one argument x and constants k, m
local ONE = {
  function(k) return "x plus " .. k, "x + " .. k, function(x) return x + k end end,
  function(k) return "x times " .. k, "x * " .. k, function(x) return x * k end end,
  function(k) return k .. " minus x", k .. " - x", function(x) return k - x end end,
  function(k, m) return string.format("x times %d, plus %d", k, m), string.format("x * %d + %d", k, m),
                        function(x) return x * k + m end end,
  function(k) return "the larger of x and " .. k, "math.max(x, " .. k .. ")", function(x) return math.max(x, k) end end,
  function(k) return "the smaller of x and " .. k, "math.min(x, " .. k .. ")", function(x) return math.min(x, k) end end,
  function() return "x squared", "x * x", function(x) return x * x end end,
  function(k) return "x modulo " .. k, "x % " .. k, function(x) return x % k end end,
  function(k) return "whether x is a multiple of " .. k, "x % " .. k .. " == 0", function(x) return x % k == 0 end end,
  function(k) return "x divided by " .. k .. ", rounded down", "x // " .. k, function(x) return x // k end end,
  function(k) return "the distance from x to " .. k, "math.abs(x - " .. k .. ")", function(x) return math.abs(x - k) end end,
  function() return "x with its sign flipped", "-x", function(x) return -x end end,
}

-- the same of two arguments a and b
local TWO = {
  function() return "a plus b", "a + b", function(a, b) return a + b end end,
  function() return "a times b", "a * b", function(a, b) return a * b end end,
  function() return "the larger of a and b", "math.max(a, b)", function(a, b) return math.max(a, b) end end,
  function(k) return "a plus b, times " .. k, "(a + b) * " .. k, function(a, b) return (a + b) * k end end,
  function() return "whether a is greater than b", "a > b", function(a, b) return a > b end end,
}

local function arg() return draw(41) - 20 end          -- a test's argument: an integer in [-20, 20]

local tasks = {}
for i = 1, 20000 do
  local k, m = 2 + draw(11), 1 + draw(20)
  local two = draw(4) == 0
  local make = two and TWO[1 + draw(#TWO)] or ONE[1 + draw(#ONE)]
  local says, body, f = make(k, m)
  local head = two and string.format("-- %s\nlocal function f(a, b) return ", says)
                    or string.format("-- %s\nlocal function f(x) return ", says)
  local tests = {}
  for j = 1, 4 do
    if two then
      local a, b = arg(), arg()
      tests[j] = string.format("assert(f(%d, %d) == %s)", a, b, tostring(f(a, b)))
    else
      local x = arg()
      tests[j] = string.format("assert(f(%d) == %s)", x, tostring(f(x)))
    end
  end
  tasks[i] = {prompt = head, answer = body .. " end\n", head = head, tests = tests, language = "lua"}
end
return {name = "code", tasks = tasks}
