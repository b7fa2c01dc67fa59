-- Addition: "a+b=" answered by the sum and a newline, a and b below 1,000 (each of one, two or three
-- digits, equally often). 20,000 tasks drawn by a fixed generator, so the file is the same everywhere.
-- Supervised fine-tuning reads them as prompt/response records (data.records = "tasks/addition.lua":
-- the loss covers the answer's bytes; the last data.eval_records are held out), and eval.tasks as
-- correct@budget (the continuation must begin with the answer).
local state = 20260101
local function draw(n)                     -- a linear congruential generator (Knuth's MMIX constants)
  state = state * 6364136223846793005 + 1442695040888963407
  return (state >> 33) % n
end
local below = {10, 100, 1000}
local function number() return draw(below[1 + draw(3)]) end

local tasks = {}
for i = 1, 20000 do
  local a, b = number(), number()
  tasks[i] = {prompt = string.format("%d+%d=", a, b), answer = string.format("%d\n", a + b)}
end
return {name = "addition", tasks = tasks}
