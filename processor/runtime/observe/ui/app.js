// The eosflow job page: polls api/job every second and renders it with the DOM and inline SVG.
// No libraries, no build step (the runner serves this file as is). The JSON it reads is
// described in docs/observability.md ("/api/job"); any field may be missing or null (a runner
// that does not know it yet), so every read has a default.
"use strict";

(function () {
  const POLL_MS = 1000;
  const FETCH_TIMEOUT_MS = 5000;
  const SVG_NS = "http://www.w3.org/2000/svg";
  const DASH = "\u2013";

  // What was drawn last: the graph, the plot and the tables are rebuilt only when their data
  // change, so that a reader's hover, tooltip and text selection survive the polling.
  const state = { updates: 0, lastOkMs: null, keys: {} };

  // ---------------------------------------------------------------- helpers
  const byId = (id) => document.getElementById(id);
  const num = (x) => (typeof x === "number" && isFinite(x) ? x : null);
  const list = (x) => (Array.isArray(x) ? x.filter((v) => v !== null && v !== undefined) : []);
  const errorText = (err) => (err && err.message ? err.message : String(err));

  function changed(name, value) {
    const key = JSON.stringify(value);
    if (state.keys[name] === key) return false;
    state.keys[name] = key;
    return true;
  }

  function svg(tag, attrs, parent) {
    const node = document.createElementNS(SVG_NS, tag);
    for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, v);
    if (parent) parent.appendChild(node);
    return node;
  }

  function svgText(parent, x, y, str, cls, attrs) {
    const node = svg("text", Object.assign({ x: x, y: y, class: cls || "" }, attrs), parent);
    node.textContent = str;
    return node;
  }

  const tooltip = (node, str) => (svg("title", {}, node).textContent = str);

  const { el, fillTable } = window.eosflowUI; // ui/panels.js (loaded first)

  const setText = (id, str) => (byId(id).textContent = str);

  // An SVG text neither wraps nor ellipsizes: cut long labels (the <title> has the whole).
  function fit(str, maxChars) {
    str = String(str);
    return str.length <= maxChars ? str : str.slice(0, Math.max(1, maxChars - 1)) + "\u2026";
  }

  // ---------------------------------------------------------------- formatting
  function fmtInt(n) {
    n = num(n);
    return n === null ? DASH : Math.round(n).toLocaleString("en-US");
  }

  function fmtCompact(n) {
    n = num(n);
    if (n === null) return DASH;
    const a = Math.abs(n);
    for (const [f, s] of [[1e9, "G"], [1e6, "M"], [1e3, "k"]]) {
      if (a >= f) return (n / f).toFixed(a >= 10 * f ? 0 : 1) + s;
    }
    return a >= 10 || n === 0 ? String(Math.round(n)) : n.toFixed(1);
  }

  function fmtSeconds(s) {
    s = num(s);
    if (s === null) return DASH;
    if (s < 1) return (s * 1000).toFixed(s < 0.01 ? 1 : 0) + " ms";
    return s.toFixed(s < 10 ? 2 : 1) + " s";
  }

  const BYTE_UNITS = ["B", "KiB", "MiB", "GiB", "TiB"];

  function fmtBytes(b) {
    b = num(b);
    if (b === null) return DASH;
    let i = 0;
    for (; Math.abs(b) >= 1024 && i < BYTE_UNITS.length - 1; i++) b /= 1024;
    return (i === 0 ? String(Math.round(b)) : b.toFixed(b < 10 ? 1 : 0)) + " " + BYTE_UNITS[i];
  }

  function fmtUptime(s) {
    s = num(s);
    if (s === null) return DASH;
    s = Math.floor(s);
    const pad = (v) => String(v).padStart(2, "0");
    const [d, h, m, sec] = [Math.floor(s / 86400), Math.floor(s / 3600) % 24, Math.floor(s / 60) % 60,
      s % 60];
    if (d) return `${d}d ${pad(h)}h ${pad(m)}m`;
    if (h) return `${h}h ${pad(m)}m ${pad(sec)}s`;
    return m ? `${m}m ${pad(sec)}s` : `${sec}s`;
  }

  // Local time; the date too when it is not today's.
  function fmtTime(ms) {
    ms = num(ms);
    if (ms === null) return DASH;
    const d = new Date(ms);
    const time = d.toLocaleTimeString("en-GB", { hour12: false });
    if (new Date().toDateString() === d.toDateString()) return time;
    return d.toLocaleDateString("sv-SE") + " " + time;
  }

  // Axis ticks from 0: multiples of 1, 2 or 5 x 10^k, the last one at or above `max`.
  function niceTicks(max, count) {
    if (!(max > 0)) max = 1;
    const raw = max / (count || 5);
    const mag = Math.pow(10, Math.floor(Math.log10(raw)));
    const step = [1, 2, 5, 10].map((f) => f * mag).find((s) => s >= raw * 0.999);
    const ticks = [];
    for (let i = 0; i === 0 || ticks[i - 1] < max * 0.9999; i++) ticks.push(+(i * step).toPrecision(12));
    return ticks;
  }

  const fmtTick = (v) => String(+v.toPrecision(6));

  // ---------------------------------------------------------------- header
  function renderHeader(job) {
    const name = job.job || "(unnamed job)";
    setText("job-name", name);
    document.title = name + " \u00b7 eosflow";
    const jobState = String(job.state || "unknown");
    const badge = byId("job-state");
    badge.textContent = jobState;
    badge.className = "state state-" + jobState.replace(/[^a-z_-]/gi, "");
    for (const key of ["runner", "mode", "recovery"]) setText("job-" + key, job[key] || DASH);
    setText("job-generation", fmtInt(job.generation));
    setText("job-restarts", fmtInt(job.restarts));
    setText("job-uptime", fmtUptime(job.uptime_s));
    const workers = list(job.workers);
    const connected = workers.filter((w) => w.connected).length;
    setText("job-workers", workers.length ? `${connected} / ${workers.length}` : DASH);
    byId("job-workers").title = workers
      .map((w) => `worker ${w.worker} (pid ${w.pid} on ${w.host}): ${w.connected ? "" : "not "}connected`)
      .join("\n");
    const rec = job.records || {};
    setText("job-records-in", `${fmtInt(rec.in)}  (${fmtCompact(rec.in_per_s)}/s)`);
    setText("job-records-out", `${fmtInt(rec.out)}  (${fmtCompact(rec.out_per_s)}/s)`);
    setText("job-records-committed", rec.committed == null ? "\u2013" : fmtInt(rec.committed));
    setText("job-updated", fmtTime(job.updated_ms));
  }

  // ---------------------------------------------------------------- stage graph
  const BOX_W = 270;
  const HEAD_H = 34;
  const ROW_H = 21;
  const GAP_X = 210;
  const GAP_Y = 36;
  const MARGIN = 24;

  const isBack = (e) => !!e.back || e.src === e.dst;

  // Depth of each stage: the longest path to it from a stage without inputs, over the forward
  // edges only (counting a loop's back edge would make the depth unbounded).
  function depths(stages, edges) {
    const depth = {};
    const indeg = {};
    const out = {};
    for (const s of stages) [depth[s.name], indeg[s.name], out[s.name]] = [0, 0, []];
    for (const e of edges) {
      if (isBack(e) || !(e.src in depth) || !(e.dst in depth)) continue;
      out[e.src].push(e.dst);
      indeg[e.dst] += 1;
    }
    const queue = stages.map((s) => s.name).filter((n) => indeg[n] === 0);
    while (queue.length) {
      const n = queue.shift();
      for (const m of out[n]) {
        depth[m] = Math.max(depth[m], depth[n] + 1);
        if (--indeg[m] === 0) queue.push(m);
      }
    }
    return depth; // a cycle without a back edge keeps the depth reached so far
  }

  // Rows of a stage box: its steps, the sources and sinks among them tagged; a source or sink
  // that is not one of the steps gets a row of its own.
  function stageRows(stage) {
    const [steps, sources, sinks] = [list(stage.steps), list(stage.sources), list(stage.sinks)];
    const rows = sources.filter((s) => !steps.includes(s)).map((s) => ({ name: s, tag: "source" }));
    for (const s of steps) {
      const tag = sources.includes(s) ? "source" : sinks.includes(s) ? "sink" : null;
      rows.push({ name: s, tag: tag, step: true });
    }
    for (const s of sinks) if (!steps.includes(s)) rows.push({ name: s, tag: "sink", step: true });
    return rows;
  }

  function layout(graph) {
    const stages = list(graph.stages).filter((s) => s.name != null);
    const edges = list(graph.edges).filter((e) => e.src != null && e.dst != null);
    const depth = depths(stages, edges);
    const columns = [];
    for (const s of stages) (columns[depth[s.name]] = columns[depth[s.name]] || []).push(s);
    const boxH = (s) => HEAD_H + 10 + stageRows(s).length * ROW_H;
    const heights = Array.from(columns, (col) => (col || []).reduce((h, s) => h + boxH(s) + GAP_Y, -GAP_Y));
    const tallest = Math.max(0, ...heights);
    const boxes = {};
    columns.forEach((col, d) => {
      let y = MARGIN + (tallest - heights[d]) / 2;
      for (const s of col || []) {
        boxes[s.name] = { x: MARGIN + d * (BOX_W + GAP_X), y: y, w: BOX_W, h: boxH(s), rows: stageRows(s) };
        y += boxes[s.name].h + GAP_Y;
      }
    });
    const backs = edges.filter(isBack).length;
    const width = MARGIN * 2 + columns.length * BOX_W + Math.max(0, columns.length - 1) * GAP_X;
    const height = MARGIN * 2 + tallest + (backs ? 40 + backs * 18 : 0);
    return { stages, edges, boxes, width, height, bottom: MARGIN + tallest };
  }

  function markers(root) {
    const defs = svg("defs", {}, root);
    for (const kind of ["shuffle", "forward", "back"]) {
      const attrs = { id: "arrow-" + kind, viewBox: "0 0 10 10", refX: 9, refY: 5, orient: "auto" };
      const m = svg("marker", Object.assign(attrs, { markerWidth: 7, markerHeight: 7 }), defs);
      svg("path", { d: "M0,0 L10,5 L0,10 z", class: "arrow arrow-" + kind }, m);
    }
  }

  function drawStage(root, stage, box) {
    const at = `translate(${box.x},${box.y})`;
    const g = svg("g", { class: "stage", "data-stage": stage.name, transform: at }, root);
    tooltip(g, `stage ${stage.name}, parallelism ${stage.parallelism ?? "?"}`);
    svg("rect", { class: "stage-box", width: box.w, height: box.h, rx: 8 }, g);
    const head = `M0,${HEAD_H} V8 a8,8 0 0 1 8,-8 H${box.w - 8} a8,8 0 0 1 8,8 V${HEAD_H} z`;
    svg("path", { class: "stage-head", d: head }, g);
    svgText(g, 12, 22, fit(stage.name, 24), "stage-name");
    const par = svg("g", { class: "parallelism" }, g);
    svg("rect", { x: box.w - 56, y: 8, width: 46, height: 18, rx: 9 }, par);
    svgText(par, box.w - 33, 21, "\u00d7" + (stage.parallelism ?? "?"), "", { "text-anchor": "middle" });
    box.rows.forEach((row, i) => {
      const y = HEAD_H + 8 + i * ROW_H;
      const r = svg("g", { class: "row" + (row.tag ? " row-" + row.tag : "") }, g);
      tooltip(r, (row.tag || "step") + " " + row.name);
      let x = 12;
      if (row.tag) {
        svg("rect", { class: "tag tag-" + row.tag, x: x, y: y + 3, width: 44, height: 15, rx: 3 }, r);
        svgText(r, x + 22, y + 14, row.tag, "tag-text", { "text-anchor": "middle" });
        x += 50;
      }
      // A step leaves room for its rates; a source topic (no step of its own) has none.
      svgText(r, x, y + 15, fit(row.name, !row.step ? 29 : row.tag ? 16 : 22), "step-name");
      if (row.step) {
        svgText(r, box.w - 12, y + 15, "", "step-rate",
          { "text-anchor": "end", "data-step": row.name, "data-sink": row.tag === "sink" ? "1" : "0" });
      }
    });
  }

  // `lane` spreads the edges between one pair of stages (a stage may read two channels of
  // another) and stacks the back edges under the boxes.
  function drawEdge(root, edge, lay, lane) {
    const [a, b] = [lay.boxes[edge.src], lay.boxes[edge.dst]];
    if (!a || !b) return;
    const back = isBack(edge);
    const how = edge.shuffle ? "shuffle" : "forward";
    const kind = back ? "back" : how;
    const attrs = { class: "edge edge-" + kind, "data-src": edge.src, "data-dst": edge.dst };
    const g = svg("g", Object.assign(attrs, { "data-topic": edge.topic ?? "", "data-shuffle": how }), root);
    tooltip(g, `${edge.src} \u2192 ${edge.dst}: ${how}${back ? ", back edge (the loop's feedback)" : ""}` +
      `\nchannel topic ${edge.topic ?? "?"}`);
    let d, lx, ly;
    if (back) {
      // Under the boxes: from the bottom of the upstream stage back to the bottom of its target.
      const [sx, sy, tx, ty] = [a.x + a.w * 0.62, a.y + a.h, b.x + b.w * 0.38, b.y + b.h];
      const cy = lay.bottom + 34 + lane * 18;
      d = `M${sx},${sy} C${sx},${cy} ${tx},${cy} ${tx},${ty + 2}`;
      [lx, ly] = [(sx + tx) / 2, 0.75 * cy + 0.125 * (sy + ty) + 14];
    } else {
      const off = lane * 30;
      const [sx, sy, tx, ty] = [a.x + a.w, a.y + a.h / 2 + off, b.x - 2, b.y + b.h / 2 + off];
      const c = Math.max(40, (tx - sx) / 2);
      d = `M${sx},${sy} C${sx + c},${sy} ${tx - c},${ty} ${tx},${ty}`;
      [lx, ly] = [(sx + tx) / 2, (sy + ty) / 2 - 8];
    }
    svg("path", { d: d, class: "edge-line", "marker-end": `url(#arrow-${kind})` }, g);
    svgText(g, lx, ly - 13, back ? "back \u00b7 " + how : how, "edge-kind", { "text-anchor": "middle" });
    // the channel's own part (its step names): every channel topic starts with eosflow.<job>.
    const label = (edge.topic ?? "").replace(/^eosflow\.[^.]+\./, "");
    svgText(g, lx, ly, fit(label, 34), "edge-topic", { "text-anchor": "middle" });
  }

  function renderGraph(job) {
    const host = byId("graph");
    if (changed("graph", job.graph || {})) {
      host.replaceChildren();
      const lay = layout(job.graph || {});
      if (!lay.stages.length) {
        host.appendChild(el("p", "empty", "No stages reported yet."));
      } else {
        const size = { width: lay.width, height: lay.height, viewBox: `0 0 ${lay.width} ${lay.height}` };
        const root = svg("svg", Object.assign(size, { role: "img", "aria-label": "stage graph" }), host);
        markers(root);
        const edgeLayer = svg("g", { class: "edges" }, root);
        const lanes = {};
        let backs = 0;
        for (const e of lay.edges) {
          const pair = e.src + "\u0000" + e.dst;
          drawEdge(edgeLayer, e, lay, isBack(e) ? backs++ : (lanes[pair] = (lanes[pair] ?? -1) + 1));
        }
        const stageLayer = svg("g", { class: "stages" }, root);
        for (const s of lay.stages) drawStage(stageLayer, s, lay.boxes[s.name]);
      }
    }
    // The rates change every second, the layout only with the graph.
    const steps = job.steps || {};
    for (const node of host.querySelectorAll("text.step-rate")) {
      const name = node.getAttribute("data-step");
      const s = steps[name];
      const sink = node.getAttribute("data-sink") === "1"; // writes, emits nothing downstream
      node.textContent = !s ? "" : sink ? `${fmtCompact(s.in_per_s)} /s written`
        : `${fmtCompact(s.in_per_s)} \u2192 ${fmtCompact(s.out_per_s)} /s`;
      node.parentNode.querySelector("title").textContent = s
        ? `step ${name}: in ${fmtInt(s.in)} (${fmtCompact(s.in_per_s)}/s), ` +
          `out ${fmtInt(s.out)} (${fmtCompact(s.out_per_s)}/s)`
        : `step ${name}`;
    }
  }

  // ---------------------------------------------------------------- checkpoint plot
  function byteAxis(max) {
    let i = 0;
    while (max / Math.pow(1024, i) >= 1024 && i < BYTE_UNITS.length - 1) i++;
    const scale = Math.pow(1024, i);
    return { ticks: niceTicks(max / scale, 4).map((t) => t * scale), scale, unit: BYTE_UNITS[i] };
  }

  function idTicks(lo, hi, room) {
    if (hi === lo) return [lo];
    const step = Math.max(1, niceTicks(hi - lo, Math.max(2, Math.min(12, room / 60)))[1]);
    const ticks = [];
    for (let v = Math.ceil(lo / step) * step; v <= hi; v += step) ticks.push(v);
    return ticks;
  }

  function renderSummary(ck) {
    const failed = ck.failed || {};
    const nFailed = Object.values(failed).reduce((a, b) => a + (num(b) || 0), 0);
    const reasons = Object.entries(failed).filter(([, v]) => v).map(([k, v]) => `${k} ${v}`);
    let str = `${fmtInt(ck.completed ?? 0)} completed \u00b7 ${fmtInt(nFailed)} failed`;
    if (reasons.length) str += ` (${reasons.join(", ")})`;
    if (ck.last_completed != null) str += ` \u00b7 last #${ck.last_completed}`;
    if (ck.pending != null) str += ` \u00b7 #${ck.pending} in progress`;
    setText("checkpoint-summary", str);
  }

  function describe(c) {
    const what = c.status === "failed" ? `FAILED (${c.reason || "no reason given"})` : c.status || "?";
    return `checkpoint ${c.id}: ${what}\n${fmtTime(c.at_ms)}\nduration ${fmtSeconds(c.duration_s)}` +
      `\nalignment ${fmtSeconds(c.alignment_s)}\nsize ${fmtBytes(c.size_bytes)}`;
  }

  function renderCheckpoints(job) {
    const ck = job.checkpoints || {};
    renderSummary(ck);
    const history = list(ck.history).filter((c) => num(c.id) !== null).sort((p, q) => p.id - q.id);
    const host = byId("checkpoints");
    // Drawn at the width of its card, in pixels: a viewBox scaled to the card would scale the
    // fonts with it.
    const W = Math.max(640, Math.min(host.clientWidth || 1000, 1400));
    if (!changed("plot", [W, history])) return;
    host.replaceChildren();
    if (!history.length) {
      host.appendChild(el("p", "empty", "No checkpoints yet."));
      return;
    }
    const H = 290;
    const m = { left: 64, right: 76, top: 40, bottom: 44 };
    const [pw, ph] = [W - m.left - m.right, H - m.top - m.bottom];
    const base = m.top + ph;
    const size = { width: W, height: H, class: "plot" };
    const root = svg("svg", Object.assign(size, { role: "img", "aria-label": "checkpoint history" }), host);

    const [lo, hi] = [history[0].id, history[history.length - 1].id];
    const band = pw / (hi - lo + 1);
    const xc = (id) => m.left + (id - lo + 0.5) * band;
    const secMax = Math.max(0, ...history.flatMap((c) => [num(c.duration_s) || 0, num(c.alignment_s) || 0]));
    const secTicks = niceTicks(secMax || 0.001, 5);
    const ys = (v) => base - (v / secTicks[secTicks.length - 1]) * ph;
    const bytes = byteAxis(Math.max(0, ...history.map((c) => num(c.size_bytes) || 0)) || 1);
    const yb = (v) => base - (v / bytes.ticks[bytes.ticks.length - 1]) * ph;

    const axes = svg("g", { class: "axes" }, root);
    const line = (cls, x1, y1, x2, y2) => svg("line", { class: cls, x1, y1, x2, y2 }, axes);
    for (const t of secTicks) {
      line("grid", m.left, ys(t), m.left + pw, ys(t));
      svgText(axes, m.left - 8, ys(t) + 4, fmtTick(t), "tick", { "text-anchor": "end" });
    }
    for (const t of bytes.ticks) {
      svgText(axes, m.left + pw + 8, yb(t) + 4, fmtTick(t / bytes.scale), "tick tick-size");
    }
    for (const id of idTicks(lo, hi, pw)) {
      line("tick-mark", xc(id), base, xc(id), base + 5);
      svgText(axes, xc(id), base + 18, String(id), "tick", { "text-anchor": "middle" });
    }
    line("axis", m.left, base, m.left + pw, base);
    line("axis", m.left, m.top, m.left, base);
    line("axis axis-size", m.left + pw, m.top, m.left + pw, base);
    const mid = m.top + ph / 2;
    svgText(axes, m.left + pw / 2, H - 6, "checkpoint id", "axis-title", { "text-anchor": "middle" });
    svgText(axes, 16, mid, "seconds", "axis-title",
      { "text-anchor": "middle", transform: `rotate(-90 16 ${mid})` });
    svgText(axes, W - 14, mid, `size (${bytes.unit})`, "axis-title axis-title-size",
      { "text-anchor": "middle", transform: `rotate(90 ${W - 14} ${mid})` });

    // A bar per checkpoint: its duration, its alignment inside. A failed one is red (pale and
    // full height when it has no duration), crossed above the plot, its reason in the tooltip.
    const bars = svg("g", { class: "bars" }, root);
    const bw = Math.max(1, Math.min(band * 0.72, 28));
    for (const c of history) {
      const failed = c.status === "failed";
      const dur = num(c.duration_s);
      const top = dur === null ? m.top : ys(dur);
      const cls = "ckpt-duration" + (failed ? " failed" + (dur === null ? " no-duration" : "") : "");
      const attrs = { class: cls, x: xc(c.id) - bw / 2, y: top, width: bw, height: Math.max(base - top, 1) };
      const r = svg("rect", Object.assign(attrs, { "data-id": c.id, "data-status": c.status || "" }), bars);
      if (failed) r.setAttribute("data-reason", c.reason || "");
      tooltip(r, describe(c));
      const al = num(c.alignment_s);
      if (al !== null && !failed) {
        svg("rect", { class: "ckpt-alignment", x: xc(c.id) - bw / 4, y: ys(al), width: bw / 2,
          height: Math.max(base - ys(al), 0), "data-id": c.id }, bars);
      }
      if (failed) svgText(bars, xc(c.id), m.top - 4, "\u2715", "failed-mark", { "text-anchor": "middle" });
    }
    // The size: a line on the right axis, with points while they are far enough apart.
    const sized = history.filter((c) => num(c.size_bytes) !== null);
    if (sized.length) {
      const points = sized.map((c) => `${xc(c.id)},${yb(c.size_bytes)}`).join(" ");
      svg("polyline", { class: "ckpt-size", points: points }, root);
      for (const c of band >= 8 ? sized : []) {
        svg("circle", { class: "ckpt-size-point", cx: xc(c.id), cy: yb(c.size_bytes), r: 2.5 }, root);
      }
    }
    // Hover targets a column wide: a bar may be a pixel.
    const hits = svg("g", { class: "hits" }, root);
    for (const c of history) {
      const attrs = { class: "ckpt-hit", x: xc(c.id) - band / 2, y: m.top, width: band, height: ph };
      tooltip(svg("rect", attrs, hits), describe(c));
    }
    legend(root, m.left, 14);
  }

  function legend(root, x, y) {
    const g = svg("g", { class: "legend", transform: `translate(${x},${y})` }, root);
    const items = [
      ["swatch-duration", "duration (s)"],
      ["swatch-alignment", "alignment (s)"],
      ["swatch-size", "size (right axis)"],
      ["swatch-failed", "failed (hover for the reason)"],
    ];
    let dx = 0;
    for (const [cls, label] of items) {
      if (cls === "swatch-size") svg("line", { class: cls, x1: dx, x2: dx + 16, y1: 6, y2: 6 }, g);
      else svg("rect", { class: cls, x: dx + 2, y: 0, width: 12, height: 12, rx: 2 }, g);
      const text = svgText(g, dx + 22, 10, label, "legend-text");
      dx += 40 + (text.getComputedTextLength ? text.getComputedTextLength() : label.length * 6.6);
    }
  }

  // ---------------------------------------------------------------- tables

  const pill = (str, kind) => el("span", "pill kind-" + String(kind).replace(/[^a-z_-]/gi, ""), str);

  function renderRestarts(job) {
    fillTable("restarts", list(job.restarts_list).reverse(), [
      { get: (r) => fmtTime(r.at_ms), cls: "nowrap mono" },
      { get: (r) => pill(r.kind || "?", r.kind || "") },
      { get: (r) => r.cause, cls: "wrap" },
    ], "No restarts.");
  }

  function renderLag(job) {
    const lag = job.lag || {};
    const rows = list(lag.sources).map((r) => Object.assign({ kind: "source" }, r))
      .concat(list(lag.channels).map((r) => Object.assign({ kind: "channel" }, r)));
    const order = { source: 0, channel: 1 };
    rows.sort((p, q) => order[p.kind] - order[q.kind] || String(p.topic).localeCompare(String(q.topic)) ||
      (p.partition ?? 0) - (q.partition ?? 0));
    const max = Math.max(1, ...rows.map((r) => num(r.records) || 0));
    const bar = (r) => {
      const div = el("div", "lagbar");
      div.style.width = ((100 * (num(r.records) || 0)) / max).toFixed(1) + "%";
      return div;
    };
    fillTable("lag", rows, [
      { get: (r) => pill(r.kind, r.kind) },
      { get: (r) => r.topic, cls: "mono" },
      { get: (r) => r.partition, cls: "num" },
      { get: (r) => fmtInt(r.records), cls: "num" },
      { get: bar, cls: "bar-col" },
    ], "No lag reported.");
  }

  function renderDeadLetters(job) {
    const dl = job.dead_letters || {};
    setText("dead-letters-total", `total ${fmtInt(dl.total ?? 0)} \u00b7 the last ones, newest first`);
    fillTable("dead-letters", list(dl.recent).reverse(), [
      { get: (r) => r.step, cls: "mono" },
      { get: (r) => pill(r.error_type || "?", "error") },
      { get: (r) => r.cause, cls: "wrap" },
      { get: (r) => r.topic, cls: "mono" },
      { get: (r) => r.partition, cls: "num" },
      { get: (r) => r.offset, cls: "num" },
    ], "No dead letters.");
  }

  // ---------------------------------------------------------------- polling
  function showBanner(message, pageError) {
    const since =
      state.lastOkMs === null ? "no data received yet" : "showing the data of " + fmtTime(state.lastOkMs);
    const banner = byId("error-banner");
    banner.textContent = pageError
      ? `This page failed to draw the job's data (${message}); ${since}.`
      : `Cannot reach the job (${message}): it may have finished, or its runner stopped; ${since}. ` +
        "Retrying every second.";
    banner.hidden = false;
    document.body.classList.add("stale");
  }

  function render(job) {
    renderHeader(job);
    renderGraph(job);
    renderCheckpoints(job);
    renderRestarts(job);
    renderLag(job);
    renderDeadLetters(job);
    for (const panel of window.eosflowPanels || []) panel(job); // ui/panels.js
    state.updates += 1;
    document.body.dataset.updates = String(state.updates);
    document.body.dataset.loaded = "1";
  }

  async function fetchJob() {
    // A runner that vanished without closing its connections would leave a fetch hanging.
    const abort = new AbortController();
    const timer = setTimeout(() => abort.abort(), FETCH_TIMEOUT_MS);
    try {
      const resp = await fetch("api/job", { cache: "no-store", signal: abort.signal });
      if (!resp.ok) throw new Error("HTTP " + resp.status);
      return await resp.json();
    } finally {
      clearTimeout(timer);
    }
  }

  async function poll() {
    let job = null;
    try {
      job = (await fetchJob()) || {};
    } catch (err) {
      showBanner(errorText(err), false);
    }
    if (job !== null) {
      state.lastOkMs = Date.now();
      byId("error-banner").hidden = true;
      document.body.classList.remove("stale");
      try {
        render(job);
      } catch (err) {
        // A bug of this page, not a lost job: say so rather than blame the runner.
        console.error(err);
        showBanner(errorText(err), true);
      }
    }
    setTimeout(poll, POLL_MS);
  }

  // The plot is drawn at the card's width: redraw it at the next poll after a resize.
  window.addEventListener("resize", () => delete state.keys.plot);
  poll();
})();
