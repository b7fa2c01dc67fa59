-- ByteFlow (models/byteflow.lua): the patch rule, its causality, the breaks' fit, float32 against float64.
local dm = require "dormouse"
local nn = require "dormouse.nn"
local config = require "dormouse.config"
local train = require "dormouse.train"
local helpers = require "tests.lua.helpers"

local function build(overrides, device)
  local sets = {"model.arch=byteflow"}
  for _, o in ipairs(overrides or {}) do sets[#sets + 1] = o end
  local cfg = config.load("experiments/stack.lua", sets)
  dm.manual_seed(cfg.seed)
  return nn.build({device = device or "cpu"}, train.build_model, cfg, "."), cfg
end

local function flags(values)
  local f = {}
  for v = 1, 256 do f[v] = 0 end
  for _, v in ipairs(values) do f[v + 1] = 1 end
  return dm.tensor(f, {dtype = "u8"})
end

local function list(t)
  local out = {}
  for i = 1, t:numel() do out[i] = t:reshape({-1}):narrow(1, i, 1):item() end
  return out
end

describe("dm.patch_index", function()
  local space = flags {32}

  it("opens a patch at max_len, or at min_len after a break, and gives the ids of tables with a zero row", function()
    local x = dm.tensor({{65, 32, 66, 67, 32, 68, 69, 70, 71, 72}, {32, 32, 32, 32, 32, 32, 32, 32, 32, 32}},
                        {dtype = "u8"})
    local pool, ctx, count = dm.patch_index(x, space, 2, 4, 5)
    -- row 1: "A " "BC " "DEFG" "H": patches end at bytes 2, 5, 9, 10 (1 + row T + t, t 0-based)
    assert.are.same({2, 5, 9, 10, 0, 12, 14, 16, 18, 20}, list(pool))
    assert.are.same({0, 0, 1, 1, 1, 2, 2, 2, 2, 3, 0, 0, 6, 6, 7, 7, 8, 8, 9, 9}, list(ctx))
    assert.are.same({4, 5}, list(count))
  end)

  it("takes a strided view, rows of one byte and empty rows", function()
    local x = dm.tensor({{1, 32, 3, 32, 5, 32}}, {dtype = "u8"})
    local pool = dm.patch_index(x:narrow(2, 2, 4), space, 1, 3, 4)
    assert.are.same({1, 3, 4, 0}, list(pool))                -- " 3 5": " ", "3 ", "5"; the fourth slot empty
    local p1, c1, n1 = dm.patch_index(dm.tensor({{7}, {9}}, {dtype = "u8"}), space, 2, 4, 1)
    assert.are.same({1, 2}, list(p1))
    assert.are.same({0, 0}, list(c1))
    assert.are.same({1, 1}, list(n1))
    local p0, c0, n0 = dm.patch_index(dm.zeros({3, 0}, {dtype = "u8"}), space, 2, 4, 0)
    assert.are.same({3, 0}, p0:shape())
    assert.are.same({3, 0}, c0:shape())
    assert.are.same({0, 0, 0}, list(n0))
  end)

  it("refuses what it cannot group, naming the input", function()
    local x = dm.tensor({{65, 66, 67}}, {dtype = "u8"})
    local function refuses(part, ...) helpers.has(helpers.err_of(dm.patch_index, ...), part) end
    refuses("x must be bytes, u8 [B, T], got i64", x:to("i64"), space, 1, 2, 3)
    refuses("x must be bytes, u8 [B, T], got u8 [3]", x:reshape({3}), space, 1, 2, 3)
    refuses("breaks must be u8 [256]", x, dm.zeros({255}, {dtype = "u8"}), 1, 2, 3)
    refuses("1 <= min_len <= max_len", x, space, 0, 2, 3)
    refuses("1 <= min_len <= max_len", x, space, 3, 2, 3)
    refuses("2 slots cannot hold the patches of 3 bytes with min_len 1", x, space, 1, 2, 2)
  end)

  it("gives a string's bytes as u8 (dm.tensor), and refuses another dtype", function()
    local t = dm.tensor("A \0\255")
    assert.are.equal("u8", t.dtype)
    assert.are.same({65, 32, 0, 255}, list(t))
    assert.are.same({0}, dm.tensor(""):shape())
    local ok, err = pcall(dm.tensor, "ab", {dtype = "f32"})
    assert.is_false(ok)
    assert.truthy(tostring(err):find("a string gives its bytes, u8", 1, true))
  end)
end)

describe("models/byteflow.lua", function()
  local function batch(rows, T)
    local corpus = dm.data.open(dm.data.default_corpus(), {eval_bytes = 4096})
    local x = corpus:batch(2, {batch = rows, seq = T, seed = 7})
    corpus:close()
    return x
  end

  it("predicts each byte from the bytes before it only: a changed byte moves no earlier logit", function()
    local m = build()
    m.breaks:copy_(flags {32, 44, 46, 10})           -- space, comma, full stop, newline
    local x = batch(2, 40)
    local base = dm.no_grad(function() return m:forward(x).fin_logits end)
    local moved = 0
    for _, at in ipairs {3, 11, 24, 40} do           -- input positions (1-based): also a break made or removed
      for _, byte in ipairs {32, 120} do
        local y = x:clone()
        y:narrow(2, at, 1):copy_(dm.full({2, 1}, byte, {dtype = "u8"}))
        local logits = dm.no_grad(function() return m:forward(y).fin_logits end)
        if at > 1 then
          local before = at - 1                     -- the positions reading inputs 1 .. at-1
          assert.is_true(dm.allclose(logits:narrow(2, 1, before), base:narrow(2, 1, before), {rtol = 0, atol = 0}),
                         string.format("byte %d at %d moved an earlier logit", byte, at))
        end
        local later = (logits:narrow(2, at, 41 - at) - base:narrow(2, at, 41 - at)):abs():max():item()
        if later > 0 then moved = moved + 1 end
      end
    end
    assert.is_true(moved >= 6, "a change reaches the positions from it on (" .. moved .. " of 8)")
  end)

  it("fits its breaks to the sample's mean patch, counts it on the log line, and keeps them in the checkpoint",
     function()
    local m = build {"model.patch.mean=3", "model.patch.sample=65536"}
    local corpus = dm.data.open(dm.data.default_corpus(), {eval_bytes = 4096})
    local said = m:prepare(corpus)
    corpus:close()
    assert.truthy(said:find("byte values are breaks", 1, true))
    assert.is_true(m.fitted.breaks > 0 and m.fitted.breaks < 256)
    assert.is_true(math.abs(m.fitted.mean - 3) < 0.25, "mean " .. m.fitted.mean)
    assert.are.equal(65536, m.fitted.sample)
    local x = batch(4, 128)
    local out = dm.no_grad(function() return m:forward(x) end)
    local per = out.extras.patch:item()
    assert.is_true(per > 2 and per < 4.5, "bytes a patch on a batch: " .. per)
    local names = {}
    for _, b in ipairs(m:named_buffers()) do names[b.name] = b.tensor end
    assert.is_truthy(names.breaks)
    assert.are.equal(m.fitted.breaks, names.breaks:to("i64"):sum():item())
  end)

  it("trains, names its arm and its fit, counts patch= and keeps its breaks in the checkpoint", function()
    local runs = helpers.tmpdir()
    local sets = {"model.arch=byteflow", "steps=6", "log.every=3", "eval.every=0", "checkpoint.every=6",
                  "name=bf", "model.patch.sample=32768"}
    helpers.run_quiet(helpers.tiny(sets), {runs = runs})
    local log = assert(helpers.read(runs .. "/bf/log.txt"))
    assert.truthy(log:find("arms: byteflow", 1, true))
    assert.truthy(log:find("byte values are breaks", 1, true))
    assert.truthy(log:find("patch %d"))
    local ckpt = dm.load(runs .. "/bf/ckpt-6/model.safetensors")
    assert.are.equal("u8", ckpt.breaks.dtype)
    assert.is_true(ckpt.breaks:to("i64"):sum():item() > 0)
    os.execute("rm -rf '" .. runs .. "'")
  end)

  it("gives the same loss and gradients in float32 and float64 (rtol 1e-4)", function()
    local m32, m64 = build(), build():cast("f64")
    for _, m in ipairs {m32, m64} do m.breaks:copy_(flags {32, 101}) end
    local x = batch(2, 33)
    local names = helpers.grads_match(m32, m64, function(m) return m:forward(x).loss end)
    for _, p in ipairs(m32:named_parameters()) do assert.is_truthy(p.tensor.grad, p.name .. " has no gradient") end
    assert.is_true(#names > 20)
  end)

  it("refuses patch lengths that do not fit, naming the key", function()
    helpers.has(helpers.err_of(build, {"model.patch.min_len=4", "model.patch.max_len=3"}),
                "model.patch: max_len (3) must be at least min_len (4)")
    helpers.has(helpers.err_of(build, {"model.patch.mean=9"}), "mean (9) must lie within")
  end)
end)
