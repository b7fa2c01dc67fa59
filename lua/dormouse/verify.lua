--[[
dormouse.verify — verifiers: whether a model's output solves a task. A
verifier is a function(task, output) → {pass = bool, score = number in [0, 1],
reason = a short phrase}; output is the bytes the model wrote after the
task's prompt. pass is the hard verdict; score is partial credit (1 when it
passes), the reward of rl.reward = "score" (dormouse post-train --verifier soft).

  local verify = require "dormouse.verify"
  verify.exact({answer = "42\n"}, "42\nand more")          → {pass = true, score = 1, reason = "exact"}
  verify.numeric({answer = "0.5"}, " about 0.50 ...")      → the first number, 0.50, is 0.5
  verify.code({language = "python3", tests = "assert f(2) == 4"}, "def f(x):\n  return x * x\n")
  verify.code({language = "lua", head = "local function f(x) return ",
               tests = {"assert(f(2) == 4)", "assert(f(-3) == 9)"}}, "x * x end")   → 2 of 2 tests
  verify.get("numeric")                                     → the verifier of that name
  verify.of(task, name)                                     → the named one, else the task's own kind

exact: the output begins with task.answer; its score is the share of the
answer's bytes the output matches before it first differs. numeric: the first
number in the output (an optional sign, digits, a decimal part, an exponent)
equals tonumber(task.answer) to task.tolerance (relative, default 1e-9; exact
for integers); no partial credit. code: task.head (code before the output,
default none), the output, then task.tests, run as one program in the
sandbox (dormouse.sandbox: task.language python3 or lua, task.seconds,
default 2). tests is a program (a string: it passes when the program exits
with status 0, the score 0 or 1) or a list of statements that raise on
failure (assert ...): each runs on its own after the output, the score is
the share that pass, and it passes when all do. A list's count is printed
under a key drawn for the run, and a program that ends before printing it
(a crash, os.exit) fails, and the functions the harness calls are taken
before the output runs; a program that reads its own source could still
forge the count, so the list form is for scoring, the sandbox for safety.
]]
local core = require "dormouse.core"

local verify = {}

local function verdict(pass, reason, score)
  return {pass = pass, score = score or (pass and 1 or 0), reason = reason}
end

function verify.exact(task, output)
  local answer = task.answer
  if type(answer) ~= "string" then error("verify.exact: the task has no answer (a string)", 2) end
  if output:sub(1, #answer) == answer then return verdict(true, "exact") end
  local n = 1
  while n <= #answer and output:byte(n) == answer:byte(n) do n = n + 1 end
  return verdict(false, n > #output and string.format("stopped after %d of %d bytes", #output, #answer)
                        or string.format("differs at byte %d", n), (n - 1) / #answer)
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

-- A program's first line, before the task's head and the output: the functions the harness calls, kept
-- where the output cannot replace them
local PRELUDE = {
  lua = "local __dm_pcall, __dm_ipairs, __dm_stdout = pcall, ipairs, io.stdout\n",
  python3 = "__dm_print = print\n",
}

-- the tests' statements as the end of a program in `language` that prints "KEY passed" last
local HARNESS = {
  lua = function(tests, key)
    local out = {"\nlocal __dm_passed = 0\nfor _, __dm_test in __dm_ipairs {"}
    for _, t in ipairs(tests) do out[#out + 1] = "function()\n" .. t .. "\nend," end
    out[#out + 1] = "} do if __dm_pcall(__dm_test) then __dm_passed = __dm_passed + 1 end end\n"
    out[#out + 1] = string.format("__dm_stdout:write(\"\\n%s \", __dm_passed, \"\\n\")\n", key)
    return table.concat(out)
  end,
  python3 = function(tests, key)
    local out = {"\n__dm_tests = []\n"}
    for i, t in ipairs(tests) do
      out[#out + 1] = string.format("def __dm_test_%d():\n    %s\n    pass\n__dm_tests.append(__dm_test_%d)\n", i,
                                    t:gsub("\n", "\n    "), i)
    end
    out[#out + 1] = "__dm_passed = 0\nfor __dm_test in __dm_tests:\n    try:\n        __dm_test()\n" ..
                    "        __dm_passed += 1\n    except BaseException:\n        pass\n"
    out[#out + 1] = string.format("__dm_print('\\n%s', __dm_passed, flush=True)\n", key)
    return table.concat(out)
  end,
}

local runs = 0
local function run_key()                       -- a word no program can know before it runs
  runs = runs + 1
  return string.format("dm%x%x", math.floor(core.now() * 1e6) % 0x100000000, runs)
end

-- a list of test statements: the share that pass
local function code_list(task, output, language)
  local tests = task.tests
  if #tests == 0 then error("verify.code: the task's tests list is empty", 3) end
  local harness = HARNESS[language]
  if not harness then error(string.format("verify.code: no test harness for language '%s'", tostring(language)), 3) end
  local key = run_key()
  local r = require("dormouse.sandbox").run {language = language, seconds = task.seconds,
    source = PRELUDE[language] .. (task.head or "") .. output .. "\n" .. harness(tests, key)}
  local passed = tonumber(r.stdout and r.stdout:match("\n" .. key .. " (%d+)\n$"))
  if not passed then
    return verdict(false, r.ok and "the tests did not run to their end" or r.reason)
  end
  local pass = passed == #tests and r.ok
  return verdict(pass, string.format("%d of %d tests passed%s", passed, #tests, r.ok and "" or "; " .. r.reason),
                 passed / #tests)
end

function verify.code(task, output)
  local language = task.language or "python3"
  if type(task.tests) == "table" then return code_list(task, output, language) end
  if type(task.tests) ~= "string" then
    error("verify.code: the task has no tests (a program, or a list of statements)", 2)
  end
  local r = require("dormouse.sandbox").run {language = language, seconds = task.seconds,
                                             source = (task.head or "") .. output .. "\n" .. task.tests}
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

--- verify.of(task, name) → the verifier named (nil: code for a task with tests, exact otherwise)
function verify.of(task, name)
  if name ~= nil then return verify.get(name) end
  return task.tests and verify.code or verify.exact
end

return verify
