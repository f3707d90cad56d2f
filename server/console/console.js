// hearth's console: draws GET /console/state (a stream of snapshots) and chats through
// /v1/chat/completions. Keys live in this tab's sessionStorage only and go out as bearer
// headers to this server; nothing here is fetched from anywhere else.
"use strict";

const HISTORY_S = 300; // the charts' longest span: the last five minutes
const MIN_SPAN_S = 30; // their shortest, while the history is younger
const RETRY_MS = 2000; // between attempts to reach the server
const $ = (id) => document.getElementById(id);
const history = []; // {at, generated, ttftSum, ttftCount, tpotSum, tpotCount, running, queued}
let latest = null;
let chatAbort = null;
const conversation = [];

function apiKey() { return sessionStorage.getItem("hearth.apiKey") || ""; }
function headers(extra, key) {
  const h = Object.assign({}, extra || {});
  const k = key === undefined ? apiKey() : key;
  if (k) h.Authorization = "Bearer " + k;
  return h;
}
function el(tag, attrs, ...children) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (k === "class") e.className = v; else e.setAttribute(k, v);
  }
  for (const c of children) e.append(c);
  return e;
}
function svg(tag, attrs, text) {
  const e = document.createElementNS("http://www.w3.org/2000/svg", tag);
  for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, v);
  if (text !== undefined) e.textContent = text;
  return e;
}
function bytes(n) {
  if (n === undefined || n === null) return "–";
  const units = ["B", "KB", "MB", "GB", "TB"];
  let i = 0;
  while (n >= 1000 && i < units.length - 1) { n /= 1000; i++; }
  return n.toFixed(i === 0 ? 0 : 1) + " " + units[i];
}
function ms(x) { return x === undefined || x === null ? "–" : x < 10 ? x.toFixed(2) + " ms" : x.toFixed(1) + " ms"; }
function secs(x) { return x === undefined || x === null || !isFinite(x) ? "–" : x < 1 ? (x * 1000).toFixed(0) + " ms" : x.toFixed(2) + " s"; }
function setStatus(text, cls) { const s = $("status"); s.textContent = text; s.className = "status " + (cls || ""); }

// The stream of snapshots: fetch (not EventSource, which cannot send the key), read
// server-sent events, draw each; on a refusal ask for the key, on a break try again.
async function connect() {
  for (;;) {
    try {
      const r = await fetch("/console/state", { headers: headers({ Accept: "text/event-stream" }), cache: "no-store" });
      if (r.status === 401) { askKey(); return; }
      if (!r.ok) throw new Error("HTTP " + r.status);
      $("key-form").hidden = true;
      await readEvents(r, (data) => draw(JSON.parse(data)));
    } catch (e) {
      // The server restarting or the network gone: said in the header, tried again.
    }
    setStatus("unreachable, retrying", "down");
    await new Promise((done) => setTimeout(done, RETRY_MS));
  }
}

// Reads a response of server-sent events to its end, handing `each` every event's data.
async function readEvents(r, each) {
  const reader = r.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, { stream: true });
    let cut;
    while ((cut = buffer.indexOf("\n\n")) >= 0) {
      const block = buffer.slice(0, cut);
      buffer = buffer.slice(cut + 2);
      const data = block.split("\n").filter((l) => l.startsWith("data:")).map((l) => l.slice(5).trimStart()).join("\n");
      if (data) each(data);
    }
  }
}

function askKey() {
  setStatus("needs the API key", "down");
  $("key-form").hidden = false;
  $("api-key").focus();
}

function draw(s) {
  latest = s;
  const m = s.model;
  $("model").textContent = `${m.id} · ${m.arch}${m.quantization ? " " + m.quantization : ""} · ${(m.parameters / 1e9).toFixed(m.parameters < 1e9 ? 2 : 1)}B parameters · ${m.context_length} tokens of context · ${m.parallel} at once`;
  setStatus(s.status === "ok" ? "ok" : "degraded: " + (s.reason || ""), s.status);
  record(s);
  drawDevices(s);
  drawRing(s);
  drawPlan(s);
  drawLoad(s);
  if (!$("model-list").childElementCount) loadModels();
  const local = s.local_models.map((m) => el("li", {}, `${m.name} · ${bytes(m.bytes)}${m.served ? " · served" : ""}`));
  $("local-models").replaceChildren(...(local.length ? local : [el("li", {}, "none found")]));
}

