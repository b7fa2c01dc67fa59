local dm = require "dormouse"
local ckpt = require "dormouse.ckpt"
local core = require "dormouse.core"

-- a fresh, empty directory for each test
local tmpdir = require("tests.lua.helpers").tmpdir

local function rm_rf(path) os.execute("rm -rf '" .. path .. "'") end

local function listdir(path)
  local names = core.listdir(path) or {}
  table.sort(names)
  return names
end

local function read(path)
  local f = assert(io.open(path, "rb"))
  local s = f:read("a")
  f:close()
  return s
end

local function write(path, s)
  local f = assert(io.open(path, "wb"))
  f:write(s)
  f:close()
end

local function flip_byte(path, at)
  local f = assert(io.open(path, "r+b"))
  f:seek("set", at)
  local b = f:read(1):byte()
  f:seek("set", at)
  f:write(string.char(b ~ 0xff))
  f:close()
end

local function same(a, b)
  return a.dtype == b.dtype and table.concat(a:shape(), ",") == table.concat(b:shape(), ",")
         and require("luassert.util").deepcompare(a:totable(), b:totable())
end

local function expect_error(fn, ...)
  local ok, err = pcall(fn)
  assert.is_false(ok, "expected an error")
  for _, part in ipairs {...} do
    assert.is_truthy(tostring(err):find(part, 1, true), "message '" .. tostring(err) .. "' lacks '" .. part .. "'")
  end
  return err
end

