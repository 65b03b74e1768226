// The page: polls each run's snapshot (live, no reload), draws the charts, the books and the
// processes; lists, filters and opens trajectories.
(() => {
"use strict";

const { el, fmt, renderDetail, renderGroup } = window.Viewer;
const POLL_MS = 2000;
const PAGE = 50;
const state = { runs: [], snaps: [], xmode: "version", tab: "charts", offset: 0, total: 0, selected: null };

async function getJSON(url) {
  const r = await fetch(url);
  if (!r.ok) throw new Error(`${url}: ${r.status} ${await r.text()}`);
  return r.json();
}

function showError(text) {
  const box = document.getElementById("error");
  box.hidden = !text;
  box.textContent = text || "";
}

function renderRuns() {
  const box = document.getElementById("runs");
  box.innerHTML = "";
  state.runs.forEach((run, i) => {
    const snap = state.snaps[i];
    const live = snap ? snap.live : run.live;
    box.append(el("span", { class: "run-chip", title: run.path },
      el("i", { class: "swatch", style: `background:${window.Charts.COLORS[(i * 3) % window.Charts.COLORS.length]}` }),
      run.name, el("span", { class: "badge" + (live ? " live" : ""), text: live ? "live" : "finished" }),
      el("span", { class: "muted", text: snap ? `${snap.steps} steps` : "" })));
  });
}

function renderBooks() {
  const box = document.getElementById("books");
  box.innerHTML = "";
  state.snaps.forEach((snap, i) => {
    if (!snap) return;
    const b = snap.last_books;
    let text = `${snap.name}: `;
    let bad = false;
    if (b) {
      const reasons = Object.entries(b).filter(([k, v]) => k.startsWith("dropped_") && k !== "dropped_total" && v)
        .map(([k, v]) => `${v} ${k.slice(8)}`);
      const dropped = b.dropped_total ?? 0;
      bad = b.received !== b.trained + b.buffered + dropped;
      text += `received ${b.received} = trained ${b.trained} + buffered ${b.buffered} + dropped ${dropped}` +
        (reasons.length ? ` (${reasons.join(", ")})` : "") + (b.version != null ? `  [after version ${b.version}]` : "");
    } else text += "no buffer books yet";
    const r = snap.rollout;
    if (r && r.workers) text += `   |   rollout: ${fmt(r.episodes_per_s, 1)} episodes/s, ${fmt(r.tokens_per_s, 0)} tokens/s, ${r.in_flight} in flight`;
    if (snap.store) text += `   |   ${snap.store.trajectories} trajectories recorded`;
    box.append(el("div", { class: bad ? "bad" : "", "data-testid": "books-line", text: text + (bad ? "  DOES NOT ADD UP" : "") }));
  });
}

function renderHealth() {
  const body = document.querySelector("#health tbody");
  body.innerHTML = "";
  const events = document.getElementById("events");
  events.innerHTML = "";
  state.snaps.forEach((snap) => {
    if (!snap) return;
    const h = snap.health;
    body.append(el("tr", {}, el("td", { text: snap.name }), el("td", { text: "launcher" }), el("td"),
      el("td", { class: h.launcher === "running" ? "alive-yes" : "", text: h.launcher }), el("td"), el("td")));
    for (const p of h.parts) {
      const alive = p.alive === true ? "yes" : p.alive === false ? (p.finished ? "finished" : "no") : "?";
      body.append(el("tr", { "data-testid": "part" }, el("td", { text: snap.name }), el("td", { text: p.name }),
        el("td", { class: "num", text: p.pid ?? "" }), el("td", { class: alive === "yes" ? "alive-yes" : alive === "no" ? "alive-no" : "", text: alive }),
        el("td", { class: "num", text: p.restarts ?? "–" }), el("td", { class: "num", text: p.deaths ?? 0 })));
    }
    for (const e of snap.events.slice(-20)) {
      events.append(el("li", { text: `${new Date(e.time * 1000).toLocaleTimeString()} ${snap.name}: ${e.event}` }));
    }
  });
}

async function poll() {
  try {
    const snaps = await Promise.all(state.runs.map((r) => getJSON(`/api/runs/${r.index}/snapshot`).catch((e) => ({ error: String(e) }))));
    const errors = snaps.filter((s) => s.error).map((s) => s.error);
    // a run that cannot be read now (the server stopped with its run) keeps its last picture
    state.snaps = snaps.map((s, i) => (s.error ? state.snaps[i] || null : s));
    showError(errors.join("\n") || state.snaps.map((s) => s && s.store_error).filter(Boolean).join("\n"));
    renderRuns();
    if (state.tab === "charts") {
      window.Charts.renderCharts(state.snaps, state.xmode, document.getElementById("chart-grid"));
      renderBooks();
      renderHealth();
    }
    document.getElementById("updated").textContent = "updated " + new Date().toLocaleTimeString();
  } catch (e) {
    showError(String(e));
  }
  if (state.snaps.some((s) => s && s.live) || !state.snaps.length) setTimeout(poll, POLL_MS);
  else setTimeout(poll, POLL_MS * 5); // finished runs: nothing changes, but a resumed one would
}

// --- trajectories ---------------------------------------------------------------------------
function runIndex() { return Number(document.getElementById("f-run").value || 0); }
function api() { return `/api/runs/${runIndex()}`; }

function query() {
  const form = new FormData(document.getElementById("filters"));
  const q = new URLSearchParams();
  for (const [k, v] of form.entries()) if (v !== "" && k !== "run") q.set(k, v);
  q.set("offset", state.offset); q.set("limit", PAGE);
  return q;
}

async function loadFacets() {
  const f = await getJSON(api() + "/facets");
  for (const [id, values] of [["f-stop", f.stop_reasons], ["f-env", f.envs]]) {
    const sel = document.getElementById(id);
    const current = sel.value;
    sel.innerHTML = "";
    sel.append(el("option", { value: "", text: "any" }));
    for (const [k, n] of Object.entries(values || {})) sel.append(el("option", { value: k, text: `${k || "(none)"} (${n})` }));
    sel.value = current;
  }
}

async function loadList() {
  let page;
  try {
    page = await getJSON(api() + "/trajectories?" + query());
  } catch (e) { showError(String(e)); return; }
  state.total = page.total;
  const body = document.querySelector("#list tbody");
  body.innerHTML = "";
  for (const r of page.rows) {
    const tr = el("tr", { "data-testid": "row", "data-id": r.id, class: r.id === state.selected ? "selected" : "" },
      el("td", { class: "num", text: r.step }), el("td", { text: r.task_id.slice(0, 10), title: r.task_id }), el("td", { class: "num", text: r.sample_index }),
      el("td", { class: "num", text: fmt(r.reward) }), el("td", { class: "num", text: fmt(r.advantage, 2) }),
      el("td", { text: r.stop_reason }), el("td", { text: `${fmt(r.min_version)}..${fmt(r.max_version)}` }),
      el("td", { class: "num", text: r.tokens }), el("td", { class: "tail", text: r.tail.replace(/\s+/g, " ") }));
    tr.onclick = () => openTrajectory(r.id);
    body.append(tr);
  }
  const end = Math.min(state.offset + PAGE, state.total);
  document.getElementById("count").textContent = state.total
    ? `${state.offset + 1}–${end} of ${state.total} trajectories` : (page.note || "no trajectories match");
  document.getElementById("prev").disabled = state.offset === 0;
  document.getElementById("next").disabled = end >= state.total;
}

async function openTrajectory(id) {
  state.selected = id;
  document.querySelectorAll("#list tbody tr").forEach((tr) => tr.classList.toggle("selected", tr.dataset.id === id));
  try {
    const d = await getJSON(`${api()}/trajectories/${encodeURIComponent(id)}`);
    renderDetail(document.getElementById("detail"), d, api(), openGroup);
  } catch (e) { showError(String(e)); }
}

async function openGroup(groupId) {
  const rows = await getJSON(`${api()}/groups/${encodeURIComponent(groupId)}`);
  renderGroup(document.getElementById("detail"), rows, openTrajectory);
}

function showTab(tab) {
  state.tab = tab;
  for (const b of document.querySelectorAll("nav .tab")) b.classList.toggle("active", b.dataset.tab === tab);
  document.getElementById("charts").hidden = tab !== "charts";
  document.getElementById("trajectories").hidden = tab !== "trajectories";
  if (tab === "trajectories") { loadFacets().catch(() => {}); loadList(); }
  else window.Charts.renderCharts(state.snaps, state.xmode, document.getElementById("chart-grid"));
  history.replaceState(null, "", "#" + tab);
}

async function init() {
  state.runs = await getJSON("/api/runs");
  const sel = document.getElementById("f-run");
  for (const r of state.runs) sel.append(el("option", { value: r.index, text: r.name }));
  document.querySelectorAll("nav .tab").forEach((b) => (b.onclick = () => showTab(b.dataset.tab)));
  document.getElementById("xmode").onchange = (e) => { state.xmode = e.target.value; window.Charts.renderCharts(state.snaps, state.xmode, document.getElementById("chart-grid")); };
  document.getElementById("filters").onsubmit = (e) => { e.preventDefault(); state.offset = 0; loadList(); };
  document.getElementById("f-clear").onclick = () => { document.getElementById("filters").reset(); state.offset = 0; loadList(); };
  sel.onchange = () => { state.offset = 0; loadFacets().catch(() => {}); loadList(); };
  document.getElementById("prev").onclick = () => { state.offset = Math.max(0, state.offset - PAGE); loadList(); };
  document.getElementById("next").onclick = () => { state.offset += PAGE; loadList(); };
  window.addEventListener("resize", () => window.Charts.renderCharts(state.snaps, state.xmode, document.getElementById("chart-grid")));
  await poll();
  if (location.hash === "#trajectories") showTab("trajectories");
}

init().catch((e) => showError(String(e)));
})();
