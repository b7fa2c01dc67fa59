--[[
The experts' banks in checkpoint files, in a low-bit format (checkpoint.banks;
docs/arms.md): each bank (a parameter a module lists in its `banks`, the MoE's
Ug, Uu and D) is written as its codes and block scales (dm.quant_encode)
instead of its f32 values, and read back as the f32 values those codes hold.

  local tensors, as, info = banks.pack(model, state, "nvfp4")
      state {name = tensor} with each bank NAME replaced by NAME.codes and
      NAME.scales; as {name = "F8_E4M3"}: the file dtype of E4M3 codes; info
      for meta.lua: {format, block, shapes = {NAME = shape}}
  local state = banks.unpack(tensors, info)
      the banks decoded back to f32, the other tensors as they are

In the files: fp8_e4m3 codes are F8_E4M3 with F32 scales (one per 32
elements of a row); nvfp4 codes are U8, two E2M1 codes a byte, with F8_E4M3
scales (one per 16); ternary codes are U8, four 2-bit codes a byte, with F32
scales (one per 32); binary codes are U8, eight sign bits a byte, with F32
scales (one per 32): a LittleBit model's banks (model.moe.littlebit) are
their latents' signs, which binary keeps exactly, so its forward loads back
bit for bit. A checkpoint so written loads into the model as the
values of its codes, which are not the masters it trained with: a resume
from it continues from those values, and says so.
]]
local dm = require "dormouse"

local banks = {}

-- the names of every bank in the model: each module's `banks`, under its own name
function banks.names(model)
  local out = {}
  for _, m in ipairs(model:named_modules()) do
    for _, p in ipairs(m.module.banks or {}) do
      out[#out + 1] = (m.name ~= "" and m.name .. "." or "") .. p
    end
  end
  return out
end

function banks.pack(model, state, format)
  local tensors, as, shapes = {}, {}, {}
  for name, t in pairs(state) do tensors[name] = t end
  for _, name in ipairs(banks.names(model)) do
    local t = assert(state[name], "banks.pack: no tensor " .. name)
    local codes, scales = dm.quant_encode(t:detach(), format)
    tensors[name], tensors[name .. ".codes"], tensors[name .. ".scales"] = nil, codes, scales
    if format == "fp8_e4m3" then as[name .. ".codes"] = "F8_E4M3" end
    if format == "nvfp4" then as[name .. ".scales"] = "F8_E4M3" end
    shapes[name] = t:shape()
  end
  return tensors, as, {format = format, shapes = shapes}
end

function banks.unpack(tensors, info, file)
  if not info then return tensors end
  local out = {}
  for name, t in pairs(tensors) do out[name] = t end
  for name, shape in pairs(info.shapes) do
    local codes, scales = tensors[name .. ".codes"], tensors[name .. ".scales"]
    if not (codes and scales) then
      error(string.format("%s: the bank '%s' (%s) has no codes or scales", file or "checkpoint", name, info.format), 0)
    end
    local n = shape[#shape]
    out[name] = dm.quant_decode(codes, scales, info.format, nil, n):reshape(shape)
    out[name .. ".codes"], out[name .. ".scales"] = nil, nil
  end
  return out
end

return banks