// A device's compute (ms) and disk reads (bytes) per generated token over the charts'
// history (prompts' work included: what a token costs the cluster now), else since the start.
function perToken(d, s) {
  const old = history.length ? history[0] : undefined;
  const then = old && old.devices[d.name];
  const tokens = then ? s.load.generated_tokens_total - old.generated : 0;
  if (tokens > 0) return [((d.compute_seconds_total - then.compute) / tokens) * 1000, (d.disk_read_bytes_total - then.read) / tokens];
  const all = s.load.generated_tokens_total;
  return all > 0 ? [(d.compute_seconds_total / all) * 1000, d.disk_read_bytes_total / all] : [null, null];
}

function drawDevices(s) {
  const body = $("devices").tBodies[0];
  body.replaceChildren(...s.devices.map((d) => {
    const windows = d.layers.map(([a, b]) => `${a}–${b - 1}`).join(", ");
    const layers = d.member ? `${d.layer_count}${windows ? " (" + windows + ")" : ""}` : "–";
    const gpu = d.gpu_layers ? `${d.gpu_layers}${d.experts_in_ram ? " (" + d.experts_in_ram + " experts in RAM)" : ""}` : "0";
    const memory = d.ram_total_bytes ? `${bytes(d.ram_available_bytes)} / ${bytes(d.ram_total_bytes)}` : "–";
    const name = d.label && d.label !== d.name ? `${d.label} (${d.name})` : d.name;
    const [compute, read] = perToken(d, s);
    const state = el("td", { class: "state-" + d.state }, d.state);
    if (d.progress) state.append(el("br"), el("small", {}, d.progress));
    return el("tr", { "data-device": d.name },
      el("th", { scope: "row" }, name),
      state,
      el("td", {}, layers),
      el("td", {}, gpu),
      el("td", {}, memory),
      el("td", {}, ms(d.hop_ms)),
      el("td", { title: d.compute_steps_total + " steps, " + secs(d.compute_seconds_total) + " since the start" }, ms(compute)),
      el("td", { title: bytes(d.disk_read_bytes_total) + " since the start" }, read === null ? "–" : bytes(read)));
  }));
}