describe("ckpt.save_tensors / load_tensors", function()
  local dir
  before_each(function() dir = tmpdir() end)
  after_each(function() rm_rf(dir) end)

  it("round-trips tensors of every dtype, views and metadata", function()
    local base = dm.randn({4, 6}, {seed = 3})
    local tensors = {
      ["layer.1.w"] = base,
      ["layer.1.wt"] = base:t(),                                  -- a strided view
      ["narrow"] = base:narrow(2, 2, 3),
      ["f64"] = dm.randn({5}, {seed = 4, dtype = "f64"}),
      ["bf16"] = base:to("bf16"), ["f16"] = base:to("f16"),
      ["i32"] = dm.arange(-3, 9, {dtype = "i32"}), ["i64"] = dm.tensor({123456789012, -1}, {dtype = "i64"}),
      ["u8"] = dm.arange(0, 256, {dtype = "u8"}),
      ["scalar"] = dm.tensor(2.5), ["empty"] = dm.zeros({0, 3}),
    }
    local path = dir .. "/t.safetensors"
    ckpt.save_tensors(path, tensors, {note = "quote \" and\nnewline", run = "b1"})
    assert.are.same({"t.safetensors"}, listdir(dir))            -- no temporary left behind
    local got, meta = ckpt.load_tensors(path)
    for name, t in pairs(tensors) do
      assert.is_true(same(t, got[name]), name)
      assert.is_true(got[name]:is_contiguous())
      assert.are.equal("cpu", got[name].device)
    end
    local n = 0
    for _ in pairs(got) do n = n + 1 end
    assert.are.equal(11, n)
    assert.are.same({note = "quote \" and\nnewline", run = "b1"}, meta)
  end)

  it("is readable by an independent reader (python3's json and struct)", function()
    local probe = io.popen("python3 -c 'import json, struct; print(1)' 2>/dev/null")
    local has_python = probe and probe:read("a"):match("1")
    if probe then probe:close() end
    if not has_python then
      print("\nSKIP: python3 not found; the C test checks the bytes by hand instead")
      return
    end
    local path = dir .. "/py.safetensors"
    ckpt.save_tensors(path, {a = dm.tensor({{1.5, -2}, {3, 4}}), b = dm.tensor({7, -8}, {dtype = "i64"}),
                             h = dm.tensor({1, -0.5}, {dtype = "bf16"})}, {k = "v"})
    local script = [==[
import json, struct, sys
raw = open(sys.argv[1], "rb").read()
n = struct.unpack("<Q", raw[:8])[0]
assert (8 + n) % 8 == 0, "data not 8-aligned"
head = json.loads(raw[8:8 + n].decode("utf-8"))
data = raw[8 + n:]
fmt = {"F32": "f", "I64": "q", "BF16": "H"}
out = []
for name in sorted(k for k in head if k != "__metadata__"):
    e = head[name]; b, end = e["data_offsets"]
    count = (end - b) // struct.calcsize(fmt[e["dtype"]])
    vals = struct.unpack("<%d%s" % (count, fmt[e["dtype"]]), data[b:end])
    if e["dtype"] == "BF16": vals = [struct.unpack("<f", struct.pack("<I", v << 16))[0] for v in vals]
    out.append("%s %s %s %s" % (name, e["dtype"], e["shape"], " ".join(repr(float(v)) for v in vals)))
assert max(e["data_offsets"][1] for k, e in head.items() if k != "__metadata__") == len(data)
out.append("meta " + json.dumps(head["__metadata__"]))
print("\n".join(out))
]==]
    write(dir .. "/read.py", script)
    local p = io.popen("python3 '" .. dir .. "/read.py' '" .. path .. "' 2>&1")
    local text = p:read("a")
    p:close()
    assert.are.equal(table.concat({
      "a F32 [2, 2] 1.5 -2.0 3.0 4.0",
      "b I64 [2] 7.0 -8.0",
      "h BF16 [2] 1.0 -0.5",
      'meta {"k": "v"}', ""}, "\n"), text)
  end)

  it("refuses bad arguments, naming the file and the key", function()
    local path = dir .. "/bad.safetensors"
    expect_error(function() ckpt.save_tensors(path, {w = 3}) end, "bad.safetensors", "'w' is a number, not a tensor")
    expect_error(function() ckpt.save_tensors(path, {dm.zeros({2})}) end, "tensor names must be strings")
    expect_error(function() ckpt.save_tensors(path, {w = dm.zeros({2})}, {step = 3}) end,
                 "metadata value of 'step' must be a string")
    expect_error(function() ckpt.save_tensors(path, {w = dm.zeros({2})}, {"x"}) end, "metadata keys must be strings")
    expect_error(function() ckpt.save_tensors(path, {["a\0b"] = dm.zeros({2})}) end, "tensor name 'a' contains a NUL byte")
    expect_error(function() ckpt.save_tensors(path, {w = dm.zeros({2})}, {k = "x\0y"}) end,
                 "metadata value of 'k' contains a NUL byte")
    local t = dm.zeros({2})
    t:free()
    expect_error(function() ckpt.save_tensors(path, {gone = t}) end, "bad.safetensors: tensor 'gone' was freed")
    local holder = {}
    dm.scope(function() holder.y = dm.zeros({2}) end)          -- released when its scope ends
    expect_error(function() ckpt.save_tensors(path, {y = holder.y}) end, "tensor 'y' was freed")
    expect_error(function() ckpt.save_tensors(path, {m = dm.zeros({2}, {device = "meta"})}) end, "meta device")
    assert.are.same({}, listdir(dir))
  end)

  it("refuses truncated and corrupted files, naming them", function()
    local path = dir .. "/w.safetensors"
    ckpt.save_tensors(path, {w = dm.zeros({1024})})
    local bytes = read(path)
    write(path, bytes:sub(1, #bytes - 100))
    expect_error(function() ckpt.load_tensors(path) end, "w.safetensors: truncated: header says 4096 bytes of data")
    write(path, bytes:sub(1, 8) .. bytes:sub(9):gsub('"F32"', '"F33"', 1))
    expect_error(function() ckpt.load_tensors(path) end, "w.safetensors: tensor 'w': unknown dtype 'F33'")
    write(path, bytes:sub(1, 8) .. bytes:sub(9):gsub('"shape"', '"shape" ', 1):gsub("  ", " ", 1))
    assert.is.truthy(ckpt.load_tensors(path).w)                -- reformatted whitespace is fine
    write(path, bytes:sub(1, 8) .. bytes:sub(9):gsub('"shape":', '"shape"', 1) .. " ")
    expect_error(function() ckpt.load_tensors(path) end, "w.safetensors: corrupted header: bad JSON", "expected ':'")
    expect_error(function() ckpt.load_tensors(dir .. "/none.safetensors") end, "none.safetensors: cannot open")
  end)
end)

describe("dm.save / dm.load", function()
  local dir
  before_each(function() dir = tmpdir() end)
  after_each(function() rm_rf(dir) end)

  it("write tensors to a safetensors file and read them back, with metadata", function()
    local w = dm.randn({3, 5}, {seed = 2})
    local path = dir .. "/w.safetensors"
    dm.save(path, {w = w, w_bf16 = w:to("bf16"), idx = dm.arange(4), col = w:narrow(2, 2, 2)}, {note = "probe"})
    local back, meta = dm.load(path)
    assert.is_true(same(back.w, w))
    assert.is_true(same(back.w_bf16, w:to("bf16")))
    assert.is_true(same(back.idx, dm.arange(4)))
    assert.is_true(same(back.col, w:narrow(2, 2, 2):contiguous()))
    assert.equal("probe", meta.note)
    assert.same({"w.safetensors"}, listdir(dir))
  end)

  it("refuse bad input by name and leave nothing on disk", function()
    local path = dir .. "/bad.safetensors"
    expect_error(function() dm.save(path, {w = dm.ones({2}), n = 3}) end, path, "'n' is a number, not a tensor")
    expect_error(function() dm.save(42, {}) end, "dm.save: path must be a string")
    expect_error(function() dm.save(path, dm.ones({2})) end, "dm.save", "tensors must be a table")
    expect_error(function() dm.load(dir .. "/none.safetensors") end, "none.safetensors")
    assert.same({}, listdir(dir))
  end)
end)

describe("ckpt.serialize", function()
  local function round(v)
    return ckpt.deserialize("return " .. ckpt.serialize(v), "test")
  end

  it("round-trips awkward values exactly", function()
    local v = {
      tenth = 0.1, big = 1e300, tiny = 5e-324, third = 1 / 3, negzero = -0.0, one = 1.0,
      int = 9007199254740993,                                    -- 2^53 + 1: no float holds it
      max = math.maxinteger, min = math.mininteger, inf = math.huge, ninf = -math.huge,
      quote = 'say "hi"\n\tand \\ leave\0', ["with space"] = true, ["end"] = false,
      nested = {a = {b = {c = {1, 2, {3}}}}, list = {"x", "y"}},
      sparse = {[1] = "a", [3] = "c", [1.5] = "float key", [-1] = "neg"},
      unicode = "café 🐭", empty = {},
    }
    local r = round(v)
    assert.are.equal(0.1, r.tenth)
    assert.are.equal(1e300, r.big)
    assert.are.equal(5e-324, r.tiny)
    assert.are.equal(1 / 3, r.third)
    assert.are.equal(-math.huge, 1 / r.negzero)                 -- the sign survives
    assert.are.equal("float", math.type(r.one))
    assert.are.equal("integer", math.type(r.int))
    assert.are.equal(9007199254740993, r.int)
    assert.are.equal(math.maxinteger, r.max)
    assert.are.equal("integer", math.type(r.min))
    assert.are.equal(math.mininteger, r.min)
    assert.are.equal(math.huge, r.inf)
    assert.are.equal(-math.huge, r.ninf)
    assert.are.equal(v.quote, r.quote)
    assert.are.same(v, r)
    local nan = round({x = 0 / 0}).x
    assert.is_true(nan ~= nan)
  end)

  it("writes readable source", function()
    assert.are.equal('{1, 2.5, "a\\nb", x = {}, ["y z"] = true}', ckpt.serialize({1, 2.5, "a\nb", x = {}, ["y z"] = true}))
    assert.are.equal("0.1", ckpt.serialize(0.1))
    assert.are.equal("-0.0", ckpt.serialize(-0.0))
    assert.are.equal("3.0", ckpt.serialize(3.0))
  end)

  it("refuses what it cannot write, naming where", function()
    expect_error(function() ckpt.serialize({a = {f = print}}, "meta") end, "meta.a.f: a function")
    expect_error(function() ckpt.serialize({w = dm.zeros({1})}, "meta") end, "meta.w: a userdata (a tensor?)")
    local cyc = {}
    cyc.self = {cyc}
    expect_error(function() ckpt.serialize(cyc, "meta") end, "meta.self[1]: the table contains itself")
    expect_error(function() ckpt.serialize({[{}] = 1}, "meta") end, "a table key")
  end)

  it("reads data, not code", function()
    expect_error(function() ckpt.deserialize("return {x = os.exit()}", "m.lua") end, "m.lua: corrupted", "global 'os'")
    expect_error(function() ckpt.deserialize("return {x = io.open('/etc/passwd')}", "m.lua") end, "global 'io'")
    expect_error(function() ckpt.deserialize("while true do end", "m.lua") end, "m.lua: corrupted: too much work")
    expect_error(function() ckpt.deserialize("return 42", "m.lua") end, "expected a table, got number")
    -- memory as well as work: no string method (("x"):rep(1.5e9) took 4.5 GB), no text past 64 MB
    expect_error(function() ckpt.deserialize("return {a = ('x'):rep(1.5e9)}", "m.lua") end, "m.lua: corrupted")
    expect_error(function() ckpt.deserialize(("return {a = 'x'}"):rep(1) .. (" "):rep((64 << 20) + 1), "m.lua") end,
                 "over the 67108864 a table literal may have")
    -- nor by concatenation, an operator ("s .. s" doubled 34 times took 12 GB): a ceiling on memory
    expect_error(function() ckpt.deserialize('local s = "x" for i = 1, 34 do s = s .. s end return {s}', "m.lua") end,
                 "m.lua: corrupted: reading it takes more than the 256 MB a table literal may")
    local big = ckpt.deserialize('local s = "xxxxxxxx" for i = 1, 20 do s = s .. s end return {#s}', "m.lua")
    assert.equal(8 << 20, big[1])                   -- under the ceiling it reads
    assert.equal(("x"):rep(300 << 20):len(), 300 << 20)   -- and the ceiling goes with the reading
    assert.equal("xx", ("x"):rep(2))                 -- the strings' methods are back afterwards
    expect_error(function() ckpt.deserialize("return {", "m.lua") end, "m.lua: corrupted")
    expect_error(function() ckpt.deserialize(string.dump(function() return {} end), "m.lua") end, "binary chunk")
  end)
end)

describe("checkpoint directories", function()
  local run
  before_each(function() run = tmpdir() .. "/run" end)
  after_each(function() rm_rf(run:match("(.*)/run")) end)

  local function parts(step)
    return {
      model = {w = dm.full({3, 2}, step), b = dm.arange(0, 4, {dtype = "i64"})},
      optim = {["w.m"] = dm.full({3, 2}, -step, {dtype = "f64"})},
      meta = {config = {lr = 3e-4, d_model = 64, name = "tiny"}, data = {position = (1 << 53) + 7}},
    }
  end

  it("saves and loads the three parts, with checksums and the RNG state", function()
    dm.manual_seed(77)
    dm.randn({10})
    local seed, offset = dm.rng_state()
    local dir = ckpt.save(run, 12, parts(12))
    assert.are.equal(run .. "/ckpt-12", dir)
    assert.are.same({"ckpt-12"}, listdir(run))
    assert.are.same({"meta.lua", "meta.xxh64", "model.safetensors", "optim.safetensors"}, listdir(dir))
    local got = ckpt.load(dir)
    assert.is_true(same(parts(12).model.w, got.model.w))
    assert.is_true(same(parts(12).model.b, got.model.b))
    assert.is_true(same(parts(12).optim["w.m"], got.optim["w.m"]))
    assert.are.equal(12, got.meta.step)
    assert.are.same({seed = seed, offset = offset}, got.meta.rng)
    assert.are.same(parts(12).meta.config, got.meta.config)
    assert.are.equal("integer", math.type(got.meta.data.position))
    local sum, size = ckpt.checksum(dir .. "/model.safetensors")
    assert.are.same({xxh64 = sum, size = size}, got.meta.files["model.safetensors"])
    assert.are.equal(core.xxh64(read(dir .. "/model.safetensors")), sum)
    assert.is_truthy(read(dir .. "/meta.lua"):match("^return {"))
  end)

  it("finds the newest complete checkpoint, ignoring temporaries", function()
    assert.is_nil(ckpt.latest(run))                            -- no run directory yet
    ckpt.save(run, 5, parts(5))
    ckpt.save(run, 40, parts(40))
    ckpt.save(run, 9, parts(9))
    core.mkdirs(run .. "/ckpt-100.tmp")                    -- an interrupted save
    core.mkdirs(run .. "/ckpt-200")                        -- no meta.lua: not complete
    core.mkdirs(run .. "/other-300")
    local path, step = ckpt.latest(run)
    assert.are.equal(run .. "/ckpt-40", path)
    assert.are.equal(40, step)
    assert.are.equal(40, ckpt.load(path).meta.step)
    ckpt.save(run, 41, parts(41))                               -- clears the stale temporary
    assert.is_nil(core.listdir(run .. "/ckpt-100.tmp"))
  end)

  it("recovers from a save interrupted while replacing a step", function()
    ckpt.save(run, 5, parts(5))
    ckpt.save(run, 7, parts(7))
    os.rename(run .. "/ckpt-5", run .. "/ckpt-5.old")           -- moved aside, replacement unfinished
    core.mkdirs(run .. "/ckpt-5.tmp")
    ckpt.save(run, 7, parts(7))                                  -- ckpt-7 exists: its .old would go
    core.mkdirs(run .. "/ckpt-7.old")
    ckpt.save(run, 8, parts(8))
    assert.are.same({"ckpt-5", "ckpt-7", "ckpt-8"}, listdir(run))
    assert.are.equal(5, ckpt.load(run .. "/ckpt-5").meta.step)
  end)

  it("keeps the last K", function()
    for step = 1, 6 do ckpt.save(run, step * 10, parts(step), {keep = 2}) end
    assert.are.same({"ckpt-50", "ckpt-60"}, listdir(run))
    ckpt.save(run, 60, parts(7), {keep = 2})                     -- the same step again replaces it
    assert.are.same({"ckpt-50", "ckpt-60"}, listdir(run))
    assert.are.equal(7, ckpt.load(run .. "/ckpt-60").model.w:totable()[1][1])
  end)

  it("refuses a file whose checksum or size does not match, naming it", function()
    local dir = ckpt.save(run, 3, parts(3))
    local model = dir .. "/model.safetensors"
    local size = #read(model)
    flip_byte(model, size - 3)
    expect_error(function() ckpt.load(dir) end, "model.safetensors: corrupted: checksum mismatch")
    flip_byte(model, size - 3)
    assert.is.truthy(ckpt.load(dir))                            -- restored: loads again
    local original = read(model)
    write(model, original .. "extra")
    expect_error(function() ckpt.load(dir) end, "model.safetensors: wrong size: meta.lua records " .. size .. " bytes, the file has " .. size + 5)
    write(model, original)
    local optim = dir .. "/optim.safetensors"
    write(optim, read(optim):sub(1, -9))
    expect_error(function() ckpt.load(dir) end, "optim.safetensors: truncated: meta.lua records")
    os.remove(optim)
    expect_error(function() ckpt.load(dir) end, "optim.safetensors: cannot open")
    local meta = read(dir .. "/meta.lua")
    write(dir .. "/meta.lua", meta:gsub("step = 3", "step = 4"))          -- an edit is caught by its checksum
    expect_error(function() ckpt.load(dir) end, "meta.lua: corrupted: checksum mismatch (meta.xxh64 records")
    os.remove(dir .. "/meta.xxh64")                                   -- as an earlier version wrote it: read as data
    write(dir .. "/meta.lua", "return {files = ")
    expect_error(function() ckpt.load(dir) end, "meta.lua: corrupted")
    write(dir .. "/meta.lua", "return {files = {}}")
    expect_error(function() ckpt.load(dir) end, "meta.lua: corrupted: step must be an integer >= 0, got nil")
    write(dir .. "/meta.lua", "return {step = 3}")
    expect_error(function() ckpt.load(dir) end, "meta.lua: corrupted: no files table")
    write(dir .. "/meta.lua", "return {step = 3, files = {}}")
    expect_error(function() ckpt.load(dir) end, "meta.lua: corrupted: no checksum recorded for model.safetensors")
    write(dir .. "/meta.lua", string.format('return {step = 3, files = {["model.safetensors"] = {size = "%d"}}}', size))
    expect_error(function() ckpt.load(dir) end,              -- once "records 430104 bytes, the file has 430104"
                 'meta.lua: corrupted: files["model.safetensors"].size must be an integer, got string ' .. size)
    os.remove(dir .. "/meta.lua")
    expect_error(function() ckpt.load(dir) end, "meta.lua")
  end)

  it("refuses what is not a regular file without opening it for reading (a FIFO would block)", function()
    local dir = ckpt.save(run, 5, parts(5))
    os.remove(dir .. "/model.safetensors")
    assert.is_truthy(os.execute("mkfifo '" .. dir .. "/model.safetensors'"))
    expect_error(function() ckpt.load(dir) end, "model.safetensors: is a FIFO, not a regular file")
    expect_error(function() ckpt.load_tensors(dir .. "/model.safetensors") end, "is a FIFO, not a regular file")
    os.remove(dir .. "/meta.lua")
    assert.is_truthy(os.execute("mkfifo '" .. dir .. "/meta.lua'"))
    expect_error(function() ckpt.load(dir) end, "meta.lua: is a FIFO, not a regular file")
  end)

  it("refuses bad arguments and leaves no temporary behind", function()
    expect_error(function() ckpt.save(run, -1, parts(1)) end, "step must be a non-negative integer")
    expect_error(function() ckpt.save(run, 1.5, parts(1)) end, "step must be a non-negative integer")
    expect_error(function() ckpt.save(run, 1, parts(1), {keep = 0}) end, "keep must be an integer >= 1")
    expect_error(function() ckpt.save(run, 1, {model = 3}) end, "model must be a table")
    expect_error(function() ckpt.save(run, 1, "weights") end, "parts must be a table")
    expect_error(function() ckpt.save(run, 1, {model = {}, meta = "m"}) end, "meta must be a table, got a string")
    expect_error(function() ckpt.save(run, 1, {model = {}, meta = {step = 2}}) end, "meta.step is 2 but the step is 1")
    expect_error(function() ckpt.save(run, 1, {model = {}, meta = {f = print}}) end, "meta.f: a function")
    expect_error(function() ckpt.save(run, 1, {model = {w = 1}}) end, "model.safetensors", "'w' is a number")
    assert.are.same({}, listdir(run))
    expect_error(function() ckpt.load(nil) end, "ckpt.load: expected a checkpoint directory")
  end)
end)
