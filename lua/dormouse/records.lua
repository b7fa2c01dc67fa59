--[[
dormouse.records — prompt/response records for supervised fine-tuning
(data.records): rows packed from whole records, and a mask that keeps the
loss to the response bytes.

  local records = require "dormouse.records"
  local set <close> = records.open("tasks/addition.lua", {eval_records = 256})
  local loader <close> = set:loader {batch = 8, seq = 256, seed = 1, ctx = 4, start = k}
  local x, prefix, k, mask = loader:next()       -- loader:peek(), loader:position() as data.lua's
  local ex, eprefix, emask = set:eval_windows {seq = 256, n = 16, ctx = 4}
  for _, r in ipairs(set:held_out()) do print(r.prompt, r.response) end

A file of records is JSONL, one object a line with the strings "prompt" and
"response" (other keys are left alone), or a task file (dormouse.tasks) whose
tasks are answered by a prefix: a task's prompt and answer are a record's.
The file's last eval_records records are held out; the others train.

Training: the records, in an order drawn from the seed once, make one
circular byte stream. Row r of batch k starts where a record starts, the
record drawn from (seed, k, r) alone (the next k is the whole data state, as
for a corpus), and reads T+1 bytes on across record ends (packing); its
prefix is the ctx bytes before that start. mask [B, T] (u8) is 1 where the
target x[:, t+1] is a response byte. Held out: the records in file order,
packed into windows of whole records (a record longer than a window is cut;
the rest of a window is byte 0 under mask 0), each window's prefix the bytes
before its first record.
]]
local dm = require "dormouse"
local json = require "dormouse.json"

local records = {}

local function fail(fmt, ...) error(string.format(fmt, ...), 0) end

-- a JSONL record's fields for the code verifier (tests: a program or a list of statements; language,
-- head, seconds), checked as a task file's are
local function code_fields(rec)
  local tests = rec.tests
  if type(tests) == "table" then
    if #tests == 0 then error("\"tests\" is an empty list", 0) end
    for j, t in ipairs(tests) do
      if type(t) ~= "string" then error(string.format("\"tests\"[%d] is not a string", j), 0) end
    end
  elseif tests ~= nil and type(tests) ~= "string" then
    error("\"tests\" must be a string (a program) or a list of strings (statements)", 0)
  end
  if rec.language ~= nil and rec.language ~= "python3" and rec.language ~= "lua" then
    error(string.format("\"language\" must be \"python3\" or \"lua\", got %s", tostring(rec.language)), 0)
  end
  if rec.head ~= nil and type(rec.head) ~= "string" then error("\"head\" must be a string", 0) end
  if rec.seconds ~= nil and (type(rec.seconds) ~= "number" or rec.seconds <= 0) then
    error("\"seconds\" must be a number > 0", 0)
  end
end

-- the records of a JSONL file, each {prompt, response} (and a code task's tests, language, head,
-- seconds); errors name the file and the line
local function read_jsonl(path)
  local f, err = io.open(path, "rb")
  if not f then fail("data.records: cannot open '%s': %s", path, tostring(err)) end
  local out, n = {}, 0
  for line in f:lines() do
    n = n + 1
    if line:match("%S") then
      local ok, rec = pcall(json.decode, line)
      if not ok or type(rec) ~= "table" then
        f:close()
        fail("data.records: %s:%d is not a JSON object (%s)", path, n, ok and type(rec) or tostring(rec))
      end
      for _, key in ipairs {"prompt", "response"} do
        if type(rec[key]) ~= "string" then
          f:close()
          fail("data.records: %s:%d has no string \"%s\" (a record is {\"prompt\": ..., \"response\": ...})",
               path, n, key)
        end
      end
      if #rec.response == 0 then f:close(); fail("data.records: %s:%d has an empty response", path, n) end
      local ok_code, err = pcall(code_fields, rec)
      if not ok_code then f:close(); fail("data.records: %s:%d: %s", path, n, err) end
      out[#out + 1] = {prompt = rec.prompt, response = rec.response, tests = rec.tests, language = rec.language,
                       head = rec.head, seconds = rec.seconds}
    end
  end
  f:close()
  return out
end

-- the records of a task file: tasks answered by a prefix
local function read_tasks(path)
  local set = require("dormouse.tasks").load(path)
  local out = {}
  for i, t in ipairs(set.tasks) do
    if t.check ~= "prefix" then
      fail("data.records: %s: tasks[%d] is checked by %s; a record is a prompt and the answer that begins its " ..
           "continuation (check \"prefix\", the default)", path, i, type(t.check) == "function" and "a function" or
           "\"" .. tostring(t.check) .. "\"")
    end
    out[i] = {prompt = t.prompt, response = t.answer, tests = t.tests, language = t.language, head = t.head,
              seconds = t.seconds}
  end
  return out
