--[[
The row norms, single fused ops with their own backward kernels (vm/ops/norm.h).

  x:rmsnorm(gain, eps)                   x / sqrt(mean(x^2) + eps) * gain over the last dim
  dm.rmsnorm(x, gain, {eps = 1e-6})      gain is [D] or nil (no gain); eps defaults to 1e-6
  x:l2norm(eps)   dm.l2norm(x, eps)      x / sqrt(sum(x^2) + eps) over the last dim (eps inside
                                         the square root, default 1e-6)

The functions are the descriptors' (ops/generated.lua): this file only documents them.
]]
return function() end
