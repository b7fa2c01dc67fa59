-- Short string functions: "reverse(abc)=" answered by "cba" and a newline; also upper, length,
-- first, last, sort and count(x, ...). Words of 2 to 8 lower-case letters; 20,000 tasks drawn by a
-- fixed generator, so the file is the same everywhere. As tasks/addition.lua: prompt/response
-- records for supervised fine-tuning and RL (data.records, dormouse post-train --env strings), or
-- eval.tasks (correct@budget).
local state = 20261206
local function draw(n)                     -- a linear congruential generator (Knuth's MMIX constants)
  state = state * 6364136223846793005 + 1442695040888963407
  return (state >> 33) % n
end

local LETTERS = "abcdefghijklmnopqrstuvwxyz"
local function word()
  local out = {}
  for i = 1, 2 + draw(7) do
    local j = 1 + draw(26)
    out[i] = LETTERS:sub(j, j)
  end
  return table.concat(out)
end

local function sorted(w)
  local t = {}
  for c in w:gmatch(".") do t[#t + 1] = c end
  table.sort(t)
  return table.concat(t)
end

local FUNCTIONS = {
  {"reverse", function(w) return w:reverse() end},
  {"upper", function(w) return w:upper() end},
  {"length", function(w) return tostring(#w) end},
  {"first", function(w) return w:sub(1, 1) end},
  {"last", function(w) return w:sub(-1) end},
  {"sort", sorted},
}

local tasks = {}
for i = 1, 20000 do
  local f = draw(#FUNCTIONS + 1)
  local w = word()
  if f == #FUNCTIONS then                  -- count(x, word): how many times the letter x occurs
    local at = 1 + draw(#w)
    local x = w:sub(at, at)
    local n = select(2, w:gsub(x, ""))
    tasks[i] = {prompt = string.format("count(%s,%s)=", x, w), answer = n .. "\n"}
  else
    local name, fn = FUNCTIONS[f + 1][1], FUNCTIONS[f + 1][2]
    tasks[i] = {prompt = string.format("%s(%s)=", name, w), answer = fn(w) .. "\n"}
  end
end
return {name = "strings", tasks = tasks}
