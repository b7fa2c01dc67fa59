--[[
Generation on the GPU (dormouse.decode): the one-byte step's blocks captured
as a CUDA graph give a full forward's greedy bytes (tiny, f32, 256 bytes; the
first 64 in bf16 on 10 prompts, tiny trained 400 steps in bf16; random
weights reported with the two best logits' margin where they first differ),
seeded sampling repeats itself and equals the eager blocks', the device's
byte draw is the CPU's, and many streams run; then b1's rate (random weights,
bf16): bytes/s at batch 1 after a 4,096-byte prompt over 10,000 bytes
(graph, and eager blocks over 1,000 for comparison), and 256 streams.
  dormouse run tests/gpu/check_decode.lua [bench-only | checks-only]
DRY=1 runs the tiny checks on the CPU (no graph there: blocks run eagerly), without b1.
]]
local dm = require "dormouse"
local nn = require "dormouse.nn"
local config = require "dormouse.config"
local train = require "dormouse.train"
local eval = require "dormouse.eval"
local decode = require "dormouse.decode"
local common = require "tests.gpu.common"
local core = require "dormouse.core"

local DRY = os.getenv("DRY") ~= nil
if not DRY and not common.gpu_or_skip(dm.cuda, "check_decode") then return end
local GPU = DRY and "cpu" or "cuda"
local checks = common.checks("check_decode")
local bench_only = arg and arg[1] == "bench-only"
local checks_only = arg and arg[1] == "checks-only"

local function build(experiment, dtype, sets)
  local cfg = config.load(experiment, sets or {})
  dm.manual_seed(cfg.seed)
  return nn.build({device = GPU, compute_dtype = dtype}, train.build_model, cfg, ".")
end

local corpus = dm.data.open(dm.data.default_corpus(), {eval_bytes = 4096})
local function text(at, n) return corpus:bytes(at, n) end

local function counted(fn)
  local before = {}
  for k, v in pairs(decode.counters) do before[k] = v end
  local r = fn()
  local d = {}
  for k, v in pairs(decode.counters) do d[k] = k ~= "nodes_per_pass" and v - before[k] or nil end
  return r, d
end

