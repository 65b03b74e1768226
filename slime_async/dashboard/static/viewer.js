// The trajectory viewer: one trajectory's conversation, its tokens coloured by loss mask, weight
// version or logprob, and its group side by side. Model text is only ever set as textContent.
(() => {
"use strict";

function el(tag, attrs = {}, ...children) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (k === "class") e.className = v;
    else if (k === "text") e.textContent = v;
    else if (k.startsWith("data-")) e.setAttribute(k, v);
    else e[k] = v;
  }
  for (const c of children) if (c != null) e.append(c);
  return e;
}

function fmt(v, digits = 3) {
  if (v == null) return "–";
  return typeof v === "number" ? (Number.isInteger(v) ? String(v) : v.toFixed(digits)) : String(v);
}

const VERSION_HUES = [210, 20, 130, 280, 45, 175, 330, 95];

function tokenColour(mode, t, versionRange) {
  if (mode === "mask") return t.mask ? "#c8f0d0" : "#e6e6e6";
  if (mode === "version") {
    const hue = VERSION_HUES[((t.version - versionRange[0]) % VERSION_HUES.length + VERSION_HUES.length) % VERSION_HUES.length];
    return `hsl(${hue} 75% 82%)`;
  }
  // logprob: white (certain) to red (surprising); p = exp(logprob)
  const p = t.logprob == null ? 0 : Math.exp(t.logprob);
  return `hsl(0 85% ${Math.round(55 + 45 * p)}%)`;
}

function legend(mode, versionRange) {
  const box = el("div", { class: "legend", "data-testid": "legend" });
  const item = (colour, text) => box.append(el("span", {}, el("i", { style: `background:${colour}` }), text));
  if (mode === "mask") { item("#c8f0d0", "trained (mask 1)"); item("#e6e6e6", "not trained (mask 0)"); }
  else if (mode === "version") {
    for (let v = versionRange[0]; v <= versionRange[1] && v - versionRange[0] < 8; v++) item(tokenColour("version", { version: v }, versionRange), `v${v}`);
  } else { item(tokenColour("logprob", { logprob: 0 }), "p = 1"); item(tokenColour("logprob", { logprob: Math.log(0.5) }), "p = 0.5"); item(tokenColour("logprob", { logprob: -10 }), "p ≈ 0"); }
  box.append(el("span", { class: "muted", text: "prompt and tool tokens in grey text; hover a token for its figures" }));
  return box;
}

function renderTokens(d, mode) {
  const box = el("div", { class: "conversation" });
  const versions = d.turns.flatMap((t) => t.versions);
  const range = versions.length ? [Math.min(...versions), Math.max(...versions)] : [0, 0];
  box.append(legend(mode, range));
  const piece = (id) => d.pieces[String(id)] ?? `⟨${id}⟩`;
  d.turns.forEach((turn, i) => {
    const t = el("div", { class: "turn", "data-testid": "turn" });
    t.append(el("div", { class: "role", text: i === 0 ? "prompt (system, user)" : (turn.new_branch ? "context (new branch)" : "environment (tool results, user)") }));
    const prompt = el("div", { class: "tokens" });
    for (const id of turn.prompt_ids) prompt.append(el("span", { class: "tok prompt", text: piece(id), title: `prompt token ${id}: not trained` }));
    t.append(prompt);
    t.append(el("div", { class: "role", text: `model (finish: ${turn.finish_reason || "–"})` }));
    const comp = el("div", { class: "tokens" });
    turn.completion_ids.forEach((id, k) => {
      const tok = { mask: turn.mask[k], version: turn.versions[k], logprob: turn.logprobs[k] };
      const span = el("span", { class: "tok completion", text: piece(id), "data-testid": "token" });
      span.style.background = tokenColour(mode, tok, range);
      span.title = `token ${id} ${JSON.stringify(piece(id))}\nlogprob ${fmt(tok.logprob, 4)} (p ${fmt(Math.exp(tok.logprob ?? -Infinity), 3)})\n` +
        `version ${tok.version} (staleness at training ${d.step - 1 - tok.version})\nloss mask ${tok.mask}`;
      comp.append(span);
    });
    t.append(comp);
    box.append(t);
  });
  return box;
}

function renderDetail(target, d, api, onGroup) {
  target.innerHTML = "";
  target.dataset.id = d.id;
  target.append(el("h2", { text: `Trajectory ${d.id.slice(0, 12)}…` }));
  const meta = el("div", { class: "meta" });
  const add = (k, v) => meta.append(el("span", {}, el("b", { text: k + " " }), String(v)));
  add("reward", fmt(d.reward)); add("advantage", fmt(d.advantage)); add("stop", d.stop_reason);
  add("trained at step", d.step); add("token versions", `${fmt(d.min_version)}..${fmt(d.max_version)}`);
  add("env", d.env || "–"); add("task", d.task_id); add("sample", d.sample_index); add("tokens", `${d.completion_tokens} generated / ${d.tokens}`);
  for (const [k, v] of Object.entries(d.rewards || {})) add("reward " + k, fmt(v));
  if (d.error) add("error", d.error);
  target.append(meta);
  const groupBtn = el("button", { text: "Group view (the G samples of this task)", "data-testid": "group-button" });
  groupBtn.onclick = () => onGroup(d.group_id);
  const exportLink = el("a", { href: api + "/export/" + encodeURIComponent(d.id), text: "export (JSON)", "data-testid": "export" });
  target.append(el("div", { class: "modes" }, groupBtn, exportLink));
  target.append(el("div", { class: "muted", text: "Replay this episode through the env with the recorded replies (after export):" }));
  target.append(el("code", { class: "cmd", text: d.replay, "data-testid": "replay" }));
  const modes = el("div", { class: "modes" }, el("b", { text: "colour tokens by" }));
  let mode = "mask";
  const body = el("div");
  for (const m of ["mask", "version", "logprob"]) {
    const input = el("input", { type: "radio", name: "colour", value: m, checked: m === mode, id: "colour-" + m });
    input.onchange = () => { mode = m; body.replaceChildren(renderTokens(d, mode)); };
    modes.append(el("label", {}, input, m === "mask" ? "loss mask" : m === "version" ? "weight version" : "logprob"));
  }
  target.append(modes, body);
  body.append(renderTokens(d, mode));
}

function renderGroup(target, rows, onOpen) {
  target.innerHTML = "";
  if (!rows.length) { target.append(el("p", { text: "no trajectories in this group" })); return; }
  target.append(el("h2", { text: `Group ${rows[0].group_id.slice(0, 12)}… — task ${rows[0].task_id}, ${rows.length} samples` }));
  const best = Math.max(...rows.map((r) => r.reward));
  const grid = el("div", { class: "group", "data-testid": "group" });
  for (const r of rows) {
    const last = r.turn_texts.length ? r.turn_texts[r.turn_texts.length - 1][1] : "";
    const card = el("div", { class: "sample" + (r.reward === best ? " best" : ""), "data-testid": "group-sample" },
      el("div", {}, el("b", { text: `#${r.sample_index} ` }), `reward ${fmt(r.reward)}, advantage ${fmt(r.advantage)}`),
      el("div", { class: "muted", text: `${r.stop_reason}, ${r.turns} turns, versions ${fmt(r.min_version)}..${fmt(r.max_version)}` }),
      el("pre", { text: r.turn_texts.map((t, i) => (i ? "" : "") + t[1]).join("\n⋯\n") || last }));
    card.onclick = () => onOpen(r.id);
    grid.append(card);
  }
  target.append(grid);
}

window.Viewer = { el, fmt, renderDetail, renderGroup };
})();
