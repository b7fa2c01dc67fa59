-- Does loss-free balancing help? The small preset with and without it,
-- three seeds each, judged on the held-out bpb_fin.
local dm = require "dormouse"

dm.sweep {
  base = "experiments/small.lua",
  arms = {
    control = {},
    no_lfb = {["model.moe.lfb_gamma"] = 0},
  },
  seeds = {1, 2, 3},
  set = {steps = tonumber(arg[1]) or 300},
}
