"""The script of a timeline page (``numerics show`` / ``numerics diff -o``): draws the heatmaps on canvases from the
data inlined in the page, nothing fetched. Kept as a Python string so that every install of torchdoctor has it.

What it reads: ``<script id="td-meta" type="application/json">`` (the page's description, :mod:`.html`) and one
``<script type="text/plain">`` block of base64 per data source: float32 little-endian, abs max then abs min, each
laid out (phase, row, column). What it draws: per panel, one cell per (row, column); where the panel has fewer
pixels than cells, a pixel shows the most extreme cell under it (nothing is averaged away, a non-finite cell is never
hidden). What it leaves for a test: ``<pre id="td-state">``, the JSON of what was drawn (cells painted, read back from
the canvas; the marker's cell and the colour there).
"""

SCRIPT = r"""
(function () {
"use strict";
const META = JSON.parse(document.getElementById("td-meta").textContent);
const NONFINITE = [255, 0, 255], EMPTY = [232, 232, 232], ZERO = [40, 40, 40];
const TURBO = ["#30123b", "#4145ab", "#4675ed", "#39a2fc", "#1bcfd4", "#24eca6", "#61fc6c", "#a4fc3b",
               "#d1e834", "#f3c63a", "#fe9b2d", "#f36315", "#d93806", "#b11901", "#7a0403"];
const LUT = (function () {
  const stops = TURBO.map(h => [1, 3, 5].map(i => parseInt(h.substr(i, 2), 16)));
  const out = [];
  for (let i = 0; i < 256; i++) {
    const x = i / 255 * (stops.length - 1), k = Math.min(Math.floor(x), stops.length - 2), f = x - k;
    out.push(stops[k].map((v, j) => Math.round(v + (stops[k + 1][j] - v) * f)));
  }
  return out;
})();
const cache = {};

function decode(id) {
  if (cache[id]) return cache[id];
  const text = document.getElementById(id).textContent.trim();
  const bin = atob(text), bytes = new Uint8Array(bin.length);
  for (let i = 0; i < bin.length; i++) bytes[i] = bin.charCodeAt(i);
  return (cache[id] = new Float32Array(bytes.buffer));
}

function fmt(v) {  // a float32, with as few digits as tell it apart from its neighbours
  if (v !== v) return "nan";
  if (!isFinite(v)) return v > 0 ? "inf" : "-inf";
  for (let p = 1; p <= 9; p++) {
    const t = v.toPrecision(p);
    if (Math.fround(parseFloat(t)) === v) return (Math.abs(v) >= 1e5 || (v !== 0 && Math.abs(v) < 1e-3))
      ? v.toExponential(Math.max(0, p - 1)) : t;
  }
  return String(v);
}

const state = {rank: 0, group: 0, mode: META.modes[0]};
(function fromHash() {
  for (const part of location.hash.replace(/^#/, "").split("&")) {
    const [k, v] = part.split("=");
    if (k === "rank" && META.ranks[+v]) state.rank = +v;
    if (k === "group" && META.groups[+v]) state.group = +v;
    if (k === "mode" && META.modes.includes(v)) state.mode = v;
  }
})();

function source(rank, s) {
  const d = decode(rank.sources[s]), R = rank.rows.length, C = rank.first.length, n = 2 * R * C;
  return {hi: d.subarray(0, n), lo: d.subarray(n, 2 * n), R: R, C: C};
}

function logmax(rank, s, r, phase) {
  const dt = rank.dtypes[s][r][phase];
  const m = META.dtype_log10_max[dt.split("/")[0]];
  return m === undefined ? META.dtype_log10_max.float32 : m;
}

// A panel's cells as scores (lower = more extreme) and colours
function scorer(rank, panel) {
  const phase = panel.phase, R = rank.rows.length, C = rank.first.length, off = phase * R * C;
  if (panel.kind === "ratio") {
    const a = source(rank, 0), b = source(rank, 1);
    let span = 0;
    for (let i = 0; i < R * C; i++) {
      const x = a.hi[off + i], y = b.hi[off + i];
      if (x > 0 && y > 0 && isFinite(x) && isFinite(y)) span = Math.max(span, Math.abs(Math.log10(y / x)));
    }
    span = Math.max(span, 1e-7);
    return {span: span, at: (r, c) => {
      const i = off + r * C + c, x = a.hi[i], y = b.hi[i];
      const rx = x >= 0 || x !== x, ry = y >= 0 || y !== y;
      if (!rx || !ry) return [2e9, EMPTY];
      const fx = isFinite(x), fy = isFinite(y);
      if (fx !== fy || (x !== x) !== (y !== y)) return [-Infinity, NONFINITE];
      if (!fx || x === y) return [0, [255, 255, 255]];
      if (x === 0 || y === 0) return [-1e9, x === 0 ? [180, 0, 0] : [0, 0, 180]];
      const v = Math.log10(y / x), t = Math.max(-1, Math.min(1, v / span)), w = Math.round(255 * (1 - Math.abs(t)));
      return [-Math.abs(v), t > 0 ? [255, w, w] : [w, w, 255]];
    }};
  }
  const d = source(rank, panel.source);
  let lo = Infinity, hi = -Infinity;
  for (let r = 0; r < R; r++) {
    const top = state.mode === "headroom" ? logmax(rank, panel.source, r, phase) : 0;
    for (let c = 0; c < C; c++) {
      const v = d.hi[off + r * C + c];
      if (v > 0 && isFinite(v)) { const s = top - Math.log10(v); lo = Math.min(lo, s); hi = Math.max(hi, s); }
    }
  }
  if (state.mode === "headroom") lo = 0;
  if (!(hi > lo)) hi = lo + 1;
  return {lo: lo, hi: hi, at: (r, c) => {
    const v = d.hi[off + r * C + c];
    if (v !== v || v === Infinity) return [-Infinity, NONFINITE];
    if (v < 0) return [2e9, EMPTY];
    if (v === 0) return [1e9, ZERO];
    const s = (state.mode === "headroom" ? logmax(rank, panel.source, r, phase) : 0) - Math.log10(v);
    const t = Math.max(0, Math.min(1, (s - lo) / (hi - lo)));
    return [s, LUT[Math.round(255 * (1 - t))]];
  }};
}

function layout(rank, perRow) {
  const R = rank.rows.length, C = rank.first.length;
  const width = Math.min(document.documentElement.clientWidth || window.innerWidth || 1400, 3000);
  const avail = Math.max(200, Math.floor((width - 260 - 40 - 14 * perRow) / perRow));
  const gc = Math.max(1, Math.ceil(C / avail)), dc = Math.ceil(C / gc), cw = Math.max(1, Math.floor(avail / dc));
  const gr = Math.max(1, Math.ceil(R / 720)), dr = Math.ceil(R / gr), rh = Math.max(1, Math.min(14, Math.floor(
    720 / dr)));
  return {R: R, C: C, gc: gc, gr: gr, dc: dc, dr: dr, cw: cw, rh: rh};
}

function drawPanel(rank, panel, L, box) {
  const sc = scorer(rank, panel);
  const pick = new Int32Array(L.dc * L.dr * 2);
  const img = new ImageData(L.dc, L.dr);
  for (let y = 0; y < L.dr; y++) {
    for (let x = 0; x < L.dc; x++) {
      let best = Infinity, colour = EMPTY, br = y * L.gr, bc = x * L.gc;
      for (let r = y * L.gr; r < Math.min(L.R, (y + 1) * L.gr); r++) {
        for (let c = x * L.gc; c < Math.min(L.C, (x + 1) * L.gc); c++) {
          const [s, col] = sc.at(r, c);
          if (s < best) { best = s; colour = col; br = r; bc = c; }
        }
      }
      const k = (y * L.dc + x) * 4;
      img.data[k] = colour[0]; img.data[k + 1] = colour[1]; img.data[k + 2] = colour[2]; img.data[k + 3] = 255;
      pick[(y * L.dc + x) * 2] = br; pick[(y * L.dc + x) * 2 + 1] = bc;
    }
  }
  const off = document.createElement("canvas");
  off.width = L.dc; off.height = L.dr;
  off.getContext("2d").putImageData(img, 0, 0);
  const canvas = document.createElement("canvas");
  canvas.width = L.dc * L.cw; canvas.height = L.dr * L.rh;
  canvas.className = "heat";
  const g = canvas.getContext("2d");
  g.imageSmoothingEnabled = false;
  g.drawImage(off, 0, 0, canvas.width, canvas.height);
  box.style.width = Math.max(200, canvas.width + 2) + "px";
  const title = document.createElement("div");
  title.className = "ptitle"; title.textContent = panel.title;
  box.appendChild(title);
  const wrap = document.createElement("div");
  wrap.className = "cwrap";
  wrap.appendChild(canvas);
  box.appendChild(wrap);
  box.appendChild(axis(rank, L, canvas.width));
  box.appendChild(legend(panel, sc));
  let painted = 0;
  const back = off.getContext("2d").getImageData(0, 0, L.dc, L.dr).data;
  for (let i = 0; i < back.length; i += 4) {
    if (back[i] !== EMPTY[0] || back[i + 1] !== EMPTY[1] || back[i + 2] !== EMPTY[2]) painted++;
  }
  const info = {title: panel.title, phase: panel.phase, kind: panel.kind, rows: L.R, cols: L.C, painted: painted,
                display: [L.dc, L.dr]};
  const m = rank.marker;
  if (m && m.phase === panel.phase) {
    info.marker = mark(g, m, L, back);
  }
  canvas.addEventListener("mousemove", e => hover(e, rank, panel, L, pick, canvas));
  canvas.addEventListener("mouseleave", () => { tip.style.display = "none"; });
  return info;
}

function mark(g, m, L, back) {
  const out = {step: m.step, col: m.col, row: m.row};
  if (m.col === null || m.col === undefined) return out;
  const x = Math.floor(m.col / L.gc), px = x * L.cw;
  g.fillStyle = "rgba(0,0,0,0.35)";
  g.fillRect(px + Math.floor(L.cw / 2), 0, 1, L.dr * L.rh);
  if (m.row !== null && m.row !== undefined) {
    const y = Math.floor(m.row / L.gr), py = y * L.rh, W = L.dc * L.cw, H = L.dr * L.rh;
    const box = (d) => {  // a frame d px around the cell, kept inside the canvas
      const x0 = Math.max(1, px - d), y0 = Math.max(1, py - d);
      return [x0, y0, Math.min(W - 1, px + L.cw + d) - x0, Math.min(H - 1, py + L.rh + d) - y0];
    };
    g.lineWidth = 2; g.strokeStyle = "#000";
    g.strokeRect(...box(3));
    g.lineWidth = 1; g.strokeStyle = "#fff";
    g.strokeRect(...box(5));
    const k = (y * L.dc + x) * 4;
    out.pixel = [back[k], back[k + 1], back[k + 2]];
    out.display = [x, y];
  }
  return out;
}

function axis(rank, L, width) {
  const a = document.createElement("div");
  a.className = "axis"; a.style.width = width + "px";
  const n = Math.max(1, Math.min(L.dc, Math.floor(width / 70)));
  for (let i = 0; i < n; i++) {
    const x = Math.round(i * (L.dc - 1) / Math.max(1, n - 1)), c = Math.min(L.C - 1, x * L.gc);
    const t = document.createElement("span");
    t.textContent = rank.first[c];
    t.style.left = (x * L.cw + L.cw / 2) + "px";
    a.appendChild(t);
  }
  const lab = document.createElement("div");
  lab.className = "axlabel"; lab.textContent = "step" + (L.gc > 1 || rank.first.some((s, i) => s !== rank.last[i])
    ? " (each column: its steps' largest abs max)" : "");
  a.appendChild(lab);
  return a;
}

function legend(panel, sc) {
  const d = document.createElement("div");
  d.className = "legend";
  const bar = document.createElement("canvas");
  bar.width = 160; bar.height = 10;
  const g = bar.getContext("2d");
  for (let i = 0; i < 160; i++) {
    let c;
    if (panel.kind === "ratio") {
      const t = i / 159 * 2 - 1, w = Math.round(255 * (1 - Math.abs(t)));
      c = t > 0 ? [255, w, w] : [w, w, 255];
    } else c = LUT[Math.round(255 * (1 - i / 159))];
    g.fillStyle = "rgb(" + c.join(",") + ")"; g.fillRect(i, 0, 1, 10);
  }
  const text = document.createElement("span");
  if (panel.kind === "ratio") {
    text.textContent = "B/A: " + Math.pow(10, -sc.span).toPrecision(4) + " (blue) .. 1 (white) .. " +
      Math.pow(10, sc.span).toPrecision(4) + " (red); magenta: non-finite in one run only; grey: not in both";
  } else if (state.mode === "headroom") {
    text.textContent = "at the dtype's max (left) .. " + sc.hi.toFixed(1) +
      " decades below it (right); magenta: inf/nan; grey: not recorded";
  } else {
    text.textContent = "abs max 1e" + (-sc.lo).toFixed(1) + " (left) .. 1e" + (-sc.hi).toFixed(1) +
      " (right); magenta: inf/nan; grey: not recorded";
  }
  d.appendChild(bar); d.appendChild(text);
  return d;
}

const tip = document.getElementById("td-tip");

function hover(e, rank, panel, L, pick, canvas) {
  const b = canvas.getBoundingClientRect();
  const x = Math.floor((e.clientX - b.left) / L.cw), y = Math.floor((e.clientY - b.top) / L.rh);
  if (x < 0 || y < 0 || x >= L.dc || y >= L.dr) { tip.style.display = "none"; return; }
  const r = pick[(y * L.dc + x) * 2], c = pick[(y * L.dc + x) * 2 + 1];
  const row = rank.rows[r], phase = panel.phase, C = L.C, R = L.R, i = phase * R * C + r * C + c;
  const slot = (phase === 0 ? "output" : "grad_output") + row[2];
  const steps = rank.first[c] === rank.last[c] ? "step " + rank.first[c]
    : "steps " + rank.first[c] + "-" + rank.last[c] + " (" + rank.count[c] + " recorded; the extremes shown)";
  const lines = [row[0] + " (" + row[1] + ") " + slot + (phase === 0 ? ", forward" : ", backward"), steps];
  if (L.gr > 1 || L.gc > 1) lines.push("(one pixel holds " + L.gr + " rows x " + L.gc + " columns: the most " +
    "extreme shown)");
  const sources = panel.kind === "ratio" ? [0, 1] : [panel.source];
  for (const s of sources) {
    const d = source(rank, s), who = META.source_names.length > 1 ? META.source_names[s] + ": " : "";
    const dt = rank.dtypes[s][r][phase];
    const hi = d.hi[i], lo = d.lo[i];
    if (hi < 0) { lines.push(who + "not recorded"); continue; }
    let line = who + "abs max " + fmt(hi) + ", abs min " + (lo < 0 ? "-" : fmt(lo)) + (dt ? " (" + dt + ")" : "");
    if (hi > 0 && isFinite(hi) && META.dtype_log10_max[dt.split("/")[0]] !== undefined) {
      line += "; " + (logmax(rank, s, r, phase) - Math.log10(hi)).toFixed(2) + " decades below " + dt + "'s max";
    }
    lines.push(line);
  }
  if (panel.kind === "ratio") {
    const a = source(rank, 0).hi[i], b2 = source(rank, 1).hi[i];
    if (a > 0 && b2 >= 0 && isFinite(a) && isFinite(b2)) lines.push("B/A " + fmt(b2 / a));
  }
  const m = rank.marker;
  if (m && m.row === r && m.col === c && m.phase === phase) lines.push(m.text);
  tip.textContent = lines.join("\n");
  tip.style.display = "block";
  tip.style.left = Math.min(e.pageX + 14, document.body.scrollWidth - 420) + "px";
  tip.style.top = (e.pageY + 14) + "px";
}

function rowLabels(rank, L) {
  const d = document.createElement("div");
  d.className = "labels";
  d.style.height = (L.dr * L.rh) + "px";
  if (L.rh < 9) {
    d.textContent = L.R + " rows (module outputs, in execution order, top first): hover for names";
    d.className += " small";
    return d;
  }
  for (let y = 0; y < L.dr; y++) {
    const s = document.createElement("div");
    s.style.height = L.rh + "px"; s.style.lineHeight = L.rh + "px";
    const row = rank.rows[y * L.gr];
    s.textContent = (row[0] || "(model)") + (row[2] ? " " + row[2] : "");
    s.title = row[0] + " (" + row[1] + ")";
    d.appendChild(s);
  }
  return d;
}

function draw() {
  const rank = META.ranks[state.rank], group = META.groups[state.group];
  const area = document.getElementById("td-panels");
  area.innerHTML = "";
  const out = {rank: state.rank, rank_name: rank.name, group: group.name, mode: state.mode, panels: []};
  document.getElementById("td-report").textContent = rank.report || "";
  document.getElementById("td-facts").textContent = rank.facts.join("\n");
  if (!rank.first.length || !rank.rows.length) {
    area.textContent = rank.name + " recorded no step" + (rank.rows.length ? "" : " and no module output");
    document.getElementById("td-state").textContent = JSON.stringify(out);
    return;
  }
  const L = layout(rank, group.panels.length);
  area.appendChild(rowLabels(rank, L));
  for (const p of group.panels) {
    const box = document.createElement("div");
    box.className = "panel";
    area.appendChild(box);
    out.panels.push(drawPanel(rank, p, L, box));
  }
  const m = rank.marker;
  document.getElementById("td-marker").textContent = m ? m.text : "";
  out.marker = m ? {step: m.step, col: m.col, row: m.row, phase: m.phase, module: m.module} : null;
  out.ms_since_navigation = Math.round(performance.now());
  document.getElementById("td-state").textContent = JSON.stringify(out);
}

function controls() {
  const sel = document.getElementById("td-rank");
  META.ranks.forEach((r, i) => { const o = document.createElement("option"); o.value = i; o.textContent = r.name;
                                 sel.appendChild(o); });
  sel.value = state.rank;
  sel.disabled = META.ranks.length < 2;
  sel.addEventListener("change", () => { state.rank = +sel.value; draw(); });
  const grp = document.getElementById("td-group");
  if (META.groups.length < 2) grp.style.display = "none";
  META.groups.forEach((g, i) => { const o = document.createElement("option"); o.value = i; o.textContent = g.name;
                                  grp.appendChild(o); });
  grp.value = state.group;
  grp.addEventListener("change", () => { state.group = +grp.value; draw(); });
  const mode = document.getElementById("td-mode");
  if (META.modes.length < 2) mode.style.display = "none";
  META.modes.forEach(m => { const o = document.createElement("option"); o.value = m;
                            o.textContent = META.mode_names[m]; mode.appendChild(o); });
  mode.value = state.mode;
  mode.addEventListener("change", () => { state.mode = mode.value; draw(); });
}

controls();
draw();
let resize = null;
window.addEventListener("resize", () => { clearTimeout(resize); resize = setTimeout(draw, 200); });
})();
"""

