// pdserve explorer: the playground (the simulator, on the server) and the live view (a deployment).
// Plain DOM and hand-drawn SVG; every number comes from the server's JSON endpoints.
"use strict";

const $ = (id) => document.getElementById(id);
const SVG_NS = "http://www.w3.org/2000/svg";
const chunkOf = (index) => 2 ** index; // the chunk-size slider moves in powers of two
const fmt = (v, digits = 1) => (Number.isFinite(v) ? v.toFixed(digits) : "–");

let options = null;

// ---- views -------------------------------------------------------------------------------------

function show(view) {
  for (const tab of document.querySelectorAll(".tab")) tab.classList.toggle("active", tab.dataset.view === view);
  $("playground").hidden = view !== "playground";
  $("live").hidden = view !== "live";
  if (view === "live") startLive();
  else stopLive();
  history.replaceState(null, "", "#" + view);
}

// ---- playground ----------------------------------------------------------------------------------

let pgSeq = 0; // the newest run asked for; answers to older ones are dropped (never drawn)
let pgTimer = null;

function playgroundSettings() {
  const long = $("long32k").checked;
  return {
    hardware: $("hardware").value,
    model: $("model").value,
    tp: Number($("tp").value),
    mode: $("mode").value,
    instances: Number($("instances").value),
    prefill: Number($("prefill").value),
    decode: Number($("decode").value),
    prompt_len: long ? 32768 : Number($("prompt_len").value),
    chunk_size: chunkOf(Number($("chunk_size").value)),
    chunking: long ? false : $("chunking").checked,
    num_decodes: Number($("num_decodes").value),
    itl_target_ms: Number($("itl_target_ms").value),
  };
}

let beforeLong = null; // the prompt slider's value before the 32k toggle took it

function toggleLong() {
  const long = $("long32k").checked;
  if (long) {
    beforeLong = $("prompt_len").value;
    $("prompt_len").value = "32768";
  } else if (beforeLong !== null) {
    $("prompt_len").value = beforeLong;
  }
}

function updateControls() {
  const s = playgroundSettings();
  const long = $("long32k").checked;
  $("prompt_len").disabled = long;
  $("chunking").disabled = long;
  $("prompt_len-out").textContent = `${s.prompt_len} tokens`;
  $("chunk_size-out").textContent = s.chunking ? `${s.chunk_size} tokens` : `${s.chunk_size} (off)`;
  $("num_decodes-out").textContent = String(s.num_decodes);
  $("itl_target_ms-out").textContent = `${s.itl_target_ms} ms`;
  const colocated = s.mode === "colocated";
  for (const el of document.querySelectorAll(".colocated-only")) el.hidden = !colocated;
  for (const el of document.querySelectorAll(".disagg-only")) el.hidden = colocated;
}

function schedulePlayground() {
  updateControls();
  clearTimeout(pgTimer);
  pgTimer = setTimeout(runPlayground, 150);
}

// ---- the server's API, behind its bearer token when it has one --------------------------------------

let tokenAsked = null; // one prompt at a time, however many calls got 401

async function api(path, init = {}) {
  const withToken = () => {
    const token = sessionStorage.getItem("pdserve-token");
    const headers = { ...(init.headers || {}) };
    if (token) headers.authorization = `Bearer ${token}`;
    return fetch(path, { ...init, headers });
  };
  let response = await withToken();
  if (response.status === 401) {
    tokenAsked ??= Promise.resolve(window.prompt("This server needs its API token (the --auth-token of pdserve serve):"));
    const token = await tokenAsked;
    tokenAsked = null;
    if (token) {
      sessionStorage.setItem("pdserve-token", token.trim());
      response = await withToken();
    }
  }
  return response;
}

async function runPlayground() {
  const seq = ++pgSeq;
  const section = $("playground");
  section.dataset.state = "loading";
  section.setAttribute("aria-busy", "true");
  let response;
  let body;
  try {
    response = await api("/explorer/api/playground", {
      method: "POST",
      headers: { "content-type": "application/json" },
      body: JSON.stringify(playgroundSettings()),
    });
    body = await response.json();
  } catch (e) {
    if (seq === pgSeq) playgroundError(`the server did not answer (${e})`);
    return;
  }
  if (seq !== pgSeq) return; // a newer run was asked for meanwhile
  if (!response.ok) {
    playgroundError(body.error ? body.error.message : `HTTP ${response.status}`);
    return;
  }
  drawPlayground(body);
  $("pg-error").hidden = true;
  section.dataset.state = "ready";
  section.dataset.seq = String(seq);
  section.removeAttribute("aria-busy");
}

