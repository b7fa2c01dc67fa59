-- ByteFlow against plain bytes at (nearly) equal parameters (docs/arms.md): six layers a model,
-- all over the bytes (plain) or one before and one after four over patches of about 4 bytes
-- (byteflow: models/byteflow.lua, plus the context projection, d^2 + d), three seeds an arm.
--   dormouse sweep experiments/byteflow_ab.lua [--jobs 6]
return {
  base = "experiments/stack_small.lua",
  control = "plain",
  arms = {
    plain = {},
    byteflow = {["model.arch"] = "byteflow", ["model.max_iter"] = 4},
  },
  seeds = {1, 2, 3},
  set = {["checkpoint.every"] = 0},
}
