-- dormouse.config and dormouse.schema: presets, every error path, --set values,
-- the command line split, config.diff and the `dormouse config` command.
local config = require "dormouse.config"
local schema = require "dormouse.schema"
local helpers = require "tests.lua.helpers"
local err_of, has = helpers.err_of, helpers.has

local here = debug.getinfo(1, "S").source:match("^@(.*)/[^/]*$") or "tests/lua"
local root = here:gsub("/?tests/lua$", "")
if root == "" then root = "." end
local function fixture(name) return here .. "/fixtures/" .. name .. ".lua" end
local function preset(name) return root .. "/experiments/" .. name .. ".lua" end

-- The message of the error fn raises.
describe("config presets", function()
  it("tiny, small and b1 resolve with every key filled", function()
    for _, name in ipairs {"tiny", "small", "b1"} do
      local cfg = config.load(preset(name))
      assert.equal(name, cfg.name)
      for _, leaf in ipairs(schema.leaves) do
        local t = cfg
        for part in leaf.key:gmatch("[^.]+") do
          if type(t) == "table" then t = t[part] end
        end
        local _, err = leaf.type:check(t)
        assert.is_nil(err, name .. ": " .. leaf.key .. " " .. tostring(err))
      end
    end
  end)

  it("carry the shapes of the table in docs/model.md", function()
    local shapes = {
      --        d     H   dh iter E     k  r   r_s  F     orders     R        de
      b1    = {2048, 32, 64, 4, 1024, 2, 64, 192, 5461, {3, 4, 5}, 4194304, 32},
      small = {768,  12, 64, 2, 64,   2, 16, 64,  2048, {2, 3, 4}, 65536,   32},
      tiny  = {64,   2,  32, 2, 8,    2, 8,  16,  128,  {2, 3},    1024,    8},
    }
    for name, s in pairs(shapes) do
      local m = config.load(preset(name)).model
      assert.same(s, {m.d, m.heads, m.head_dim, m.max_iter, m.experts, m.top_k, m.expert_rank,
                      m.shared_rank, m.ffn, m.engram.orders, m.engram.rows, m.engram.width})
    end
  end)

  it("keep the optimiser constants of the spec", function()
    local o = config.load(preset("b1")).optim
    assert.equal(5, o.engram_lr_mult)
    assert.equal(0.95, o.momentum)
    assert.is_true(o.nesterov)
    assert.equal(5, o.ns_steps)
    assert.equal(0.1, o.weight_decay)
    assert.same({0.9, 0.95}, o.betas)
    local m = config.load(preset("b1")).model
    assert.equal("softplus", m.kda.gate)
    assert.equal(-5, m.kda.gate_lb)
    assert.equal(1e-3, m.moe.lfb_gamma)
    assert.is_nil(m.moe.capacity_factor)           -- dropless
  end)
end)