// Members on a circle in ring order (the head at the top), each hop an arrow labelled
// with its latency; candidates outside the ring along the bottom, dashed.
function drawRing(s) {
  const ring = $("ring");
  const title = ring.querySelector("title");
  ring.replaceChildren(title);
  const members = s.devices.filter((d) => d.member);
  const others = s.devices.filter((d) => !d.member);
  const cx = 200, cy = 110, r = members.length > 1 ? 80 : 0;
  const at = members.map((_, i) => {
    const a = -Math.PI / 2 + (2 * Math.PI * i) / Math.max(members.length, 1);
    return [cx + r * Math.cos(a), cy + r * Math.sin(a)];
  });
  const defs = svg("defs");
  const marker = svg("marker", { id: "arrow", viewBox: "0 0 10 10", refX: "10", refY: "5", markerWidth: "7", markerHeight: "7", orient: "auto-start-reverse" });
  marker.append(svg("path", { d: "M 0 0 L 10 5 L 0 10 z", fill: "currentColor" }));
  defs.append(marker);
  ring.append(defs);
  const NODE = 34;
  if (members.length > 1) {
    members.forEach((d, i) => {
      const [x1, y1] = at[i];
      const [x2, y2] = at[(i + 1) % members.length];
      const len = Math.hypot(x2 - x1, y2 - y1) || 1;
      const ux = (x2 - x1) / len, uy = (y2 - y1) / len;
      ring.append(svg("line", { class: "link", x1: x1 + ux * NODE, y1: y1 + uy * NODE, x2: x2 - ux * NODE, y2: y2 - uy * NODE, "marker-end": "url(#arrow)" }));
      const next = members[(i + 1) % members.length];
      const hop = next.hop_ms;
      if (hop !== undefined && hop !== null) {
        ring.append(svg("text", { class: "hop", x: (x1 + x2) / 2 + uy * 14, y: (y1 + y2) / 2 - ux * 14 + 4 }, ms(hop)));
      }
    });
  }
  members.forEach((d, i) => {
    const [x, y] = at[i];
    ring.append(svg("circle", { class: "node " + d.state, cx: x, cy: y, r: NODE }));
    ring.append(svg("text", { x: x, y: y - 2 }, short(d.label || d.name)));
    ring.append(svg("text", { x: x, y: y + 12 }, d.layer_count + " layers"));
  });
  others.forEach((d, i) => {
    const x = 40 + i * 80, y = 238;
    ring.append(svg("circle", { class: "node " + d.state, cx: x, cy: y, r: 16 }));
    ring.append(svg("text", { x: x + 34, y: y + 4 }, short(d.label || d.name) + " · " + d.state));
  });
  title.textContent = `The ring: ${members.map((d) => `${d.label || d.name} (${d.layer_count} layers, ${d.state})`).join(" → ")}${others.length ? "; outside it: " + others.map((d) => `${d.label || d.name} (${d.state})`).join(", ") : ""}`;
}
// A label that fits a node: a worker known only by its address shows its port's end.
function short(name) { return name.length > 13 ? "…" + name.slice(-12) : name; }

function facts(dl, rows) {
  dl.replaceChildren(...rows.flatMap(([k, v]) => [el("dt", {}, k), el("dd", {}, v)]));
}

function drawPlan(s) {
  const p = s.plan;
  facts($("plan-facts"), [
    ["strategy", p.source + (p.automatic ? " (re-plans itself when idle)" : "")],
    ["rounds k", String(p.rounds)],
    ["micro-batches in flight", String(p.micro_batches)],
    ["TPOT predicted / measured", `${ms(p.predicted_tpot_ms)} / ${ms(p.measured_tpot_ms)}`],
    ["8 streams forecast", p.forecast_tokens_per_s ? p.forecast_tokens_per_s.toFixed(1) + " tokens/s" : "–"],
    ["hop measured", ms(p.measured_hop_ms)],
    ["running since", p.adopted_at ? new Date(p.adopted_at * 1000).toLocaleString() + (p.replans ? ` (re-planned ${p.replans}×)` : "") : "–"],
    ["left out", p.dropped.length ? p.dropped.join(", ") : "none"],
  ]);
  const c = p.last_check;
  $("last-check").textContent = c ? `Last look ${new Date(c.at * 1000).toLocaleTimeString()}: ${c.applied ? "changed the plan" : "kept it"} — ${c.reason}${c.fetching ? " (fetching: " + c.fetching + ")" : ""}` : "";
  $("admin-form").hidden = !s.admin;
  $("what-if-form").hidden = !s.admin || s.devices.length < 2;
  whatIfChoices(s);
}

// The devices a "what if" may leave out (every one but the head) or copy, kept as the
// person ticked them while snapshots arrive.
function whatIfChoices(s) {
  const box = $("what-if-without");
  const names = s.devices.filter((d) => d.name !== "head").map((d) => d.name);
  const shown = [...box.querySelectorAll("input")].map((i) => i.value);
  if (shown.join("\n") !== names.join("\n")) {
    const ticked = new Set([...box.querySelectorAll("input:checked")].map((i) => i.value));
    box.replaceChildren(...names.map((n, i) => {
      const id = "without-" + i;
      const input = el("input", { type: "checkbox", id, value: n });
      input.checked = ticked.has(n);
      return el("label", { for: id }, input, " without " + n);
    }));
  }
  const copy = $("what-if-copy");
  const all = s.devices.map((d) => d.name);
  if ([...copy.options].slice(1).map((o) => o.value).join("\n") !== all.join("\n")) {
    const chosen = copy.value;
    copy.replaceChildren(el("option", { value: "" }, "none"), ...all.map((n) => el("option", { value: n }, n)));
    copy.value = all.includes(chosen) ? chosen : "";
  }
}

