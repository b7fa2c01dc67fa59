-- dormouse corpus: pack writes zstd frames a run reads in place; info says what a corpus holds
local data = require "dormouse.data"
local helpers = require "tests.lua.helpers"

local function write(path, s)
  local f = assert(io.open(path, "wb"))
  f:write(s)
  f:close()
end

local text = require("tests.lua.helpers").text     -- a window's place in it is unique

local function corpus_cmd(...) return helpers.command("corpus", ...) end

local has_zstd = os.execute("command -v zstd >/dev/null 2>&1")

describe("dormouse corpus pack", function()
  local dir, a, b
  before_each(function()
    dir = helpers.tmpdir()
    a, b = text(300000, 1), text(70000, 2)
    os.execute("mkdir -p '" .. dir .. "/in/sub'")
    write(dir .. "/in/a.txt", a)
    write(dir .. "/in/sub/b.txt", b)
  end)
  after_each(function() os.execute("rm -rf '" .. dir .. "'") end)

  it("packs a folder into frames that a corpus reads in place, byte for byte", function()
    local code, out = corpus_cmd("pack", dir .. "/p.zst", dir .. "/in", "--frame-bytes", "10000", "--level", "3")
    assert.are.equal(0, code)
    assert.is_truthy(out:find("370.0 kB in 2 files", 1, true), out)
    assert.is_truthy(out:find("in frames of 10.0 kB", 1, true), out)
    local c <close> = data.open(dir .. "/p.zst", {eval_bytes = 1000})
    assert.are.same({}, c:decoded_whole())
    assert.are.equal(370000, c:size())
    assert.are.equal(a .. b, c:bytes(0, 370000))
    -- rows drawn from the packed file equal the rows drawn from the raw files
    local raw <close> = data.open({dir .. "/in/a.txt", dir .. "/in/sub/b.txt"}, {eval_bytes = 1000})
    local spec = {batch = 8, seq = 300, seed = 4, ctx = 5}
    for k = 0, 5 do assert.are.same(raw:batch(k, spec):totable(), c:batch(k, spec):totable()) end
    -- paths from a list, one a line (blank lines skipped), after those given
    write(dir .. "/list", dir .. "/in/sub/b.txt\n\n" .. dir .. "/in/a.txt\n")
    assert.are.equal(0, (corpus_cmd("pack", dir .. "/listed.zst", dir .. "/in/a.txt", "--files-from", dir .. "/list")))
    local listed <close> = data.open(dir .. "/listed.zst")
    assert.are.equal(a .. b .. a, listed:bytes(0, 670000))
    -- a packed .zst can be packed again (decoded as it is read)
    assert.are.equal(0, (corpus_cmd("pack", dir .. "/again.zst", dir .. "/p.zst", dir .. "/in/a.txt")))
    local again <close> = data.open(dir .. "/again.zst")
    assert.are.equal(a .. b .. a, again:bytes(0, 670000))
    if has_zstd then
      write(dir .. "/joined", a .. b)
      assert.is_true(os.execute("zstd -q -d -c '" .. dir .. "/p.zst' | cmp -s - '" .. dir .. "/joined'") == true)
    end
  end)

  it("refuses to replace a file without --force, to pack its own output, and bad flags", function()
    write(dir .. "/p.zst", "keep me")
    local code, _, err = corpus_cmd("pack", dir .. "/p.zst", dir .. "/in")
    assert.are.equal(1, code)
    assert.is_truthy(err:find("exists; --force replaces it", 1, true), err)
    assert.are.equal("keep me", helpers.read(dir .. "/p.zst"))
    code, _, err = corpus_cmd("pack", dir .. "/in/x.zst", dir .. "/in")
    assert.are.equal(0, code)                   -- x.zst did not exist when the folder was listed
    code, _, err = corpus_cmd("pack", dir .. "/in/x.zst", dir .. "/in", "--force")
    assert.are.equal(1, code)
    assert.is_truthy(err:find("is the output: pack into another file", 1, true), err)
    code, _, err = corpus_cmd("pack", dir .. "/out.txt", dir .. "/in")
    assert.are.equal(2, code)
    assert.is_truthy(err:find("OUT must end in .zst", 1, true), err)
    code, _, err = corpus_cmd("pack", dir .. "/o.zst", dir .. "/in", "--frame-bytes", "99999999")
    assert.are.equal(1, code)
    assert.is_truthy(err:find("the frame size must be in 1 .. 16777216 bytes, got 99999999", 1, true), err)
    assert.is_nil(io.open(dir .. "/o.zst"))
    assert.is_nil(io.open(dir .. "/o.zst.tmp"))
    code, _, err = corpus_cmd("pack", dir .. "/o.zst", dir .. "/missing")
    assert.are.equal(1, code)
    assert.is_truthy(err:find("cannot open '" .. dir .. "/missing'", 1, true), err)
    code, _, err = corpus_cmd("info", dir .. "/in", "--level", "3")
    assert.are.equal(2, code)
    assert.is_truthy(err:find("are pack's", 1, true), err)
  end)
end)

describe("dormouse corpus info and a run's word on files held whole", function()
  it("names a .zst file that a run would hold whole, and a run says so once", function()
    if not has_zstd then
      pending("the zstd command is not installed; tests/c/test_zframes.c covers files held whole")
      return
    end
    local dir = helpers.tmpdir()
    local kjv = data.open(data.default_corpus())
    write(dir .. "/t.txt", kjv:bytes(0, 200000))
    kjv:close()
    -- from a pipe, zstd does not know the size: its frame's header does not say it
    assert(os.execute("cat '" .. dir .. "/t.txt' | zstd -q -c > '" .. dir .. "/piped.zst'"))
    local code, out = corpus_cmd("info", dir .. "/piped.zst", dir .. "/t.txt")
    assert.are.equal(0, code)
    assert.is_truthy(out:find("whole     " .. dir .. "/piped.zst: 200.0 kB held in memory", 1, true), out)
    local cfg = require("dormouse.config").load("experiments/tiny.lua", {"name=whole", "steps=2", "schedule.warmup=1", "eval.every=0",
      "checkpoint.every=0", "log.every=1", "eval.baseline={}", "data.path=" .. dir .. "/piped.zst"})
    helpers.run_quiet(cfg, {runs = dir})
    local log = helpers.read(dir .. "/whole/log.txt")
    assert.is_truthy(log:find("corpus: " .. dir .. "/piped.zst is held whole in memory (200000 bytes decoded)", 1,
                              true), log)
    os.execute("rm -rf '" .. dir .. "'")
  end)
end)
