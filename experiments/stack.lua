-- The unshared-stack baseline (models/stack.lua) at the demo's size.
return {
  name = "stack",
  steps = 400, batch = 8, seq = 128, dtype = "f32",
  model = {arch = "stack", d = 128, heads = 4, head_dim = 32, max_iter = 2, ffn = 512},
  data = {eval_bytes = 65536},
  optim = {muon_lr = 3e-3, adamw_lr = 3e-3},
  schedule = {kind = "wsd", warmup = 20, decay = 0.25},
  eval = {every = 100, windows = 64, baseline = {3, 5}},
  checkpoint = {every = 200, keep = 1},
  log = {every = 20},
}