async function whatIf(event) {
  event.preventDefault();
  const out = $("what-if-result");
  const without = [...$("what-if-without").querySelectorAll("input:checked")].map((i) => i.value);
  const copies = $("what-if-copy").value ? [$("what-if-copy").value] : [];
  const strategy = $("strategy").value;
  out.textContent = "solving…";
  try {
    const r = await fetch("/admin/what-if", { method: "POST", headers: headers({ "Content-Type": "application/json" }, $("admin-key").value), body: JSON.stringify(Object.assign({ without, copies }, strategy ? { strategy } : {})) });
    const body = await r.json().catch(() => ({}));
    if (!r.ok) {
      out.textContent = `Refused (${r.status}): ${(body.error && body.error.message) || r.statusText}`;
      return;
    }
    const rate = (x) => (x ? x.toFixed(1) + " tokens/s" : "–");
    const table = el("table", { class: "what-if-plan" },
      el("thead", {}, el("tr", {}, el("th", { scope: "col" }, "device"), el("th", { scope: "col" }, "layers"), el("th", { scope: "col" }, "GPU layers"))),
      el("tbody", {}, ...body.members.map((m) => el("tr", {}, el("th", { scope: "row" }, m.name), el("td", {}, `${m.layers} (${m.windows.map(([a, b]) => `${a}–${b - 1}`).join(", ")})`), el("td", {}, String(m.gpu_layers))))));
    out.replaceChildren(
      el("p", { class: "note" }, `${body.strategy}: ${body.members.length} devices in the ring, k = ${body.rounds}${body.dropped.length ? ", leaving out " + body.dropped.join(", ") : ""}. TPOT ${ms(body.predicted_tpot_ms)} (now ${ms(body.current_predicted_tpot_ms)}); 8 streams ${rate(body.forecast_tokens_per_s)} (now ${rate(body.current_forecast_tokens_per_s)}).`),
      el("div", { class: "table-wrap" }, table));
  } catch (e) {
    out.textContent = "The server could not be reached.";
  }
}

function record(s) {
  const l = s.load;
  const devices = {};
  for (const d of s.devices) devices[d.name] = { compute: d.compute_seconds_total, read: d.disk_read_bytes_total };
  history.push({ at: s.at, generated: l.generated_tokens_total, ttftSum: l.ttft_seconds_sum, ttftCount: l.ttft_count, tpotSum: l.tpot_seconds_sum, tpotCount: l.tpot_count, running: l.running, queued: l.queued, devices });
  while (history.length > 2 && history[0].at < s.at - HISTORY_S) history.shift();
}

// Rates between consecutive snapshots: [time, value] points.
function series(f) {
  const out = [];
  for (let i = 1; i < history.length; i++) {
    const v = f(history[i - 1], history[i]);
    if (v !== null && isFinite(v)) out.push([history[i].at, v]);
  }
  return out;
}

function chart(id, lines) {
  const box = $(id);
  box.replaceChildren();
  const now = latest ? latest.at : Date.now() / 1000;
  const all = lines.flatMap((l) => l.points.map((p) => p[1]));
  const top = Math.max(1e-9, ...all) * 1.15;
  // The span grows with the history, from half a minute to HISTORY_S: a chart fills as
  // the console watches instead of starting as a sliver at its right edge.
  const span = Math.min(HISTORY_S, Math.max(MIN_SPAN_S, history.length ? now - history[0].at : 0));
  const x = (t) => Math.max(0, 300 * (1 - (now - t) / span)).toFixed(1);
  const y = (v) => (78 - (76 * v) / top).toFixed(1);
  for (const l of lines) {
    if (!l.points.length) continue;
    // Each value holds until the next snapshot: steps, not slopes between far-apart points.
    const d = l.points.map(([t, v], i) => `${i ? "H" + x(t) + " V" : "M" + x(t) + ","}${y(v)}`).join(" ") + ` H300`;
    box.append(svg("path", { class: l.cls, d }));
  }
}

