-- Long sequences: passes by segments with the state carried (exact, against the whole pass),
-- training and eval by segments, and streaming generation against full forwards.
local dm = require "dormouse"
local config = require "dormouse.config"
local train = require "dormouse.train"
local segments = require "dormouse.segments"
local eval = require "dormouse.eval"
local helpers = require "tests.lua.helpers"

local function build(overrides, dtype)
  local cfg = config.load("experiments/tiny.lua", overrides)
  dm.manual_seed(cfg.seed)
  local m = train.build_model(cfg, ".")
  return dtype and m:cast(dtype) or m, cfg
end

local function rel(a, b)
  local scale = b:abs():max():item()
  return (a:to("f64") - b:to("f64")):abs():max():item() / (scale > 0 and scale or 1)
end

-- every gradient of model b as model a's (1e-10 relative); the number compared
local function same_gradients(a, b)
  local pb = {}
  for _, p in ipairs(b:named_parameters()) do pb[p.name] = p.tensor end
  local checked = 0
  for _, p in ipairs(a:named_parameters()) do
    if p.tensor.grad then
      local e = rel(pb[p.name].grad, p.tensor.grad)
      assert.is_true(e <= 1e-10, string.format("%s: %.3g", p.name, e))
      checked = checked + 1
    end
  end
  return checked
end

-- the Engram rows' sparse gradient of model b as model a's: the same rows, sums to 1e-10
local function same_engram_rows(a, b)
  local ra, ga = a.block.engram:sparse_grad()
  local rb, gb = b.block.engram:sparse_grad()
  assert.is_true(dm.allclose(ra, rb, {rtol = 0, atol = 0}))
  assert.is_true(rel(gb, ga) <= 1e-10)
end

local corpus
setup(function() corpus = dm.data.open(dm.data.default_corpus(), {eval_bytes = 4096}) end)
teardown(function() corpus:close() end)

local function batch(T, seed) return corpus:batch(3, {batch = 2, seq = T, seed = seed or 5, ctx = 2}) end