end

--[[ records.read(path) → {{prompt =, response =}, ...}: a .lua path is a task file, any other JSONL ]]
function records.read(path)
  if type(path) ~= "string" then fail("data.records: expects a path, got a %s", type(path)) end
  local list = path:match("%.lua$") and read_tasks(path) or read_jsonl(path)
  if #list == 0 then fail("data.records: %s holds no record", path) end
  return list
end

-- a 64-bit mix (splitmix64's finaliser): the draws of the order and of the rows' records
local function mix(z)
  z = (z ~ (z >> 30)) * 0xbf58476d1ce4e5b9
  z = (z ~ (z >> 27)) * 0x94d049bb133111eb
  return z ~ (z >> 31)
end

local function draw(n, ...)              -- an integer in [0, n) from the integers given
  local z = 0x9e3779b97f4a7c15
  for _, v in ipairs {...} do z = mix(z + v) end
  return z % n
end

-- n bytes of the circular string s from the 0-based offset `from` (any integer)
local function circular(s, from, n)
  local len, parts, at = #s, {}, from % #s
  while n > 0 do
    local take = math.min(n, len - at)
    parts[#parts + 1] = s:sub(at + 1, at + take)
    n, at = n - take, 0
  end
  return table.concat(parts)
end

-- bytes (a string, or a list of strings) as a u8 tensor of `shape`
local function u8(parts, shape)
  local v = {}
  for _, s in ipairs(type(parts) == "string" and {parts} or parts) do
    for i = 1, #s do v[#v + 1] = s:byte(i) end
  end
  if #v == 0 then return dm.zeros(shape, {dtype = "u8"}) end
  return dm.tensor(v, {dtype = "u8"}):reshape(shape)
end

records.mix = mix                        -- (the RL step's draw of its tasks: dormouse.rl)

local RESPONSE, PROMPT = "\1", "\0"

-- the bytes and the mask of records in order, and where each starts (0-based)
local function stream(list)
  local bytes, mask, starts, at = {}, {}, {}, 0
  for i, r in ipairs(list) do
    starts[i] = at
    bytes[#bytes + 1] = r.prompt .. r.response
    mask[#mask + 1] = PROMPT:rep(#r.prompt) .. RESPONSE:rep(#r.response)
    at = at + #r.prompt + #r.response
  end
  return table.concat(bytes), table.concat(mask), starts
end

local Set = {}
Set.__index = Set
Set.__close = function(self) self:close() end

--[[ records.open(path or {path, ...}, {eval_records = N}) → a record set. The last N (default 0) records
of each file are held out, at least one left to train; the held-out records of several files are taken
in turn (the first of each, then the second of each, ...), so that any first n of them mix the files. ]]
function records.open(paths, opts)
  opts = opts or {}
  if type(paths) ~= "table" then paths = {paths} end
  local held = opts.eval_records or 0
  if math.type(held) ~= "integer" or held < 0 then
    fail("data.eval_records must be an integer >= 0, got %s", tostring(held))
  end
  local self = setmetatable({paths = paths, train = {}, held = {}, streams = {}}, Set)
  local held_of = {}
  for f, path in ipairs(paths) do
    local list = records.read(path)
    if held >= #list then
      fail("data.eval_records: %d records held out of the %d in %s leaves none to train on", held, #list, path)
    end
    held_of[f] = {}
    for i, r in ipairs(list) do
      if i <= #list - held then self.train[#self.train + 1] = r else held_of[f][#held_of[f] + 1] = r end
    end
  end
  for i = 1, held do
    for f = 1, #paths do self.held[#self.held + 1] = held_of[f][i] end
  end
  self.train_bytes, self.train_response = 0, 0
  for _, r in ipairs(self.train) do
    self.train_bytes = self.train_bytes + #r.prompt + #r.response
    self.train_response = self.train_response + #r.response
  end
  self.held_bytes = 0
  for _, r in ipairs(self.held) do self.held_bytes = self.held_bytes + #r.prompt + #r.response end
  return self
end

function Set:size() return self.train_bytes + self.held_bytes end
function Set:train_size() return self.train_bytes end
function Set:eval_size() return self.held_bytes end
function Set:files() return self.paths end
function Set:close() self.streams = {} end
function Set:held_out() return self.held end

-- what a run's first line says of it
function Set:describe()
  return string.format("records %s (%d to train, %d held out; %d bytes, %d of them responses)",
                       table.concat(self.paths, " + "),
                       #self.train, #self.held, self.train_bytes, self.train_response)
end

-- the training stream in the seed's order: {bytes, mask, starts}, made once a seed
function Set:stream(seed)
  local s = self.streams[seed]
  if s then return s end
  local order = {}
  for i = 1, #self.train do order[i] = i end
  for i = #order, 2, -1 do                             -- Fisher-Yates, from the seed
    local j = 1 + draw(i, seed, i)
    order[i], order[j] = order[j], order[i]
  end
  local list = {}
  for i, o in ipairs(order) do list[i] = self.train[o] end
  local bytes, mask, starts = stream(list)
  s = {bytes = bytes, mask = mask, starts = starts}
  self.streams[seed] = s
  return s
end

--- set:bytes(offset, n) → n bytes of the training stream (seed 0's order) from a 0-based offset
function Set:bytes(offset, n)
  return circular(self:stream(0).bytes, offset, math.min(n, self.train_bytes - offset))
end

--[[ set:batch(k, {batch = B, seq = T, seed = s, ctx = c}) → x [B, T+1], prefix [B, c], mask [B, T] (u8, on
the CPU): batch k of the seed's stream. ]]
function Set:batch(k, o)
  local s = self:stream(o.seed or 0)
  local B, T, ctx = o.batch, o.seq, o.ctx or 0
  local xs, ps, ms = {}, {}, {}
  for r = 1, B do
    local start = s.starts[1 + draw(#s.starts, o.seed or 0, k, r)]
    xs[r] = circular(s.bytes, start, T + 1)
    ps[r] = ctx > 0 and circular(s.bytes, start - ctx, ctx) or ""
    ms[r] = circular(s.mask, start + 1, T)
  end
  return u8(xs, {B, T + 1}), u8(ps, {B, ctx}), u8(ms, {B, T})
end

local Loader = {}
Loader.__index = Loader
Loader.__close = function(self) self:close() end

--- set:loader{batch, seq, seed, ctx, start = k} → batches start, start+1, ... (next, peek, position, close)
function Set:loader(o)
  local known = {batch = true, seq = true, seed = true, ctx = true, start = true, dtype = true}
  for key in pairs(o) do
    if not known[key] then fail("records:loader: unknown option '%s'", tostring(key)) end
  end
  if o.dtype and o.dtype ~= "u8" then fail("records:loader: batches are u8 bytes, not %s", tostring(o.dtype)) end
  self:stream(o.seed or 0)                             -- the order made now, not at the first step
  return setmetatable({set = self, o = o, k = o.start or 0}, Loader)
end

local function check_open(self)
  if not self.set then error("records loader: closed", 2) end
end

--- loader:next() → x, prefix, k, mask
function Loader:next()
  check_open(self)
  local p = self.peeked
  if p then
    self.peeked = nil
    self.k = self.k + 1
    return p[1], p[2], p[3], p[4]
  end
  local k = self.k
  local x, prefix, mask = self.set:batch(k, self.o)
  self.k = k + 1
  return x, prefix, k, mask
end

--- loader:peek() → the batch the next next() returns, without taking it (its tensors outlive the scope)
function Loader:peek()
  check_open(self)
  if not self.peeked then
    local x, prefix, mask = self.set:batch(self.k, self.o)
    self.peeked = {dm.keep(x), dm.keep(prefix), self.k, dm.keep(mask)}
  end
  local p = self.peeked
  return p[1], p[2], p[3], p[4]
end

function Loader:position() check_open(self); return self.k end
function Loader:close() self.set, self.peeked = nil, nil end

--[[ set:eval_windows{seq = T, n = N (default all), ctx} → x [N, T+1], prefix [N, ctx], mask [N, T] (u8) and
the number of held-out records cut to fit a window ]]
function Set:eval_windows(o)
  local T, ctx = o.seq, o.ctx or 0
  if #self.held == 0 then fail("data.eval_records: no record is held out, so there is nothing to evaluate on") end
  local bytes, mask, starts = stream(self.held)
  local xs, ps, ms, cut = {}, {}, {}, 0
  local i = 1
  while i <= #self.held and (o.n == nil or #xs < o.n) do
    local first, fill = i, 0
    repeat                                             -- whole records while they fit; one at least
      local r = self.held[i]
      local len = #r.prompt + #r.response
      if fill > 0 and fill + len > T + 1 then break end
      if len > T + 1 then cut = cut + 1 end
      fill = math.min(T + 1, fill + len)
      i = i + 1
    until i > #self.held
    local at = starts[first]
    local pad = ("\0"):rep(T + 1 - fill)
    xs[#xs + 1] = bytes:sub(at + 1, at + fill) .. pad
    ms[#ms + 1] = (mask:sub(at + 2, at + fill) .. pad):sub(1, T)
    local before = bytes:sub(math.max(1, at - ctx + 1), at)
    ps[#ps + 1] = ("\0"):rep(ctx - #before) .. before
  end
  local n = #xs
  return u8(xs, {n, T + 1}), u8(ps, {n, ctx}), u8(ms, {n, T}), cut
end

return records
