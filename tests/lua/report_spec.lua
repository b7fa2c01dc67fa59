-- report.html: the charts drawn by headless Chromium (the page says how many it made and how many
-- drew ink in their plots), live while the run goes, and the inline-SVG page without the library.
local helpers = require "tests.lua.helpers"
local core = require "dormouse.core"

local function browser()
  for _, name in ipairs {"chromium", "chromium-browser", "google-chrome"} do
    if os.execute("command -v " .. name .. " >/dev/null 2>&1") == true then return name end
  end
end

-- the page's DOM after its scripts ran, as headless Chromium has it
local function rendered(path)
  local p = assert(io.popen(string.format("timeout 120 %s --headless=new --no-sandbox --disable-gpu " ..
    "--virtual-time-budget=5000 --dump-dom 'file://%s' 2>/dev/null", browser(), path)))
  local dom = p:read("a")
  p:close()
  return dom
end

local read = helpers.read

describe("report.html", function()
  local runs, dir
  setup(function()
    runs = helpers.tmpdir()
    helpers.run_quiet(helpers.tiny({"steps=40", "eval.every=20", "log.every=5", "checkpoint.every=0", "name=r"}),
                      {runs = runs})
    helpers.run_quiet(helpers.tiny({"steps=40", "eval.every=10", "log.every=5", "checkpoint.every=10", "name=live"}),
                      {runs = runs, stop_at = 20})
    helpers.run_quiet(helpers.tiny({"steps=10", "eval.every=10", "log.every=5", "checkpoint.every=0", "name=plain",
                                    "model.arch=stack"}), {runs = runs})
    helpers.run_quiet(helpers.tiny({"steps=30", "eval.every=15", "log.every=5", "checkpoint.every=0", "name=ticks"}),
                      {runs = runs})
    dir = runs .. "/r"
  end)
  teardown(function() os.execute("rm -rf '" .. runs .. "'") end)

  it("holds its charts' data, the eval table and the latest sample, and stands alone", function()
    if not core.vendor("uplot.js") then pending("this build has no chart library (configured offline)") return end
    local html = read(dir .. "/report.html")
    helpers.has(html, '<script id="data" type="application/json">', "held-out bits per byte", "<th>bpb_fin</th>",
                "<h2>latest sample</h2><p>at step 40:</p><pre>", "finished; last record at step 40")
    assert.is_nil(html:find("http-equiv=\"refresh\"", 1, true), "a finished run's page does not reload")
    assert.is_nil(html:find("<script src", 1, true), "nothing loaded from elsewhere")
    assert.is_nil(html:find("<link", 1, true))
  end)

  it("draws every chart in headless Chromium, ink in each plot and no script error", function()
    if not core.vendor("uplot.js") then pending("this build has no chart library (configured offline)") return end
    if not browser() then pending("no headless Chromium here (make test installs it)") return end
    local dom = rendered(dir .. "/report.html")
    local body = dom:match("<body[^>]*>")
    assert.truthy(body, "no body in the rendered page")
    -- the load map's axes and key: experts down, steps across, the colours' meaning
    helpers.has(dom, "experts 1 to 8 down, steps 5 to 40 across", '">none</span>', '">1x</span>', '">8x</span>')
    assert.is_nil(body:find("data-error", 1, true), body)
    local charts, drawn = tonumber(body:match('data%-charts="(%d+)"')), tonumber(body:match('data%-drawn="(%d+)"'))
    assert.equal(8, charts, body)                  -- seven curves and the experts' load map
    assert.equal(charts, drawn, body)
    -- the step axis has whole steps only, even where a chart spans steps 15 to 30 (two evals)
    local ticks = rendered(runs .. "/ticks/report.html"):match("<body[^>]*>"):match('data%-step%-ticks="([^"]*)"')
    assert.truthy(ticks and ticks:find("%d"), "no step ticks recorded")
    assert.is_nil(ticks:find("%."), "fractional step ticks: " .. ticks)
    -- a model without experts or Engram: their charts are left out, not drawn empty
    body = rendered(runs .. "/plain/report.html"):match("<body[^>]*>")
    charts, drawn = tonumber(body:match('data%-charts="(%d+)"')), tonumber(body:match('data%-drawn="(%d+)"'))
    assert.equal(5, charts, body)                  -- held-out, training loss, tokens/s, lr and norm, memory
    assert.equal(charts, drawn, body)
  end)

  it("reloads itself while the run goes, and not once it has stopped", function()
    if not core.vendor("uplot.js") then pending("this build has no chart library (configured offline)") return end
    local report = require "dormouse.report"
    local recs = {{kind = "log", step = 5, loss = 2, tok_s = 10, lr = 1e-3}}
    helpers.has(report.html({name = "x", live = true}, recs, {}), '<meta http-equiv="refresh" content="30">',
                "running: this page reloads every 30 s")
    local html = read(runs .. "/live/report.html")           -- stopped after step 20 of 40
    assert.is_nil(html:find("http-equiv", 1, true))
    helpers.has(html, "stopped after step 20 (--resume continues it)")
  end)

  it("is inline SVG, said once, when the build has no chart library", function()
    local report = require "dormouse.report"
    local vendor = core.vendor
    core.vendor = function() return nil end
    local ok, html = pcall(report.html, {name = "x"}, {{kind = "log", step = 5, loss = 2, tok_s = 10, lr = 1e-3}}, {})
    core.vendor = vendor
    assert.is_true(ok, html)
    helpers.has(html, "<svg", "bits per byte")
  end)
end)