describe("a pass by segments with the state carried", function()
  it("gives the whole pass's logits and loss (f64; segments shorter than the convolutions' reach too)", function()
    local m = build(nil, "f64")
    local x, prefix = batch(64)
    dm.no_grad(function()
      local whole = m:forward(x, prefix)
      for _, len in ipairs {17, 5, 1} do            -- 17, 17, 17, 13; Engram's convolution reaches 9 back
        local state, at, fin = {}, 1, 0
        for _, seg in ipairs(segments.split(x, prefix, len)) do
          local out = m:forward(seg.x, seg.prefix, {state = state})
          assert.is_true(rel(out.fin_logits, whole.fin_logits:narrow(2, at, seg.n)) <= 1e-12, "segment at " .. at)
          state, at, fin = out.state, at + seg.n, fin + out.fin:item() * seg.n / 64
        end
        assert.is_true(math.abs(fin - whole.fin:item()) <= 1e-12 * whole.fin:item(), "len " .. len)
      end
    end)
  end)

  it("gives the whole pass's loss, every gradient, the Engram rows' gradient and the routing counts (f64, 4 segments)",
     function()
    local a, b = build(nil, "f64"), build(nil, "f64")
    local x, prefix = batch(64)
    dm.scope(function()
      local out = a:forward(x, prefix)
      local la = out.loss:item()
      out.loss:backward()
      local ca = a:update_balance()
      local lb = segments.backward(b, x, prefix, 16, 1.0):item()
      local cb = b:update_balance()
      assert.is_true(math.abs(la - lb) <= 1e-12 * la)
      assert.is_true(dm.allclose(ca, cb, {rtol = 0, atol = 0}), "routing counts")
      assert.is_true(same_gradients(a, b) > 30)
      same_engram_rows(a, b)
    end)
  end)

  it("runs 200 segments (T 3,200 by 16) as one pass: the loss, every gradient, the Engram rows' sum (f64)",
     function()
    local a, b = build(nil, "f64"), build(nil, "f64")
    local x, prefix = corpus:batch(3, {batch = 1, seq = 3200, seed = 7, ctx = 2})
    dm.scope(function()
      local out = a:forward(x, prefix)
      local la = out.loss:item()
      out.loss:backward()
      local lb = segments.backward(b, x, prefix, 16, 1.0):item()
      assert.is_true(math.abs(la - lb) <= 1e-12 * la, la .. " vs " .. lb)
      same_gradients(a, b)
      -- the segments' lookups were folded as they came: one running sum is left, no lookup
      assert.are.equal(0, #b.block.engram.entries)
      same_engram_rows(a, b)
    end)
  end)

  it("works for models/stack.lua as well", function()
    local m = build({"model.arch=stack"}, "f64")
    local x, prefix = batch(48)
    dm.no_grad(function()
      local whole = m:forward(x, prefix).fin:item()
      local by = segments.evaluate(m, x, prefix, 20).fin
      assert.is_true(math.abs(by - whole) <= 1e-12 * whole)
    end)
  end)

  it("refuses a model whose forward carries no state, by name", function()
    local m = build(nil, "f64")
    local x, prefix = batch(32)
    local stateless = setmetatable({}, {__index = function(_, k)
      if k == "forward" then return function(_, ...) local o = m:forward(...); o.state = nil; return o end end
      return m[k]
    end, __tostring = function() return "a model" end})
    helpers.has(helpers.err_of(segments.evaluate, stateless, x, prefix, 8), "returns no state (out.state)")
  end)

  it("recomputes each iteration's block under model.recompute with the same loss and gradients (f64)", function()
    local a, b = build(nil, "f64"), build({"model.recompute=true"}, "f64")
    local x, prefix = batch(64)
    dm.scope(function()
      local out = a:forward(x, prefix)
      local la = out.loss:item()
      out.loss:backward()
      local lb = segments.backward(b, x, prefix, 16, 1.0):item()
      assert.is_true(math.abs(la - lb) <= 1e-12 * la)
      same_gradients(a, b)
    end)
  end)
end)

describe("training with model.segment", function()
  it("takes the same steps as training on whole rows, and evaluates by segments, saying so", function()
    local dir = helpers.tmpdir()
    local base = {"steps=6", "log.every=1", "eval.every=6", "checkpoint.every=0", "seq=64"}
    local a = helpers.run_quiet(helpers.tiny(base, {"name=whole"}), {runs = dir})
    local b = helpers.run_quiet(helpers.tiny(base, {"name=seg", "model.segment=16"}), {runs = dir})
    assert.is_true(math.abs(a.bpb_fin - b.bpb_fin) <= 1e-5 * a.bpb_fin, a.bpb_fin .. " vs " .. b.bpb_fin)
    local function lines(name, kind)
      local out = {}
      for l in io.lines(dir .. "/" .. name .. "/log.txt") do
        if l:match("^" .. kind) then out[#out + 1] = l end
      end
      return out
    end
    local sa, sb = lines("whole", "step"), lines("seg", "step")
    assert.equal(6, #sb)
    for i = 1, 6 do                                 -- loss and gradient norm as printed
      assert.equal(sa[i]:match("loss (%S+)"), sb[i]:match("loss (%S+)"))
      assert.equal(sa[i]:match("gnorm (%S+)"), sb[i]:match("gnorm (%S+)"))
      assert.equal(sa[i]:match("busiest (%S+)"), sb[i]:match("busiest (%S+)"))
    end
    helpers.has(lines("seg", "eval")[1], "ctx 64 (segments of 16)")
    helpers.has(lines("whole", "eval")[1], "ctx 64  fin")
    os.execute("rm -rf '" .. dir .. "'")
  end)

  it("counts the arms on the log line as whole rows do (their terms by the segments' shares); QAT runs", function()
    local dir = helpers.tmpdir()
    local base = {"steps=3", "schedule.warmup=1", "log.every=3", "eval.every=0", "checkpoint.every=0", "seq=64", "model.loom=true",
                  "model.moe.qat=fp8_e4m3", "model.moe.qat_from=0"}
    helpers.run_quiet(helpers.tiny(base, {"name=whole"}), {runs = dir})
    helpers.run_quiet(helpers.tiny(base, {"name=seg", "model.segment=16"}), {runs = dir})
    local function step3(name)
      for l in io.lines(dir .. "/" .. name .. "/log.txt") do if l:match("^step +3 ") then return l end end
    end
    local a, b = step3("whole"), step3("seg")
    for _, counter in ipairs {"loom", "qat"} do
      local va, vb = tonumber(a:match(counter .. " (%S+)")), tonumber(b:match(counter .. " (%S+)"))
      assert.is_true(va ~= nil and vb ~= nil, a .. "\n" .. b)
      assert.is_true(math.abs(va - vb) <= 1e-3 * math.abs(va) + 1e-6, counter .. ": " .. va .. " vs " .. vb)
    end
    os.execute("rm -rf '" .. dir .. "'")
  end)

  it("is refused by graph = true, naming both keys", function()
    local step = require "dormouse.step"
    local cfg = helpers.tiny({"model.segment=16", "seq=64"})
    local model = build({"model.segment=16", "seq=64"})
    local err = helpers.err_of(step.new, {cfg = cfg, device = "cpu", model = model}, {capture = true, uncaptured = true})
    helpers.has(err, "model.segment = 16", "seq = 64")
  end)
end)

describe("streaming generation", function()
  local m, dir
  setup(function()
    dir = helpers.tmpdir()
    helpers.run_quiet(helpers.tiny({"steps=30", "eval.every=0", "checkpoint.every=30", "name=st"}), {runs = dir})
    m = require("dormouse.probe").load(dir .. "/st", ".")
  end)
  teardown(function() os.execute("rm -rf '" .. dir .. "'") end)

  it("gives the bytes of generation by full forwards, greedy and sampled (f32, 256 bytes, from a checkpoint)",
     function()
    local prompt = "In the beginning God created"
    local full = eval.sample(m, prompt, 256, {temperature = 0, stream = false, context = 4096})
    local streamed = eval.sample(m, prompt, 256, {temperature = 0})
    assert.equal(256, #streamed)
    assert.equal(full, streamed)
    assert.equal(eval.sample(m, prompt, 128, {temperature = 0.9, seed = 7, stream = false, context = 4096}),
                 eval.sample(m, prompt, 128, {temperature = 0.9, seed = 7}))
    assert.equal(eval.sample(m, "", 64, {temperature = 0, stream = false}), eval.sample(m, "", 64, {temperature = 0}))
    assert.equal(full, eval.sample(m, prompt, 256, {temperature = 0, prompt_chunk = 7}))   -- the prompt in chunks
  end)

  it("takes a long prompt in chunks, as one pass would", function()
    local corpus = dm.data.open(dm.data.default_corpus(), {eval_bytes = 4096})
    local prompt = corpus:bytes(0, 20000)
    corpus:close()
    assert.equal(eval.sample(m, prompt, 32, {temperature = 0, prompt_chunk = 20000}),
                 eval.sample(m, prompt, 32, {temperature = 0, prompt_chunk = 8192}))
  end)

  it("keeps host memory flat over a long prompt (dormouse sample --prompt-file, its peak within 300 MB)", function()
    if require("dormouse.core").sanitized then        -- its allocator keeps freed memory in quarantine
      pending("AddressSanitizer's allocator: the peak is its own; the plain build checks it")
      return
    end
    -- a child process each: its peak resident memory (VmHWM) with a 40 KB prompt and with a 2-byte one
    local bin = arg and arg[-1]
    local corpus = dm.data.open(dm.data.default_corpus(), {eval_bytes = 4096})
    local long = corpus:bytes(0, 40000)
    corpus:close()
    local function peak_kb(text)
      local prompt = os.tmpname()
      local f = assert(io.open(prompt, "wb")); f:write(text); f:close()
      local script = os.tmpname()
      f = assert(io.open(script, "w"))
      f:write(string.format([[
local m = require("dormouse.probe").load(%q, ".")
local f = io.open(%q, "rb"); local text = f:read("a"); f:close()
require("dormouse.eval").sample(m, text, 2, {temperature = 0})
for line in io.lines("/proc/self/status") do
  local kb = line:match("^VmHWM:%%s+(%%d+) kB") if kb then print(kb) end
end]], dir .. "/st", prompt))
      f:close()
      local p = assert(io.popen(string.format("'%s' run '%s' 2>/dev/null", bin, script)))
      local out = p:read("a")
      p:close()
      os.remove(prompt); os.remove(script)
      return assert(tonumber(out:match("(%d+)%s*$")), out)
    end
    local short, grown = peak_kb("hi"), peak_kb(long)
    assert.is_true(grown - short < 300 * 1024, string.format("%d KB against %d KB", grown, short))
  end)

  it("checks its options", function()
    helpers.has(helpers.err_of(eval.sample, m, "x", 4, {temperature = -1}), "temperature must be a finite number >= 0")
    helpers.has(helpers.err_of(eval.sample, m, "x", 4, {temperature = math.huge}), "a finite number >= 0")
    -- a temperature whose 1/T an f32 cannot hold is greedy, not a NaN's 0xFF every byte
    assert.equal(eval.sample(m, "In the beginning", 16, {temperature = 0}),
                 eval.sample(m, "In the beginning", 16, {temperature = 1e-40}))
    helpers.has(helpers.err_of(eval.sample, m, "x", 4, {top_p = 0}), "top_p must be a number in (0, 1]")
  end)

  it("runs many streams in one batched step, each the bytes it gives alone, a finished slot taking the next prompt",
     function()
    local prompts = {"In the beginning", "And God said", "\n  1 And the LORD spake unto Moses, ", "Amen", "x"}
    local done = {}
    local texts = eval.sample_streams(m, prompts, 48, {temperature = 0.9, seed = 5, streams = 2,
                                                       on_done = function(j, text) done[#done + 1] = j end})
    for j, p in ipairs(prompts) do
      assert.equal(eval.sample(m, p, 48, {temperature = 0.9, seed = 5 + j - 1}), texts[j], "stream " .. j)
    end
    table.sort(done)
    assert.same({1, 2, 3, 4, 5}, done)
    -- prompts of one length pass together (five of 10 bytes, by passes of two when a pass holds 20
    -- tokens; one of 2 bytes alone): the same texts as alone
    local even = {"In the beg", "And God sa", "Let there ", "Amen, amen", "And it was", "so"}
    for _, tokens in ipairs {eval.PROMPT_TOKENS, 20} do
      local saved = eval.PROMPT_TOKENS
      eval.PROMPT_TOKENS = tokens
      local ok, together = pcall(eval.sample_streams, m, even, 24, {temperature = 0.9, seed = 3, streams = 6})
      eval.PROMPT_TOKENS = saved
      assert.is_true(ok, tostring(together))
      for j, p in ipairs(even) do
        assert.equal(eval.sample(m, p, 24, {temperature = 0.9, seed = 3 + j - 1}), together[j], "prompt " .. j)
      end
    end
    -- a stop text ends a stream once its text ends with it; greedy streams equal greedy alone
    local greedy = eval.sample(m, "In the", 64, {temperature = 0})
    local at = greedy:find("e", 1, true)
    assert.is_truthy(at, greedy)
    local stopped = eval.sample_streams(m, {"In the", "In the"}, 64, {temperature = 0, stop = "e"})
    assert.same({greedy:sub(1, at), greedy:sub(1, at)}, stopped)
    helpers.has(helpers.err_of(eval.sample_streams, m, {"x"}, 4, {top_p = 2}), "top_p must be a number in (0, 1]")
  end)

  it("runs as `dormouse sample RUN --prompts FILE --streams N`, one JSON line a stream", function()
    local bin = arg and arg[-1]
    local file = dir .. "/prompts.jsonl"
    local f = assert(io.open(file, "w"))
    f:write('{"prompt": "In the"}\n{"prompt": "And God"}\n{"prompt": "Amen"}\n')
    f:close()
    local p = assert(io.popen(string.format("'%s' sample '%s/st' --prompts '%s' --streams 2 -n 20 --temperature 0 " ..
                                            "2>/dev/null", bin, dir, file)))
    local out = p:read("a")
    local _, _, code = p:close()
    assert.equal(0, code, out)
    local json, seen = require "dormouse.json", {}
    for line in out:gmatch("[^\n]+") do
      local rec = json.decode(line)
      seen[rec.stream] = rec
    end
    for j, prompt in ipairs {"In the", "And God", "Amen"} do
      assert.equal(prompt, seen[j].prompt)
      assert.equal(eval.sample(m, prompt, 20, {temperature = 0}), seen[j].text)
    end
    f = assert(io.open(dir .. "/bad.jsonl", "w")); f:write('{"prompt": "a"}\n{"text": 3}\n'); f:close()
    p = assert(io.popen(string.format("'%s' sample '%s/st' --prompts '%s/bad.jsonl' 2>&1", bin, dir, dir)))
    local err = p:read("a")
    _, _, code = p:close()
    assert.equal(1, code, err)
    helpers.has(err, "bad.jsonl line 2: expected {\"prompt\": \"...\"}")
  end)

  it("runs as `dormouse sample RUN --prompt TEXT -n N`, the bytes on stdout and their rate on stderr", function()
    local bin = arg and arg[-1]
    local function sample(args)
      local err = dir .. "/stderr"
      local p = assert(io.popen(string.format("'%s' sample %s 2>'%s' </dev/null", bin, args, err)))
      local out = p:read("a")
      local _, _, code = p:close()
      local f = assert(io.open(err))
      local text = f:read("a")
      f:close()
      return code, out, text
    end
    local code, out, err = sample("'" .. dir .. "/st' --prompt 'In the' -n 150 --temperature 0")
    assert.equal(0, code, err)
    local want = eval.sample(m, "In the", 150, {temperature = 0})
    local shown = {}
    local put, finish = require("dormouse.human").byte_printer(function(b) shown[#shown + 1] = b end)
    for i = 1, #want do put(want:sub(i, i)) end
    finish()
    assert.equal(table.concat(shown) .. "\n", out)
    helpers.has(err, "ckpt-30 (step 30), 6 prompt bytes, streaming", "bytes/s over bytes 2-100: ", "101-150: ")
    code, _, err = sample("'" .. dir .. "/st' --top-p 2")
    assert.equal(2, code)
    helpers.has(err, "--top-p takes a number in (0, 1], got '2'", "usage: dormouse sample RUN")
    code, _, err = sample("'" .. dir .. "/st' --prompt x -n 4 --speculative")      -- this model has no draft head
    assert.equal(1, code)
    helpers.has(err, "speculative decoding needs a model with a draft head")
    code, _, err = sample("'" .. dir .. "/st' --speculative --full")
    assert.equal(2, code)
    helpers.has(err, "--speculative drafts on the streamed step: not with --full")
    code, _, err = sample("'" .. dir .. "/none' --prompt x")
    assert.equal(1, code)
    helpers.has(err, "holds no checkpoint")
  end)
end)

describe("long sequences", function()
  it("are measured by `dormouse long`: a table of lengths by segments and generation's rate", function()
    local bin = arg and arg[-1]
    local p = assert(io.popen(string.format("'%s' long experiments/tiny.lua --lengths 64,128 --segment 64 " ..
                                            "--steps 1 --bytes 120 --prompt-bytes 16 2>/dev/null", bin)))
    local out = p:read("a")
    local _, _, code = p:close()
    assert.equal(0, code, out)
    assert.truthy(out:find("\n%s+64%s+1%s+%d+"), out)          -- T, segments, tokens/s
    assert.truthy(out:find("\n%s+128%s+2%s+%d+"), out)
    helpers.has(out, "a 16-byte prompt", "bytes      2-100", "bytes    101-120")
    p = assert(io.popen(string.format("'%s' long experiments/tiny.lua --lengths 64,x 2>&1", bin)))
    local err = p:read("a")
    _, _, code = p:close()
    assert.equal(2, code)
    helpers.has(err, "--lengths must be an integer >= 2, got x", "usage: dormouse long")
    p = assert(io.popen(string.format("'%s' long experiments/tiny.lua --lengths '' 2>&1", bin)))
    err = p:read("a")
    _, _, code = p:close()
    assert.equal(2, code, err)
    helpers.has(err, "--lengths must list one length or more", "usage: dormouse long")
  end)
end)