if not bench_only then
  checks.check("core.sample_bytes on the GPU = on the CPU (the host's pick), 672 draws", function()
    local rows = {}
    for r = 1, 48 do
      local l = dm.randn({256}, {seed = r}):totable()
      for i = 1, 256 do
        if r % 4 == 0 then l[i] = math.floor(l[i] * 2) / 2 elseif r % 4 == 1 then l[i] = l[i] * 6 end
      end
      rows[r] = l
    end
    local logits = dm.tensor(rows)
    local seeds, counts = {}, {}
    for r = 1, 48 do seeds[r], counts[r] = 100 + r, r % 7 end
    local differ, n = 0, 0
    for _, setting in ipairs {{0, 1}, {1, 0.95}, {0.7, 0.5}, {1.5, 1}, {1, 1e-9}, {1e-40, 0.9}, {1, 0.999}} do
      for _, offset in ipairs {0, 3} do
        local out = {}
        for side, device in pairs {cpu = "cpu", gpu = GPU} do
          local o = dm.zeros({48}, {dtype = "u8"}):to(device)
          core.sample_bytes(o, logits:to(device), dm.tensor(seeds, {dtype = "i64"}):to(device),
                            dm.tensor(counts, {dtype = "i64"}):to(device), setting[1], setting[2], offset)
          out[side] = o:to("cpu"):totable()
        end
        for r = 1, 48 do
          n = n + 1
          if out.cpu[r] ~= out.gpu[r] then differ = differ + 1 end
        end
      end
    end
    assert(differ <= 1, string.format("%d of %d draws differ", differ, n))    -- (exp's last bit may move one)
    return string.format("%d of %d differ", differ, n)
  end)

  local tiny = build("experiments/tiny.lua", "f32")
  checks.check("tiny f32: the graph's greedy 256 bytes = a full forward's", function()
    local prompt = text(1000, 300)
    local full = eval.sample(tiny, prompt, 256, {temperature = 0, stream = false, context = 4096, device = GPU})
    local got, c = counted(function() return eval.sample(tiny, prompt, 256, {temperature = 0, device = GPU}) end)
    assert(DRY or (c.captures == 1 and c.replayed >= 6), string.format("captures %d, replayed %d, eager %d, failed %d",
                                                              c.captures, c.replayed, c.eager, c.failed_captures))
    assert(got == full, string.format("differ from byte %d", (function()
      for i = 1, #full do if got:byte(i) ~= full:byte(i) then return i end end
      return #full + 1 end)()))
    return string.format("%d blocks replayed", c.replayed)
  end)

  checks.check("tiny f32: seeded sampling repeats, and the graph's bytes = eager blocks'", function()
    local prompt = text(5000, 100)
    local a = eval.sample(tiny, prompt, 200, {temperature = 0.9, seed = 3, device = GPU})
    local b = eval.sample(tiny, prompt, 200, {temperature = 0.9, seed = 3, device = GPU})
    local e = eval.sample(tiny, prompt, 200, {temperature = 0.9, seed = 3, device = GPU, graph = false})
    assert(a == b, "two runs of one seed differ")
    assert(a == e, "the graph's bytes differ from the eager blocks'")
  end)

  checks.check("tiny f32: 6 streams, 3 at once, greedy = each alone for 32 bytes", function()
    local prompts = {}
    for j = 1, 6 do prompts[j] = text(700 * j, 40 + j) end
    local texts = eval.sample_streams(tiny, prompts, 48, {temperature = 0, streams = 3, device = GPU})
    for j, p in ipairs(prompts) do
      local alone = eval.sample(tiny, p, 48, {temperature = 0, device = GPU})
      assert(texts[j]:sub(1, 32) == alone:sub(1, 32), "stream " .. j)
    end
  end)

  -- bf16: the step (one position, recurrent KDA, products at one row) and a full forward (chunked KDA,
  -- products over the context) round differently, so a greedy byte can differ where the full forward's
  -- two best logits are within that rounding. A trained model's must agree for 64 bytes on 10 prompts;
  -- random weights (near-uniform logits: many near-ties) are reported with the first difference's margin.
  local function top_two_margin(model, context)             -- a full forward's last logits: best - second
    return dm.no_grad(function() return dm.scope(function()
      local row = {context:byte(1, -1)}
      row[#row + 1] = 0                                      -- the target slot the forward needs
      local x = dm.tensor({row}, {dtype = "u8"}):to(GPU)
      local l = model:forward(x, dm.zeros({1, 0}, {dtype = "u8"}):to(GPU)).fin_logits
      local v = l:narrow(2, l:size(2), 1):reshape({l:size(3)}):to("cpu"):to("f32"):totable()
      table.sort(v, function(a, b) return a > b end)
      return v[1] - v[2]
    end) end)
  end
  -- the bytes agreed by prompt, the fewest, and the largest of the full forward's top-two margins at
  -- the first difference over the prompts that differ (nil when none does)
  local function greedy_agreement(model)
    local worst, each, margin = math.huge, {}, nil
    for j = 1, 10 do
      local prompt = text(3000 * j, 200)
      local full = eval.sample(model, prompt, 64, {temperature = 0, stream = false, context = 4096, device = GPU})
      local got = eval.sample(model, prompt, 64, {temperature = 0, device = GPU})
      local same = 0
      while same < 64 and got:byte(same + 1) == full:byte(same + 1) do same = same + 1 end
      each[j], worst = same, math.min(worst, same)
      if same < 64 then margin = math.max(margin or 0, top_two_margin(model, prompt .. full:sub(1, same))) end
    end
    return worst, table.concat(each, " "), margin
  end
  local function trained_bf16(steps)                        -- tiny trained in bf16 on the device
    local dir = os.tmpname()
    os.remove(dir)
    core.mkdirs(dir)
    local cfg = config.load("experiments/tiny.lua", {"steps=" .. steps, "dtype=bf16", "device=" .. GPU, "name=t16",
                                                     "eval.every=" .. steps, "checkpoint.every=" .. steps})
    local ok, model = pcall(function()
      train.run(cfg, {runs = dir, quiet = true, silent = true, root = "."})
      return require("dormouse.probe").load(dir .. "/t16", ".", {device = GPU})
    end)
    core.remove_tree(dir)                                    -- whether or not it trained
    if not ok then error(model, 0) end
    return model
  end
  if not DRY then   -- (the CPU's experts take no bf16)
    checks.check("tiny bf16, trained 400 steps: the graph's greedy bytes = a full forward's for 64 bytes on 10 " ..
                 "prompts", function()
      local worst, each, margin = greedy_agreement(trained_bf16(400))
      assert(worst == 64, string.format("a prompt agrees for %d bytes only (bytes by prompt: %s; the full " ..
                                        "forward's two best logits at most %.3g apart where they differ)", worst,
                                        each, margin or 0))
      return "bytes by prompt: " .. each
    end)
    checks.check("tiny bf16, random weights: agreement reported (a difference only at a near-tie)", function()
      local worst, each, margin = greedy_agreement(build("experiments/tiny.lua", "bf16"))
      if margin and margin >= 0.1 then             -- a few bf16 steps of a logit near 8 (2^-5 each)
        error(string.format("a prompt differs where the full forward's two best logits are %.3g apart (bytes by " ..
                            "prompt: %s)", margin, each))
      end
      return string.format("bytes by prompt: %s%s", each, margin and
                           string.format("; the differences at margins of %.3g at most", margin) or "")
    end)
  end
end

if DRY or checks_only then corpus:close(); checks.finish(); return end

-- b1's rates
local b1 = build("experiments/b1.lua", "bf16")
local rows = {}
local function rate_line(label, stamps, t0)
  local parts = {}
  for _, r in ipairs(eval.rates(stamps)) do parts[#parts + 1] = string.format("%d-%d: %.1f", r.from, r.to, r.rate) end
  print(string.format("%s: prompt and first byte %.3f s; bytes/s %s", label, stamps[1] - t0, table.concat(parts, ", ")))
  return eval.rates(stamps)
end

local function batch1(n, graph)
  local stamps, t0 = {}, core.now()
  local _, c = counted(function()
    return eval.sample(b1, text(10000, 4096), n, {temperature = 0.8, seed = 1, device = GPU, graph = graph,
                                                   on_byte = function() stamps[#stamps + 1] = core.now() end})
  end)
  dm.cuda.synchronize()
  local r = rate_line(string.format("b1 batch 1, %s", graph == false and "eager blocks" or "graph"), stamps, t0)
  return r, c
end

checks.check("b1 bf16, batch 1, graph: 10,000 bytes after 4,096", function()
  local r, c = batch1(10000)
  rows[#rows + 1] = {"b1 batch 1 graph, bytes 2-100", r[1].rate}
  rows[#rows + 1] = {"b1 batch 1 graph, bytes 1001-10000", r[#r].rate}
  return string.format("captures %d, replayed %d, eager %d; %.0f graph nodes a pass", c.captures, c.replayed, c.eager,
                       decode.counters.nodes_per_pass or 0)
end)

checks.check("b1 bf16, batch 1, eager blocks: 1,000 bytes after 4,096", function()
  local r = batch1(1000, false)
  rows[#rows + 1] = {"b1 batch 1 eager, bytes 101-1000", r[#r].rate}
end)

checks.check("b1 bf16, 256 streams of 512 bytes", function()
  local prompts = {}
  for j = 1, 256 do prompts[j] = text(97 * j, 64) end
  local t0, total, seen = core.now(), 0, {}
  local t_first                               -- the first block's end: every prompt has run
  eval.sample_streams(b1, prompts, 512, {temperature = 0.8, seed = 1, streams = 256, device = GPU,
                                         on_byte = function(j)
                                           seen[j] = (seen[j] or 0) + 1
                                           if seen[j] == 2 and not t_first then t_first = core.now() end
                                         end,
                                         on_done = function(_, s) total = total + #s end})
  dm.cuda.synchronize()
  local dt, steady = core.now() - t0, core.now() - t_first
  local before = 256 * (1 + decode.BLOCK.cuda)    -- each stream's first byte and its first block, made by then
  rows[#rows + 1] = {"b1 256 streams, bytes/s in all (prompts included)", total / dt}
  rows[#rows + 1] = {"b1 256 streams, bytes/s after the first block", (total - before) / steady}
  return string.format("%d bytes in %.2f s (%d in the %.2f s after the first block)", total, dt, total - before,
                       steady)
end)

print("\n| measure | bytes/s |\n|---|---|")
for _, r in ipairs(rows) do print(string.format("| %s | %.1f |", r[1], r[2])) end
corpus:close()
checks.finish()
