--[[
The SiLU-gated product (the experts' gate), a single fused op with its own backward kernel
(vm/ops/silu_mul.h).

  dm.silu_mul(a, b), a:silu_mul(b)       silu(a) * b in one pass (a and b of one shape)

The functions are the descriptor's (ops/generated.lua): this file only documents them.
]]
return function() end
