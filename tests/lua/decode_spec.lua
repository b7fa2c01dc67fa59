-- Generation's draw on the device (core.sample_bytes against the host's pick) and the decoder
-- (dormouse.decode): blocks of bytes over fixed buffers give the bytes a byte at a time gives.
local dm = require "dormouse"
local core = require "dormouse.core"
local config = require "dormouse.config"
local train = require "dormouse.train"
local eval = require "dormouse.eval"
local decode = require "dormouse.decode"
local helpers = require "tests.lua.helpers"

-- rows of logits (a list of lists of 256) drawn by core.sample_bytes: the bytes, as a list
local function device_draw(rows, temperature, top_p, seeds, counts, offset)
  local B = #rows
  local out = dm.zeros({B}, {dtype = "u8"})
  core.sample_bytes(out, dm.tensor(rows), dm.tensor(seeds, {dtype = "i64"}), dm.tensor(counts, {dtype = "i64"}),
                    temperature, top_p, offset)
  return out:totable()
end

describe("the byte draw on the logits' device (core.sample_bytes)", function()
  it("draws the host's byte (eval.pick) from the same uniform, over temperatures, nuclei and ties", function()
    local rows, kinds = {}, {}
    for r = 1, 48 do
      local l = dm.randn({256}, {seed = r}):totable()
      if r % 4 == 0 then                        -- ties: a few values repeated, the maximum too
        for i = 1, 256 do l[i] = math.floor(l[i] * 2) / 2 end
      elseif r % 4 == 1 then                    -- peaked: a handful of likely bytes
        for i = 1, 256 do l[i] = l[i] * 6 end
      end
      rows[r], kinds[r] = l, r % 4
    end
    local seeds, counts = {}, {}
    for r = 1, #rows do seeds[r], counts[r] = 100 + r, r % 7 end
    local compared = 0
    for _, setting in ipairs {{0, 1}, {1, 0.95}, {0.7, 0.5}, {1.5, 1}, {1, 1e-9}, {1e-40, 0.9}, {1, 0.999}} do
      local T, p = setting[1], setting[2]
      for _, offset in ipairs {0, 3} do
        local got = device_draw(rows, T, p, seeds, counts, offset)
        for r, l in ipairs(rows) do
          local u = dm.rand({counts[r] + offset + 1}, {seed = seeds[r]}):totable()[counts[r] + offset + 1]
          -- rows are rounded to f32 by dm.tensor: the host picks from those values
          local f32 = dm.tensor(l):totable()
          assert.are.equal(eval.pick(f32, T, p, u), got[r],
                           string.format("row %d (kind %d), temperature %g, top_p %g, offset %d", r, kinds[r], T, p, offset))
          compared = compared + 1
        end
      end
    end
    assert.are.equal(48 * 7 * 2, compared)
  end)

  it("spreads its draws as the nucleus says (8,000 draws of one row)", function()
    local l = {}
    for i = 1, 256 do l[i] = -30 end
    l[66], l[67], l[68] = 2, 1, 0                -- bytes 65, 66, 67 ('A', 'B', 'C'): 0.665, 0.245, 0.090
    local B = 8000
    local rows, seeds, counts = {}, {}, {}
    for b = 1, B do rows[b], seeds[b], counts[b] = l, 9, b end
    local got = device_draw(rows, 1, 0.9, seeds, counts, 0)
    local n = {}
    for _, b in ipairs(got) do n[b] = (n[b] or 0) + 1 end
    -- the nucleus of 0.9 holds A and B (0.665 + 0.245 >= 0.9): C never comes
    local pa = math.exp(2) / (math.exp(2) + math.exp(1))
    assert.is_nil(n[67])
    assert.is_true(math.abs(n[65] / B - pa) < 0.02, tostring(n[65]))
    assert.are.equal(B, n[65] + n[66])
  end)

  it("refuses bad shapes, dtypes and settings by name", function()
    local l, s, c = dm.zeros({2, 256}), dm.zeros({2}, {dtype = "i64"}), dm.zeros({2}, {dtype = "i64"})
    local out = dm.zeros({2}, {dtype = "u8"})
    local function err(...) return helpers.err_of(core.sample_bytes, ...) end
    helpers.has(err(out, dm.zeros({2, 300}), s, c, 1, 1), "logits must have shape [B, V] with 1 <= V <= 256")
    helpers.has(err(out, l:to("f64"), s, c, 1, 1), "logits must be contiguous f32, got f64")
    helpers.has(err(dm.zeros({3}, {dtype = "u8"}), l, s, c, 1, 1), "out must have shape [2]")
    helpers.has(err(dm.zeros({2}), l, s, c, 1, 1), "out must be u8 or i64, got f32")
    helpers.has(err(out, l, dm.zeros({2}), c, 1, 1), "seeds and counts must be i64")
    helpers.has(err(out, l, s, c, -1, 1), "temperature must be a finite number >= 0")
    helpers.has(err(out, l, s, c, 1, 0), "top_p must lie in (0, 1]")
    helpers.has(err(out, l, s, c, 1, 1, -2), "offset must be >= 0")
  end)
end)

