// The charts: each definition turns the runs' snapshots into lines; uPlot (vendored) draws them.
// Several runs (compare) are drawn on the same chart, one colour per run.
(() => {
"use strict";

const COLORS = ["#2f6fde", "#e0543f", "#2aa15a", "#9b59b6", "#e8a33d", "#17a2b8", "#7f8c8d", "#c2185b"];
const DASHES = [[], [6, 3], [2, 3], [10, 3, 2, 3]];

function xOf(snap, xmode, versions, times) {
  // the x of each point: its version, or seconds since the run's first step
  if (xmode === "version") return versions;
  const t0 = snap.started || (times.find((t) => t != null) ?? 0);
  return times.map((t) => (t == null ? null : t - t0));
}

function metricLine(key, label) {
  return (snap, xmode) => {
    const m = snap.metrics;
    const x = xmode === "version" ? m.version : m.elapsed_s;
    return [{ label, x, y: m[key] }];
  };
}

const CHARTS = [
  { id: "reward", title: "Reward (trained batch mean)", lines: metricLine("reward_mean", "reward") },
  {
    id: "heldout", title: "Held-out success", lines: (snap, xmode) => {
      const e = snap.eval, out = [];
      for (const k of Object.keys(e)) {
        if (k === "version" || k === "time" || !k.endsWith("/pass@1")) continue;
        out.push({ label: k.replace(/^eval\//, ""), x: xOf(snap, xmode, e.version, e.time), y: e[k] });
      }
      const s = snap.success || {};
      if (!out.length && xmode === "version" && (s.success_before || s.success_after)) {
        // no evaluation beside training: the success check before and after RL
        const last = snap.metrics.version.length ? snap.metrics.version[snap.metrics.version.length - 1] : 0;
        const x = [0], y = [s.success_before ? s.success_before.sampled : null];
        if (s.success_after) { x.push(last); y.push(s.success_after.sampled); }
        out.push({ label: "sampled (check)", x, y, points: true });
      }
      return out;
    },
  },
  { id: "steptime", title: "Trainer step time (s)", lines: metricLine("seconds", "step s") },
  {
    id: "throughput", title: "Trainer samples/s and tokens/s ÷ 100", lines: (snap, xmode) => {
      const m = snap.metrics, x = xmode === "version" ? m.version : m.elapsed_s;
      return [{ label: "samples/s", x, y: m.samples_per_s },
        { label: "tokens/s ÷ 100", x, y: m.tokens_per_s.map((v) => (v == null ? null : v / 100)) }];
    },
  },
  {
    id: "rollout", title: "Rollout episodes/s and tokens/s ÷ 100 (over time)", time: true, lines: (snap) => {
      const h = snap.rollout.history || [];
      const x = xOf(snap, "time", null, h.map((s) => s.time));
      return [{ label: "episodes/s", x, y: h.map((s) => s.episodes_per_s) },
        { label: "tokens/s ÷ 100", x, y: h.map((s) => s.tokens_per_s / 100) }];
    },
  },
  {
    id: "staleness", title: "Staleness of trained tokens (share of tokens)", bars: true, lines: (snap) => {
      const h = snap.staleness;
      if (!h) return [];
      const keys = Object.keys(h).map(Number).sort((a, b) => a - b);
      const total = keys.reduce((a, k) => a + h[k], 0) || 1;
      return [{ label: "tokens", x: keys, y: keys.map((k) => h[k] / total) }];
    },
  },
  { id: "publish", title: "Weight update per step (publish, s)", lines: metricLine("publish_s", "publish s") },
  { id: "maxstale", title: "Max staleness per step (versions)", lines: metricLine("max_staleness", "max staleness") },
  {
    id: "buffer", title: "Buffer: received = trained + buffered + dropped", lines: (snap, xmode) => {
      const b = snap.books;
      const x = xmode === "version" ? b.version : xOf(snap, "time", null, b.time || []);
      return ["received", "trained", "buffered", "dropped_total"].map((k) => ({ label: k.replace("_total", ""), x, y: b[k] }));
    },
  },
];

const plots = {};

function joinLines(lines) {
  // one x column for all lines (uPlot wants aligned data): uPlot.join fills the gaps with null
  const tables = lines.map((l) => {
    const pairs = [];
    for (let i = 0; i < l.x.length; i++) if (l.x[i] != null) pairs.push([l.x[i], l.y[i]]);
    pairs.sort((a, b) => a[0] - b[0]);
    const xs = [], ys = [];
    for (const [x, y] of pairs) { if (xs.length && xs[xs.length - 1] === x) { ys[ys.length - 1] = y; continue; } xs.push(x); ys.push(y); }
    return [xs, ys];
  });
  return tables.length === 1 ? tables[0] : uPlot.join(tables);
}

function renderCharts(snaps, xmode, grid) {
  for (const def of CHARTS) {
    let card = document.getElementById("chart-" + def.id);
    if (!card) {
      card = document.createElement("div");
      card.className = "card"; card.id = "chart-" + def.id; card.dataset.testid = "chart";
      const h = document.createElement("h3"); h.textContent = def.title; card.appendChild(h);
      const body = document.createElement("div"); body.className = "plot"; card.appendChild(body);
      grid.appendChild(card);
    }
    const lines = [];
    snaps.forEach((snap, r) => {
      if (!snap) return;
      def.lines(snap, xmode).forEach((l, k) => {
        lines.push({ ...l, label: snaps.length > 1 ? `${snap.name}: ${l.label}` : l.label, run: r, k });
      });
    });
    const points = lines.reduce((n, l) => n + l.y.filter((v) => v != null).length, 0);
    card.dataset.points = String(points);
    const body = card.querySelector(".plot");
    if (!points) {
      if (plots[def.id]) { plots[def.id].destroy(); delete plots[def.id]; }
      body.innerHTML = '<div class="empty">no data yet</div>';
      continue;
    }
    const data = joinLines(lines);
    const key = xmode + "|" + lines.map((l) => l.label).join("|");
    const width = Math.max(300, body.clientWidth || card.clientWidth - 16);
    const p = plots[def.id];
    if (p && p._key === key && p.width === width) { p.setData(data); continue; }
    if (p) p.destroy();
    body.innerHTML = "";
    const series = [{ label: def.bars ? "staleness" : (def.time || xmode === "time" ? "s" : "version") }];
    for (const l of lines) {
      const color = COLORS[(l.run * 3 + l.k) % COLORS.length];
      const s = { label: l.label, stroke: color, width: 2, dash: DASHES[l.run % DASHES.length], spanGaps: true };
      if (def.bars) Object.assign(s, { fill: color + "88", paths: uPlot.paths.bars({ size: [0.7 / lines.length, 60] }), points: { show: false } });
      else if (l.points || data[0].length < 3) s.points = { show: true, size: 7 };
      series.push(s);
    }
    const opts = {
      width, height: 220, series, legend: { live: true },
      scales: def.bars ? { x: { time: false, range: (u, lo, hi) => [lo - 0.5, hi + 0.5] }, y: { range: (u, lo, hi) => [0, hi * 1.1 || 1] } }
        : { x: { time: false } },
      axes: [{ label: def.bars ? "staleness (versions)" : (def.time || xmode === "time" ? "seconds" : "version"),
        ...(def.bars || xmode === "version" ? { incrs: [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000] } : {}) }, {}],
    };
    const plot = new uPlot(opts, data, body);
    plot._key = key;
    plots[def.id] = plot;
  }
}

window.Charts = { renderCharts, COLORS };
})();
