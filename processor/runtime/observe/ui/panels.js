// The job page's shared helpers (an element, a table; app.js uses them too) and its panels
// beside app.js's: the watermarks (per stage and per source partition, the partition that
// holds the job back marked) and the note on a page served from a finished run's saved state
// (`eosflow status --web`). app.js calls each of `window.eosflowPanels` with the /api/job
// document (docs/observability.md) after drawing its own; any field may be missing or null.
"use strict";

(function () {
  const DASH = "\u2013";
  const drawn = {};
  const byId = (id) => document.getElementById(id);
  const num = (x) => (typeof x === "number" && isFinite(x) ? x : null);
  const list = (x) => (Array.isArray(x) ? x.filter((v) => v !== null && v !== undefined) : []);

  function el(tag, cls, str) {
    const node = document.createElement(tag);
    if (cls) node.className = cls;
    if (str !== undefined && str !== null) node.textContent = String(str);
    return node;
  }

  // An event time in UTC (the progress line's and `eosflow status`'s), the date when it is
  // not the day of `nowMs`.
  function fmtEventTime(ms, nowMs) {
    ms = num(ms);
    if (ms === null) return "none yet";
    const iso = new Date(ms).toISOString().replace(/\.\d+Z$/, "Z");
    const today = new Date(num(nowMs) ?? Date.now()).toISOString().slice(0, 10);
    return iso.slice(0, 10) === today ? iso.slice(11) : iso.replace("T", " ");
  }

  // 850ms, 12s, 2m10s, 3h05m, 2d04h: the same as the console's.
  function fmtSpan(s) {
    s = num(s);
    if (s === null) return DASH;
    const sign = s < 0 ? "-" : "";
    let a = Math.abs(s);
    if (a < 1) return sign + Math.round(a * 1000) + "ms";
    a = Math.floor(a);
    const pad = (n) => String(n).padStart(2, "0");
    const [d, h, m, sec] = [Math.floor(a / 86400), Math.floor(a / 3600) % 24, Math.floor(a / 60) % 60, a % 60];
    if (d) return `${sign}${d}d${pad(h)}h`;
    if (h) return `${sign}${h}h${pad(m)}m`;
    if (m) return `${sign}${m}m${pad(sec)}s`;
    return `${sign}${sec}s`;
  }

  const where = (p) => (p ? `${p.topic}[${p.partition}]` + (p.state && p.state !== "reading" ? ` (${p.state})` : "") : "");

  function fill(id, rows, columns, emptyText) {
    const key = JSON.stringify(rows);
    if (drawn[id] === key) return;
    drawn[id] = key;
    const tbody = byId(id).querySelector("tbody");
    tbody.replaceChildren();
    if (!rows.length) {
      const td = el("td", "empty", emptyText);
      td.colSpan = columns.length;
      tbody.appendChild(el("tr", "empty")).appendChild(td);
      return;
    }
    for (const row of rows) {
      const tr = tbody.appendChild(el("tr"));
      if (row.holding) tr.dataset.holding = "1"; // the partition that holds the job back
      for (const col of columns) {
        const td = tr.appendChild(el("td", col.cls || ""));
        const v = col.get(row);
        if (v instanceof Node) td.appendChild(v);
        else td.textContent = v === null || v === undefined || v === "" ? DASH : String(v);
      }
    }
  }

  // The page's helpers, for app.js too: an element, and a table body filled with rows (one
  // cell per column; redrawn only when the rows change).
  window.eosflowUI = { el, fillTable: fill };

  function stageMark(s, nowMs) {
    return s.end ? "end of input" : fmtEventTime(s.watermark_ms, nowMs);
  }

  const HISTORICAL_S = 86400; // a watermark a day or more behind now: historical event time

  function renderWatermarks(job) {
    const wm = job.watermarks || {};
    const now = wm.now_ms;
    const held = where(wm.held_by);
    const summary = byId("watermark-summary");
    if (wm.end) summary.textContent = "job watermark: end of input";
    else if (!list(wm.stages).length) summary.textContent = "no watermark reported";
    else {
      const parts = [`job watermark ${fmtEventTime(wm.watermark_ms, now)} UTC`];
      if (num(wm.watermark_ms) !== null) {
        // Historical data (a backfill of last year's events): how far the job trails what it
        // read is what matters; "behind now" would dominate the line with a constant.
        parts.push(`${fmtSpan(wm.behind_newest_s)} behind newest`);
        if (num(wm.lag_s) !== null && wm.lag_s < HISTORICAL_S) parts.push(`${fmtSpan(wm.lag_s)} behind now`);
      }
      if (held) parts.push(`held by ${held}`);
      const n = wm.paused_ahead;
      if (n) parts.push(`${n} partition${n === 1 ? "" : "s"} paused ahead (alignment)`);
      summary.textContent = parts.join(" \u00b7 ");
    }
    summary.dataset.heldBy = wm.held_by ? `${wm.held_by.topic}[${wm.held_by.partition}]` : "";
    fill("watermark-stages", list(wm.stages), [
      { get: (s) => s.stage, cls: "mono" },
      { get: (s) => stageMark(s, now), cls: "mono nowrap" },
      { get: (s) => (s.end ? DASH : fmtSpan(s.lag_s)), cls: "num" },
      { get: (s) => (s.end ? DASH : fmtSpan(s.behind_newest_s)), cls: "num" },
      { get: (s) => where(s.held_by), cls: "mono" },
    ], "No stage reported a watermark yet.");
    fill("watermark-sources", list(wm.sources), [
      { get: (p) => p.topic, cls: "mono" },
      { get: (p) => p.partition, cls: "num" },
      { get: (p) => fmtEventTime(p.watermark_ms, now), cls: "mono nowrap" },
      { get: (p) => fmtEventTime(p.newest_ms, now), cls: "mono nowrap" },
      { get: (p) => fmtSpan(p.behind_newest_s), cls: "num" },
      { get: (p) => el("span", "pill wm-" + String(p.state).replace(/[^a-z_-]/gi, ""), p.state || "?") },
      { get: (p) => (p.holding ? el("span", "pill wm-holding", "holds the job back") : el("span")), cls: "nowrap" },
    ], "No source partition reported yet.");
  }

  function renderArchived(job) {
    const note = byId("archived-note");
    const saved = job.archived;
    note.hidden = !saved;
    if (!saved) return;
    const at = num(saved.written_ms) !== null ? new Date(saved.written_ms).toLocaleString("sv-SE") : "?";
    const kept = list(saved.retained_checkpoints).length;
    note.textContent =
      `The job's runner has exited: this is its last run's page, as saved at ${at} ` +
      `(${saved.status_file}), with the ${kept} checkpoints its snapshot store retains. It does not change.`;
  }

  window.eosflowPanels = [renderWatermarks, renderArchived];
})();
