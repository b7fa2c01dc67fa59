--[[
The experts' banks of b1 in each low-bit format (docs/arms.md): their bytes
as bf16 (the compute copy a step holds), as f32 (the masters) and as each
format's codes and scales; the time to quantize (dequantised values, QAT's
forward), encode and decode them on the device, beside the time of the cast
to bf16 (the step's compute copy: the same reads, half the writes);
and the relative error of the decoded values (||q - w|| / ||w||), on b1's
shapes (1,024 experts: Ug, Uu [1024, 2048, 64], D [1024, 64, 5461]) drawn as
the model draws them.
  dormouse run tests/gpu/bank_formats.lua            (SMALL=1: small's shapes)
]]
local dm = require "dormouse"
local common = require "tests.gpu.common"
local config = require "dormouse.config"
if not common.gpu_or_skip(dm.cuda, "bank_formats") then return end

local m = config.load(os.getenv("SMALL") and "experiments/small.lua" or "experiments/b1.lua").model
local E, d, r, F = m.experts, m.d, m.expert_rank, m.ffn
local shapes = {Ug = {{E, d, r}, d ^ -0.5}, Uu = {{E, d, r}, d ^ -0.5}, D = {{E, r, F}, r ^ -0.5}}
local banks = {}
for name, s in pairs(shapes) do banks[name] = dm.keep(dm.randn(s[1], {device = "cuda", seed = #name}) * s[2]) end

local function bytes(t) return t:numel() * ({f32 = 4, bf16 = 2, u8 = 1})[t.dtype] end
local function timed(fn)
  for _ = 1, 2 do fn() end                                   -- warm: module load, allocations
  dm.cuda.synchronize()
  local t0 = dm.core.now()
  local n = 5
  for _ = 1, n do fn() end
  dm.cuda.synchronize()
  return (dm.core.now() - t0) / n * 1e3
end

local total32, total16, cast_ms = 0, 0, 0
for _, t in pairs(banks) do
  total32, total16 = total32 + bytes(t), total16 + t:numel() * 2
  cast_ms = cast_ms + timed(function() dm.scope(function() t:to("bf16") end) end)
end
local rows = {{"f32 (masters)", total32, "-", "-", "-", "-"},
              {"bf16 (compute copy)", total16, "-", string.format("%.2f", cast_ms), "-", "-"}}
for _, format in ipairs {"fp8_e4m3", "nvfp4", "ternary", "binary"} do
  local size, err2, norm2, q_ms, enc_ms, dec_ms = 0, 0, 0, 0, 0, 0
  for _, name in ipairs {"Ug", "Uu", "D"} do
    local w = banks[name]
    local n = w:size(-1)
    dm.scope(function()
      local codes, scales = dm.quant_encode(w, format)
      size = size + bytes(codes) + bytes(scales)
      local back = dm.quant_decode(codes, scales, format, nil, n):reshape(w:shape())
      err2 = err2 + (back - w):pow(2):sum():item()
      norm2 = norm2 + w:pow(2):sum():item()
      assert((back - dm.quantize(w, format)):abs():max():item() == 0, format .. ": decode(encode) is not quantize")
      q_ms = q_ms + timed(function() dm.scope(function() dm.quantize(w, format) end) end)
      enc_ms = enc_ms + timed(function() dm.scope(function() dm.quant_encode(w, format) end) end)
      dec_ms = dec_ms + timed(function() dm.scope(function() dm.quant_decode(codes, scales, format, nil, n) end) end)
    end)
  end
  rows[#rows + 1] = {format, size, string.format("%.4f", math.sqrt(err2 / norm2)), string.format("%.2f", q_ms),
                     string.format("%.2f", enc_ms), string.format("%.2f", dec_ms)}
end
print(string.format("bank formats at %s's shapes (%d experts, d %d, rank %d, ffn %d):", os.getenv("SMALL") and "small" or "b1",
                    E, d, r, F))
print(string.format("%-22s %12s %9s %11s %10s %10s", "form", "GB", "rel err", "quantize ms", "encode ms", "decode ms"))
for _, row in ipairs(rows) do
  print(string.format("%-22s %12.3f %9s %11s %10s %10s", row[1], row[2] / 1e9, row[3], row[4], row[5], row[6]))
end
print("(the bf16 row's quantize column is the cast's time: the same reads as quantize, half its writes)")
