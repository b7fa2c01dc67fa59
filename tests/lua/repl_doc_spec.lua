-- docs/repl.md's first captured session, typed into the REPL again: each line's output must be
-- what the page shows, so the page cannot go stale. The page shows the screen: a banner, the
-- prompts, lines wrapped at the pane's 100 columns; off a terminal the REPL prints none of those,
-- so each line's expected output is compared with the wraps taken out and blanks runs as one.
local helpers = require "tests.lua.helpers"

-- the first ``` block after "## A session": {input = {lines}, output = text} a prompt
local function first_session(path)
  local steps, in_section, in_block = {}, false, false
  for line in io.lines(path) do
    if not in_section then
      in_section = line == "## A session"
    elseif not in_block then
      in_block = line == "```"
    elseif line == "```" then
      break
    elseif line:match("^>> ") then
      local s = steps[#steps]
      s.input[#s.input + 1] = line:sub(4)
    elseif line:match("^> ") then
      steps[#steps + 1] = {input = {line:sub(3)}, output = {}}
    elseif line ~= ">" and #steps > 0 then
      local out = steps[#steps].output
      out[#out + 1] = line
    end
  end
  return steps
end

describe("docs/repl.md", function()
  it("shows the session the REPL gives today", function()
    local steps = first_session("docs/repl.md")
    assert.is_true(#steps >= 10, "only " .. #steps .. " prompts found")
    local input = helpers.tmpdir() .. "/session.lua"
    local f = assert(io.open(input, "w"))
    -- each prompt's output ends with a marker line, so the outputs can be told apart
    for i, s in ipairs(steps) do
      f:write(table.concat(s.input, "\n"), "\n", string.format("print('--- %d')", i), "\n")
    end
    f:close()
    local root = io.popen("pwd"):read("l")
    local bin = arg[-1]:sub(1, 1) == "/" and arg[-1] or root .. "/" .. arg[-1]
    local code, out = helpers.sh(string.format("'%s' repl < '%s'", bin, input))
    assert.equal(0, code, out)
    local got, at = {}, 1
    for i = 1, #steps do
      local stop = out:find("--- " .. i .. "\n", at, true)
      assert.truthy(stop, "no marker " .. i .. " in\n" .. out)
      got[i] = out:sub(at, stop - 1)
      at = stop + #("--- " .. i .. "\n")
    end
    -- the pane's wraps taken out, and a tab as the pane drew it (spaces to its next stop): runs of
    -- blanks compare as one
    local function plain(text) return (text:gsub("[ \t]+", " ")) end
    for i, s in ipairs(steps) do
      local want, have = plain(table.concat(s.output, "")), plain((got[i]:gsub("\n", "")))
      if s.input[1] == "dm.memory()" then           -- the bytes held depend on when the collector ran
        want, have = want:gsub("%d+", "N"), have:gsub("%d+", "N")
      end
      assert.are.equal(want, have, "after > " .. s.input[1])
    end
  end)
end)