describe("config schema", function()
  it("gives every key a type, a default that passes it and a one-line doc", function()
    assert.is_true(#schema.leaves > 40)
    for _, leaf in ipairs(schema.leaves) do
      assert.is_true(schema.is_type(leaf.type), leaf.key)
      assert.is_string(leaf.doc, leaf.key)
      assert.is_nil(leaf.doc:find("\n"), leaf.key)
      local _, err = leaf.type:check(leaf.default)
      assert.is_nil(err, leaf.key)
    end
  end)

  -- A floor, read from the sources: a key whose name no code outside the schema mentions (as a
  -- field, .name, or a string, "name") is a key nothing reads, a silent no-op to whoever sets it.
  it("has no key that no code reads: each key's name is read outside the schema", function()
    local core = require "dormouse.core"
    local texts = {}
    local function walk(dir)
      for _, name in ipairs(assert(core.listdir(dir))) do
        local path = dir .. "/" .. name
        if name:match("%.lua$") then
          if not path:match("schema%.lua$") then
            local f = assert(io.open(path, "rb"))
            texts[#texts + 1] = f:read("a")
            f:close()
          end
        elseif not name:match("%.") then
          walk(path)
        end
      end
    end
    walk("lua/dormouse")
    walk("models")
    local code = table.concat(texts, "\n")
    local unread = {}
    for _, leaf in ipairs(schema.leaves) do
      local n = leaf.name
      if not (code:find("%." .. n .. "[^%w_]") or code:find('"' .. n .. '"', 1, true)) then
        unread[#unread + 1] = leaf.key
      end
    end
    assert.same({}, unread)
  end)

  it("fills the defaults into an empty table", function()
    local cfg = config.resolve({}, "empty")
    assert.equal(768, cfg.model.d)
    assert.equal("wsd", cfg.schedule.kind)
    assert.equal("run", cfg.name)
    assert.same({2, 3, 4}, cfg.model.engram.orders)
  end)

  it("names the run after the experiment file", function()
    assert.equal("config_ok", config.load(fixture("config_ok")).name)
  end)

  it("keeps an experiment's values and its globals to itself", function()
    local cfg = config.load(fixture("config_ok"))
    assert.equal(300, cfg.steps)
    assert.equal(128, cfg.model.d)
    assert.equal(0.01, cfg.model.moe.lfb_gamma)
    assert.equal(2e-3, cfg.optim.muon_lr)
    local g = config.load(fixture("config_globals"))
    assert.equal(128, g.seq)
    assert.equal("G", g.name)
    assert.is_nil(rawget(_G, "leaked_global"))
  end)

  it("turns an integral float into an integer", function()
    local cfg = config.resolve({steps = 1e3}, "t")
    assert.equal("integer", math.type(cfg.steps))
  end)

  it("does not share the default lists between configs", function()
    local a = config.resolve({}, "a")
    a.model.engram.orders[1] = 7
    assert.same({2, 3, 4}, config.resolve({}, "b").model.engram.orders)
  end)
end)

describe("config errors", function()
  it("an unknown key names the file, the dotted key and the nearest key", function()
    local f = fixture("config_unknown_key")
    has(err_of(config.load, f), f .. ":", "unknown key 'optim.muon_lrr'", "did you mean 'optim.muon_lr'?")
  end)

  it("suggests a key at its right depth, at the top level, and across a swap", function()
    has(err_of(config.resolve, {model = {lfb_gamma = 1}}, "x.lua"),
        "unknown key 'model.lfb_gamma'", "did you mean 'model.moe.lfb_gamma'?")
    has(err_of(config.resolve, {stpes = 1}, "x.lua"), "unknown key 'stpes'", "did you mean 'steps'?")
    has(err_of(config.resolve, {optim = {mnuo_lr = 1}}, "x.lua"), "did you mean 'optim.muon_lr'?")
    assert.equal("optim.muon_lr", config.suggest("muon_lr"))        -- a key in the wrong section
    assert.equal("model.engram.ram", config.suggest("model.engram_ram"))
    assert.equal("optim", config.suggest("optm"))
    assert.equal("eval.every", config.suggest("eval.evry"))
  end)

  it("a wrong type names the key and both types", function()
    local f = fixture("config_wrong_type")
    has(err_of(config.load, f), f .. ": model.d: expected integer", 'got string "abc"')
    has(err_of(config.resolve, {steps = 2.5}, "x.lua"), "x.lua: steps: expected integer", "got number 2.5")
    has(err_of(config.resolve, {graph = "yes"}, "x.lua"), "graph: expected boolean or nil, got string \"yes\"")
    has(err_of(config.resolve, {data = {path = 3}}, "x.lua"), "data.path: expected string or nil, got number 3")
  end)

  it("a value out of bounds shows the bounds", function()
    has(err_of(config.resolve, {batch = 0}, "x.lua"), "batch: expected integer >= 1, got number 0")
    has(err_of(config.resolve, {model = {kda = {gate_lb = 1}}}, "x.lua"),
        "model.kda.gate_lb: expected number < 0, got number 1")
    has(err_of(config.resolve, {schedule = {decay = 1.5}}, "x.lua"), "expected number in [0, 1], got number 1.5")
    has(err_of(config.resolve, {optim = {momentum = 1}}, "x.lua"), "expected number in [0, 1), got number 1")
    has(err_of(config.resolve, {optim = {clip = 0 / 0}}, "x.lua"), "optim.clip: expected number >= 0, got number")
  end)

  it("an enum value not allowed lists the allowed ones", function()
    local f = fixture("config_bad_enum")
    has(err_of(config.load, f), f .. ": schedule.kind:", '"linear" is not allowed', '"wsd", "cosine", "constant"')
    has(err_of(config.resolve, {device = 1}, "x.lua"), 'device: expected one of "auto", "cpu", "cuda", got number 1')
  end)

  it("a list checks its length and each entry", function()
    has(err_of(config.resolve, {optim = {betas = {0.9}}}, "x.lua"),
        "optim.betas: expected list of 2 numbers in [0, 1), got a list of 1: {0.9}")
    has(err_of(config.resolve, {optim = {betas = {0.9, "x"}}}, "x.lua"), 'optim.betas[2]: expected number in [0, 1), got string "x"')
    has(err_of(config.resolve, {model = {engram = {orders = 3}}}, "x.lua"),
        "model.engram.orders: expected list of integers in [1, 8], got number 3 (write {3})")
    has(err_of(config.resolve, {eval = {depths = {a = 1}}}, "x.lua"), "eval.depths: expected list of integers >= 1, got table")
  end)

  it("a section must be a table with named keys", function()
    has(err_of(config.resolve, {model = 5}, "x.lua"), "x.lua: model: expected a table", "got number 5")
    has(err_of(config.resolve, {model = {768}}, "x.lua"), "model: unexpected list entry [1]")
    has(err_of(config.resolve, {5}, "x.lua"), "the top level: unexpected list entry [1]")
    has(err_of(config.resolve, 5, "x.lua"), "x.lua: a config must be a table, got number 5")
  end)

  it("reports every error of a file at once, one per line", function()
    local f = fixture("config_many_errors")
    local msg = err_of(config.load, f)
    has(msg, "unknown key 'stpes'", "model.d: expected integer", "model.engram.orders[2]:", 'device: "tpu" is not allowed')
    local lines = 0
    for line in msg:gmatch("[^\n]+") do
      lines = lines + 1
      assert.equal(f .. ":", line:sub(1, #f + 1))
    end
    assert.equal(4, lines)
  end)

  it("a syntax error shows file:line", function()
    local f = fixture("config_syntax")
    has(err_of(config.load, f), f .. ":3:")
  end)

  it("a run-time error shows file:line", function()
    local f = fixture("config_runtime")
    has(err_of(config.load, f), f .. ":3:", "undefined_helper")
  end)

  it("a file that returns no table says so", function()
    local f = fixture("config_not_table")
    has(err_of(config.load, f), f .. ": an experiment must return a table, got number 42")
    local g = fixture("config_no_return")
    has(err_of(config.load, g), g .. ": the file returned nothing")
  end)

  it("a missing file names it", function()
    has(err_of(config.load, "tests/lua/fixtures/no_such_file.lua"), "cannot open", "no_such_file.lua")
    has(err_of(config.load, nil), "expected the path of an experiment file, got nil")
  end)

  it("checks across keys once each key is valid", function()
    has(err_of(config.resolve, {model = {experts = 2, top_k = 3}}, "x.lua"),
        "x.lua: model.top_k (3) exceeds model.experts (2)")
    has(err_of(config.resolve, {model = {engram = {orders = {3, 2}}}}, "x.lua"),
        "model.engram.orders must be strictly ascending, got {3, 2}")
    has(err_of(config.resolve, {eval = {depths = {3}}}, "x.lua"), "eval.depths holds 3, beyond model.max_iter (2)")
    has(err_of(config.resolve, {steps = 50}, "x.lua"), "schedule.warmup (100) exceeds steps (50)")
    has(err_of(config.resolve, {steps = 200, schedule = {decay = 0.6}}, "x.lua"),
        "schedule.warmup (100) and schedule.decay (0.6 of 200 steps) overlap")
    assert.has_no.errors(function() config.resolve({steps = 200, schedule = {kind = "cosine", decay = 0.6}}, "x") end)
  end)

  it("a resolved config refuses to read a key it does not know", function()
    local cfg = config.resolve({}, "x")
    has(err_of(function() return cfg.model.dd end), "config has no key 'model.dd'", "did you mean 'model.d'?")
    has(err_of(function() return cfg.optim.lr end), "config has no key 'optim.lr'")
    assert.is_nil(cfg.data.path)                    -- a known key that is nil reads nil
    assert.is_nil(cfg.model.moe.capacity_factor)
  end)
end)

describe("config --set values", function()
  local function parse(s) return config.parse_value(s) end

  it("reads integers and floats", function()
    assert.equal(12, parse("12")); assert.equal("integer", math.type(parse("12")))
    assert.equal(-2, parse("-2"))
    assert.equal(3, parse("+3"))
    assert.equal(1e-3, parse("1e-3")); assert.equal("float", math.type(parse("1e-3")))
    assert.equal(0.5, parse(".5"))
    assert.equal(-0.25, parse("-.25"))
    assert.equal(2e5, parse("2E+5"))
    assert.equal(5.0, parse("5."))
    assert.equal(7, parse("  7  "))
  end)

  it("reads booleans and nil", function()
    assert.is_true(parse("true"))
    assert.is_false(parse("false"))
    local v, form = parse("nil")
    assert.is_nil(v); assert.equal("nil", form)
  end)

  it("reads quoted and bare strings", function()
    assert.equal("a b", parse('"a b"'))
    assert.equal("x'y", parse("'x\\'y'"))
    assert.equal('say "hi"', parse('"say \\"hi\\""'))
    assert.equal("12", parse('"12"'))
    assert.equal("hello world", parse("hello world"))
    assert.equal("/data/corpus.bin", parse("/data/corpus.bin"))
    assert.equal("1e-3x", parse("1e-3x"))           -- not a number: text
    assert.equal("", parse("''"))
    local _, form = parse("abc")
    assert.equal("string", form)
  end)

  it("reads lists in braces and bare", function()
    assert.same({1, 2, 3}, parse("{1, 2, 3}"))
    assert.same({1, 2, 3}, parse("1,2,3"))
    assert.same({0.9, 0.95}, parse("{0.9,0.95}"))
    assert.same({}, parse("{}"))
    assert.same({1}, parse("{1,}"))
    assert.same({"a", "b"}, parse("a,b"))
    local _, form = parse("{1}")
    assert.equal("list", form)
  end)

  it("names the offset of what it cannot read", function()
    has(err_of(parse, "{1,2"), 'cannot parse the value "{1,2" at offset 4')
    has(err_of(parse, "{{1}}"), "at offset 1")
    has(err_of(parse, "1,2}"), "cannot parse")
    has(err_of(parse, ""), "empty value")
    has(err_of(parse, "{1, nil}"), "nil cannot be an entry of a list")
  end)
end)

describe("config overrides", function()
  it("reach nested keys and are checked by the schema", function()
    local cfg, info = config.load(preset("tiny"), {"model.engram.width=16", "optim.betas={0.8, 0.9}",
                                                   "model.kda.gate=softplus", "steps=60"})
    assert.equal(16, cfg.model.engram.width)
    assert.same({0.8, 0.9}, cfg.optim.betas)
    assert.equal("softplus", cfg.model.kda.gate)
    assert.equal(60, cfg.steps)
    assert.equal(64, cfg.model.d)                   -- the rest of the file stays
    assert.is_truthy(info.overridden["model.engram.width"])
  end)

  it("take lists bare, nil for optional keys, and bare numbers as text for text keys", function()
    local cfg = config.resolve({model = {moe = {capacity_factor = 2}}}, "x",
                               {"model.engram.orders=3,4,5", "model.moe.capacity_factor=nil", "name= 2024 ", "data.path=/tmp/c.bin"})
    assert.same({3, 4, 5}, cfg.model.engram.orders)
    assert.is_nil(cfg.model.moe.capacity_factor)
    assert.equal("2024", cfg.name)
    assert.equal("/tmp/c.bin", cfg.data.path)
  end)

  it("take a map of dotted keys to Lua values", function()
    local cfg = config.resolve({}, "x", {["model.d"] = 32, ["optim.nesterov"] = false})
    assert.equal(32, cfg.model.d)
    assert.is_false(cfg.optim.nesterov)
    has(err_of(config.resolve, {}, "x", {["model.dd"] = 32}), "unknown key 'model.dd'", "did you mean 'model.d'?")
    has(err_of(config.resolve, {}, "x", {name = 5}), "override name = 5: name: expected string or nil, got number 5")
  end)

  it("an unknown key names the --set and suggests the nearest key", function()
    has(err_of(config.load, preset("tiny"), {"optim.muon_lrr=1e-3"}),
        "--set optim.muon_lrr=1e-3: unknown key 'optim.muon_lrr' (did you mean 'optim.muon_lr'?)")
  end)

  it("a wrong value names the --set, the key and both types", function()
    has(err_of(config.load, preset("tiny"), {"model.d=abc"}),
        '--set model.d=abc: model.d: expected integer >= 1, got string "abc"')
    has(err_of(config.resolve, {}, "x", {"steps=1.5"}), "steps: expected integer >= 1, got number 1.5")
    has(err_of(config.resolve, {}, "x", {"model.d=nil"}), "model.d: expected integer >= 1, got nil")
    has(err_of(config.resolve, {}, "x", {"schedule.kind=linear"}), '"linear" is not allowed; allowed: "wsd"')
    has(err_of(config.resolve, {}, "x", {"model.engram.orders={1,x}"}), "model.engram.orders[2]: expected integer")
  end)

  it("a section or a malformed --set is an error", function()
    has(err_of(config.resolve, {}, "x", {"model=3"}), "'model' is a section; set one of its keys, such as 'model.arch'")
    has(err_of(config.resolve, {}, "x", {"steps"}), "--set steps: expected KEY=VALUE")
    has(err_of(config.resolve, {}, "x", {"a..b=1"}), "is not a dotted key")
    has(err_of(config.resolve, {}, "x", {"steps={1"}), "--set steps={1: cannot parse the value")
  end)

  it("are followed by the checks across keys", function()
    has(err_of(config.load, preset("b1"), {"steps=10"}), "experiments/b1.lua with its overrides: schedule.warmup (2000) exceeds steps (10)")
    assert.equal(10, config.load(preset("b1"), {"steps=10", "schedule.warmup=0", "schedule.decay=0.1"}).steps)
  end)
end)

describe("config.parse_args", function()
  it("splits the file, the overrides and the flags", function()
    local a = config.parse_args({"train", "experiments/b1.lua", "--set", "steps=10", "--set=optim.muon_lr=1e-3",
                                 "--resume", "runs/b1"}, 2)
    assert.equal("experiments/b1.lua", a.file)
    assert.same({"steps=10", "optim.muon_lr=1e-3"}, a.overrides)
    assert.same({resume = "runs/b1"}, a.flags)
    local b = config.parse_args({"--resume=runs/x", "--dry", "f.lua"}, 1, {resume = "DIR", dry = true})
    assert.same({resume = "runs/x", dry = true}, b.flags)
    assert.equal("f.lua", b.file)
    assert.is_nil(config.parse_args({"x"}, 2).file)
  end)

  it("refuses a --set without =, a missing value, an unknown flag and a second file", function()
    has(err_of(config.parse_args, {"f.lua", "--set", "steps"}, 1), "--set steps: expected KEY=VALUE")
    has(err_of(config.parse_args, {"f.lua", "--set"}, 1), "--set needs KEY=VALUE")
    has(err_of(config.parse_args, {"f.lua", "--resume"}, 1), "--resume needs a value")
    has(err_of(config.parse_args, {"f.lua", "--bogus"}, 1), "unknown flag --bogus", "--set KEY=VALUE", "--resume DIR")
    has(err_of(config.parse_args, {"f.lua", "-x"}, 1), "unknown flag -x")
    has(err_of(config.parse_args, {"f.lua", "--dry=1"}, 1, {dry = true}), "--dry takes no value")
    has(err_of(config.parse_args, {"a.lua", "b.lua"}, 1), "one experiment file expected, got 'a.lua' and 'b.lua'")
  end)
end)

describe("config.diff", function()
  it("is empty for equal configs, lists differing keys in schema order with both values", function()
    local a = config.load(preset("small"))
    assert.same({}, config.diff(a, config.load(preset("small"))))
    local b = config.load(preset("small"), {"optim.muon_lr=2e-3", "model.d=512", "model.engram.orders={2,3}"})
    assert.same({
      {key = "model.d", a = 768, b = 512},
      {key = "model.engram.orders", a = {2, 3, 4}, b = {2, 3}},
      {key = "optim.muon_lr", a = 1e-3, b = 2e-3},
    }, config.diff(a, b))
  end)

  it("ignores the progress keys unless told otherwise", function()
    local a = config.load(preset("small"))
    local b = config.load(preset("small"), {"steps=4000", "eval.every=100", "log.every=1", "checkpoint.keep=9"})
    assert.same({}, config.diff(a, b))
    assert.equal(4, #config.diff(a, b, {}))
    assert.same({{key = "steps", a = 2000, b = 4000}}, config.diff(a, b, {"eval", "log", "checkpoint"}))
    local progress = {}
    for _, k in ipairs(config.progress_keys) do progress[k] = true end
    for _, k in ipairs {"steps", "eval.every", "eval.windows", "eval.depths", "checkpoint.every", "checkpoint.keep", "log.every"} do
      assert.is_true(progress[k], k)
    end
    assert.is_nil(progress["model.d"])
  end)

  it("compares nil values, plain tables and keys the schema does not know", function()
    local a = config.resolve({}, "a")
    local old = {model = {moe = {capacity_factor = 2.0}}, retired = {knob = 1}}
    local d = config.diff(a, old)
    local keys = {}
    for _, e in ipairs(d) do keys[e.key] = e end
    assert.equal(2.0, keys["model.moe.capacity_factor"].b)
    assert.is_nil(keys["model.moe.capacity_factor"].a)
    assert.equal(1, keys["retired.knob"].b)
    assert.equal("retired.knob", d[#d].key)          -- unknown keys come last
  end)

  it("formats a diff one key per line", function()
    local d = {{key = "optim.muon_lr", a = 1e-3, b = 2e-3}}
    assert.equal("  optim.muon_lr: 0.001 (checkpoint) vs 0.002 (this run)",
                 config.format_diff(d, "checkpoint", "this run"))
  end)
end)

describe("dormouse config", function()
  local command = require "dormouse.commands.config"

  -- Run the command with stdout and stderr captured.
  local function run(...)
    local out, err = {}, {}
    local write, stderr = io.write, io.stderr
    io.write = function(...) for _, s in ipairs {...} do out[#out + 1] = s end end
    io.stderr = {write = function(_, ...) for _, s in ipairs {...} do err[#err + 1] = s end end}
    local ok, code = pcall(command.run, {"config", ...}, {})
    io.write, io.stderr = write, stderr
    assert.is_true(ok, tostring(code))
    return code, table.concat(out), table.concat(err)
  end

  it("prints every key with its value and doc, aligned, marking what differs from the default", function()
    local code, out = run(preset("b1"), "--set", "optim.clip=0.5")
    assert.equal(0, code)
    has(out, "-- model: the model family", "-- model.engram: hashed byte n-gram memory")
    local d = out:match("\n(model%.d +=[^\n]*)")
    assert.is_truthy(d:match("^model%.d +%= 2048 +%* %-%- model width d %(default 768%)$"), d)
    local clip = out:match("\n(optim%.clip +=[^\n]*)")
    has(clip, "0.5", "*", "(default 1.0) [--set]")
    local seed = out:match("\n(seed +=[^\n]*)")
    assert.is_truthy(seed:match("^seed +%= 1 +%-%- "), seed)   -- the default: no mark
    local col
    for line in out:gmatch("[^\n]+") do               -- the values start in one column
      if not line:match("^%-%-") then
        local c = line:find(" = ", 1, true)
        col = col or c
        assert.equal(col, c, line)
      end
    end
    local n = 0
    for _ in out:gmatch("\n[%w_.]+ += ") do n = n + 1 end
    assert.equal(#schema.leaves, n)
  end)

  it("prints the defaults without a file, and a diff with --diff", function()
    local code, out = run()
    assert.equal(0, code)
    has(out, "-- defaults, resolved")
    code, out = run(preset("tiny"), "--diff", preset("small"))
    assert.equal(0, code)
    has(out, "  model.d: 64 (", ") vs 768 (")
  end)

  it("exits 1 with the message on a config error, 2 on a usage error", function()
    local code, _, err = run(fixture("config_unknown_key"))
    assert.equal(1, code)
    has(err, "did you mean 'optim.muon_lr'?")
    code, _, err = run(preset("tiny"), "--set", "nope")
    assert.equal(2, code)
    has(err, "expected KEY=VALUE", "usage: dormouse config")
  end)
end)

-- A model file with hyperparameters of its own: it returns {keys = ..., build = ...}, and its keys
-- are checked, defaulted, overridden and listed as the runtime's are, under model.
describe("a model file's own keys", function()
  local dir, path
  local function write(name, text)
    local p = dir .. "/" .. name .. ".lua"
    local f = assert(io.open(p, "w"))
    f:write(text)
    f:close()
    return p
  end
  setup(function()
    dir = helpers.tmpdir()
    path = write("gated", [[
local schema = require "dormouse.schema"
local nn = require "dormouse.nn"
return {
  keys = {
    {"gated", schema.boolean, false, "gate the block's output"},
    {"gate_bias", schema.number, 1.0, "the gate's initial bias"},
    {"gate", "the gate's shape", {{"rank", schema.integer{min = 1}, 4, "its rank"}}},
  },
  build = function(m) return nn.Linear(m.d, m.gate.rank) end,
}]])
  end)
  teardown(function() os.execute("rm -rf '" .. dir .. "'") end)

  it("are checked, defaulted, set on the command line and listed", function()
    local cfg, info = config.resolve({model = {arch = path, gated = true}}, "exp.lua", {"model.gate_bias=2.5"})
    assert.is_true(cfg.model.gated)
    assert.equal(2.5, cfg.model.gate_bias)
    assert.equal(4, cfg.model.gate.rank)
    assert.equal(768, cfg.model.d)                                  -- the runtime's keys as ever
    has(config.describe(cfg, info), "model.gated", "gate the block's output", "model.gate.rank")
    local model = require("dormouse.train").build_model(cfg, ".")
    assert.equal(768 * 4, model:n_params())
  end)

  it("train, and come back from the checkpoint with the run", function()
    local tiny = write("tiny_keys", [[
local dm = require "dormouse"
local nn = require "dormouse.nn"
local schema = require "dormouse.schema"
local M = nn.class("TinyKeys")
function M:init(m)
  self:child("emb", nn.Embedding(256, m.d))
  self:child("head", nn.Linear(m.d, 256))
  self.scale = m.scale
end
function M:forward(x)
  local T = x:size(2) - 1
  local targets = x:narrow(2, 2, T):to("i64"):reshape({-1})
  local h = self.emb:forward(x:narrow(2, 1, T)) * self.scale
  local logits = self.head:forward(self:activation(h)):to(h.dtype)
  local ce = dm.cross_entropy(logits:reshape({-1, 256}), targets)
  return {loss = ce, fin = ce, fin_logits = logits}
end
return {keys = {{"scale", schema.number{above = 0}, 1.0, "the embedding's scale"}},
        build = function(m) return M(m) end}]])
    local runs = helpers.tmpdir()
    helpers.run_quiet(helpers.tiny({"steps=2", "eval.every=0", "checkpoint.every=2", "log.every=2",
                                    "schedule.warmup=1", "eval.windows=2", "eval.baseline={}", "name=k",
                                    "model.arch=" .. tiny, "model.scale=0.5"}), {runs = runs})
    local probe = require "dormouse.probe"
    has(err_of(probe.load, runs .. "/k", "."), "model.arch names a model file by its path", "--trust")
    local _, cfg, _, step = probe.load(runs .. "/k", ".", {trust = true})     -- the user's own file
    os.execute("rm -rf '" .. runs .. "'")
    assert.equal(2, step)
    assert.equal(0.5, cfg.model.scale)
  end)

  it("refuse what the schema would: unknown keys, wrong types, the runtime's names", function()
    has(err_of(config.resolve, {model = {arch = path, gatedd = true}}, "exp.lua"), "unknown key 'model.gatedd'",
        "did you mean 'model.gated'?")
    has(err_of(config.resolve, {model = {arch = path, gated = 3}}, "exp.lua"), "model.gated", "boolean")
    has(err_of(config.resolve, {model = {arch = path}}, "exp.lua", {"model.gate.rank=0"}), "model.gate.rank")
    has(err_of(config.resolve, {model = {gated = true}}, "exp.lua"), "unknown key 'model.gated'")   -- not this arch
    local clash = write("clash", [[return {keys = {{"d", require("dormouse.schema").integer, 1, "x"}},
                                           build = function() end}]])
    has(err_of(config.resolve, {model = {arch = clash}}, "exp.lua"), clash, "key 'd' is the runtime's own")
    local untyped = write("untyped", [[return {keys = {{"x", "number", 1, "x"}}, build = function() end}]])
    has(err_of(config.resolve, {model = {arch = untyped}}, "exp.lua"), untyped, "key 'x': its type")
  end)
end)

describe("retired keys", function()
  it("are dropped with a note, from a file, a checkpoint's config or --set, and left out of resume's comparison",
     function()
    local helpers = require "tests.lua.helpers"
    local cfg = config.resolve({model = {kda = {chunk = 32, gate = "softplus"}}}, "old.lua", {"model.kda.chunk=16"})
    assert.equal("softplus", cfg.model.kda.gate)
    helpers.has(helpers.err_of(function() return cfg.model.kda.chunk end), "config has no key 'model.kda.chunk'")
    local saved = config.plain(config.resolve({}, "a"))
    saved.model.kda.chunk = 64                      -- as a checkpoint of an earlier version holds it
    assert.same({}, config.diff(saved, config.plain(config.resolve({}, "b"))))
  end)
end)

describe("keys introduced after a checkpoint was made", function()
  it("read as the code did before them (config.upgrade); a config of now is left as it is", function()
    local old = config.plain(config.load("experiments/tiny.lua", {"model.engram.output=projection"}))
    for _, key in ipairs {"alpha_gain"} do old.model.engram[key] = nil end
    old.model.init.a_log, old.model.init.engram_conv, old.model.moe.router = nil, nil, nil
    old.model.moe.aux_balance, old.optim.gates = nil, nil
    local up = config.upgrade(old)
    assert.same({false, 3, "log_uniform", "zeros", "sigmoid", 0, "adamw"},
                {up.model.engram.alpha_gain, up.model.engram.dilation, up.model.init.a_log,
                 up.model.init.engram_conv, up.model.moe.router, up.model.moe.aux_balance, up.optim.gates})
    assert.is_nil(old.model.engram.dilation)                -- a copy: the saved table is not touched
    old.model.engram.output = "spec"                        -- the spec form's nil was the largest order already
    assert.is_nil(config.upgrade(old).model.engram.dilation)
    local now = config.plain(config.load("experiments/tiny.lua"))
    assert.same(now, config.upgrade(now))
    for key in pairs(require("dormouse.schema").introduced) do
      assert.truthy(require("dormouse.schema").nodes[key], key .. " is a key of the schema")
    end
  end)
end)