function playgroundError(message) {
  const section = $("playground");
  $("pg-error").textContent = message;
  $("pg-error").hidden = false;
  for (const id of ["fig-stall", "fig-ttft", "fig-over", "fig-throughput"]) {
    setFigure(id, null, "–");
    $(`${id}-other`).textContent = "";
  }
  $("pg-timelines").replaceChildren();
  $("pg-command").textContent = "";
  section.dataset.state = "error";
  section.removeAttribute("aria-busy");
}

function setFigure(id, value, text) {
  const el = $(id);
  el.textContent = text;
  if (value === null) delete el.dataset.value;
  else el.dataset.value = String(value);
}

function drawPlayground(data) {
  const [main, other] = data.runs;
  const f = main.figures;
  const g = other.figures;
  const tag = other.label;
  setFigure("fig-stall", f.worst_decode_stall_ms, `${fmt(f.worst_decode_stall_ms)} ms`);
  setFigure("fig-ttft", f.long_prompt_ttft_ms, `${fmt(f.long_prompt_ttft_ms, 0)} ms`);
  setFigure("fig-over", f.steps_over_target, `${f.steps_over_target} of ${f.steps_in_window}`);
  setFigure("fig-throughput", f.decode_throughput_tok_s, `${fmt(f.decode_throughput_tok_s, 0)} tok/s`);
  $("fig-stall-other").textContent = `${tag}: ${fmt(g.worst_decode_stall_ms)} ms`;
  $("fig-ttft-other").textContent = `${tag}: ${fmt(g.long_prompt_ttft_ms, 0)} ms`;
  $("fig-over-other").textContent = `${tag}: ${g.steps_over_target} of ${g.steps_in_window}`;
  $("fig-throughput-other").textContent = `${tag}: ${fmt(g.decode_throughput_tok_s, 0)} tok/s`;
  $("pg-command").textContent = data.command;
  $("pg-elapsed").textContent = `(${data.cost_model}; ran in ${fmt(data.elapsed_s * 1000, 0)} ms)`;

  const target = data.settings.itl_target_ms;
  let ymax = target * 1.25;
  for (const run of data.runs) for (const inst of run.instances) for (const s of inst.steps) ymax = Math.max(ymax, s[1]);
  const runs = data.runs.map((run, i) => {
    const box = document.createElement("div");
    box.className = "run";
    box.dataset.run = i === 0 ? "main" : "other";
    box.dataset.chunked = String(run.chunked);
    const title = document.createElement("h3");
    title.textContent = `${i === 0 ? "As set" : "For comparison"}: ${run.label}, ${run.architecture}`;
    box.append(title);
    let x0 = Infinity;
    let x1 = -Infinity;
    for (const inst of run.instances) {
      for (const s of inst.steps) {
        x0 = Math.min(x0, s[0]);
        x1 = Math.max(x1, s[0] + s[1]);
      }
    }
    for (const inst of run.instances) {
      box.append(timeline(inst.steps, { x0, x1, ymax, target, window: run.window_ms, label: `${inst.name} (${inst.role})`, name: inst.name }));
    }
    return box;
  });
  $("pg-timelines").replaceChildren(...runs);
}

// ---- the step timeline (both views) ---------------------------------------------------------------

function svg(tag, attrs = {}) {
  const el = document.createElementNS(SVG_NS, tag);
  for (const [k, v] of Object.entries(attrs)) el.setAttribute(k, String(v));
  return el;
}

