-- b1 on a 16 GB card: the same model and batch (8 x 1024 = 8,192 bytes a
-- step) in under 12 GiB of device memory (11.88 measured on an H200):
--   the Engram tables and their Adam moments in host memory (4.5 GiB),
--   each iteration of the block recomputed in the backward,
--   Muon's momentum in bf16.
-- About 45K tokens/s on an H200 (eager: graph mode needs the tables on the device).
-- `dormouse plan experiments/b1_16gb.lua --memory 16GiB` shows where the memory goes.
local here = debug.getinfo(1, "S").source:match("^@(.*[/\\])") or ""
local b1 = dofile(here .. "b1.lua")

b1.name = "b1_16gb"
b1.model.engram.ram = true
b1.model.recompute = true
b1.optim.momentum_dtype = "bf16"
return b1
