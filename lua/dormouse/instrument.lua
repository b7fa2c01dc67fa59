--[[
The instrument layer (docs/model.md): the NaN firewall, the CE ceiling, the
MoE and Engram counters, and the log and eval lines.
]]
local core = require "dormouse.core"

local instrument = {}

local LN2 = math.log(2)
instrument.LN2 = LN2

-- A window of steps between two log lines.
function instrument.window()
  return {steps = 0, loss = 0, tokens = 0, skips = 0, grad_norm = 0, t0 = core.now(),
          counts = nil, lr = 0}
end

--[[ The firewall: a step whose loss or gradient norm is not finite is
skipped and counted; two windows in a row with skips end the run. ]]
function instrument.firewall()
  return {total = 0, windows_with_skips = 0}
end

function instrument.finite(x) return x == x and x ~= math.huge and x ~= -math.huge end

function instrument.end_window(fw, window)
  fw.total = fw.total + window.skips
  if window.skips > 0 then fw.windows_with_skips = fw.windows_with_skips + 1
  else fw.windows_with_skips = 0 end
  return fw.windows_with_skips >= 2
end

--[[ The utilisation floor (guard.*): the window's MoE counters against guard.busiest and
guard.dead; `state` counts the windows past the floor in a row. Returns nil, or once
guard.windows of them have passed, what is past it ("busiest 0.370 > 0.050, dead 61 > 50")
and for how many windows. ]]
function instrument.utilisation(state, moe, guard)
  if not moe or (guard.busiest == nil and guard.dead == nil) then return nil end
  local past = {}
  if guard.busiest and moe.busiest > guard.busiest then
    past[#past + 1] = string.format("busiest %.3f > %.3f", moe.busiest, guard.busiest)
  end
  if guard.dead and moe.dead > guard.dead then past[#past + 1] = string.format("dead %d > %d", moe.dead, guard.dead) end
  state.windows = #past > 0 and (state.windows or 0) + 1 or 0
  if state.windows < guard.windows then return nil end
  return table.concat(past, ", "), state.windows
end

-- MoE counters from the window's summed routing counts (an i64 tensor [E] on any device, or a Lua list
-- of E counts) and the assignments it dropped at capacity (a number; nil: dropless): the op
-- moe_counters's busiest share, entropy (normalised here by log E) and dead experts.
function instrument.moe_counters(counts, drops)
  if not counts then return nil end
  local dm = require "dormouse"
  local t = dm.is_tensor(counts) and counts or dm.tensor(counts, {dtype = "i64"})
  local c = dm.moe_counters(t)
  return {busiest = c.busiest_share, entropy = c.entropy / math.log(math.max(t:numel(), 2)), dead = c.dead,
          drops = math.tointeger(drops) or drops or 0}
end

function instrument.shares(counts)
  if not counts then return nil end
  local total = 0
  for _, c in ipairs(counts) do total = total + c end
  local out = {}
  for e, c in ipairs(counts) do out[e] = total > 0 and math.floor(c / total * 1e4 + 0.5) / 1e4 or 0 end
  return out
end

-- A window's events (an arm acting on the weights, {retract = 1} a step), summed by name.
function instrument.add_events(acc, events)
  if not events then return acc end
  acc = acc or {}
  for name, n in pairs(events) do acc[name] = (acc[name] or 0) + n end
  return acc
end

-- The window's routing counts (or any device sum: drops, an arm's terms), summed on the device;
-- read once, at the log line.
function instrument.add_counts(acc, counts)
  if not counts then return acc end
  return acc and acc + counts or counts
end

local function mib(bytes) return bytes / 2 ^ 20 end

