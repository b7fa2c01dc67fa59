--[[
TensorBoard event files: a run's metrics as scalars that `tensorboard
--logdir runs/` shows (log.tensorboard = true; docs/training.md).

  local w = tensorboard.open(dir)          dir/events.out.tfevents.TIME.dormouse, its first event
                                           the file version
  w:scalars(step, wall_time, {tag = value, ...})
  w:close()
  tensorboard.scalars_of(rec)              → the {tag = value} of a metrics.jsonl record
  tensorboard.rewrite(dir, records)        the folder's event files made again from records
                                           (a resume: what the truncated metrics hold)
  tensorboard.crc32c(s)                    CRC-32C (Castagnoli) of a string

The file is a sequence of TFRecords: the data's length (uint64, little
endian), the masked CRC-32C of those 8 bytes, the data, the masked CRC-32C
of the data. Each record's data is an Event message (tensorflow's
event.proto): wall_time (1, double), step (2, varint), file_version (3,
string) or summary (5: Summary, whose repeated value (1) holds a tag (1,
string) and a simple_value (2, float)), in protobuf's wire format.
]]
local core = require "dormouse.core"
local LN2 = require("dormouse.instrument").LN2

local tensorboard = {}

---------------------------------------------------------------- CRC-32C

local CRC_TABLE = {}
for i = 0, 255 do
  local c = i
  for _ = 1, 8 do c = (c & 1) ~= 0 and (0x82F63B78 ~ (c >> 1)) or (c >> 1) end
  CRC_TABLE[i] = c
end

function tensorboard.crc32c(s)
  local c = 0xFFFFFFFF
  for i = 1, #s do c = CRC_TABLE[(c ~ s:byte(i)) & 0xFF] ~ (c >> 8) end
  return c ~ 0xFFFFFFFF
end

-- the record format's masked CRC: rotated right by 15 and offset, so that a CRC of CRCs differs
local function masked(s)
  local c = tensorboard.crc32c(s)
  return ((((c >> 15) | (c << 17)) & 0xFFFFFFFF) + 0xA282EAD8) & 0xFFFFFFFF
end

local function record(data)
  local len = string.pack("<I8", #data)
  return len .. string.pack("<I4", masked(len)) .. data .. string.pack("<I4", masked(data))
end

---------------------------------------------------------------- protobuf, the parts used

local function varint(n)
  local out = {}
  repeat
    local b = n & 0x7F
    n = n >> 7
    out[#out + 1] = string.char(n ~= 0 and (b | 0x80) or b)
  until n == 0
  return table.concat(out)
end

local function field(number, wire) return varint((number << 3) | wire) end
local function bytes_field(number, s) return field(number, 2) .. varint(#s) .. s end

local function event(wall_time, step, what)
  return field(1, 1) .. string.pack("<d", wall_time) .. field(2, 0) .. varint(step) .. what
end

local function summary(values)
  local tags = {}
  for tag in pairs(values) do tags[#tags + 1] = tag end
  table.sort(tags)
  local parts = {}
  for _, tag in ipairs(tags) do
    parts[#parts + 1] = bytes_field(1, bytes_field(1, tag) .. field(2, 5) .. string.pack("<f", values[tag]))
  end
  return bytes_field(5, table.concat(parts))
end

---------------------------------------------------------------- the writer

local Writer = {}
Writer.__index = Writer

function tensorboard.open(dir, wall_time)
  core.mkdirs(dir)
  wall_time = wall_time or os.time()
  local path = string.format("%s/events.out.tfevents.%d.dormouse", dir, math.floor(wall_time))
  local f, err = io.open(path, "wb")
  if not f then error(string.format("tensorboard: cannot write %s", err), 0) end
  f:write(record(event(wall_time, 0, bytes_field(3, "brain.Event:2"))))
  f:flush()
  return setmetatable({file = f, path = path}, Writer)
end

-- values: tag -> a finite or non-finite number (TensorBoard draws NaN as a gap)
function Writer:scalars(step, wall_time, values)
  if next(values) == nil then return end
  self.file:write(record(event(wall_time, step, summary(values))))
  self.file:flush()
end

function Writer:close() if self.file then self.file:close(); self.file = nil end end


-- The scalars of a metrics.jsonl record: training windows under train/, mem/ and moe/,
-- held-out evals under eval/ (bits per byte; per iteration and per depth).
function tensorboard.scalars_of(rec)
  local v = {}
  if rec.kind == "log" then
    v["train/loss"], v["train/bpb"] = rec.loss, rec.loss and rec.loss / LN2
    v["train/tokens_per_s"], v["train/lr"], v["train/grad_norm"] = rec.tok_s, rec.lr, rec.grad_norm
    v["train/skips"] = rec.skips
    v["mem/allocated_mib"] = rec.mem_allocated and rec.mem_allocated / 2 ^ 20
    v["mem/peak_mib"] = rec.mem_peak and rec.mem_peak / 2 ^ 20
    v["moe/busiest"], v["moe/entropy"], v["moe/dead"], v["moe/drops"] =
      rec.moe_busiest, rec.moe_entropy, rec.moe_dead, rec.moe_drops
    for name, x in pairs(rec.extras or {}) do v["train/" .. name] = x end     -- a model's own terms
  elseif rec.kind == "eval" then
    v["eval/bpb_fin"] = rec.bpb_fin
    for i, ce in ipairs(rec.periter or {}) do v["eval/bpb_iter" .. i] = ce / LN2 end
    for D, ce in pairs(rec.depths or {}) do v["eval/bpb_fin_" .. tostring(D)] = ce / LN2 end
  end
  return v
end

-- One record into the writer at its step and time (log records carry theirs).
function Writer:add(rec)
  if not rec.step then return end
  self:scalars(rec.step, rec.time or os.time(), tensorboard.scalars_of(rec))
end

-- The folder's event files made again from records (a resume keeps what the truncated
-- metrics hold and nothing after): the new file is written, then the old ones go.
function tensorboard.rewrite(dir, records, wall_time)
  local old = {}
  for _, name in ipairs(core.listdir(dir) or {}) do
    if name:find("tfevents", 1, true) then old[#old + 1] = dir .. "/" .. name end
  end
  local w = tensorboard.open(dir, wall_time)
  for _, rec in ipairs(records) do w:add(rec) end
  for _, path in ipairs(old) do
    if path ~= w.path then os.remove(path) end
  end
  return w
end

return tensorboard
