--[[
report.html: one self-contained page of the run's curves, rewritten at every
log line and eval. With the chart library the build embeds (uPlot, from the
npm registry: cmake/vendor.cmake) the page draws them with it: held-out bits
per byte on a log axis (per iteration, per depth, the n-gram baselines), the
training loss, tokens/s, learning rate and gradient norm, the experts'
balance and each expert's load over time, Engram's distinct rows, memory;
then an eval table and the latest sample. Without it (a build configured
offline) the page is inline SVG, said once on stderr.

  report.html(run, records, baselines)    run = {name, summary, config_text, live, stopped = its last step}
]]
local json = require "dormouse.json"
local core = require "dormouse.core"
local LN2 = require("dormouse.instrument").LN2
local report = {}

local colors = {"#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#17becf", "#7f7f7f"}

local function esc(s) return (tostring(s):gsub("&", "&amp;"):gsub("<", "&lt;"):gsub(">", "&gt;")) end

local function nice(v)
  if v == 0 then return "0" end
  local a = math.abs(v)
  if a >= 1e4 or a < 1e-2 then return string.format("%.2e", v) end
  return string.format("%.3g", v)
end

local function bounds(series)
  local x0, x1, y0, y1 = math.huge, -math.huge, math.huge, -math.huge
  for _, s in ipairs(series) do
    for _, p in ipairs(s.points) do
      x0, x1 = math.min(x0, p[1]), math.max(x1, p[1])
      y0, y1 = math.min(y0, p[2]), math.max(y1, p[2])
    end
  end
  if x0 == math.huge then return nil end
  if x1 == x0 then x1 = x0 + 1 end
  if y1 == y0 then y0, y1 = y0 - 0.5, y1 + 0.5 end
  local pad = (y1 - y0) * 0.05
  local lo = y0 - pad
  if y0 >= 0 and lo < 0 then lo = 0 end           -- non-negative data keeps a zero floor
  return x0, x1, lo, y1 + pad
end