// steps: [start, duration ms, prefill ms, decode ms, prefill tokens, decode tokens]; x in the unit of start.
function timeline(steps, { x0, x1, ymax, target = null, window = null, label, name, xUnit = "ms" }) {
  const W = 1000;
  const H = 120;
  const left = 150;
  const top = 8;
  const bottom = 18;
  const plotW = W - left - 10;
  const plotH = H - top - bottom;
  const span = Math.max(x1 - x0, 1e-9);
  const xs = (t) => left + ((t - x0) / span) * plotW;
  const ys = (ms) => (ms / ymax) * plotH;
  const root = svg("svg", { viewBox: `0 0 ${W} ${H}`, class: "timeline", "data-instance": name, role: "img" });
  root.append(svg("title"));
  root.firstChild.textContent = `${label}: ${steps.length} steps`;
  if (window) {
    const [w0, w1] = window;
    root.append(svg("rect", { class: "window", x: xs(w0), y: top, width: Math.max(xs(w1) - xs(w0), 1), height: plotH }));
  }
  for (const s of steps) {
    const [start, ms, prefillMs, decodeMs, prefillTokens, decodeTokens] = s;
    const x = xs(start);
    const w = Math.max(((xUnit === "s" ? ms / 1000 : ms) / span) * plotW - 0.6, 0.8);
    const bar = svg("g", { class: "bar", "data-ms": ms });
    const hd = ys(decodeMs);
    const hp = ys(prefillMs);
    const base = top + plotH;
    if (decodeMs > 0) bar.append(svg("rect", { class: "step decode", x, y: base - hd, width: w, height: hd }));
    if (prefillMs > 0) bar.append(svg("rect", { class: "step prefill", x, y: base - hd - hp, width: w, height: hp }));
    const tip = svg("title");
    tip.textContent = `${fmt(ms)} ms: ${prefillTokens} prefill + ${decodeTokens} decode tokens`;
    bar.append(tip);
    root.append(bar);
  }
  root.append(svg("line", { class: "axis", x1: left, x2: left + plotW, y1: top + plotH, y2: top + plotH }));
  if (target !== null) {
    const y = top + plotH - ys(target);
    root.append(svg("line", { class: "target", x1: left, x2: left + plotW, y1: y, y2: y }));
    const t = svg("text", { x: left + plotW - 4, y: y - 3, "text-anchor": "end" });
    t.textContent = `ITL target ${target} ms`;
    root.append(t);
  }
  const name_ = svg("text", { x: 4, y: top + 14 });
  name_.textContent = label;
  const peak = svg("text", { x: 4, y: top + 30 });
  peak.textContent = `top: ${fmt(ymax, 0)} ms`;
  const from = svg("text", { x: left, y: H - 4 });
  from.textContent = xUnit === "s" ? `${fmt(x0, 1)} s` : `${fmt(x0, 0)} ms`;
  const to = svg("text", { x: left + plotW, y: H - 4, "text-anchor": "end" });
  to.textContent = xUnit === "s" ? `${fmt(x1, 1)} s (now)` : `${fmt(x1, 0)} ms`;
  root.append(name_, peak, from, to);
  return root;
}

// ---- live ----------------------------------------------------------------------------------------

let liveTimer = null;
let liveBusy = false;
let sentBurst = -1; // the number of the last burst this page sent: older news is not shown over it
const burstNumber = (id) => Number(id.split("-").pop());

function startLive() {
  if (!options || !options.live) {
    $("live-missing").hidden = false;
    $("live-body").hidden = true;
    return;
  }
  if (liveTimer === null) {
    pollLive();
    liveTimer = setInterval(pollLive, 1000);
  }
}

function stopLive() {
  clearInterval(liveTimer);
  liveTimer = null;
}

async function pollLive() {
  if (liveBusy) return; // the previous answer has not come yet: skip a beat rather than pile up
  liveBusy = true;
  try {
    const response = await api("/explorer/api/live");
    const body = await response.json();
    if (!response.ok) throw new Error(body.error ? body.error.message : `HTTP ${response.status}`);
    drawLive(body);
    $("live-error").hidden = true;
    $("live").dataset.state = "ready";
  } catch (e) {
    $("live-error").textContent = `live view: ${e.message || e}`;
    $("live-error").hidden = false;
    $("live").dataset.state = "error";
  } finally {
    liveBusy = false;
  }
}

