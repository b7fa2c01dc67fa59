--[[
report.html: one self-contained page (inline SVG, no scripts) with the run's
curves — loss and BPB per iteration, tokens/s, expert load, learning rate —
rewritten at every eval.
]]
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
function report.html(run, records, baselines)
  local LN2 = math.log(2)
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

return report