describe("json.decode_string and json.decode", function()
  it("read back every string and record json.encode writes, and refuse a broken one", function()
    local json = require "dormouse.json"
    for _, t in ipairs {"plain", 'q"uote\\back\nnl\ttab/', "\1\2\31 ctl", "é → 𝄞", "\255\128 raw", ""} do
      local enc = json.encode(t)
      local dec, after = json.decode_string(enc, 1)
      assert.equal(t, dec)
      assert.equal(#enc + 1, after)
    end
    local rec = {kind = "eval", step = 40, periter = {1.6, 0 / 0, 1.4}, depths = {[2] = 1.7}, text = 'a"\n\255',
                 flags = {true, false}, nested = {a = {b = {}}}}
    local back = json.decode(json.encode(rec))
    assert.equal(40, back.step)
    assert.equal("integer", math.type(back.step))
    assert.same({1.6, nil, 1.4}, back.periter)                 -- a non-finite number was written as null
    assert.same({["2"] = 1.7}, back.depths)
    assert.equal(rec.text, back.text)
    assert.same({true, false}, back.flags)
    assert.same({a = {b = {}}}, back.nested)
    assert.is_false(pcall(json.decode, '{"a":1'))
    assert.is_false(pcall(json.decode, '[1, 2] x'))
    assert.is_nil(json.decode_string('"open', 1))
    assert.is_nil(json.decode_string('"bad \\q"', 1))
    assert.is_nil(json.decode_string('x"', 1))
  end)
end)

describe("a resumed run's report", function()
  it("keeps the samples of the steps before the resume", function()
    local runs = helpers.tmpdir()
    local o = {"steps=20", "eval.every=10", "log.every=5", "checkpoint.every=10", "name=res", "eval.sample=24"}
    helpers.run_quiet(helpers.tiny(o), {runs = runs, stop_at = 10})
    local line = read(runs .. "/res/metrics.jsonl"):match('[^\n]*"kind":"sample"[^\n]*')
    local at = line:find('"text":"', 1, true)
    local text = require("dormouse.json").decode_string(line, at + 7)
    o[#o] = "eval.sample=0"                        -- the resumed run samples nothing: the page shows the kept one
    helpers.run_quiet(helpers.tiny(o), {runs = runs, resume = runs .. "/res"})
    local html = read(runs .. "/res/report.html")
    local shown = {}
    local put, finish = require("dormouse.human").byte_printer(function(b) shown[#shown + 1] = b end)
    for i = 1, #text do put(text:sub(i, i)) end
    finish()
    local esc = table.concat(shown):gsub("&", "&amp;"):gsub("<", "&lt;"):gsub(">", "&gt;")
    helpers.has(html, "<p>at step 10:</p><pre>" .. esc .. "</pre>")
    os.execute("rm -rf '" .. runs .. "'")
  end)
end)

describe("the report's sample", function()
  it("failing, is said once and turned off; the run goes on", function()
    local eval = require "dormouse.eval"
    local sample = eval.sample
    eval.sample = function() error("no sampling here") end
    local runs = helpers.tmpdir()
    local ok, res = pcall(helpers.run_quiet, helpers.tiny({"steps=20", "eval.every=10", "log.every=10",
                                                           "checkpoint.every=0", "name=sf"}), {runs = runs})
    eval.sample = sample
    assert.is_true(ok, res)
    local log = read(runs .. "/sf/log.txt")
    local _, n = log:gsub("the report's sample failed", "")
    assert.equal(1, n, log)
    helpers.has(log, "no sampling here")
    os.execute("rm -rf '" .. runs .. "'")
  end)
end)