describe("a pass's state at a position inside it (opts.state_at: speculative decoding's verify pass)", function()
  it("is the state a pass up to that position leaves, and the pass's output is unchanged (f64)", function()
    local cfg = config.load("experiments/tiny.lua", {})
    dm.manual_seed(cfg.seed)
    local m64 = train.build_model(cfg, "."):cast("f64")
    m64:eval()
    local bytes = {72, 101, 108, 108, 111, 32, 119, 111, 114, 108, 100}
    dm.no_grad(function()
      local x = dm.tensor({bytes}, {dtype = "u8"})
      local ctx = m64:context()
      -- the prompt: bytes 1..5 (byte 6 its last target); then a pass of bytes 6 and 7 (byte 8 the target)
      local s0 = m64:forward(x:narrow(2, 1, 6), dm.zeros({1, 0}, {dtype = "u8"}), {state = {}}).state
      local win = x:narrow(2, 6, 3)
      local prefix = x:narrow(2, 6 - ctx, ctx)
      local split = m64:forward(win, prefix, {state = s0, state_at = 1})
      local whole = m64:forward(win, prefix, {state = s0})
      local first = m64:forward(x:narrow(2, 6, 2), prefix, {state = s0})
      local worst = 0
      for i, part in pairs(first.state) do
        for key, t in pairs(part) do
          local d = (split.state_at[i][key]:to("f64") - t:to("f64")):abs():max():item()
          worst = math.max(worst, d / math.max(t:to("f64"):abs():max():item(), 1e-300))
        end
      end
      assert.is_true(worst <= 1e-12, "the state at position 1: " .. worst)
      local d = (split.fin_logits - whole.fin_logits):abs():max():item()
      assert.is_true(d <= 1e-12 * whole.fin_logits:abs():max():item(), "logits " .. d)
      for i, part in pairs(whole.state) do
        for key, t in pairs(part) do
          assert.is_true(dm.allclose(split.state[i][key], t, {rtol = 1e-12, atol = 1e-14}), key)
        end
      end
    end)
  end)
end)

