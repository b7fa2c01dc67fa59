-- TensorBoard event files (log.tensorboard): read back by a decoder of this file's own
-- (TFRecord framing, masked CRC-32C, protobuf wire format), against metrics.jsonl.
local tb = require "dormouse.tensorboard"
local helpers = require "tests.lua.helpers"

-- CRC-32C, bit by bit (not the module's table): the reference the record CRCs are checked with
local function crc32c(s)
  local c = 0xFFFFFFFF
  for i = 1, #s do
    c = c ~ s:byte(i)
    for _ = 1, 8 do
      local lsb = c & 1
      c = c >> 1
      if lsb == 1 then c = c ~ 0x82F63B78 end
    end
  end
  return c ~ 0xFFFFFFFF
end
local function masked(c) return ((((c >> 15) | (c << 17)) & 0xFFFFFFFF) + 0xA282EAD8) & 0xFFFFFFFF end

local function varint(s, i)
  local n, shift = 0, 0
  repeat
    local b = s:byte(i)
    n, shift, i = n | ((b & 0x7F) << shift), shift + 7, i + 1
  until b < 0x80
  return n, i
end

-- the fields of a message: {[number] = {values...}}, strings for length-delimited ones
local function fields(s)
  local out, i = {}, 1
  while i <= #s do
    local key
    key, i = varint(s, i)
    local number, wire, v = key >> 3, key & 7, nil
    if wire == 0 then v, i = varint(s, i)
    elseif wire == 1 then v, i = string.unpack("<d", s, i)
    elseif wire == 5 then v, i = string.unpack("<f", s, i)
    elseif wire == 2 then
      local n
      n, i = varint(s, i)
      v, i = s:sub(i, i + n - 1), i + n
    else error("wire type " .. wire) end
    out[number] = out[number] or {}
    table.insert(out[number], v)
  end
  return out
end

-- every event of a file: {wall_time, step, version, values = {tag = v}}; each record's CRCs checked
local function events(path)
  local f = assert(io.open(path, "rb"))
  local data = f:read("a")
  f:close()
  local out, i = {}, 1
  while i <= #data do
    local len_bytes = data:sub(i, i + 7)
    local len = string.unpack("<I8", len_bytes)
    assert.equal(masked(crc32c(len_bytes)), (string.unpack("<I4", data, i + 8)), "length CRC at " .. i)
    local body = data:sub(i + 12, i + 11 + len)
    assert.equal(masked(crc32c(body)), (string.unpack("<I4", data, i + 12 + len)), "data CRC at " .. i)
    i = i + 16 + len
    local ev = fields(body)
    local e = {wall_time = ev[1][1], step = ev[2] and ev[2][1] or 0, version = ev[3] and ev[3][1], values = {}}
    for _, v in ipairs(ev[5] and fields(ev[5][1])[1] or {}) do
      local vf = fields(v)
      e.values[vf[1][1]] = vf[2][1]
    end
    out[#out + 1] = e
  end
  assert.equal(#data + 1, i, "the last record ends at the file's end")
  return out
end

local function tb_files(dir)
  local out = {}
  for _, name in ipairs(require("dormouse.core").listdir(dir) or {}) do
    if name:find("tfevents", 1, true) then out[#out + 1] = dir .. "/" .. name end
  end
  return out
end

local function f32(x) return (string.unpack("<f", string.pack("<f", x))) end

describe("TensorBoard event files", function()
  it("use CRC-32C as its check values give it", function()
    assert.equal(0xE3069283, tb.crc32c("123456789"))
    assert.equal(0x8A9136AA, tb.crc32c(string.rep("\0", 32)))      -- RFC 3720, B.4
    assert.equal(0x62A8AB43, tb.crc32c(string.rep("\255", 32)))
    assert.equal(crc32c("dormouse"), tb.crc32c("dormouse"))
  end)

  it("hold a run's log and eval records as scalars (log.tensorboard = true), and are made again on resume",
     function()
    local runs = helpers.tmpdir()
    local o = {"steps=12", "log.every=3", "eval.every=6", "checkpoint.every=6", "log.tensorboard=true", "name=tb"}
    helpers.run_quiet(helpers.tiny(o), {runs = runs, stop_at = 9})   -- killed after step 9: its checkpoint is 6
    helpers.run_quiet(helpers.tiny(o), {runs = runs, resume = runs .. "/tb"})
    local files = tb_files(runs .. "/tb/tb")
    assert.equal(1, #files)
    local evs = events(files[1])
    assert.equal("brain.Event:2", evs[1].version)
    local steps, by_step = {}, {}
    for k = 2, #evs do
      steps[#steps + 1] = evs[k].step
      by_step[evs[k].step] = by_step[evs[k].step] or {}
      for tag, v in pairs(evs[k].values) do by_step[evs[k].step][tag] = v end
    end
    assert.same({3, 6, 6, 9, 12, 12}, steps)      -- log lines and evals once each, none from before the resume
    for line in io.lines(runs .. "/tb/metrics.jsonl") do
      local step = tonumber(line:match('"step":(%d+)'))
      if line:find('"kind":"log"', 1, true) then
        assert.equal(f32(tonumber(line:match('"loss":([^,}]+)'))), by_step[step]["train/loss"])
        assert.equal(f32(tonumber(line:match('"lr":([^,}]+)'))), by_step[step]["train/lr"])
        assert.is_number(by_step[step]["moe/busiest"])
      elseif line:find('"kind":"eval"', 1, true) then
        assert.equal(f32(tonumber(line:match('"bpb_fin":([^,}]+)'))), by_step[step]["eval/bpb_fin"])
        assert.is_number(by_step[step]["eval/bpb_iter2"])
        assert.is_number(by_step[step]["eval/bpb_fin_1"])     -- tiny's eval.depths = {1}
      end
    end
    os.execute("rm -rf '" .. runs .. "'")
  end)

  it("are not written unless asked for", function()
    local runs = helpers.tmpdir()
    helpers.run_quiet(helpers.tiny({"steps=6", "log.every=3", "eval.every=0", "checkpoint.every=0", "name=plain"}),
                      {runs = runs})
    assert.same({}, tb_files(runs .. "/plain/tb"))
    os.execute("rm -rf '" .. runs .. "'")
  end)
end)
