--[[
Learning-rate schedules: each is a function step -> multiplier of the peak
learning rate, for the updates step = 1 .. steps (docs/model.md; WSD as in
research-engram-muon-moe.md D.1). Pure Lua, no tensors.

  warm-up   m = step / warmup                              while step <= warmup
  wsd       1 (stable) until D = steps - round(decay * steps), then
            m = floor + (1 - floor) * (1 - sqrt(x)),  x = (step - D) / (steps - D)
  cosine    m = floor + (1 - floor) * (1 + cos(pi * x)) / 2,  x = (step - warmup) / (steps - warmup)
  constant  m = 1

Every shape starts with the warm-up and ends at the floor (wsd, cosine);
steps past the end stay there.

  local lr_mult = schedule.new({kind = "wsd", warmup = 100, decay = 0.2, floor = 0}, 2000)
  lr_mult(1) --> 0.01
]]
local core = require "dormouse.core"

local schedule = {}

local function fail(fmt, ...) core.error(string.format(fmt, ...)) end

local function check_step(step)
  if math.type(step) ~= "integer" or step < 1 then
    fail("schedule: step must be an integer >= 1, got %s", tostring(step))
  end
end

-- the warm-up's multiplier, or nil once it is over
local function warming(step, warmup)
  if step <= warmup then return step / warmup end
end

-- x in [0, 1]: how far step is from `from` to `to`
local function progress(step, from, to)
  if to <= from then return 1 end
  return math.min(1, math.max(0, (step - from) / (to - from)))
end

function schedule.constant(o)
  return function(step)
    check_step(step)
    return warming(step, o.warmup) or 1
  end
end

function schedule.wsd(o)
  local D = math.max(o.warmup, o.steps - math.floor(o.decay * o.steps + 0.5))
  return function(step)
    check_step(step)
    local w = warming(step, o.warmup)
    if w then return w end
    if step <= D then return 1 end
    return o.floor + (1 - o.floor) * (1 - math.sqrt(progress(step, D, o.steps)))
  end
end

function schedule.cosine(o)
  return function(step)
    check_step(step)
    local w = warming(step, o.warmup)
    if w then return w end
    return o.floor + (1 - o.floor) * (1 + math.cos(math.pi * progress(step, o.warmup, o.steps))) / 2
  end
end

local defaults = {kind = "wsd", warmup = 100, decay = 0.2, floor = 0.0}

--[[ cfg: {kind, warmup, decay, floor} as in the config's `schedule` section
(missing keys take the schema's defaults); steps: the run's total updates. ]]
function schedule.new(cfg, steps)
  cfg = cfg or {}
  if type(cfg) ~= "table" then fail("schedule: the config must be a table, got a %s", type(cfg)) end
  for key in pairs(cfg) do
    if defaults[key] == nil then
      fail("schedule: unknown key '%s' (kind, warmup, decay, floor)", tostring(key))
    end
  end
  local o = {steps = steps}
  for key, v in pairs(defaults) do
    local given = rawget(cfg, key)
    if given == nil then o[key] = v else o[key] = given end
  end
  if math.type(steps) ~= "integer" or steps < 1 then
    fail("schedule: steps must be an integer >= 1, got %s", tostring(steps))
  end
  if math.type(o.warmup) ~= "integer" or o.warmup < 0 then
    fail("schedule: warmup must be an integer >= 0, got %s", tostring(o.warmup))
  end
  for _, key in ipairs {"decay", "floor"} do
    if type(o[key]) ~= "number" or o[key] < 0 or o[key] > 1 then
      fail("schedule: %s must be a fraction in [0, 1], got %s", key, tostring(o[key]))
    end
  end
  local make = ({wsd = schedule.wsd, cosine = schedule.cosine, constant = schedule.constant})[o.kind]
  if not make then fail("schedule: unknown kind '%s' (wsd, cosine, constant)", tostring(o.kind)) end
  return make(o)
end

return schedule