local function fmt_time(s)
  if s >= 3600 then return string.format("%dh%02dm", s // 3600, (s % 3600) // 60) end
  if s >= 60 then return string.format("%dm%02ds", s // 60, s % 60) end
  return string.format("%ds", math.floor(s))
end
instrument.fmt_time = fmt_time

-- The log line: step, loss, BPB, tokens/s, lr, grad norm, skips, memory, counters.
function instrument.log_line(r)
  local parts = {string.format("step %6d", r.step)}
  if r.policy then           -- an RL step's loss is the policy-gradient objective, not a cross-entropy: no bpb
    parts[2] = string.format("pg_loss %.4f", r.loss)
    parts[3] = string.format("sampled/s %6.0f", r.tok_s)
  else
    parts[2] = string.format("loss %.4f", r.loss)
    parts[3] = string.format("bpb %.4f", r.loss / LN2)
    parts[4] = string.format("tok/s %8.0f", r.tok_s)
  end
  for _, part in ipairs {
    string.format("lr %.2e", r.lr),
    string.format("gnorm %.3f", r.grad_norm),
    string.format("skips %d", r.skips),
    string.format("mem %.0f/%.0fMiB", mib(r.mem.allocated), mib(r.mem.peak)),
  } do parts[#parts + 1] = part end
  local names = {}                                  -- a model's own terms (an arm's loss), by name
  for name in pairs(r.extras or {}) do names[#names + 1] = name end
  table.sort(names)
  for _, name in ipairs(names) do parts[#parts + 1] = string.format("%s %.4f", name, r.extras[name]) end
  local events = {}                                 -- an arm's actions in the window, counted
  for name in pairs(r.events or {}) do events[#events + 1] = name end
  table.sort(events)
  for _, name in ipairs(events) do parts[#parts + 1] = string.format("%s %d", name, r.events[name]) end
  if r.moe then
    parts[#parts + 1] = string.format("moe busiest %.3f entropy %.3f dead %d drops %d",
                                      r.moe.busiest, r.moe.entropy, r.moe.dead, r.moe.drops)
  end
  if r.engram then
    parts[#parts + 1] = string.format("engram rows %d uniq %.3f", r.engram.rows, r.engram.unique_frac)
  end
  if r.utilisation then
    parts[#parts + 1] = string.format("utilisation %s for %d windows", r.utilisation, r.utilisation_windows)
  end
  if r.kda and r.kda.chunked + r.kda.recurrent > 0 then   -- KDA's forward passes by path
    parts[#parts + 1] = string.format("kda chunked %d recurrent %d", r.kda.chunked, r.kda.recurrent)
  end
  return table.concat(parts, "  ")
end

-- The worst routing of the log records past step `from` (the warm-up): {busiest, dead}, the largest
-- busiest share and the most experts without a row in any one log window; nil when none routed
function instrument.worst_routing(records, from)
  local worst
  for _, r in ipairs(records) do
    if r.kind == "log" and r.step > from and r.moe_busiest then
      worst = worst or {busiest = 0, dead = 0}
      worst.busiest, worst.dead = math.max(worst.busiest, r.moe_busiest), math.max(worst.dead, r.moe_dead)
    end
  end
  return worst
end

-- Names in order with their numbers as numbers: correct@64 before correct@256 before correct@1024
function instrument.natural_less(a, b)
  local function padded(s) return (s:gsub("%d+", function(d) return string.format("%020d", tonumber(d)) end)) end
  return padded(a) < padded(b)
end

-- The eval line: window bytes, context, fin, bpb_fin (beside the n-gram baselines), periter, depths.
function instrument.eval_line(e, baselines)
  local parts = {
    string.format("eval %6d", e.step),
    string.format("bytes %d", e.bytes),
  }
  if e.ctx then                                      -- the context each byte was scored with
    parts[#parts + 1] = string.format("ctx %d", e.ctx) .. (e.segment and string.format(" (segments of %d)", e.segment) or "")
  end
  parts[#parts + 1] = string.format("fin %.4f", e.fin)
  parts[#parts + 1] = string.format("bpb_fin %.4f", e.fin / LN2)
  for _, b in ipairs(baselines or {}) do
    parts[#parts + 1] = string.format("ngram%d %.4f", b.order, b.bpb)
  end
  local per = {}
  for i, ce in ipairs(e.periter) do per[i] = string.format("%.3f", ce / LN2) end
  if #per > 0 then parts[#parts + 1] = "periter_bpb " .. table.concat(per, "/") end   -- a model may give none
  local depths = {}
  for D, ce in pairs(e.depths or {}) do depths[#depths + 1] = {D, ce} end
  table.sort(depths, function(a, b) return a[1] < b[1] end)
  for _, d in ipairs(depths) do parts[#parts + 1] = string.format("fin_%d %.4f", d[1], d[2] / LN2) end
  local names = {}                                   -- the model's own measures (an arm's), by name
  for name in pairs(e.measures or {}) do names[#names + 1] = name end
  table.sort(names, instrument.natural_less)
  for _, name in ipairs(names) do parts[#parts + 1] = string.format("%s %.4f", name, e.measures[name]) end
  return table.concat(parts, "  ")
end

-- A progress bar for a terminal: [=====>     ] 120/2000 ETA 3m12s.
function instrument.progress(step, total, elapsed, extra)
  local width = 30
  local done = math.floor(width * step / total)
  local eta = step > 0 and elapsed / step * (total - step) or 0
  return string.format("\r[%s%s] %d/%d ETA %s %s", string.rep("=", done), string.rep(" ", width - done),
                       step, total, fmt_time(eta), extra or "")
end

return instrument
