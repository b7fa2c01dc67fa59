--[[ tools/casts.lua — the dtype conversions of one training step, counted on the meta device (no GPU):
each cast that changes a tensor's dtype, its bytes read and written, summed by where the model makes
it (the first frame in lua/dormouse/nn/ or models/), largest first.

  dormouse run tools/casts.lua [EXPERIMENT] [KEY=VALUE ...]      default experiments/b1.lua

The step is the one `dormouse plan` runs (forward, backward, the optimisers; plan.step); the casts
counted are those the Lua asks for (dm.cast and x:to(dtype)), not a cast's backward nor the C ops'
own. Casts have no floor: a step whose kernels read and write the dtypes their neighbours use needs
none, so the table is what is left to fold, and its bytes against the copy rate (about 3 TB/s on an
H100) bound what they cost. The parameters' casts to the compute dtype are nn.pass_once's copies
(lua/dormouse/nn/init.lua). ]]
local dm = require "dormouse"
local core = require "dormouse.core"
local config = require "dormouse.config"
local plan = require "dormouse.plan"

local file = arg[1] or "experiments/b1.lua"
local sets = {}
for i = 2, #arg do sets[#sets + 1] = arg[i] end
local cfg = config.load(file, sets)

-- where a cast is made: the first frame in the model's code (nn/ or models/), as FILE:LINE (function)
local function site()
  for level = 3, 40 do
    local info = debug.getinfo(level, "Sln")
    if not info then break end
    local at = info.source:match("(lua/dormouse/nn/[%w_]+%.lua)$") or info.source:match("(models/[%w_]+%.lua)$")
    if at then                               -- (a tail call leaves its caller's frame without a name)
      return string.format("%s:%d (%s)", at, info.currentline,
                           info.name or string.format("the function at line %d", info.linedefined))
    end
  end
  return "elsewhere"
end

local by_site, total, calls = {}, 0, 0
local function count(x, dtype)
  if not dm.is_tensor(x) or x.dtype == dtype or not core.dtype_code(dtype) then return end
  local bytes = x:numel() * (core.dtype_size(x.dtype) + core.dtype_size(dtype))
  local key = string.format("%s %s -> %s", site(), x.dtype, dtype)
  local s = by_site[key] or {bytes = 0, calls = 0}
  s.bytes, s.calls = s.bytes + bytes, s.calls + 1
  by_site[key] = s
  total, calls = total + bytes, calls + 1
end

local T = core.methods
local cast, to_dtype = dm.cast, T._cast
local session = plan.session(cfg, {})
dm.cast = function(x, dtype, ...) count(x, dtype); return cast(x, dtype, ...) end
T._cast = function(x, dtype) count(x, dtype); return to_dtype(x, dtype) end
local ok, err = pcall(session.run, session, cfg.batch, cfg.seq)
dm.cast, T._cast = cast, to_dtype
session:close()
if not ok then error(err, 0) end

local keys = {}
for k in pairs(by_site) do keys[#keys + 1] = k end
table.sort(keys, function(a, b) return by_site[a].bytes > by_site[b].bytes end)
print(string.format("%s: batch %d x seq %d, compute %s; the casts the Lua asks for in one training step",
                    file, cfg.batch, cfg.seq, cfg.dtype))
print(string.format("%10s %6s  %s", "MB", "calls", "where, from -> to"))
for _, k in ipairs(keys) do print(string.format("%10.1f %6d  %s", by_site[k].bytes / 1e6, by_site[k].calls, k)) end
print(string.format("%10.1f %6d  in all: %.2f ms at 3 TB/s", total / 1e6, calls, total / 3e12 * 1e3))