describe("the decoder (blocks of bytes over fixed buffers)", function()
  local m
  setup(function()
    local cfg = config.load("experiments/tiny.lua", {"model.engram.orders={2,3}"})
    dm.manual_seed(3)
    m = train.build_model(cfg, ".")
  end)

  it("gives the bytes a byte at a time gives, whatever the block, greedy and sampled", function()
    local prompt = "In the beginning God created"
    for _, T in ipairs {0, 0.9} do
      local one = eval.sample(m, prompt, 45, {temperature = T, seed = 4, block = 1})
      assert.are.equal(45, #one)
      for _, K in ipairs {2, 7, 45, 64} do
        assert.are.equal(one, eval.sample(m, prompt, 45, {temperature = T, seed = 4, block = K}),
                         string.format("temperature %g, block %d", T, K))
      end
      -- by full forwards (no state): the same bytes
      assert.are.equal(one, eval.sample(m, prompt, 45, {temperature = T, seed = 4, stream = false, context = 4096}))
    end
    assert.are.equal(1, #eval.sample(m, prompt, 1, {block = 8}))
    assert.are.equal("", eval.sample(m, prompt, 0, {block = 8}))
  end)

  it("runs many streams in blocks as a byte at a time, a finished slot taking the next prompt", function()
    local prompts = {"In the beginning", "And God said", "Amen", "x", "Let there be light"}
    local function texts(K, stop)
      return eval.sample_streams(m, prompts, 30, {temperature = 0.8, seed = 2, streams = 2, block = K, stop = stop})
    end
    local one = texts(1)
    for j, p in ipairs(prompts) do
      assert.are.equal(eval.sample(m, p, 30, {temperature = 0.8, seed = 2 + j - 1}), one[j], "stream " .. j)
    end
    assert.same(one, texts(4))
    assert.same(one, texts(30))
    assert.same(texts(1, "e"), texts(5, "e"))             -- a stop inside a block ends the stream there
    for j, t in ipairs(texts(5, "e")) do
      assert.is_true(#t == 30 or t:sub(-1) == "e", string.format("stream %d: %q", j, t))
    end
  end)

  it("a greedy judge stops inside a block, as it would a byte at a time", function()
    local n = 0
    local function judge(text)
      n = n + 1
      if #text == 11 then return true end
    end
    local one = eval.greedy_until(m, "In the", 40, judge, {block = 1})
    local calls = n
    n = 0
    local text, verdict = eval.greedy_until(m, "In the", 40, judge, {block = 8})
    assert.are.equal(one, text)
    assert.are.equal(11, #text)
    assert.is_true(verdict)
    assert.are.equal(calls, n)
  end)

  it("gathers a short pass's Engram lookups as they are, the values of the distinct-rows form", function()
    local x = dm.tensor({{72, 105, 32, 72, 105, 33}, {33, 10, 10, 33, 10, 10}}, {dtype = "u8"})
    local prefix = dm.tensor({{1, 2, 3, 4}, {5, 6, 7, 8}}, {dtype = "u8"})
    local engram = m.block.engram
    local short = dm.no_grad(function() return engram:lookup(x:narrow(2, 1, 2), prefix) end)
    local long = dm.no_grad(function() return engram:lookup(x, prefix) end)   -- six bytes a row: the sorted form
    assert.is_true(short.in_order)                                     -- the compact is the lookups, in order
    assert.is_nil(long.in_order)
    assert.is_true(long.compact:size(1) < long.inverse:numel())       -- repeated n-grams: fewer distinct rows
    local a = short.compact:reshape({-1})
    local b = dm.embedding(long.inverse, long.compact):narrow(2, 1, 2):reshape({-1})
    assert.is_true(dm.allclose(a, b, {rtol = 0, atol = 0}))
  end)

  it("refuses a step before any stream is put", function()
    local d = decode.new(m, 2, {block = 2})
    helpers.has(helpers.err_of(d.step, d), "decode: step before any slot was put")
    d:free()
  end)
end)

describe("the one-byte step's launches (b1's structure at small widths, bf16, on the meta device)", function()
  local nn = require "dormouse.nn"
  local VIEWS = {reshape = true, narrow = true, unsqueeze = true, squeeze = true, transpose = true, expand = true}

  -- a pass of generation's step (batch 1, one byte, state carried) after a first one that made the
  -- held copies, as the decoder's blocks run it: its op calls by name, and the calls that are not views
  local function step_ops(sets)
    local all = {"model.d=128", "model.heads=2", "model.head_dim=64", "model.experts=64", "model.ffn=341",
                 "model.engram.rows=4096", "model.expert_rank=16", "model.shared_rank=32"}
    for _, s in ipairs(sets or {}) do all[#all + 1] = s end
    local cfg = config.load("experiments/b1.lua", all)
    local model = nn.build({device = "meta", compute_dtype = "bf16"}, train.build_model, cfg, ".")
    model:eval()
    local calls, kernels = {}, 0
    dm.no_grad(function()
      local ctx = model:context()
      local function bytes(n) return dm.zeros({1, n}, {dtype = "u8", device = "meta"}) end
      local state = model:forward(bytes(9), bytes(ctx), {state = {}}).state
      local copies = {}
      local function step() model:forward(bytes(2), bytes(ctx), {state = state, readout = "fin"}) end
      nn.holding(copies, step)
      dm.profile.start()
      nn.holding(copies, step)
      for _, r in ipairs(dm.profile.stop()) do
        calls[r.name] = (calls[r.name] or 0) + r.calls
        if not VIEWS[r.name] then kernels = kernels + r.calls end
      end
      nn.release_copies(copies)
    end)
    return calls, kernels, cfg.model.max_iter
  end

  it("makes 8 products an iteration and 2 a pass: the products of one input stacked, Engram's once", function()
    local calls, _, iters = step_ops()
    -- an iteration: KDA's stack (q, k, v, beta, the gate's and the output gate's first factors), their
    -- second factors, W_o; Engram's W_e; the router's and shared expert's stack, its down and the write.
    -- A pass: Engram's keys and values, the head.
    assert.are.equal(8 * iters + 2, calls.matmul)
    assert.is_nil(calls.cat)                             -- the write's padding: routed added in place, not padded
    assert.are.equal(iters, calls.add_)                  -- that sum alone: a step counts no routing
    -- KDA's and Engram's adds with the next norms, and the experts' with the next iteration's
    assert.are.equal(3 * iters - 1, calls.add_rmsnorm)
  end)

  it("calls at most 183 ops that are not views (a new op in the step trips this; then say why here)", function()
    local _, kernels = step_ops()
    assert.is_true(kernels <= 183, "ops that are not views: " .. kernels)
  end)
end)

-- the chi-square quantile for df degrees of freedom at a tail of 1e-3 (Wilson and Hilferty)
local function chi2_limit(df)
  local z = 3.09                                                          -- the normal's 0.999 quantile
  return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ^ 3
end

describe("speculative decoding (a draft head's byte verified a pass)", function()
  local m, trained
  setup(function()
    local cfg = config.load("experiments/tiny.lua", {"model.aux.draft=0.1"})
    dm.manual_seed(3)
    m = train.build_model(cfg, ".")
    local dir = helpers.tmpdir()
    helpers.run_quiet(helpers.tiny({"steps=150", "eval.every=0", "checkpoint.every=150", "name=sp",
                                    "model.aux.draft=0.1"}), {runs = dir})      -- its drafts: about half kept
    trained = require("dormouse.probe").load(dir .. "/sp", ".")
    os.execute("rm -rf '" .. dir .. "'")
  end)

  it("gives the greedy bytes, whatever the block, one stream or many", function()
    local prompt = "In the beginning God"
    local plain = eval.sample(trained, prompt, 50, {temperature = 0})
    local before = decode.counters.drafts_kept
    for _, K in ipairs {1, 3, 7} do
      assert.are.equal(plain, eval.sample(trained, prompt, 50, {temperature = 0, speculative = true, block = K}),
                       "block " .. K)
    end
    assert.is_true(decode.counters.drafts_kept - before > 20)          -- the kept drafts' path is taken
    local prompts = {"In the", "And God said", "Amen"}
    local texts = eval.sample_streams(trained, prompts, 30, {temperature = 0, speculative = true, block = 4})
    for j, p in ipairs(prompts) do assert.are.equal(eval.sample(trained, p, 30, {temperature = 0}), texts[j]) end
    assert.are.equal(eval.sample(m, prompt, 40, {temperature = 0}),    -- an untrained draft: rarely kept
                     eval.sample(m, prompt, 40, {temperature = 0, speculative = true, block = 5}))
  end)

  it("samples the model's own distribution (a chi-square test against plain sampling, 1,200 streams)", function()
    local N, prompt = 1200, "And the LORD said unto"
    local prompts = {}
    for j = 1, N do prompts[j] = prompt end
    local function counts(opts)
      local texts = eval.sample_streams(trained, prompts, 4, opts)
      local c = {}
      for _, t in ipairs(texts) do
        for pos = 2, 4 do                        -- the bytes a verify pass decides (the first is the prompt's)
          local key = pos .. ":" .. t:byte(pos)
          c[key] = (c[key] or 0) + 1
        end
      end
      return c
    end
    local plain = counts({temperature = 1, top_p = 1, seed = 1, streams = N})
    local spec = counts({temperature = 1, seed = 100000, streams = N, speculative = true, block = 2})
    local stat, df, other_a, other_b = 0, -1, 0, 0
    local keys = {}
    for key in pairs(plain) do keys[key] = true end
    for key in pairs(spec) do keys[key] = true end
    for key in pairs(keys) do
      local a, b = plain[key] or 0, spec[key] or 0
      if a + b >= 10 then stat, df = stat + (a - b) ^ 2 / (a + b), df + 1
      else other_a, other_b = other_a + a, other_b + b end
    end
    if other_a + other_b > 0 then stat, df = stat + (other_a - other_b) ^ 2 / (other_a + other_b), df + 1 end
    assert.is_true(df >= 5, "too few categories: " .. df)
    assert.is_true(stat < chi2_limit(df), string.format("chi-square %.1f on %d degrees of freedom (limit %.1f)", stat,
                                                        df, chi2_limit(df)))
  end)

  it("refuses a nucleus and a model without a draft head, by name", function()
    helpers.has(helpers.err_of(decode.speculative, m, 1, {top_p = 0.9}), "top_p must be 1, got 0.9")
    local plain = train.build_model(config.load("experiments/tiny.lua", {}), ".")
    helpers.has(helpers.err_of(eval.sample, plain, "x", 4, {speculative = true}), "draft head")
  end)
end)

