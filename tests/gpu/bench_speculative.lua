--[[
Speculative decoding measured: small trained with the draft head (model.aux.draft = 0.1) for
STEPS steps (default 2,000) on the embedded corpus, then 4,000 bytes at batch 1 after a
1,024-byte prompt, plain and speculative, greedy and at temperature 0.8, each with the decoder's
CUDA graph: bytes/s over bytes 1,001-4,000 and the share of drafts kept.
  dormouse run tests/gpu/bench_speculative.lua [STEPS]
DRY=1: the CPU, tiny for 60 steps and 200 bytes (the script itself).
]]
local dm = require "dormouse"
local eval = require "dormouse.eval"
local decode = require "dormouse.decode"
local core = require "dormouse.core"
local common = require "tests.gpu.common"

local DRY = os.getenv("DRY") ~= nil
if not DRY and not common.gpu_or_skip(dm.cuda, "bench_speculative") then return end
local device = DRY and "cpu" or "cuda"
local steps = tonumber(arg and arg[1]) or (DRY and 60 or 2000)
local n = DRY and 200 or 4000

local dir = os.tmpname()                   -- a folder of that name for the run (the GPU machine has no busted)
os.remove(dir)
core.mkdirs(dir)
local cfg = require("dormouse.config").load(DRY and "experiments/tiny.lua" or "experiments/small.lua", {
  "steps=" .. steps, "model.aux.draft=0.1", "eval.every=" .. steps, "checkpoint.every=" .. steps, "name=spec",
  "device=" .. device, "schedule.warmup=" .. math.max(1, steps // 20)})
require("dormouse.train").run(cfg, {runs = dir, quiet = true, silent = true, root = "."})
for line in io.lines(dir .. "/spec/log.txt") do
  if line:find("^eval") then print(line:sub(1, 160)) end
end
local m = require("dormouse.probe").load(dir .. "/spec", ".", {device = device})
local corpus = dm.data.open(dm.data.default_corpus(), {eval_bytes = 4096})
local prompt = corpus:bytes(20000, 1024)
corpus:close()

print(string.format("| %s, %d steps, batch 1 | bytes/s over the last bytes to %d | drafts kept |",
                    DRY and "tiny" or "small", steps, n))
print("|---|---|---|")
for _, T in ipairs {0, 0.8} do
  for _, speculative in ipairs {false, true} do
    local before, kept_before = decode.counters.drafts, decode.counters.drafts_kept
    local stamps = {}
    eval.sample(m, prompt, n, {temperature = T, top_p = 1, seed = 1, device = device, speculative = speculative,
                               on_byte = function() stamps[#stamps + 1] = core.now() end})
    if not DRY then dm.cuda.synchronize() end
    local rates = eval.rates(stamps)
    local drafts = decode.counters.drafts - before
    print(string.format("| temperature %g, %s | %.1f | %s |", T, speculative and "speculative" or "plain",
                        rates[#rates].rate, drafts > 0 and string.format("%.1f%%", 100 * (decode.counters.drafts_kept -
                        kept_before) / drafts) or ""))
  end
end
core.remove_tree(dir)
