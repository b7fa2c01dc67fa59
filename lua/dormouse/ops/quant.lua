--[[
The low-bit number formats of the expert banks (vm/ops/quant.h):

  dm.quantize(x, format, block)     x through the format block by block along its last dim,
  x:quantize(format, block)         dequantised: the values the format can hold, in x's dtype
  dm.fake_quantize(x, format, block)  the same values forward, the gradient passed straight
                                    through to x (quantisation-aware training)
  dm.quant_encode(x, format, block)   the same values as bits: codes, scales
  dm.quant_decode(codes, scales, format, block, n)   and back (f32, rows of n elements)
  dm.littlebit(x, row, col)         LittleBit's binary factor row * sign(x) * col in one pass
                                    (x [E, m, n], row [E, m, 1], col [E, 1, n], one dtype), the
                                    sign's gradient passed straight through to x; its function
                                    is its descriptor's (vm/ops/quant.c, ops/generated.lua)

Codes are u8, [..., ceil(n / per byte)]: one E4M3 code a byte (fp8_e4m3), two
E2M1 codes (nvfp4, the lower nibble first), four 2-bit ternary codes (0, +1
as 1, -1 as 2; the lowest bits first) or eight binary sign bits (1 for -1;
the lowest bit first). Scales are [..., ceil(n / block)], f32,
or E4M3 codes in u8 for nvfp4. quant_decode(quant_encode(x)) is quantize(x)
in f32, bit for bit.

format: "fp8_e4m3" (a scale amax/448 per block, E4M3 elements), "nvfp4" (an
E4M3 scale amax/6 per block, E2M1 elements), "ternary" (the block's mean
|x| times -1, 0 or 1) or "binary" (the block's mean |x| times the sign, +1
at 0: a LittleBit latent's signs exactly). block: elements per scale along the last dim (a row's
last block may be shorter); nil takes the format's own (16 for nvfp4, 32 for
the others). quantize takes no gradient; fake_quantize's forward is exactly
quantize's (q + (x - x), the difference detached), its gradient 1.
]]
return function(dm, T, core)

-- (quantize, quant_encode, quant_decode and littlebit come from their descriptors: ops/generated.lua)

function dm.fake_quantize(x, format, block)
  local held = x:detach()
  return dm.quantize(held, format, block) + (x - held)
end
T.fake_quantize = dm.fake_quantize

end