STYLE = """
body { font: 13px/1.4 system-ui, sans-serif; margin: 16px; color: #111; }
h1 { font-size: 17px; margin: 0 0 4px 0; }
.sub { color: #555; margin-bottom: 8px; }
.controls { margin: 8px 0; display: flex; gap: 14px; align-items: center; }
#td-marker { font-weight: 600; color: #900; margin: 6px 0; }
#td-panels { display: flex; align-items: flex-start; gap: 14px; }
.labels { width: 260px; overflow: hidden; font: 9px/1 monospace; text-align: right; margin-top: 19px;
          white-space: nowrap; flex: none; }
.labels.small { font: 12px/1.3 system-ui, sans-serif; color: #555; white-space: normal; }
.panel { flex: none; }
.ptitle { font-weight: 600; height: 19px; white-space: nowrap; overflow: hidden; text-overflow: ellipsis; }
.cwrap { position: relative; line-height: 0; }
canvas.heat { border: 1px solid #999; cursor: crosshair; }
.axis { position: relative; height: 30px; font-size: 11px; color: #333; }
.axis span { position: absolute; top: 2px; transform: translateX(-50%); }
.axis .axlabel { position: absolute; top: 15px; left: 0; right: 0; text-align: center; color: #666; }
.legend { font-size: 11px; color: #333; }
.legend canvas { display: block; margin-bottom: 2px; }
#td-tip { position: absolute; display: none; background: #fffff0; border: 1px solid #888; padding: 4px 6px;
          font: 12px/1.35 monospace; white-space: pre; pointer-events: none; z-index: 10; max-width: 640px;
          box-shadow: 1px 1px 4px rgba(0,0,0,.25); }
pre { background: #f6f6f6; padding: 8px; overflow-x: auto; font-size: 12px; }
h2 { font-size: 15px; margin: 18px 0 4px 0; }
"""
