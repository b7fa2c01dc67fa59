local dm = require "dormouse"
local data = require "dormouse.data"

local tmpdir = require("tests.lua.helpers").tmpdir

local function rm_rf(path) os.execute("rm -rf '" .. path .. "'") end

local function write(path, s)
  local f = assert(io.open(path, "wb"))
  f:write(s)
  f:close()
end

local function read(path)
  local f = assert(io.open(path, "rb"))
  local s = f:read("a")
  f:close()
  return s
end

-- the error of fn(), which must contain every part, and be located in this file
local function expect_error(fn, ...)
  local ok, err = pcall(fn)
  assert.is_false(ok, "expected an error")
  err = tostring(err)
  for _, part in ipairs {...} do
    assert.is_truthy(err:find(part, 1, true), "message '" .. err .. "' lacks '" .. part .. "'")
  end
  return err
end

local function located(err) assert.is_truthy(err:find("data_spec.lua:%d+: "), "not located: " .. err) end

local text = require("tests.lua.helpers").text     -- a window's place in it is unique

local function row_string(t, r)
  local rows = t:totable()
  return string.char(table.unpack(rows[r]))
end

-- is `path` mapped into this process? (Linux)
local function mapped(path)
  local f = io.open("/proc/self/maps", "r")
  if not f then return nil end
  local maps = f:read("a")
  f:close()
  return maps:find(path, 1, true) ~= nil
end

