-- The Lua library's layers (docs/architecture.md, "Layers"): every module under lua/dormouse has
-- one, and a module requires only modules of its own layer or below, with no cycle, except the
-- conveniences the library's table offers its users, listed here with their reason.
local LAYERS = {
  {"foundation", {"dormouse.tensor", "dormouse.ops.*", "dormouse.json", "dormouse.human", "dormouse.cuda",
                  "dormouse.graph", "dormouse.fuse", "dormouse.profile", "dormouse.recompute", "dormouse.ckpt",
                  "dormouse.data", "dormouse.sandbox", "dormouse.schema", "dormouse.config",
                  "dormouse.optim.schedule"}},
  {"library", {"dormouse"}},
  {"parts", {"dormouse.nn", "dormouse.nn.*", "dormouse.optim", "dormouse.optim.*", "dormouse.banks",
             "dormouse.segments", "dormouse.instrument", "dormouse.dist", "dormouse.preflight", "dormouse.step",
             "dormouse.verify"}},
  {"using a model", {"dormouse.decode", "dormouse.eval", "dormouse.tasks", "dormouse.records", "dormouse.rollouts",
                     "dormouse.report", "dormouse.tensorboard"}},
  {"training", {"dormouse.rl", "dormouse.train"}},
  {"tools", {"dormouse.plan", "dormouse.probe", "dormouse.stress", "dormouse.sweep", "dormouse.experiment",
             "dormouse.repl", "dormouse.cli", "dormouse.commands.*"}},
}

-- requires that reach up a layer, each with why it may
local UPWARD = {
  ["dormouse -> dormouse.sweep"] = "dm.sweep{...}, the scripts' way to run a sweep, loads it on its first call",
}

local function module_files()
  local p = assert(io.popen("cd lua && find dormouse -name '*.lua' | LC_ALL=C sort"))
  local out = {}
  for path in p:lines() do
    local name = path:gsub("%.lua$", ""):gsub("/", "."):gsub("%.init$", "")
    out[name] = "lua/" .. path
  end
  p:close()
  return out
end

local function layer_of(name)
  for i, l in ipairs(LAYERS) do
    for _, pattern in ipairs(l[2]) do
      if pattern == name or (pattern:sub(-2) == ".*" and name:sub(1, #pattern - 1) == pattern:sub(1, -2)) then
        return i
      end
    end
  end
end

-- the dormouse modules a file requires by a literal name (at load or inside a function)
local function requires(path, known)
  local f = assert(io.open(path))
  local text = f:read("a")
  f:close()
  local out = {}
  for name in text:gmatch("require%s*%(?%s*[\"'](dormouse[%w_.]*)[\"']") do
    if known[name] then out[name] = true end
  end
  return out
end

describe("the Lua library's layers", function()
  local files = module_files()

  it("place every module", function()
    local missing = {}
    for name in pairs(files) do if not layer_of(name) then missing[#missing + 1] = name end end
    table.sort(missing)
    assert.are.equal("", table.concat(missing, ", "), "modules in no layer (tests/lua/layers_spec.lua)")
  end)

  it("require nothing above their own layer but the listed conveniences", function()
    local bad = {}
    for name, path in pairs(files) do
      for dep in pairs(requires(path, files)) do
        local from, to = layer_of(name), layer_of(dep)
        local edge = name .. " -> " .. dep
        if from and to and to > from and not UPWARD[edge] then
          bad[#bad + 1] = string.format("%s (%s requires %s)", edge, LAYERS[from][1], LAYERS[to][1])
        end
      end
    end
    table.sort(bad)
    assert.are.equal("", table.concat(bad, "\n"))
  end)

  it("form no cycle of requires", function()
    local deps = {}
    for name, path in pairs(files) do
      deps[name] = {}
      for dep in pairs(requires(path, files)) do
        if dep ~= name and not UPWARD[name .. " -> " .. dep] then deps[name][#deps[name] + 1] = dep end
      end
      table.sort(deps[name])
    end
    local state, cycle = {}, nil                 -- depth-first: a module met again on the path closes a cycle
    local path = {}
    local function visit(m)
      if cycle then return end
      state[m] = "open"
      path[#path + 1] = m
      for _, d in ipairs(deps[m]) do
        if state[d] == "open" then
          local at = 1
          while path[at] ~= d do at = at + 1 end
          cycle = table.concat(path, " -> ", at) .. " -> " .. d
          return
        elseif not state[d] then visit(d) end
        if cycle then return end
      end
      path[#path] = nil
      state[m] = "done"
    end
    local names = {}
    for name in pairs(files) do names[#names + 1] = name end
    table.sort(names)
    for _, m in ipairs(names) do if not state[m] then visit(m) end end
    assert.is_nil(cycle)
  end)

  it("say why each upward require may be", function()
    for edge, why in pairs(UPWARD) do
      local from, to = edge:match("^(%S+) %-> (%S+)$")
      assert.is_truthy(files[from] and files[to], edge)
      assert.is_true(requires(files[from], files)[to] == true, edge .. " is listed but not there")
      assert.is_true(#why > 20, edge)
    end
  end)
end)
