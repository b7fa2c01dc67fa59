-- Balance at b1 (docs/training.md, "Balance at b1"): what keeps b1's 1,024 experts in use without
-- costing held-out loss. 2,000 steps of b1 (warm-up 200) on a corpus they do not repeat, made by
-- tools/english-corpus.sh (68 MB of English; a run reads 16 MB of it); one seed an arm, the table
-- gives each arm's held-out bpb_fin and its last log window's busiest share and dead experts, each
-- run's log (runs/sweep-balance_b1/ARM-s1.log, metrics.jsonl) the same every 10 steps.
--   tools/english-corpus.sh && dormouse sweep experiments/balance_b1.lua --jobs 2   (~14-22 GiB a run)
local f32 = {["model.moe.router_dtype"] = "f32"}
return {
  name = "balance_b1",
  base = "experiments/b1.lua",
  arms = {
    control = {},                                                    -- softmax router, proportional
    f32 = f32,
    sign_f32 = {["model.moe.balance"] = "sign", ["model.moe.router_dtype"] = "f32"},   -- collapses
    aux_f32 = {["model.moe.balance"] = "sign", ["model.moe.router_dtype"] = "f32", ["model.moe.aux_balance"] = 1e-2},
    aux_1e3 = {["model.moe.balance"] = "sign", ["model.moe.router_dtype"] = "f32", ["model.moe.aux_balance"] = 1e-3},
    aux_1e3_proportional = {["model.moe.router_dtype"] = "f32", ["model.moe.aux_balance"] = 1e-3},
    aux_3e3_proportional = {["model.moe.router_dtype"] = "f32", ["model.moe.aux_balance"] = 3e-3},
    gamma_1e2 = {["model.moe.lfb_gamma"] = 1e-2},
    log = {["model.moe.balance"] = "log"},                           -- a starved expert back as fast
    log_1e2 = {["model.moe.balance"] = "log", ["model.moe.lfb_gamma"] = 1e-2},
    router_small = {["model.moe.router_std"] = 1e-3},
    -- the logits bounded (s cos(u, w_e)), so the balancing bias keeps its hold as the router trains
    cosine_10 = {["model.moe.router_cosine"] = 10},
    cosine_10_sign = {["model.moe.router_cosine"] = 10, ["model.moe.balance"] = "sign"},
    -- the sigmoid router (the default before): loss-free balancing by sign collapses, in proportion does not
    sigmoid = {["model.moe.router"] = "sigmoid", ["model.moe.balance"] = "sign"},
    sigmoid_proportional = {["model.moe.router"] = "sigmoid"},
    sigmoid_aux = {["model.moe.router"] = "sigmoid", ["model.moe.balance"] = "sign", ["model.moe.aux_balance"] = 1e-2},
    -- Muon gives a starved expert a full-size update from a few rows, and an idle one from its fading
    -- momentum: each expert's update scaled by its rows in the step (model.moe.update_by_load)
    load_share = {["model.moe.update_by_load"] = "share"},
    load_active = {["model.moe.update_by_load"] = "active"},
    aux_3e3_load_share = {["model.moe.router_dtype"] = "f32", ["model.moe.aux_balance"] = 3e-3,
                          ["model.moe.update_by_load"] = "share"},
    -- the one weight that kept the dead under 100 (aux_f32), with each expert's update by its share: on seed 1
    -- the first arm to meet the three balance targets (docs/training.md, "Balance at b1")
    aux_f32_load_share = {["model.moe.balance"] = "sign", ["model.moe.router_dtype"] = "f32",
                          ["model.moe.aux_balance"] = 1e-2, ["model.moe.update_by_load"] = "share"},
    -- the same with the router's product from bf16 operands, its f32 sums kept: the f32 product costs
    -- b1 about 8% of its tokens/s (router_dtype = f32_sums)
    aux_sums_load_share = {["model.moe.balance"] = "sign", ["model.moe.router_dtype"] = "f32_sums",
                           ["model.moe.aux_balance"] = 1e-2, ["model.moe.update_by_load"] = "share"},
  },
  seeds = {1},
  set = {steps = 2000, ["schedule.warmup"] = 200, ["data.path"] = "corpora/english.txt.zst",
         ["eval.every"] = 500, ["eval.depths"] = {}, ["checkpoint.every"] = 0},
}
