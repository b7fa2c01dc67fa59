local m = getmetatable("") return {step = 1, a = m and m.__index.rep("x", 2^31)}
