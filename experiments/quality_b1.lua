-- Learning quality at b1: 400 steps (B 8, T 1024, lr 5e-4, warm-up 40) on the embedded corpus, the
-- defaults against the forms they replaced (docs/training.md, "Learning quality" and "Balance at b1");
-- held-out bpb_fin on the whole held-out split. A change to the model or its optimiser is checked here too.
--   dormouse sweep experiments/quality_b1.lua --jobs 2           (~14-22 GiB a run; 3 at once overflow 80 GB)
--   dormouse sweep experiments/quality_b1.lua --arms router_f32 --jobs 2
--   dormouse sweep experiments/quality_b1.lua --arms aux_sums_load_share --seeds 1,2 --jobs 2
local sigmoid = {["model.moe.router"] = "sigmoid", ["model.moe.balance"] = "sign"}   -- the router before
local function with(a, b)
  local out = {}
  for k, v in pairs(a) do out[k] = v end
  for k, v in pairs(b) do out[k] = v end
  return out
end

return {
  name = "quality_b1",
  base = "experiments/b1.lua",
  arms = {
    control = {},                                      -- softmax router, proportional balancing (b1.lua)
    router_f32 = {["model.moe.router_dtype"] = "f32"},
    sign_f32 = {["model.moe.balance"] = "sign", ["model.moe.router_dtype"] = "f32"},
    -- the balance that met the targets on seed 1 at 2,000 steps (balance_b1.lua), its router's sums in f32
    aux_sums_load_share = {["model.moe.balance"] = "sign", ["model.moe.router_dtype"] = "f32_sums",
                           ["model.moe.aux_balance"] = 1e-2, ["model.moe.update_by_load"] = "share"},
    sigmoid = sigmoid,                                 -- the defaults of small's A/B
    before = with(sigmoid, {["model.kda.gate"] = "bounded", ["model.init.dt_bias"] = "zeros",
                            ["model.init.a_log"] = "log_uniform", ["model.engram.output"] = "spec",
                            ["model.engram.alpha_gain"] = false, ["model.init.engram_conv"] = "zeros"}),
  },
  seeds = {1, 2, 3},
  set = {steps = 400, ["schedule.warmup"] = 40, ["eval.every"] = 0, ["eval.depths"] = {}, ["checkpoint.every"] = 0},
}
