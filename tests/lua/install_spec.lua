-- make install: the binary in PREFIX/bin finds its library, models, experiments and tasks in
-- PREFIX/share/dormouse from its own location, with no DORMOUSE_HOME and from any folder.
local helpers = require "tests.lua.helpers"
local has = helpers.has

describe("an installed dormouse", function()
  it("runs from any folder without DORMOUSE_HOME, the experiments and tasks beside it", function()
    local bin = arg and arg[-1]
    local here = assert(io.popen("pwd")):read("l")            -- ctest sets the folder, not $PWD
    local exe = bin:sub(1, 1) == "/" and bin or here .. "/" .. bin
    local build = exe:match("^(.*)/[^/]+$")
    local prefix, cwd = helpers.tmpdir(), helpers.tmpdir()
    local function sh(cmd)
      local p = assert(io.popen(cmd .. " 2>&1"))
      local out = p:read("a")
      local _, _, code = p:close()
      return code, out
    end
    local code, out = sh(string.format("cmake --install '%s' --prefix '%s'", build, prefix))
    assert.equal(0, code, out)
    for _, f in ipairs {"bin/dormouse", "share/dormouse/lua/dormouse/init.lua", "share/dormouse/models/dormouse.lua",
                        "share/dormouse/experiments/tiny.lua", "share/dormouse/tasks/kjv.lua"} do
      assert.is_truthy(io.open(prefix .. "/" .. f), f)
    end
    code, out = sh(string.format("cd '%s' && env -u DORMOUSE_HOME '%s/bin/dormouse' run '%s/share/dormouse/experiments/tiny.lua' " ..
                                 "--quiet --sample 0 --set steps=2 --set schedule.warmup=1 --set eval.windows=2 " ..
                                 "--set eval.tasks=tasks/kjv.lua --set eval.budgets={4}", cwd, prefix, prefix))
    assert.equal(0, code, out)
    has(out, "done: runs/tiny, step 2", "correct@4")
    code, out = sh(string.format("cd '%s' && env -u DORMOUSE_HOME '%s/bin/dormouse' help sweep", cwd, prefix))
    assert.equal(0, code, out)
    has(out, "usage: dormouse sweep")
  end)
end)