-- One chart: series = {{name =, points = {{x, y}, ...}, dashed =}, ...}.
function report.chart(title, series, ylabel)
  local W, L, R, B = 560, 72, 16, 40
  local legend_rows = math.ceil(#series / 2)
  local T = 30 + 14 * legend_rows                 -- the legend sits between the title and the plot
  local H = T + 250 + B
  local x0, x1, y0, y1 = bounds(series)
  local out = {string.format('<svg viewBox="0 0 %d %d" width="%d" height="%d" role="img">', W, H, W, H),
               string.format('<text x="%d" y="18" font-weight="bold">%s</text>', L, esc(title))}
  if not x0 then
    out[#out + 1] = string.format('<text x="%d" y="%d" fill="#888">no data yet</text></svg>', L, H / 2)
    return table.concat(out)
  end
  local function sx(x) return L + (x - x0) / (x1 - x0) * (W - L - R) end
  local function sy(y) return H - B - (y - y0) / (y1 - y0) * (H - T - B) end
  out[#out + 1] = string.format('<rect x="%d" y="%d" width="%d" height="%d" fill="none" stroke="#ccc"/>',
                                L, T, W - L - R, H - T - B)
  for i = 0, 4 do
    local y = y0 + (y1 - y0) * i / 4
    out[#out + 1] = string.format('<line x1="%d" x2="%d" y1="%.1f" y2="%.1f" stroke="#eee"/>' ..
      '<text x="%d" y="%.1f" font-size="11" text-anchor="end">%s</text>', L, W - R, sy(y), sy(y), L - 4, sy(y) + 4, nice(y))
    local x = x0 + (x1 - x0) * i / 4
    out[#out + 1] = string.format('<text x="%.1f" y="%d" font-size="11" text-anchor="middle">%s</text>',
                                  sx(x), H - B + 16, string.format("%d", math.floor(x + 0.5)))
  end
  out[#out + 1] = string.format('<text x="%d" y="%d" font-size="11" text-anchor="middle">step</text>',
                                (L + W - R) // 2, H - 6)
  if ylabel then
    out[#out + 1] = string.format('<text x="10" y="%d" font-size="11" transform="rotate(-90 10 %d)" ' ..
                                  'text-anchor="middle">%s</text>', H // 2, H // 2, esc(ylabel))
  end
  for i, s in ipairs(series) do
    local pts = {}
    for _, p in ipairs(s.points) do pts[#pts + 1] = string.format("%.1f,%.1f", sx(p[1]), sy(p[2])) end
    local color = colors[(i - 1) % #colors + 1]
    out[#out + 1] = string.format('<polyline fill="none" stroke="%s" stroke-width="1.6"%s points="%s"/>',
                                  color, s.dashed and ' stroke-dasharray="5,4"' or "", table.concat(pts, " "))
    if #s.points == 1 then
      out[#out + 1] = string.format('<circle cx="%.1f" cy="%.1f" r="3" fill="%s"/>',
                                    sx(s.points[1][1]), sy(s.points[1][2]), color)
    end
    out[#out + 1] = string.format('<text x="%d" y="%d" font-size="11" fill="%s">%s %s</text>',
                                  L + ((i - 1) % 2) * 240, 30 + 14 * ((i - 1) // 2), color,
                                  s.dashed and "- -" or "—", esc(s.name))
  end
  out[#out + 1] = "</svg>"
  return table.concat(out)
end

local function series_of(records, kind, field, name, scale)
  local pts = {}
  for _, r in ipairs(records) do
    if r.kind == kind and r[field] then pts[#pts + 1] = {r.step, r[field] * (scale or 1)} end
  end
  return {name = name, points = pts}
end

--[[ The page from the run's records (the lines of metrics.jsonl as tables):
kind "log" (step, loss, tok_s, lr, moe_busiest, moe_entropy) and kind "eval"
(step, fin, periter = {...}). ]]
local function svg_page(run, records, baselines)
  local bpb = {series_of(records, "log", "loss", "train loss (bpb)", 1 / LN2),
               series_of(records, "eval", "fin", "held-out bpb_fin", 1 / LN2)}
  local iters = 0
  for _, r in ipairs(records) do if r.kind == "eval" then iters = math.max(iters, #r.periter) end end
  for i = 1, iters do
    local pts = {}
    for _, r in ipairs(records) do
      if r.kind == "eval" and r.periter[i] then pts[#pts + 1] = {r.step, r.periter[i] / LN2} end
    end
    bpb[#bpb + 1] = {name = "held-out bpb, iteration " .. i, points = pts, dashed = true}
  end
  for _, b in ipairs(baselines or {}) do
    local pts = {}
    for _, r in ipairs(records) do if r.kind == "eval" then pts[#pts + 1] = {r.step, b.bpb} end end
    bpb[#bpb + 1] = {name = string.format("order-%d n-gram", b.order), points = pts, dashed = true}
  end
  local charts = {
    report.chart("bits per byte", bpb, "bpb"),
    report.chart("tokens per second", {series_of(records, "log", "tok_s", "tokens/s")}, "tok/s"),
    report.chart("expert load", {series_of(records, "log", "moe_busiest", "busiest expert's share"),
                                 series_of(records, "log", "moe_entropy", "router entropy (normalised)")}),
    report.chart("learning rate", {series_of(records, "log", "lr", "learning rate (AdamW group; Muon follows the same schedule)")}, "lr"),
  }
  local last = records[#records]
  return table.concat {
    "<!doctype html><html><head><meta charset=\"utf-8\"><title>", esc(run.name), " — dormouse</title>",
    "<style>body{font-family:system-ui,sans-serif;margin:24px;color:#222}",
    ".grid{display:grid;grid-template-columns:repeat(auto-fill,minmax(560px,1fr));gap:16px}",
    "svg{background:#fff;border:1px solid #ddd}pre{background:#f6f6f6;padding:8px;overflow:auto}</style>",
    "</head><body><h1>", esc(run.name), "</h1><p>", esc(run.summary or ""), "</p>",
    "<p>last record: step ", last and last.step or 0, "</p>",
    "<div class=\"grid\">", table.concat(charts), "</div>",
    "<h2>config</h2><pre>", esc(run.config_text or ""), "</pre></body></html>\n",
  }
end

local function chart_data(records, baselines)
  local logs = {step = {}, bpb = {}, tok_s = {}, lr = {}, grad_norm = {}, busiest = {}, entropy = {}, dead = {},
                drops = {}, mem_allocated = {}, mem_peak = {}, engram_unique = {}, engram_rows = {}}
  local evals = {step = {}, bpb_fin = {}, iters = {}, depths = {}}
  local loads = {}
  local function put(list, i, v) list[i] = v == nil and 0 / 0 or v end
  for _, r in ipairs(records) do
    if r.kind == "log" then
      local i = #logs.step + 1
      logs.step[i] = r.step
      put(logs.bpb, i, r.loss and r.loss / LN2)
      put(logs.tok_s, i, r.tok_s); put(logs.lr, i, r.lr); put(logs.grad_norm, i, r.grad_norm)
      put(logs.busiest, i, r.moe_busiest); put(logs.entropy, i, r.moe_entropy); put(logs.dead, i, r.moe_dead)
      put(logs.drops, i, r.moe_drops)
      put(logs.mem_allocated, i, r.mem_allocated and r.mem_allocated / 2 ^ 20)
      put(logs.mem_peak, i, r.mem_peak and r.mem_peak / 2 ^ 20)
      put(logs.engram_unique, i, r.engram_unique); put(logs.engram_rows, i, r.engram_rows)
      if r.moe_load then loads[#loads + 1] = {step = r.step, load = r.moe_load} end
    elseif r.kind == "eval" then
      local i = #evals.step + 1
      evals.step[i] = r.step
      evals.bpb_fin[i] = r.bpb_fin or (r.fin and r.fin / LN2) or 0 / 0    -- a non-finite one was saved as null
      for k, ce in ipairs(r.periter or {}) do
        evals.iters[k] = evals.iters[k] or {}
        evals.iters[k][i] = ce / LN2
      end
      for D, ce in pairs(r.depths or {}) do
        local key = tostring(D)
        evals.depths[key] = evals.depths[key] or {}
        evals.depths[key][i] = ce / LN2
      end
    end
  end
  local n = #evals.step          -- series with gaps (an eval without that iteration) as null, to n
  for _, list in pairs(evals.iters) do for i = 1, n do if list[i] == nil then list[i] = 0 / 0 end end end
  for _, list in pairs(evals.depths) do for i = 1, n do if list[i] == nil then list[i] = 0 / 0 end end end
  -- the per-expert load over time: at most 240 windows, evenly picked
  local load = {step = {}, share = {}}
  local every = math.max(1, math.ceil(#loads / 240))
  for i = 1, #loads, every do
    load.step[#load.step + 1] = loads[i].step
    load.share[#load.share + 1] = loads[i].load
  end
  local base = {}
  for _, b in ipairs(baselines or {}) do base[#base + 1] = {order = b.order, bpb = b.bpb} end
  return {logs = logs, evals = evals, baselines = base, load = load}
end

local JS = [==[
(function () {
  "use strict";
  var body = document.body, made = 0, drawn = 0;
  window.onerror = function (msg) { body.dataset.error = String(msg); };
  var D = JSON.parse(document.getElementById("data").textContent);
  var C = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#17becf", "#7f7f7f", "#bcbd22", "#e377c2"];
  var W = Math.max(420, Math.min(640, Math.floor((document.documentElement.clientWidth - 130) / 2)));

  function fmt(v) {
    if (v == null) return "";
    var a = Math.abs(v);
    if (a >= 1e6) return +(v / 1e6).toPrecision(3) + "M";
    if (a >= 1e4) return +(v / 1e3).toPrecision(3) + "K";
    if (a !== 0 && a < 1e-3) return v.toExponential(1);
    return String(+v.toPrecision(3));
  }
  // round ticks on a log axis: round multiples of powers of ten, finer the narrower the range, 8 or fewer
  function logTicks(u, axis, min, max) {
    var r = max / min, t = [];
    var m = r > 20 ? [1, 2, 5] : r > 3 ? [1, 1.5, 2, 3, 4, 5, 6, 8]
          : [1, 1.1, 1.2, 1.3, 1.4, 1.5, 1.6, 1.8, 2, 2.2, 2.5, 3, 3.5, 4, 4.5, 5, 6, 7, 8, 9];
    for (var e = Math.floor(Math.log10(min)); e <= Math.ceil(Math.log10(max)); e++)
      for (var i = 0; i < m.length; i++) {
        var v = +(m[i] * Math.pow(10, e)).toPrecision(3);
        if (v >= min * 0.999 && v <= max * 1.001) t.push(v);
      }
    while (t.length > 8) t = t.filter(function (_, i) { return i % 2 === 0; });
    return t;
  }
  // several series on their own steps, joined on the union of the steps (null where one has none)
  function join(parts) {
    var steps = {}, xs = [];
    parts.forEach(function (p) { p.x.forEach(function (s) { if (!steps[s]) { steps[s] = 1; xs.push(s); } }); });
    xs.sort(function (a, b) { return a - b; });
    var at = {};
    xs.forEach(function (s, i) { at[s] = i; });
    return [xs].concat(parts.map(function (p) {
      var y = xs.map(function () { return null; });
      p.x.forEach(function (s, i) { y[at[s]] = p.y[i]; });
      return y;
    }));
  }
  // the plot area's pixels in the first series' colour: ink where the data are
  function inked(u, color) {
    var b = u.bbox, img = u.ctx.getImageData(b.left, b.top, Math.max(1, b.width), Math.max(1, b.height)).data;
    var r = parseInt(color.slice(1, 3), 16), g = parseInt(color.slice(3, 5), 16), bl = parseInt(color.slice(5, 7), 16);
    var n = 0;
    for (var i = 0; i < img.length; i += 4)
      if (img[i + 3] > 128 && Math.abs(img[i] - r) + Math.abs(img[i + 1] - g) + Math.abs(img[i + 2] - bl) < 90) n++;
    return n > 10;
  }
  // the step axis's ticks: whole steps only (no run has a step 17.5), every 1, 2 or 5 times a power of
  // ten, the first at least as wide as uPlot's own choice; each chart's ticks go on the body for tests
  var stepTicks = {};
  function stepSplits(u, ax, min, max, incr) {
    var inc = 1, k = 0;
    while (inc < incr) { k++; inc = [1, 2, 5][k % 3] * Math.pow(10, Math.floor(k / 3)); }
    var out = [];
    for (var v = Math.ceil(min / inc) * inc; v <= max; v += inc) { out.push(v); stepTicks[v] = true; }
    body.dataset.stepTicks = Object.keys(stepTicks).join(" ");
    return out;
  }
  function chart(title, parts, o) {
    o = o || {};
    // a series the run never logged (a model without experts, without Engram) is left out, and a chart
    // left with none is not drawn: no empty frames
    parts = parts.filter(function (p) { return p.y.some(function (v) { return v != null; }); });
    if (parts.length === 0) return;
    if (o.right && !parts.some(function (p) { return p.scale === o.right; })) o.right = undefined;
    var data = join(parts);
    if (data[0].length === 0) return;
    var el = document.createElement("div");
    el.className = "chart";
    document.getElementById("charts").appendChild(el);
    var series = [{label: "step"}], axes = [{label: "step", splits: stepSplits,
                                             values: function (u, v) { return v.map(fmt); }}];
    parts.forEach(function (p, i) {
      series.push({label: p.label, stroke: p.color || C[i % C.length], width: p.width || 1.5, dash: p.dash,
                   scale: p.scale || "y", spanGaps: true, points: {show: data[0].length < 30},
                   value: function (u, v) { return fmt(v); }});
    });
    var scales = {x: {time: false}};
    scales.y = o.log ? {distr: 3, log: 10, range: function (u, mn, mx) { return [mn / 1.08, mx * 1.08]; }} : o.zero ? {range: function (u, mn, mx) { return [0, mx > 0 ? mx * 1.05 : 1]; }} : {};
    axes.push({label: o.ylabel || "", size: 60, splits: o.log ? logTicks : undefined,
               values: function (u, v) { return v.map(fmt); }});
    if (o.right) {
      scales[o.right] = {range: function (u, mn, mx) { return [0, mx > 0 ? mx * 1.1 : 1]; }};
      axes.push({scale: o.right, side: 1, label: o.rlabel || "", size: 50, grid: {show: false},
                 values: function (u, v) { return v.map(fmt); }});
    }
    var counted = false;                  // uPlot draws in a microtask: the ink is looked at when it has
    var hooks = {draw: [function (u) {
      if (!counted && inked(u, series[1].stroke)) { counted = true; drawn++; body.dataset.drawn = String(drawn); }
    }]};
    new uPlot({title: title, width: W, height: 280, series: series, scales: scales, axes: axes, hooks: hooks}, data, el);
    made++;
  }
  function part(label, x, y, more) {
    var p = {label: label, x: x, y: y};
    for (var k in more || {}) p[k] = more[k];
    return p;
  }

  var L = D.logs, E = D.evals;
  // held-out bits per byte: the final readout, each iteration's, each depth's, the n-gram lines
  var held = [part("bpb_fin", E.step, E.bpb_fin, {width: 2.5})];
  E.iters.forEach(function (y, i) { held.push(part("iteration " + (i + 1), E.step, y, {dash: [6, 3]})); });
  Object.keys(E.depths).sort().forEach(function (d) { held.push(part("fin_" + d, E.step, E.depths[d], {dash: [2, 3]})); });
  D.baselines.forEach(function (b) {
    held.push(part("order-" + b.order + " n-gram", E.step, E.step.map(function () { return b.bpb; }),
                   {dash: [10, 4], color: "#999999"}));
  });
  chart("held-out bits per byte", held, {log: true, ylabel: "bpb"});
  chart("training loss (bits per byte)", [part("train loss", L.step, L.bpb), part("held-out bpb_fin", E.step, E.bpb_fin)],
        {log: true, ylabel: "bpb"});
  chart("tokens per second", [part("tokens/s", L.step, L.tok_s)], {zero: true, ylabel: "tokens/s"});
  chart("learning rate and gradient norm", [part("learning rate", L.step, L.lr),
        part("gradient norm", L.step, L.grad_norm, {scale: "g"})], {zero: true, ylabel: "lr", right: "g", rlabel: "norm"});
  chart("experts' balance", [part("busiest expert's share", L.step, L.busiest),
        part("router entropy (normalised)", L.step, L.entropy), part("dead experts", L.step, L.dead, {scale: "n"}),
        part("dropped assignments", L.step, L.drops, {scale: "n"})], {zero: true, ylabel: "share", right: "n", rlabel: "count"});
  chart("Engram: distinct rows a step", [part("distinct rows / lookups", L.step, L.engram_unique),
        part("distinct rows", L.step, L.engram_rows, {scale: "r"})], {zero: true, ylabel: "fraction", right: "r", rlabel: "rows"});
  chart("memory (MiB)", [part("allocated", L.step, L.mem_allocated), part("peak", L.step, L.mem_peak)],
        {zero: true, ylabel: "MiB"});

  // each expert's share of the assignments over time, against the fair share 1/E: a heat map with
  // the experts' ids down its left, the steps along its foot and the colours' key in its caption
  var S = D.load;
  if (S.share.length > 0) {
    var n = S.share.length, experts = S.share[0].length, w = W, h = 280, left = 44, foot = 22;
    var pw = w - left - 8, ph = h - foot;
    function shade(v) {                                   // v: the load over the fair share
      if (v === 0) return "#f4a6a6";
      var k = Math.min(1, Math.log2(1 + v) / Math.log2(9));   // fair load (1) at a third, 8x at the top
      return "rgb(" + Math.round(247 - 239 * k) + "," + Math.round(251 - 203 * k) + "," + Math.round(255 - 148 * k) + ")";
    }
    var key = [0, 0.5, 1, 2, 4, 8].map(function (v) {
      return '<span class="key" style="background:' + shade(v) + '">' + (v === 0 ? "none" : v + "x") + "</span>";
    }).join(" ");
    var el = document.createElement("div");
    el.className = "chart heat";
    el.innerHTML = "<div><b>each expert's load over time</b>: its share of the assignments over the fair share 1/" +
                   experts + ", experts 1 to " + experts + " down, steps " + S.step[0] + " to " + S.step[n - 1] +
                   " across</div><div>" + key + "</div>";
    var cv = document.createElement("canvas");
    cv.width = w; cv.height = h;
    el.appendChild(cv);
    document.getElementById("charts").appendChild(el);
    var ctx = cv.getContext("2d"), cw = pw / n, rh = ph / experts, cells = 0;
    for (var t = 0; t < n; t++)
      for (var e = 0; e < experts; e++) {
        ctx.fillStyle = shade(S.share[t][e] * experts);
        ctx.fillRect(left + Math.floor(t * cw), Math.floor(e * rh), Math.ceil(cw), Math.ceil(rh));
        cells++;
      }
    ctx.fillStyle = "#222";
    ctx.font = "11px system-ui, sans-serif";
    ctx.textAlign = "right";
    ctx.textBaseline = "middle";
    var ticks = Math.min(experts, 8);
    for (var i = 0; i < ticks; i++) {                     // expert ids, 1-based, first and last among them
      var id = Math.round(i * (experts - 1) / Math.max(1, ticks - 1));
      ctx.fillText(String(id + 1), left - 4, Math.min(ph - 6, Math.max(6, (id + 0.5) * rh)));
    }
    ctx.textAlign = "center";
    ctx.textBaseline = "top";
    var marks = Math.min(n, 6);
    for (var j = 0; j < marks; j++) {                     // the steps of evenly spaced windows
      var at = Math.round(j * (n - 1) / Math.max(1, marks - 1));
      var x = Math.min(w - 20, Math.max(left + 12, left + (at + 0.5) * cw));
      ctx.fillText(String(S.step[at]), x, ph + 5);
    }
    made++;
    if (cells === n * experts) drawn++;
  }
  body.dataset.charts = String(made);
  body.dataset.drawn = String(drawn);       // the charts' draw hooks add theirs as they draw
})();
]==]

local CSS = [==[
body{font-family:system-ui,sans-serif;margin:24px;color:#222;max-width:1400px}
#charts{display:flex;flex-wrap:wrap;gap:16px}.chart{border:1px solid #ddd;padding:4px;background:#fff}
.heat{font-size:12px}.key{display:inline-block;padding:0 6px;border:1px solid #ccc}table{border-collapse:collapse;font-size:13px}td,th{border:1px solid #ddd;padding:3px 8px;text-align:right}
pre{background:#f6f6f6;padding:8px;overflow:auto;white-space:pre-wrap}.status{color:#555}
]==]

-- an HTML-safe rendering of a sample's bytes (UTF-8 whole, anything else as \xNN)
local function sample_html(text)
  local out = {}
  local put, finish = require("dormouse.human").byte_printer(function(s) out[#out + 1] = s end)
  for i = 1, #text do put(text:sub(i, i)) end
  finish()
  return esc(table.concat(out))
end

local function eval_table(records)
  local rows, iters, depths, measured = {}, 0, {}, {}
  for _, r in ipairs(records) do
    if r.kind == "eval" then
      rows[#rows + 1] = r
      iters = math.max(iters, #(r.periter or {}))
      for D in pairs(r.depths or {}) do depths[D] = true end
      for name in pairs(r.measures or {}) do measured[name] = true end
    end
  end
  local ds, ms = {}, {}
  for D in pairs(depths) do ds[#ds + 1] = D end
  table.sort(ds)
  for name in pairs(measured) do ms[#ms + 1] = name end       -- correct@B, an arm's draft_accept
  table.sort(ms, require("dormouse.instrument").natural_less)
  local out = {"<table><tr><th>step</th><th>bpb_fin</th>"}
  for i = 1, iters do out[#out + 1] = "<th>iteration " .. i .. "</th>" end
  for _, D in ipairs(ds) do out[#out + 1] = "<th>fin_" .. D .. "</th>" end
  for _, name in ipairs(ms) do out[#out + 1] = "<th>" .. esc(name) .. "</th>" end
  out[#out + 1] = "</tr>"
  for k = #rows, 1, -1 do                        -- the latest first
    local r = rows[k]
    out[#out + 1] = string.format("<tr><td>%d</td><td>%.4f</td>", r.step, r.bpb_fin or (r.fin and r.fin / LN2) or 0 / 0)
    for i = 1, iters do
      local v = r.periter and r.periter[i]
      out[#out + 1] = v and string.format("<td>%.4f</td>", v / LN2) or "<td></td>"
    end
    for _, D in ipairs(ds) do
      local v = r.depths and r.depths[D]
      out[#out + 1] = v and string.format("<td>%.4f</td>", v / LN2) or "<td></td>"
    end
    for _, name in ipairs(ms) do
      local v = r.measures and r.measures[name]
      out[#out + 1] = type(v) == "number" and string.format("<td>%.4f</td>", v) or "<td></td>"
    end
    out[#out + 1] = "</tr>"
  end
  out[#out + 1] = "</table>"
  return #rows > 0 and table.concat(out) or "<p>no eval yet</p>"
end

local warned = false

function report.html(run, records, baselines)
  local lib, css = core.vendor("uplot.js"), core.vendor("uplot.css")
  if not lib then
    if not warned then
      warned = true
      io.stderr:write("report: this build has no chart library (configured offline, or -DDM_VENDOR=OFF): " ..
                      "report.html is inline SVG\n")
    end
    return svg_page(run, records, baselines)
  end
  local sample
  for _, r in ipairs(records) do if r.kind == "sample" and r.text then sample = r end end
  local last = records[#records]
  local data = json.encode(chart_data(records, baselines)):gsub("</", "<\\/")
  return table.concat {
    "<!doctype html><html><head><meta charset=\"utf-8\">",
    run.live and "<meta http-equiv=\"refresh\" content=\"30\">" or "",
    "<title>", esc(run.name), " — dormouse</title><style>", css, CSS, "</style></head><body>",
    "<h1>", esc(run.name), "</h1><p>", esc(run.summary or ""), "</p>",
    "<p class=\"status\">", run.live and "running: this page reloads every 30 s; "
      or run.stopped and string.format("stopped after step %d (--resume continues it); ", run.stopped) or "finished; ",
    "last record at step ", tostring(last and last.step or 0), "</p>",
    "<div id=\"charts\"></div>",
    "<h2>held-out evals (bits per byte)</h2>", eval_table(records),
    "<h2>latest sample</h2>", sample and string.format("<p>at step %d:</p><pre>%s</pre>", sample.step,
                                                         sample_html(sample.text)) or "<p>none yet</p>",
    "<h2>config</h2><pre>", esc(run.config_text or ""), "</pre>",
    "<script id=\"data\" type=\"application/json\">", data, "</script>",
    "<!-- the charts: uPlot, embedded (its license follows) --><!--\n", ((core.vendor("uplot.LICENSE") or ""):gsub("%-%-", "- -")),
    "\n--><script>", lib, "</script><script>", JS, "</script></body></html>\n",
  }
end

return report
