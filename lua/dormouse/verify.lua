--[[
dormouse.verify — verifiers: whether a model's output solves a task. A
verifier is a function(task, output) → {pass = bool, score = number in [0, 1],
reason = a short phrase}; output is the bytes the model wrote after the
task's prompt.

  local verify = require "dormouse.verify"
  verify.exact({answer = "42\n"}, "42\nand more")          → {pass = true, score = 1, reason = "exact"}
  verify.numeric({answer = "0.5"}, " about 0.50 ...")      → the first number, 0.50, is 0.5
  verify.code({language = "python3", tests = "assert f(2) == 4"}, "def f(x):\n  return x * x\n")
  verify.get("numeric")                                     → the verifier of that name

exact: the output begins with task.answer. numeric: the first number in the
output (an optional sign, digits, a decimal part, an exponent) equals
tonumber(task.answer) to task.tolerance (relative, default 1e-9; exact for
integers). code: the output, then a newline and task.tests, run as one
program in the sandbox (dormouse.sandbox: task.language python3 or lua,
task.seconds, default 2); it passes when the program exits with status 0, and
fails with the sandbox's reason otherwise (a time limit, an assertion's
message, output over the cap).
]]
local verify = {}

local function verdict(pass, reason) return {pass = pass, score = pass and 1 or 0, reason = reason} end

function verify.exact(task, output)
  local answer = task.answer
  if type(answer) ~= "string" then error("verify.exact: the task has no answer (a string)", 2) end
  if output:sub(1, #answer) == answer then return verdict(true, "exact") end
  local n = 1
  while n <= #answer and output:byte(n) == answer:byte(n) do n = n + 1 end
  return verdict(false, n > #output and string.format("stopped after %d of %d bytes", #output, #answer)
                        or string.format("differs at byte %d", n))
end

-- the first number in text: its value and its spelling, or nil
local function first_number(text)
  local from, to
  for _, pattern in ipairs {"[-+]?%d+%.?%d*", "[-+]?%.%d+"} do
    local f, t = text:find(pattern)
    if f and (not from or f < from) then from, to = f, t end
  end
  if not from then return nil end
  local e_to = select(2, text:find("^[eE][-+]?%d+", to + 1))
  local spelled = text:sub(from, e_to or to)
  return tonumber(spelled), spelled
end

function verify.numeric(task, output)
  local want = tonumber(task.answer)
  if not want then error(string.format("verify.numeric: the task's answer %q is not a number", tostring(task.answer)), 2) end
  local got, spelled = first_number(output)
  if not got then return verdict(false, "no number in the output") end
  local tol = task.tolerance or 1e-9
  local pass
  if math.type(want) == "integer" and math.type(got) == "integer" then pass = got == want
  else pass = math.abs(got - want) <= tol * math.max(math.abs(want), 1e-300) end
  return verdict(pass, pass and "equal" or string.format("%s is not %s", spelled, tostring(task.answer)))
end

function verify.code(task, output)
  if type(task.tests) ~= "string" then error("verify.code: the task has no tests (a program, a string)", 2) end
  local r = require("dormouse.sandbox").run {language = task.language or "python3",
                                             source = output .. "\n" .. task.tests, seconds = task.seconds}
  return verdict(r.ok, r.ok and string.format("tests passed in %.2f s", r.seconds) or r.reason)
end

local NAMES = {exact = verify.exact, numeric = verify.numeric, code = verify.code}

--- verify.get(name) → the verifier; an unknown name is an error listing the known ones
function verify.get(name)
  local v = NAMES[name]
  if not v then
    error(string.format("verify: no verifier '%s' (exact, numeric, code)", tostring(name)), 2)
  end
  return v
end

return verify
