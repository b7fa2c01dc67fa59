-- A plain stack of six byte layers at small's width (models/stack.lua): the plain-bytes side of
-- the ByteFlow A/B (experiments/byteflow_ab.lua), small's data, schedule and optimiser.
return {
  name = "stack_small",
  steps = 2000,
  batch = 8,
  seq = 512,
  model = {arch = "stack", d = 768, heads = 12, head_dim = 64, max_iter = 6, ffn = 2048},
  data = {eval_bytes = 81920},
  optim = {muon_lr = 1e-3, adamw_lr = 1e-3},
  schedule = {kind = "wsd", warmup = 100, decay = 0.2},
  eval = {every = 250},
  checkpoint = {every = 500, keep = 3},
  log = {every = 10},
}