function drawLoad(s) {
  const rate = series((a, b) => (b.at > a.at ? (b.generated - a.generated) / (b.at - a.at) : null));
  const ttft = series((a, b) => (b.ttftCount > a.ttftCount ? (b.ttftSum - a.ttftSum) / (b.ttftCount - a.ttftCount) : null));
  const tpot = series((a, b) => (b.tpotCount > a.tpotCount ? (b.tpotSum - a.tpotSum) / (b.tpotCount - a.tpotCount) : null));
  const running = history.map((h) => [h.at, h.running]);
  const queued = history.map((h) => [h.at, h.queued]);
  chart("chart-rate", [{ cls: "line", points: rate }]);
  chart("chart-busy", [{ cls: "line", points: running }, { cls: "line2", points: queued }]);
  chart("chart-ttft", [{ cls: "line", points: ttft }]);
  chart("chart-tpot", [{ cls: "line", points: tpot }]);
  const last = (pts) => (pts.length ? pts[pts.length - 1][1] : null);
  $("now-rate").textContent = last(rate) === null ? "–" : last(rate).toFixed(1) + " tokens/s";
  $("now-busy").textContent = `${s.load.running} running · ${s.load.queued} queued`;
  $("now-ttft").textContent = secs(last(ttft));
  $("now-tpot").textContent = secs(last(tpot));
  const l = s.load;
  facts($("load-facts"), [
    ["requests", `${l.requests_total} (${l.errors_total} errors)`],
    ["tokens generated", String(l.generated_tokens_total)],
    ["prompt tokens computed / cached", `${l.prompt_tokens_total} / ${l.cached_prompt_tokens_total}`],
    ["speculation accepted", l.draft_tokens_total ? `${((100 * l.accepted_tokens_total) / l.draft_tokens_total).toFixed(0)}% of ${l.draft_tokens_total} drafted` : "–"],
  ]);
}

async function loadModels() {
  try {
    const r = await fetch("/v1/models", { headers: headers() });
    if (!r.ok) return;
    const list = await r.json();
    $("model-list").replaceChildren(...list.data.map((m) => el("li", {}, `${m.id}${m.context_length ? " · " + m.context_length + " tokens of context" : ""}${m.capabilities ? " · " + m.capabilities.join(", ") : ""}`)));
  } catch (e) {
    // Shown again with the next snapshot.
  }
}

async function replan(event) {
  event.preventDefault();
  const out = $("replan-result");
  const key = $("admin-key").value;
  const strategy = $("strategy").value;
  out.textContent = "re-planning when the server is next idle…";
  try {
    const r = await fetch("/admin/replan", { method: "POST", headers: headers({ "Content-Type": "application/json" }, key), body: JSON.stringify(strategy ? { strategy } : {}) });
    const body = await r.json().catch(() => ({}));
    if (r.ok) {
      const c = body.last_check;
      out.textContent = r.status === 202 ? body.message : c ? `${c.applied ? "Adopted a new plan" : "Kept the plan"}: ${c.reason}` : "Done.";
    } else {
      out.textContent = `Refused (${r.status}): ${(body.error && body.error.message) || r.statusText}`;
    }
  } catch (e) {
    out.textContent = "The server could not be reached.";
  }
}

function bubble(cls, text) {
  const m = el("div", { class: "msg " + cls }, text || "");
  $("messages").append(m);
  m.scrollIntoView({ block: "nearest" });
  return m;
}

