--[[
Parameter groups, chosen by name and shape (docs/model.md, Optimisers):

  muon     every 2-D weight and every 3-D bank [E, m, n] of the hidden layers
           (each expert's matrix orthogonalised on its own)
  adamw    embeddings, the head, gains, biases (dt_bias too), the router,
           scales (cg, cu, scg, scu, LittleBit's rows and columns), gates, A_log, convolution weights, and
           anything that is not 2-D or 3-D
  engram   the Engram tables: Adam at engram_lr_mult × adamw_lr, no weight
           decay. For now a dense AdamW group; the sparse touched-rows Adam
           comes with the host-side tables (vm/hostable).

"Gates" are KDA's gate projections: the beta gate wb (d -> H), the decay
gate's low-rank pair wg1, wg2, and the output gate's pair wo1, wo2; like the
router they stay with AdamW by default (no primary source puts gate matrices
under Muon); optim.gates = "muon" gives them to Muon (groups.assign's opts).
The rules are a list; the first that matches a parameter decides its group.
]]
local dm = require "dormouse"
local core = require "dormouse.core"

local groups = {}

-- the last component of a dotted name ("block.kda.conv_q" -> "conv_q")
local function leaf(name) return name:match("([^.]+)$") end

-- the component before it, the owning module's name ("block.kda.wb.weight" -> "wb")
local function owner(name) return name:match("([^.]+)%.[^.]+$") end

local function class_of(e) return e.module and e.module._name end

local scales = {cg = true, cu = true, scg = true, scu = true}
local gates = {wb = true, wg1 = true, wg2 = true, wo1 = true, wo2 = true}

groups.rules = {
  {"engram", "Engram table", function(e) return leaf(e.name) == "table" and (class_of(e) == "Engram" or e.name:find("engram", 1, true)) end},
  {"adamw", "embedding", function(e) return class_of(e) == "Embedding" or e.name:match("^emb%.") end},
  {"adamw", "head", function(e) return e.name:match("^head%.") or e.name:match("^future_head%.") end},
  {"adamw", "gate", function(e) return leaf(e.name) == "loom_gate" end},   -- LOOM's per-iteration gates
  {"adamw", "gain", function(e) return leaf(e.name):match("gain$") end},
  {"adamw", "bias", function(e) return leaf(e.name):match("bias$") end},
  {"adamw", "router", function(e) return owner(e.name) == "router" end},
  {"adamw", "scale", function(e) return scales[leaf(e.name)] end},
  {"adamw", "scale", function(e)                                       -- LittleBit's row and column scales
    return class_of(e) == "MoE" and (leaf(e.name):match("_row$") or leaf(e.name):match("_col$")) ~= nil
  end},
  {"adamw", "gate", function(e, opts) return gates[owner(e.name) or ""] and opts.gates ~= "muon" end},
  {"adamw", "A_log", function(e) return leaf(e.name) == "A_log" end},
  {"adamw", "conv", function(e) return leaf(e.name):match("^conv") end},
  {"muon", "matrix", function(e) local n = e.tensor:dim() return n == 2 or n == 3 end},
  {"adamw", "other", function() return true end},
}

groups.order = {"muon", "adamw", "engram"}

-- The group and the rule's reason for one entry {name, tensor, module}; opts.gates = "muon": KDA's
-- gate projections go to Muon.
function groups.classify(e, opts)
  for _, rule in ipairs(groups.rules) do
    if rule[3](e, opts or {}) then return rule[1], rule[2] end
  end
end

--[[ entries: a module's named_parameters(); opts: {gates = "adamw" | "muon"} (optim.gates).
Returns {muon = {...}, adamw = {...}, engram = {...}}, each a list of the entries with `why`
(the rule) set. ]]
function groups.assign(entries, opts)
  local out = {}
  for _, name in ipairs(groups.order) do out[name] = {} end
  for _, e in ipairs(entries) do
    local g, why = groups.classify(e, opts)
    local list = out[g]
    list[#list + 1] = {name = e.name, tensor = e.tensor, module = e.module, why = why}
  end
  return out
end

local human = require("dormouse.human").count    -- parameter counts as 1.23M, the module tree's form

-- names joined up to `width` characters, then "(+N more)"
local function abbreviate(names, width)
  local out, used = {}, 0
  for i, name in ipairs(names) do
    if used + #name > width and i > 1 then
      out[#out + 1] = string.format("(+%d more)", #names - i + 1)
      break
    end
    out[#out + 1] = name
    used = used + #name + 2
  end
  return table.concat(out, ", ")
end

--[[ The table printed at start: group -> tensors, parameters, lr, weight
decay, names. rows: {{name, entries, lr, weight_decay}, ...}. ]]
function groups.describe(rows, width)
  local lines = {string.format("%-7s %7s %9s %9s %6s  %s", "group", "tensors", "params", "lr", "wd", "names")}
  for _, r in ipairs(rows) do
    local n, names = 0, {}
    for _, e in ipairs(r.entries) do
      n = n + e.tensor:numel()
      names[#names + 1] = e.name
    end
    lines[#lines + 1] = string.format("%-7s %7d %9s %9.2e %6g  %s", r.name, #r.entries, human(n), r.lr,
                                      r.weight_decay, abbreviate(names, width or 90))
  end
  return table.concat(lines, "\n")
end

--[[ The state every optimiser group keeps: for each slot ("m", "v",
"momentum") one zero tensor per parameter, on the parameter's device,
kept past any dm.scope (the first step often runs inside one): of the
parameter's dtype and shape, or dtypes[slot] and shapes[slot](parameter). ]]
function groups.new_group(name, entries, slots, dtypes, shapes)
  local g = {name = name, entries = entries, params = {}, slots = slots, state = {}}
  for _, slot in ipairs(slots) do g.state[slot] = {} end
  for i, e in ipairs(entries) do
    g.params[i] = e.tensor
    for _, slot in ipairs(slots) do
      local dtype = dtypes and dtypes[slot] or e.tensor.dtype
      local shape = shapes and shapes[slot] and shapes[slot](e.tensor) or e.tensor:shape()
      g.state[slot][i] = dm.keep(dm.zeros(shape, {dtype = dtype, device = e.tensor.device}))
    end
  end
  return g
end

-- a 32-bit FNV-1a hash of a group's name: the key of its stochastic rounding's bits
function groups.salt(name)
  local h = 2166136261
  for i = 1, #name do h = ((h ~ name:byte(i)) * 16777619) & 0xffffffff end
  return h
end

--[[ Adam moments in 8 bits (vm/core/code8.h): slots m8 and v8 (u8 codes of m and sqrt(v), the
parameter's shape) and m_scale and v_scale (f32, one a block of block(parameter) values). ]]
local CODE8_SLOTS = {"m8", "m_scale", "v8", "v_scale"}

function groups.code8_group(name, entries, block)
  local function scales(t) return {(t:numel() + block(t) - 1) // block(t)} end
  local g = groups.new_group(name, entries, CODE8_SLOTS, {m8 = "u8", m_scale = "f32", v8 = "u8", v_scale = "f32"},
                             {m_scale = scales, v_scale = scales})
  g.code8, g.salt = true, groups.salt(name)
  return g
end

--[[ A checkpoint's state (a table of "<param>.<slot>" tensors) in group g's form: f32 moments m, v
packed into 8-bit codes for an 8-bit group, codes unpacked into f32 moments for an f32 one (a run
resumed with the other setting). Returns tbl itself when nothing needed it, else a new table. ]]
function groups.code8_adapt(g, tbl, block)
  local converted = {}        -- key -> its tensor in this form, or false: a key of the other form, dropped
  local function cpu(t) return t:to("cpu"):to("f32"):contiguous() end
  for i, e in ipairs(g.entries) do
    local k, p = e.name .. ".", g.params[i]
    if g.code8 and not tbl[k .. "m8"] and dm.is_tensor(tbl[k .. "m"]) and dm.is_tensor(tbl[k .. "v"]) then
      for _, slot in ipairs {"m", "v"} do      -- load_state's check, before the conversion reads them
        local t = tbl[k .. slot]
        if table.concat(t:shape(), ",") ~= table.concat(p:shape(), ",") then
          core.error(string.format("optim state '%s%s': shape [%s] but the parameter's is [%s]", k, slot,
                                   table.concat(t:shape(), ", "), table.concat(p:shape(), ", ")))
        end
      end
      local function pack(values, signed)
        local codes = dm.zeros(p:shape(), {dtype = "u8"})
        local scales = dm.zeros({(p:numel() + block(p) - 1) // block(p)})
        core.code8_pack(codes, scales, values, signed, g.salt, block(p))
        return codes, scales
      end
      converted[k .. "m8"], converted[k .. "m_scale"] = pack(cpu(tbl[k .. "m"]), true)
      converted[k .. "v8"], converted[k .. "v_scale"] = pack(cpu(tbl[k .. "v"]):sqrt(), false)
      converted[k .. "m"], converted[k .. "v"] = false, false
    elseif not g.code8 and not tbl[k .. "m"] and dm.is_tensor(tbl[k .. "m8"]) then
      local function unpack(codes, scales, signed)
        local values = dm.zeros(codes:shape())
        core.code8_unpack(values, codes:to("cpu"):contiguous(), scales:to("cpu"):contiguous(), signed, block(p))
        return values
      end
      converted[k .. "m"] = unpack(tbl[k .. "m8"], tbl[k .. "m_scale"], true)
      local r = unpack(tbl[k .. "v8"], tbl[k .. "v_scale"], false)
      converted[k .. "v"] = r * r
      for _, slot in ipairs(CODE8_SLOTS) do converted[k .. slot] = false end
    end
  end
  if next(converted) == nil then return tbl end
  local merged = {}
  for key, v in pairs(tbl) do merged[key] = v end
  for key, v in pairs(converted) do merged[key] = v or nil end
  return merged
end

-- the group's state under "<parameter name>.<slot>", into out
function groups.state_into(g, out)
  for i, e in ipairs(g.entries) do
    for _, slot in ipairs(g.slots) do out[e.name .. "." .. slot] = g.state[slot][i] end
  end
  return out
end

return groups