function drawLive(data) {
  $("latency-window").textContent = `(finished in the last ${data.latency_window_s} s, measured at the router; ms)`;
  const rows = Object.entries(data.latency).map(([mode, kinds]) => {
    const tr = document.createElement("tr");
    tr.dataset.mode = mode;
    const ttft = kinds.ttft || {};
    const itl = kinds.itl || {};
    const cells = [mode, ttft.n || 0, ttft.p50, ttft.p90, ttft.p99, itl.p50, itl.p90, itl.p99];
    tr.replaceChildren(
      ...cells.map((v, i) => {
        const td = document.createElement("td");
        td.textContent = i < 2 ? String(v) : fmt(v);
        return td;
      }),
    );
    return tr;
  });
  $("latency").tBodies[0].replaceChildren(...rows);

  let ymax = 1;
  for (const w of data.workers) for (const s of w.steps) ymax = Math.max(ymax, s[1]);
  const cards = data.workers.map((w) => {
    const card = document.createElement("div");
    card.className = `worker ${w.state}`;
    card.dataset.worker = w.id;
    card.dataset.steps = String(w.steps.length);
    const head = document.createElement("div");
    head.className = "head";
    const b = w.blocks;
    const pct = (n) => (b.total ? (100 * n) / b.total : 0);
    head.innerHTML = `<b></b><span></span><span></span>
      <span class="kv" title="KV blocks: used / cached / free"><span class="used"></span><span class="cached"></span><span class="free"></span></span>
      <span class="blocks"></span>`;
    head.children[0].textContent = w.id;
    head.children[1].textContent = `${w.role}${w.state === "serving" ? "" : ` (${w.state})`}${w.node ? ` on ${w.node}` : ""}`;
    head.children[2].textContent = `running ${w.running}, waiting ${w.waiting}${w.remote_pending ? `, KV pending ${w.remote_pending}` : ""}`;
    const kv = head.querySelector(".kv");
    kv.children[0].style.width = `${pct(b.used)}%`;
    kv.children[1].style.width = `${pct(b.cached)}%`;
    kv.children[2].style.width = `${pct(b.free)}%`;
    head.querySelector(".blocks").textContent = `KV blocks ${b.used} used, ${b.cached} cached, ${b.free} free of ${b.total}`;
    card.append(head);
    card.append(timeline(w.steps, { x0: -data.window_s, x1: 0, ymax, label: `${w.id} (${w.role})`, name: w.id, xUnit: "s" }));
    return card;
  });
  $("workers").replaceChildren(...cards);

  const last = data.bursts[data.bursts.length - 1];
  if (last && burstNumber(last.id) >= sentBurst) {
    const state = last.ended ? "done" : "running";
    const errors = last.errors.length ? ` (${last.errors[0]})` : "";
    $("burst-status").textContent = `${last.id} [${last.mode}]: ${last.done} of ${last.requests} finished, ${last.failed} failed, ${state}${errors}`;
    $("burst-status").dataset.burst = last.id;
    $("burst-status").dataset.state = state;
  }
}

async function sendBurst(event) {
  event.preventDefault();
  const body = {
    mode: $("burst-mode").value || null,
    streams: Number($("burst-streams").value),
    long_prompts: Number($("burst-long").value),
    long_prompt_tokens: Number($("burst-long-tokens").value),
  };
  try {
    const response = await api("/explorer/api/burst", {
      method: "POST",
      headers: { "content-type": "application/json" },
      body: JSON.stringify(body),
    });
    const answer = await response.json();
    if (!response.ok) throw new Error(answer.error ? answer.error.message : `HTTP ${response.status}`);
    sentBurst = burstNumber(answer.id);
    $("burst-status").textContent = `${answer.id} [${answer.mode}]: ${answer.requests} requests sent`;
    $("burst-status").dataset.burst = answer.id;
    $("burst-status").dataset.state = "running";
    $("live-error").hidden = true;
    pollLive();
  } catch (e) {
    $("live-error").textContent = `burst: ${e.message || e}`;
    $("live-error").hidden = false;
  }
}

// ---- start -----------------------------------------------------------------------------------------

async function init() {
  options = await (await api("/explorer/api/options")).json();
  const fill = (select, names) => select.replaceChildren(...names.map((n) => new Option(n, n)));
  fill($("hardware"), options.hardware);
  fill($("model"), Object.keys(options.models));
  const d = options.defaults;
  $("hardware").value = d.hardware;
  $("model").value = d.model;
  $("burst-long-tokens").value = String(options.burst_defaults.long_prompt_tokens);
  if (options.default_mode) $("burst-mode").options[0].textContent = `deployment default (${options.default_mode})`;
  $("long32k").addEventListener("change", toggleLong); // before the re-run below reads the controls
  for (const el of document.querySelectorAll("#controls input, #controls select")) {
    el.addEventListener(el.type === "range" ? "input" : "change", schedulePlayground);
  }
  $("burst-form").addEventListener("submit", sendBurst);
  for (const tab of document.querySelectorAll(".tab")) tab.addEventListener("click", () => show(tab.dataset.view));
  updateControls();
  runPlayground();
  show(location.hash === "#live" ? "live" : "playground");
}

init();
