-- docs/first-hour.md as a newcomer follows it: its files written, each `$ dormouse ...` command
-- run in order in a fresh folder, the REPL lines typed into the REPL. Training commands run a
-- few steps (SHORT), which is the one change made to them.
local helpers = require "tests.lua.helpers"

local SHORT = {
  run = " --set steps=6 --set schedule.warmup=2 --set eval.every=6 --set eval.windows=4 " ..
        "--set eval.budgets={16} --set checkpoint.every=6 --sample 16",
  sweep = " --set eval.windows=4 --set eval.budgets={16}",
}

-- the page's files ({path, text}) and commands ({line, input = REPL lines}), in order
local function read_page(path)
  local files, commands, block = {}, {}, nil
  for line in io.lines(path) do
    if block then
      if line == "```" then
        local name = block[1]:match("^%-%- (%S+%.lua)$")
        if name then files[#files + 1] = {path = name, text = table.concat(block, "\n") .. "\n"} end
        block = nil
      else
        block[#block + 1] = line
      end
    elseif line == "```lua" then
      block = {}
    elseif line:match("^    %$ dormouse ") then
      commands[#commands + 1] = {line = line:match("^    %$ dormouse (.*)$"), input = {}}
    elseif line:match("^    > ") then
      local c = commands[#commands]
      c.input[#c.input + 1] = line:match("^    > (.*)$")
    end
  end
  return files, commands
end

describe("docs/first-hour.md", function()
  it("runs as written: every file and command of the page, in order, in a fresh folder", function()
    local root = io.popen("pwd"):read("l")
    local bin = arg[-1]:sub(1, 1) == "/" and arg[-1] or root .. "/" .. arg[-1]     -- run from another folder
    local files, commands = read_page("docs/first-hour.md")
    assert.is_true(#files >= 2 and #commands >= 8, #files .. " files, " .. #commands .. " commands")
    local dir = helpers.tmpdir()
    -- a repository of its own: the page adds to models/ and experiments/ (the library and tasks linked)
    assert.equal(0, (helpers.sh(string.format("cp -r '%s/experiments' '%s/models' '%s/' && ln -s '%s/tasks' '%s/tasks' " ..
                                              "&& ln -s '%s/lua' '%s/lua'", root, root, dir, root, dir, root, dir))))
    for _, f in ipairs(files) do
      local out = assert(io.open(dir .. "/" .. f.path, "w"))
      out:write(f.text)
      out:close()
    end
    for _, c in ipairs(commands) do
      local verb = c.line:match("^(%S+)")
      local line = c.line .. (SHORT[verb] or "")
      if verb == "sweep" then line = line:gsub("%-%-steps %d+", "--steps 4") end
      local cmd = string.format("cd '%s' && DORMOUSE_HOME='%s' '%s' %s", dir, dir, bin, line)
      if #c.input > 0 then
        local input = dir .. "/repl-input.lua"
        local f = assert(io.open(input, "w"))
        f:write(table.concat(c.input, "\n"), "\n")
        f:close()
        cmd = cmd .. " < '" .. input .. "'"
      end
      local code, out = helpers.sh(cmd)
      assert.equal(0, code, "dormouse " .. line .. "\n" .. out)
      assert.is_nil(out:match("repl:%d+:"), "dormouse " .. line .. "\n" .. out)
      if verb == "run" then helpers.has(out, "done: runs/") end
    end
    helpers.has(helpers.read(dir .. "/runs/demo_ft/log.txt"), "init: the model's weights from runs/demo")
    assert.truthy(helpers.read(dir .. "/runs/bigram/log.txt"))
    helpers.has(helpers.read(dir .. "/runs/sweep-sweep_demo/verdict.txt"), "no_lfb", "control")
  end)
end)