describe("data.open", function()
  local dir, body
  before_each(function()
    dir = tmpdir()
    body = text(3000)
    write(dir .. "/a.txt", body)
  end)
  after_each(function() rm_rf(dir) end)

  it("opens a file and reports its splits", function()
    local c <close> = data.open(dir .. "/a.txt", {eval_bytes = 500})
    assert.are.equal(3000, c:size())
    assert.are.equal(2500, c:train_size())
    assert.are.equal(500, c:eval_size())
    assert.are.same({dir .. "/a.txt"}, c:files())
    assert.are.equal(body:sub(11, 20), c:bytes(10, 10))
    assert.are.equal("\0\0" .. body:sub(1, 3), c:bytes(-2, 5))     -- before the start: pad bytes 0
    assert.are.equal(3000, data.open(dir .. "/a.txt"):train_size())  -- no held-out split by default
    assert.are.equal("Corpus('" .. dir .. "/a.txt': 3000 bytes, train 2500, held out 500)", tostring(c))
  end)

  it("concatenates lists and directories in order, skipping hidden names", function()
    os.execute("mkdir -p '" .. dir .. "/d/sub'")
    write(dir .. "/d/b", "BB")
    write(dir .. "/d/a", "A")
    write(dir .. "/d/sub/c", "C")
    write(dir .. "/d/.hidden", "H")
    local c <close> = data.open({dir .. "/d", dir .. "/d/a"})
    assert.are.equal("ABBCA", c:bytes(0, 5))
    assert.are.equal(4, #c:files())
  end)

  it("reads zstd files", function()
    if not os.execute("command -v zstd >/dev/null 2>&1") then
      pending("the zstd command is not installed; tests/c/test_data.c covers zstd with libzstd")
      return
    end
    assert(os.execute("zstd -q '" .. dir .. "/a.txt' -o '" .. dir .. "/a.txt.zst'"))
    local c <close> = data.open(dir .. "/a.txt.zst", {eval_bytes = 100})
    assert.are.equal(body, c:bytes(0, 3000))
  end)

  it("names the file and the offset in its errors", function()
    located(expect_error(function() data.open(dir .. "/missing.txt") end,
                         "cannot open '" .. dir .. "/missing.txt': No such file or directory"))
    write(dir .. "/empty.txt", "")
    located(expect_error(function() data.open(dir .. "/empty.txt") end, "corpus is empty", "empty.txt"))
    os.execute("mkdir -p '" .. dir .. "/nothing'")
    expect_error(function() data.open(dir .. "/nothing") end, "directory '" .. dir .. "/nothing' holds no files")
    write(dir .. "/bad.zst", "this is not zstd at all")
    located(expect_error(function() data.open(dir .. "/bad.zst") end,
                         "bad.zst' is a corrupted zstd stream", "at compressed byte offset"))
    expect_error(function() data.open(dir .. "/a.txt", {eval_bytes = 3000}) end,
                 "eval_bytes (3000) must be smaller than the corpus size (3000 bytes)")
  end)

  it("checks its arguments", function()
    located(expect_error(function() data.open(42) end, "data.open: expects a path or a list of paths, got number"))
    expect_error(function() data.open({}) end, "got an empty list")
    expect_error(function() data.open({dir .. "/a.txt", 7}) end, "path 2 is a number, not a string")
    located(expect_error(function() data.open(dir .. "/a.txt", {held = 5}) end,
                         "data.open: unknown option 'held' (options: eval, eval_bytes, weights)"))
    expect_error(function() data.open(dir .. "/a.txt", {eval_bytes = -1}) end,
                 "option 'eval_bytes' must be an integer >= 0, got -1")
    expect_error(function() data.open(dir .. "/a.txt", {eval_bytes = 1.5}) end, "got 1.5")
    expect_error(function() data.open(dir .. "/a.txt", "eval") end, "options must be a table, got a string")
  end)

  it("releases the mapped bytes on close and on collection", function()
    if mapped(dir) == nil then pending("no /proc/self/maps here") return end
    local c = data.open(dir .. "/a.txt")
    assert.is_true(mapped(dir .. "/a.txt"))
    c:close()
    assert.is_false(mapped(dir .. "/a.txt"))
    located(expect_error(function() c:size() end, "the corpus is closed"))
    assert.are.equal("Corpus (closed)", tostring(c))
    c:close()                                              -- twice is fine
    do local _ <close> = data.open(dir .. "/a.txt") end
    assert.is_false(mapped(dir .. "/a.txt"))
    data.open(dir .. "/a.txt")
    collectgarbage()
    collectgarbage()
    assert.is_false(mapped(dir .. "/a.txt"))
  end)
end)

describe("a mixture of sources", function()
  local dir, lower, upper, held
  before_each(function()
    dir = tmpdir()
    lower, upper, held = text(20000, 1), text(5000, 2):upper(), text(3000, 3)
    write(dir .. "/a.txt", lower)
    write(dir .. "/b.txt", upper)
    write(dir .. "/e.txt", held)
  end)
  after_each(function() rm_rf(dir) end)

  -- the rows of a batch: how many read source a (lower case), and whether any mixes the two
  local function count_rows(c, n)
    local from_a, crossing = 0, 0
    for _, row in ipairs(c:batch(0, {batch = n, seq = 31, seed = 5}):totable()) do
      local s = string.char(table.unpack(row))
      if s:match("^%l+$") then from_a = from_a + 1 elseif not s:match("^%u+$") then crossing = crossing + 1 end
    end
    return from_a, crossing
  end

  it("draws each row from one source, in proportion to the weights", function()
    local c <close> = data.open({dir .. "/a.txt", dir .. "/b.txt"}, {eval_bytes = 1000, weights = {0.8, 0.2}})
    local from_a, crossing = count_rows(c, 4000)
    assert.are.equal(0, crossing)
    -- corpus:starts says where each row of a batch begins: source a's train bytes, then b's
    local spec = {batch = 6, seq = 31, seed = 5}
    local x = c:batch(2, spec):totable()
    for r, at in ipairs(c:starts(2, spec)) do assert.are.equal(c:bytes(at, 32), string.char(table.unpack(x[r]))) end
    assert.are.same({c:starts(2, spec)[4]}, c:starts(2, {batch = 1, seq = 31, seed = 5, first_row = 3}))
    -- 4,000 draws of a 0.8 coin: the standard deviation of the share is 0.0063
    assert.is_true(math.abs(from_a / 4000 - 0.8) < 0.025, "rows from source a: " .. from_a .. " of 4000")
    local other <close> = data.open({dir .. "/a.txt", dir .. "/b.txt"}, {eval_bytes = 1000, weights = {1, 3}})
    local a2 = count_rows(other, 4000)
    assert.is_true(math.abs(a2 / 4000 - 0.25) < 0.03, "rows from source a at weights 1:3: " .. a2)
    assert.are.equal("Corpus('" .. dir .. "/a.txt' and 1 more files, 2 sources: 25000 bytes, train 24000, " ..
                     "held out 1000)", tostring(c))
  end)

  it("holds out each source's tail, eval_bytes shared by weight", function()
    local c <close> = data.open({dir .. "/a.txt", dir .. "/b.txt"}, {eval_bytes = 1000, weights = {0.8, 0.2}})
    local src = c:sources()
    assert.are.same({0, 19200, 0.8}, {src[1].begin, src[1]["end"], src[1].share})
    assert.are.same({19200, 24000}, {src[2].begin, src[2]["end"]})
    assert.is_true(math.abs(src[2].share - 0.2) < 1e-12)
    assert.are.equal(lower:sub(1, 19200) .. upper:sub(1, 4800), c:bytes(0, 24000))
    assert.are.equal(lower:sub(19201) .. upper:sub(4801), c:bytes(24000, 1000))
    -- no training row reaches a held-out byte: every row lies inside its source's train bytes
    for _, row in ipairs(c:batch(3, {batch = 500, seq = 63, seed = 2}):totable()) do
      local s = string.char(table.unpack(row))
      local at = lower:find(s, 1, true) or upper:find(s, 1, true)
      assert.is_truthy(at)
      assert.is_true(at + 63 <= (s:match("^%l") and 19200 or 4800))
    end
  end)

  it("holds out the end of a separate eval source, and trains on every byte of the others", function()
    local c <close> = data.open({dir .. "/a.txt", dir .. "/b.txt"},
                                {eval_bytes = 2000, weights = {1, 1}, eval = dir .. "/e.txt"})
    assert.are.equal(25000, c:train_size())
    assert.are.equal(2000, c:eval_size())
    assert.are.equal(held:sub(1001), c:bytes(25000, 2000))
    local x = c:eval_windows({seq = 100, n = 2})
    assert.are.equal(held:sub(1001, 1101), row_string(x, 1))
    -- one source with an eval source: the same
    local one <close> = data.open(dir .. "/a.txt", {eval_bytes = 500, eval = dir .. "/e.txt"})
    assert.are.same({20000, 500}, {one:train_size(), one:eval_size()})
  end)

  it("takes globs, in sorted order", function()
    local c <close> = data.open(dir .. "/*.txt", {eval_bytes = 10})
    assert.are.same({dir .. "/a.txt", dir .. "/b.txt", dir .. "/e.txt"}, c:files())
    local mixed <close> = data.open({dir .. "/[ab].txt", dir .. "/e.*"}, {weights = {1, 1}})
    assert.are.equal(2, #mixed:sources())
    expect_error(function() data.open(dir .. "/*.bin") end, "'" .. dir .. "/*.bin' matches no file")
  end)

  it("refuses weights, eval sources and shares that cannot work, naming them", function()
    local ab = {dir .. "/a.txt", dir .. "/b.txt"}
    located(expect_error(function() data.open(ab, {weights = {1}}) end,
                         "option 'weights' must be a list of 2 numbers, one a path, got 1 entries"))
    expect_error(function() data.open(ab, {weights = {1, 0}}) end, "weight 2 (of '" .. dir .. "/b.txt') must be a number > 0")
    expect_error(function() data.open(ab, {weights = {1, 1}, eval = dir .. "/e.txt"}) end,
                 "an eval source ('" .. dir .. "/e.txt') needs eval_bytes > 0")
    expect_error(function() data.open(ab, {weights = {1, 1}, eval_bytes = 4000, eval = dir .. "/e.txt"}) end,
                 "the eval source '" .. dir .. "/e.txt' holds 3000 bytes, fewer than eval_bytes (4000)")
    expect_error(function() data.open(ab, {weights = {1, 9}, eval_bytes = 6000}) end,
                 "source 2 ('" .. dir .. "/b.txt') holds 5000 bytes; its share of eval_bytes, 5400, leaves none to train on")
    write(dir .. "/tiny.txt", "xyz")
    local c <close> = data.open({dir .. "/a.txt", dir .. "/tiny.txt"}, {weights = {1, 1}})
    expect_error(function() c:batch(0, {batch = 2, seq = 8}) end,
                 "the train split of source 2, '" .. dir .. "/tiny.txt' (3 bytes), is shorter than one window of seq + 1 = 9 bytes")
  end)
end)

describe("corpus:batch and corpus:loader", function()
  local dir, body, c
  before_each(function()
    dir = tmpdir()
    body = text(4000, 7)
    write(dir .. "/b.txt", body)
    c = data.open(dir .. "/b.txt", {eval_bytes = 1000})
  end)
  after_each(function() c:close(); rm_rf(dir) end)

  it("gives rows of seq+1 train bytes with the ctx bytes before them", function()
    local x, prefix = c:batch(3, {batch = 4, seq = 15, seed = 9, ctx = 3})
    assert.are.same({4, 16}, x:shape())
    assert.are.same({4, 3}, prefix:shape())
    assert.are.equal("u8", x.dtype)
    for r = 1, 4 do
      local s = row_string(prefix, r) .. row_string(x, r)
      local at = body:find(s, 1, true)
      assert.is_truthy(at, "row " .. r .. " is not in the corpus")
      assert.is_true(at + #s - 1 <= 3000, "row " .. r .. " reaches the held-out split")
    end
    local x2, p2 = c:batch(3, {batch = 4, seq = 15, seed = 9, ctx = 3})
    assert.are.same(x:totable(), x2:totable())
    assert.are.same(prefix:totable(), p2:totable())
    assert.are.not_same(x:totable(), c:batch(4, {batch = 4, seq = 15, seed = 9, ctx = 3}):totable())
    local wide = c:batch(3, {batch = 4, seq = 15, seed = 9, ctx = 3, dtype = "i64"})
    assert.are.equal("i64", wide.dtype)
    assert.are.same(x:totable(), wide:totable())
    local _, none = c:batch(0, {batch = 2, seq = 4})
    assert.are.same({2, 0}, none:shape())
  end)

  it("checks the batch options", function()
    located(expect_error(function() c:batch(0, {batch = 4, seq = 8, sed = 1}) end,
                         "corpus:batch: unknown option 'sed' (options: batch, ctx, device, dtype, first_row, seed, seq)"))
    expect_error(function() c:batch(0, {seq = 8}) end, "corpus:batch: option 'batch' is required")
    expect_error(function() c:batch(0, {batch = 0, seq = 8}) end, "option 'batch' must be an integer >= 1, got 0")
    expect_error(function() c:batch(-1, {batch = 1, seq = 8}) end, "k (the batch number, from 0) must be an integer >= 0, got -1")
    expect_error(function() c:batch(0, {batch = 1, seq = 8, dtype = "f32"}) end,
                 "option 'dtype' must be one of u8, i32, i64, got f32")
    expect_error(function() c:batch(0, {batch = 1, seq = 8, seed = "x"}) end, "option 'seed' must be an integer")
    located(expect_error(function() c:batch(0, {batch = 1, seq = 3000}) end,
                         "the train split of", "(3000 bytes) is shorter than one window of seq + 1 = 3001 bytes"))
    expect_error(function() c:batch(0, {batch = 1, seq = 8, device = "meta"}) end, "meta device")
  end)

  it("hands out batch k, k+1, ... from its thread, as corpus:batch draws them", function()
    local opts = {batch = 3, seq = 20, seed = 5, ctx = 2}
    local loader <close> = c:loader {batch = 3, seq = 20, seed = 5, ctx = 2, start = 10, depth = 2}
    assert.are.equal(10, loader:position())
    for k = 10, 25 do
      local x, prefix, got = loader:next()
      assert.are.equal(k, got)
      local want, wprefix = c:batch(k, opts)
      assert.are.same(want:totable(), x:totable())
      assert.are.same(wprefix:totable(), prefix:totable())
    end
    assert.are.equal(26, loader:position())
    loader:close()
    located(expect_error(function() loader:next() end, "the loader is closed"))
  end)

  it("keeps working after its corpus is closed, and checks its options", function()
    local loader = c:loader {batch = 2, seq = 8}
    local want = c:batch(0, {batch = 2, seq = 8})
    c:close()
    assert.are.same(want:totable(), (loader:next()):totable())
    loader:close()
    c = data.open(dir .. "/b.txt", {eval_bytes = 1000})
    located(expect_error(function() c:loader {batch = 2, seq = 8, depth = 0} end,
                         "corpus:loader: option 'depth' must be an integer >= 1, got 0"))
    expect_error(function() c:loader {batch = 2, seq = 8, depth = 5000} end, "depth must be in 1..1024, got 5000")
    expect_error(function() c:loader {batch = 2, seq = 8, start = -3} end, "option 'start' must be an integer >= 0")
    expect_error(function() c:loader {batch = 2, seq = 8, steps = 3} end, "unknown option 'steps'")
  end)
end)

describe("corpus:eval_windows and the n-gram baseline", function()
  local dir, body, c
  before_each(function()
    dir = tmpdir()
    body = text(2000, 3)
    write(dir .. "/e.txt", body)
    c = data.open(dir .. "/e.txt", {eval_bytes = 401})
  end)
  after_each(function() c:close(); rm_rf(dir) end)

  it("cuts the held-out split into consecutive windows sharing one byte", function()
    assert.are.equal(40, c:eval_count(10))
    local x, prefix = c:eval_windows {seq = 10, ctx = 2}
    assert.are.same({40, 11}, x:shape())
    for i = 1, 40, 13 do
      local start = 1599 + (i - 1) * 10                      -- 0-based offset of window i
      assert.are.equal(body:sub(start + 1, start + 11), row_string(x, i))
      assert.are.equal(body:sub(start - 1, start), row_string(prefix, i))
    end
    assert.are.equal(body:sub(-11), row_string(x, 40))         -- the last window ends at the end
    local first = c:eval_windows {seq = 10, n = 3, dtype = "i32"}
    assert.are.same({3, 11}, first:shape())
    assert.are.equal("i32", first.dtype)
  end)

  it("checks the window options", function()
    located(expect_error(function() c:eval_windows {seq = 10, n = 41} end,
                         "asked for 41 windows of seq + 1 = 11 bytes; the held-out split (401 bytes) holds 40"))
    expect_error(function() c:eval_windows {n = 3} end, "corpus:eval_windows: option 'seq' is required")
    expect_error(function() c:eval_windows {seq = 401} end, "shorter than one window of seq + 1 = 402")
    expect_error(function() c:eval_windows {seq = 4, batch = 3} end, "unknown option 'batch'")
    local whole = data.open(dir .. "/e.txt")
    located(expect_error(function() whole:eval_windows {seq = 10} end, "has no held-out split"))
    expect_error(function() whole:ngram_bpb(3) end, "corpus:ngram_bpb: the corpus has no held-out split")
    whole:close()
  end)

  it("scores the held-out bytes, or the targets of the eval windows", function()
    local bpb, scored = c:ngram_bpb(1)
    assert.are.equal(401, scored)
    assert.is_true(bpb > 4 and bpb < 5, "unigram bpb " .. bpb)      -- 26 letters: about log2(26) = 4.7
    local wbpb, wscored = c:ngram_bpb(2, {seq = 10, n = 7})
    assert.are.equal(70, wscored)
    assert.is_true(wbpb > 0 and wbpb < 8)
    local _, all = c:ngram_bpb(2, {seq = 10})
    assert.are.equal(400, all)                                     -- every held-out byte but the first
    local m <close> = c:ngram(3)
    local info = m:info()
    assert.are.equal(3, info.order)
    assert.are.equal(3, #info.discounts)
    assert.are.equal(26, info.entries[1])
    assert.are.equal(m:bpb {seq = 10}, (c:ngram_bpb(3, {seq = 10})))
    -- a repetitive corpus is predicted better by longer contexts
    write(dir .. "/r.txt", string.rep("the cat sat on the mat. ", 200))
    local r <close> = data.open(dir .. "/r.txt", {eval_bytes = 480})
    assert.is_true(r:ngram_bpb(4) < r:ngram_bpb(2))
    assert.is_true(r:ngram_bpb(4) < 0.2)
    -- a sampled fit (tests/c/test_ngram.c checks its counts) is another model, and a sample as
    -- large as the split is the whole fit
    assert.are_not.equal(c:ngram_bpb(3), c:ngram_bpb(3, {sample = 200}))
    assert.are.equal(c:ngram_bpb(3), c:ngram_bpb(3, {sample = c:train_size()}))
  end)

  it("checks the baseline options", function()
    located(expect_error(function() c:ngram_bpb(0) end, "corpus:ngram: option 'order' must be an integer >= 1, got 0"))
    located(expect_error(function() c:ngram_bpb(9) end, "ngram: order must be in 1..8, got 9"))
    expect_error(function() c:ngram_bpb(2, {n = 3}) end, "option 'n' needs 'seq'")
    expect_error(function() c:ngram_bpb(2, {seq = 10, n = 41}) end, "asked for 41 windows")
    expect_error(function() c:ngram_bpb(2, {seq = 401}) end, "shorter than one window of seq + 1 = 402")
    expect_error(function() c:ngram_bpb(2, {ctx = 3}) end, "unknown option 'ctx' (options: n, sample, seq)")
    expect_error(function() c:ngram(2, {sample = -1}) end, "corpus:ngram: option 'sample' must be an integer >= 0, got -1")
    local m = c:ngram(2)
    m:close()
    expect_error(function() m:bpb() end, "the n-gram model is closed")
  end)
end)

describe("dormouse baseline", function()
  local function baseline(...) return require("tests.lua.helpers").command("baseline", ...) end

  it("prints each order's held-out bpb, as corpus:ngram_bpb scores it, and refuses what it cannot do", function()
    local dir = tmpdir()
    write(dir .. "/r.txt", string.rep("the cat sat on the mat. ", 200))
    local code, out = baseline(dir .. "/r.txt", "--order", "1-3", "--eval-bytes", "480")
    assert.equal(0, code)
    local c <close> = data.open(dir .. "/r.txt", {eval_bytes = 480})
    for order = 1, 3 do
      local line = out:match("\n" .. order .. " +[^\n]+")
      assert.truthy(line, "no row for order " .. order .. " in\n" .. out)
      local bpb = tonumber(line:match("^\n%d+ +([%d.]+)"))
      assert.is_true(math.abs(bpb - c:ngram_bpb(order)) < 1e-4, line)
    end
    assert.truthy(out:find("held out  480 bytes", 1, true), out)
    code, out = baseline(dir .. "/r.txt", "--order", "2", "--eval-bytes", "480", "--seq", "10", "--windows", "4")
    assert.equal(0, code)
    assert.truthy(out:find("scored    the targets of 4 held-out windows of 11 bytes", 1, true), out)
    local said
    code, _, said = baseline(dir .. "/r.txt")
    assert.equal(2, code); assert.truthy(said:find("which order? give --order N", 1, true), said)
    code, _, said = baseline(dir .. "/r.txt", "--order", "2", "--windows", "3")
    assert.equal(2, code); assert.truthy(said:find("--windows needs --seq", 1, true), said)
    rm_rf(dir)
  end)
end)

describe("data.default_corpus", function()
  local dir
  before_each(function() dir = tmpdir() end)
  after_each(function() rm_rf(dir) end)

  it("says which package to install when `bible` is missing", function()
    located(expect_error(function() data.default_corpus {cache_dir = dir, program = "no-such-bible-program"} end,
                         "the program 'no-such-bible-program' was not found",
                         "Debian package bible-kjv", "apt-get install bible-kjv"))
  end)

  it("runs the program without a shell: a name with shell syntax is only a name", function()
    local marker = dir .. "/ran"
    expect_error(function() data.default_corpus {cache_dir = dir, program = "true; touch '" .. marker .. "'"} end,
                 "was not found")
    assert.is_nil(io.open(marker))
  end)

  it("refuses output that is not the Bible", function()
    expect_error(function() data.default_corpus {cache_dir = dir, program = "echo"} end,
                 "printed", "that are not the King James Bible")
  end)

  it("writes the King James Bible once and caches it", function()
    if not os.execute("command -v bible >/dev/null 2>&1") then
      pending("bible-kjv is not installed")
      return
    end
    local path = data.default_corpus {cache_dir = dir .. "/cache"}
    assert.are.equal(dir .. "/cache/kjv.txt", path)
    local kjv = read(path)
    assert.are.equal(4298239, #kjv)
    local head = "\nGenesis 1\n\n  1 In the beginning God created the heaven and the earth.\n"
    local tail = "  21 The grace of our Lord Jesus Christ be with you all. Amen.\n"
    assert.are.equal(head, kjv:sub(1, #head))
    assert.are.equal(tail, kjv:sub(-#tail))
    -- cached: the program is not run again, and no temporary file is left
    assert.are.equal(path, data.default_corpus {cache_dir = dir .. "/cache", program = "no-such-bible-program"})
    local p = io.popen("ls '" .. dir .. "/cache'")
    assert.are.equal("kjv.txt\n", p:read("a"))
    p:close()
    expect_error(function() data.default_corpus {cache = dir} end, "unknown option 'cache' (options: cache_dir, program)")
  end)
end)