async function send(event) {
  event.preventDefault();
  const text = $("prompt").value.trim();
  if (!text || chatAbort) return;
  $("prompt").value = "";
  conversation.push({ role: "user", content: text });
  bubble("user", text);
  const reply = bubble("assistant");
  const thinking = el("details", { class: "reasoning" }, el("summary", {}, "reasoning"));
  const answer = el("div", { class: "answer" });
  reply.append(answer);
  const system = $("system").value.trim();
  const messages = (system ? [{ role: "system", content: system }] : []).concat(conversation);
  const body = { model: latest ? latest.model.id : "", messages, stream: true, stream_options: { include_usage: true }, temperature: Number($("temperature").value), top_p: Number($("top-p").value), max_tokens: Number($("max-tokens").value) };
  chatAbort = new AbortController();
  $("send").disabled = true;
  $("stop").disabled = false;
  const started = performance.now();
  let first = null, usage = null, finish = null, content = "";
  try {
    const r = await fetch("/v1/chat/completions", { method: "POST", headers: headers({ "Content-Type": "application/json", Accept: "text/event-stream" }), body: JSON.stringify(body), signal: chatAbort.signal });
    if (!r.ok) {
      const e = await r.json().catch(() => ({}));
      throw new Error((e.error && e.error.message) || "HTTP " + r.status);
    }
    await readEvents(r, (data) => {
      if (data === "[DONE]") return;
      const chunk = JSON.parse(data);
      // A failure after the stream began (a ring member lost) comes as an error event.
      if (chunk.error) throw new Error(chunk.error.message || "the server failed the answer");
      if (chunk.usage) usage = chunk.usage;
      for (const c of chunk.choices || []) {
        const d = c.delta || {};
        if (d.reasoning_content) {
          if (!thinking.isConnected) reply.prepend(thinking);
          thinking.append(d.reasoning_content);
        }
        if (d.content) {
          if (first === null) first = performance.now();
          content += d.content;
          answer.textContent = content;
        }
        if (c.finish_reason) finish = c.finish_reason;
      }
    });
    conversation.push({ role: "assistant", content });
  } catch (e) {
    if (e.name === "AbortError") {
      finish = "stopped";
      conversation.push({ role: "assistant", content });
    } else {
      conversation.pop();
      reply.className = "msg error";
      reply.textContent = "Error: " + e.message;
    }
  } finally {
    chatAbort = null;
    $("send").disabled = false;
    $("stop").disabled = true;
  }
  const seconds = (performance.now() - (first || started)) / 1000;
  const n = usage ? usage.completion_tokens : null;
  const parts = [];
  if (first !== null) parts.push(`first token after ${secs((first - started) / 1000)}`);
  if (usage) parts.push(`${usage.prompt_tokens} prompt + ${n} generated tokens`);
  if (n && seconds > 0) parts.push(`${(n / seconds).toFixed(1)} tokens/s`);
  if (finish) parts.push(finish === "length" ? "cut at max tokens" : finish === "stopped" ? "stopped" : "done");
  $("chat-stats").textContent = parts.join(" · ");
  reply.dataset.done = "true";
}

document.addEventListener("DOMContentLoaded", () => {
  $("key-form").addEventListener("submit", (e) => {
    e.preventDefault();
    sessionStorage.setItem("hearth.apiKey", $("api-key").value);
    $("api-key").value = "";
    $("key-form").hidden = true;
    setStatus("connecting");
    connect();
  });
  $("admin-form").addEventListener("submit", replan);
  $("what-if-form").addEventListener("submit", whatIf);
  $("chat-form").addEventListener("submit", send);
  $("prompt").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && (e.ctrlKey || e.metaKey)) {
      e.preventDefault();
      $("chat-form").requestSubmit();
    }
  });
  $("stop").addEventListener("click", () => chatAbort && chatAbort.abort());
  $("clear").addEventListener("click", () => {
    conversation.length = 0;
    $("messages").replaceChildren();
    $("chat-stats").textContent = "";
  });
  // The server says in the page whether it needs a key: asked for before any request, so
  // a first visit makes no refused request.
  if (document.body.dataset.key === "required" && !apiKey()) askKey(); else connect();
});
