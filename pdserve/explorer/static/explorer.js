// pdserve explorer: the playground (the simulator, on the server) and the live view (a deployment).
// Plain DOM and hand-drawn SVG; every number comes from the server's JSON endpoints.
"use strict";

const $ = (id) => document.getElementById(id);
const SVG_NS = "http://www.w3.org/2000/svg";
const chunkOf = (index) => 2 ** index; // the chunk-size slider moves in powers of two
const fmt = (v, digits = 1) => (Number.isFinite(v) ? v.toFixed(digits) : "–");
const plural = (n, one, many = `${one}s`) => `${n} ${n === 1 ? one : many}`;

// The labels on the page, by the key the server names in its messages.
const LABELS = {
  hardware: "Hardware",
  model: "Model",
  tp: "Tensor parallel",
  mode: "Architecture",
  instances: "Instances",
  prefill: "Prefill (P)",
  decode: "Decode (D)",
  prompt_len: "Prompt length",
  chunk_size: "Chunk size",
  chunking: "Chunked prefill",
  num_decodes: "Concurrent decodes",
  itl_target_ms: "ITL target",
  body: "Settings",
};
const BURST_LABELS = {
  mode: "Mode",
  streams: "Streams",
  long_prompts: "Long prompts",
  long_prompt_tokens: "Long prompt tokens",
  long_prompt_delay_s: "Long prompt delay",
  body: "Burst",
};

// A server message ("chunk_size: ...") in the page's words ("Chunk size: ..."), every key replaced by its label.
function inPageWords(message, field, labels) {
  let text = String(message);
  const keys = Object.keys(labels).filter((k) => k.includes("_")).sort((a, b) => b.length - a.length);
  if (field && labels[field] && text.startsWith(`${field}:`)) text = labels[field] + text.slice(field.length);
  else if (field && labels[field]) text = `${labels[field]}: ${text}`;
  for (const key of keys) text = text.replace(new RegExp(`\\b${key}\\b`, "g"), labels[key].toLowerCase());
  return text;
}

// A number field's value, or an error naming its label (empty or typed-over fields are not zero).
function wholeNumber(input, label) {
  const raw = input.value.trim();
  const low = Number(input.min);
  const high = input.max === "" ? Infinity : Number(input.max);
  const range = Number.isFinite(high) ? `from ${low} to ${high}` : `of at least ${low}`;
  if (input.validity.badInput || raw === "" || !Number.isInteger(Number(raw))) {
    throw new FieldError(`${label}: enter a whole number ${range}`);
  }
  const value = Number(raw);
  if (value < low || value > high) throw new FieldError(`${label}: must be ${range}, got ${value}`);
  return value;
}

class FieldError extends Error {}

let options = null;

// ---- views -------------------------------------------------------------------------------------

function show(view) {
  for (const tab of document.querySelectorAll(".tab")) {
    tab.classList.toggle("active", tab.dataset.view === view);
    tab.setAttribute("aria-selected", String(tab.dataset.view === view));
  }
  $("playground").hidden = view !== "playground";
  $("live").hidden = view !== "live";
  if (view === "live") startLive();
  else stopLive();
  history.replaceState(null, "", "#" + view);
}

// ---- playground ----------------------------------------------------------------------------------

let pgSeq = 0; // the newest run asked for; answers to older ones are dropped (never drawn)
let pgTimer = null;
let lastData = null; // the drawn run
let previousData = null; // the run drawn before it (the trade-off sentence compares the two)

function playgroundSettings() {
  const long = $("long32k").checked;
  const colocated = $("mode").value === "colocated";
  const shown = (id, on) => (on ? wholeNumber($(id), LABELS[id]) : 1); // a hidden field is not this run's
  return {
    hardware: $("hardware").value,
    model: $("model").value,
    tp: Number($("tp").value),
    mode: $("mode").value,
    instances: shown("instances", colocated),
    prefill: shown("prefill", !colocated),
    decode: shown("decode", !colocated),
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
  const long = $("long32k").checked;
  $("prompt_len").disabled = long;
  $("chunking").disabled = long;
  const chunk = chunkOf(Number($("chunk_size").value));
  const chunking = long ? false : $("chunking").checked;
  $("prompt_len-out").textContent = `${long ? 32768 : $("prompt_len").value} tokens`;
  $("chunk_size-out").textContent = chunking ? `${chunk} tokens` : `${chunk} (off)`;
  $("num_decodes-out").textContent = $("num_decodes").value;
  $("itl_target_ms-out").textContent = `${$("itl_target_ms").value} ms`;
  const colocated = $("mode").value === "colocated";
  for (const el of document.querySelectorAll(".colocated-only")) el.hidden = !colocated;
  for (const el of document.querySelectorAll(".disagg-only")) el.hidden = colocated;
  if (sweepData) $("sweep").dataset.state = "stale";
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

async function postJson(url, body) {
  const response = await api(url, {
    method: "POST",
    headers: { "content-type": "application/json" },
    body: JSON.stringify(body),
  });
  return { response, body: await response.json() };
}

async function runPlayground() {
  const seq = ++pgSeq;
  const section = $("playground");
  let settings;
  try {
    settings = playgroundSettings();
  } catch (e) {
    if (!(e instanceof FieldError)) throw e;
    playgroundError(e.message);
    return;
  }
  section.dataset.state = "loading";
  section.setAttribute("aria-busy", "true");
  let answer;
  try {
    answer = await postJson("/explorer/api/playground", settings);
  } catch (e) {
    if (seq === pgSeq) playgroundError(`The server did not answer (${e})`);
    return;
  }
  if (seq !== pgSeq) return; // a newer run was asked for meanwhile
  const { response, body } = answer;
  if (!response.ok) {
    const error = body.error || {};
    playgroundError(error.message ? inPageWords(error.message, error.field, LABELS) : `HTTP ${response.status}`);
    return;
  }
  previousData = lastData;
  lastData = body;
  step = null;
  drawPlayground(body);
  $("pg-error").hidden = true;
  section.dataset.state = "ready";
  section.dataset.seq = String(seq);
  section.removeAttribute("aria-busy");
}

function playgroundError(message) {
  const section = $("playground");
  ++pgSeq; // an answer still on its way is older than this message
  $("pg-error").textContent = message;
  $("pg-error").hidden = false;
  for (const id of ["fig-stall", "fig-ttft", "fig-over", "fig-throughput"]) {
    setFigure(id, null, "–");
    $(`${id}-other`).textContent = "";
  }
  $("pg-timelines").replaceChildren();
  $("pg-caption").textContent = "";
  $("pg-command").textContent = "";
  $("pg-elapsed").textContent = "";
  $("step-detail").textContent = "";
  $("assumptions").textContent = "";
  lastData = null;
  pause();
  section.dataset.state = "error";
  section.dataset.errors = String(Number(section.dataset.errors || 0) + 1); // messages shown so far
  section.removeAttribute("aria-busy");
}

function setFigure(id, value, text) {
  const el = $(id);
  el.textContent = text;
  if (value === null) delete el.dataset.value;
  else el.dataset.value = String(value);
}

const stallRatio = (data) => {
  const [a, b] = data.runs.map((r) => r.figures.worst_decode_stall_ms);
  const [off, on] = data.runs[0].chunked ? [b, a] : [a, b];
  return on > 0 ? off / on : NaN;
};

function drawPlayground(data) {
  const [main, other] = data.runs;
  const f = main.figures;
  const g = other.figures;
  const tag = other.label;
  const ratio = stallRatio(data);
  setFigure("fig-stall", f.worst_decode_stall_ms, `${fmt(f.worst_decode_stall_ms)} ms`);
  setFigure("fig-ttft", f.long_prompt_ttft_ms, `${fmt(f.long_prompt_ttft_ms, 0)} ms`);
  setFigure("fig-over", f.steps_over_target, `${f.steps_over_target} of ${f.steps_in_window}`);
  setFigure("fig-throughput", f.decode_throughput_tok_s, `${fmt(f.decode_throughput_tok_s, 0)} tok/s`);
  setFigure("fig-ratio", Number.isFinite(ratio) ? ratio : null, `${fmt(ratio, 1)}×`);
  $("fig-stall-other").textContent = `${tag}: ${fmt(g.worst_decode_stall_ms)} ms`;
  $("fig-ttft-other").textContent = `${tag}: ${fmt(g.long_prompt_ttft_ms, 0)} ms`;
  $("fig-over-other").textContent = `${tag}: ${g.steps_over_target} of ${g.steps_in_window}`;
  $("fig-throughput-other").textContent = `${tag}: ${fmt(g.decode_throughput_tok_s, 0)} tok/s`;
  const chunked = main.chunked ? main : other;
  $("fig-ratio-other").textContent = `chunking off ÷ ${chunked.label}`;
  $("pg-command").textContent = data.command;
  $("pg-elapsed").textContent = `(${data.cost_model}; ran in ${fmt(data.elapsed_s * 1000, 0)} ms)`;
  drawTimelines(data);
  $("pg-caption").textContent = caption(data, previousData);
  $("assumptions").textContent = assumptions(data);
  const lesson = isLessonScenario(data.settings);
  $("lesson-note").hidden = !lesson;
  $("lesson-hint").hidden = lesson;
  selectStep(0, firstWindowStep(0));
}

// ---- the timelines of the two runs, drawn to the box's pixel width ----------------------------------------

let timelineBars = [[], []]; // per run: the flat step list and its bar elements, for the step-through

function drawTimelines(data) {
  const target = data.settings.itl_target_ms;
  const scale = $("y-scale").value;
  let x0 = Infinity;
  let x1 = -Infinity;
  const peaks = data.runs.map((run) => {
    let peak = target * 1.25;
    for (const inst of run.instances) {
      for (const s of inst.steps) {
        x0 = Math.min(x0, s[0]);
        x1 = Math.max(x1, s[0] + s[1]);
        peak = Math.max(peak, s[1]);
      }
    }
    return peak;
  });
  const shared = Math.max(...peaks);
  const width = Math.max(560, Math.floor($("pg-timelines").clientWidth - 32)); // inside the box's padding
  timelineBars = [[], []];
  const boxes = data.runs.map((run, r) => {
    const box = document.createElement("div");
    box.className = "run";
    box.dataset.run = r === 0 ? "main" : "other";
    box.dataset.chunked = String(run.chunked);
    const title = document.createElement("h3");
    title.textContent = `${r === 0 ? "As set" : "For comparison"}: ${run.label}, ${run.architecture}`;
    box.append(title);
    for (const inst of run.instances) {
      const head = document.createElement("div");
      head.className = "instance";
      head.textContent = `${inst.name} (${inst.role})`;
      const scroll = document.createElement("div");
      scroll.className = "scroll";
      const { root, bars } = timeline(inst.steps, {
        x0,
        x1,
        ymax: scale === "per-row" ? peaks[r] : shared,
        scale: scale === "log" ? "log" : "linear",
        target,
        window: run.window_ms,
        marks: [
          { t: run.arrival_ms, label: "long prompt arrives", cls: "arrival" },
          { t: run.first_token_ms, label: "its first token", cls: "first-token" },
        ],
        kinds: inst.kinds,
        name: inst.name,
        label: `${run.label}, ${inst.name}`,
        width,
        onSelect: (i) => {
          const flat = timelineBars[r].findIndex((b) => b.inst === inst && b.i === i);
          selectStep(r, flat);
        },
      });
      inst.steps.forEach((s, i) => timelineBars[r].push({ run, inst, i, s, bar: bars[i] }));
      scroll.append(root);
      box.append(head, scroll);
    }
    timelineBars[r].sort((a, b) => a.s[0] - b.s[0] || a.inst.name.localeCompare(b.inst.name));
    return box;
  });
  $("pg-timelines").replaceChildren(...boxes);
  for (const scroll of $("pg-timelines").querySelectorAll(".scroll")) {
    const focus = Number(scroll.firstChild.dataset.focusX); // narrow screens: start at the long prompt's arrival
    if (scroll.scrollWidth > scroll.clientWidth) scroll.scrollLeft = focus - scroll.clientWidth * 0.2;
  }
  $("scale-note").textContent = {
    shared: "Bar height: step time, on one linear scale for both rows.",
    "per-row": "Bar height: step time, each row on its own linear scale (its own y-axis values).",
    log: "Bar height: step time on a logarithmic scale (1 ms to the peak); the colours split each bar in proportion.",
  }[scale];
}

function svg(tag, attrs = {}) {
  const el = document.createElementNS(SVG_NS, tag);
  for (const [k, v] of Object.entries(attrs)) el.setAttribute(k, String(v));
  return el;
}

function text(x, y, content, attrs = {}) {
  const t = svg("text", { x, y, ...attrs });
  t.textContent = content;
  return t;
}

function niceStep(span, count) {
  const raw = span / Math.max(count, 1);
  const p = 10 ** Math.floor(Math.log10(raw));
  for (const m of [1, 2, 2.5, 5, 10]) if (m * p >= raw) return m * p;
  return 10 * p;
}

// steps: [start, duration ms, prefill ms, decode ms, prefill tokens, decode tokens]; x in the unit of start.
// Drawn at `width` pixels (the SVG's user units are pixels, so its text keeps its size on any screen).
function timeline(steps, opts) {
  const { x0, x1, ymax, scale = "linear", target = null, window = null, marks = [], kinds = null } = opts;
  const { label, name, xUnit = "ms", width = 800, onSelect = null } = opts;
  const W = width;
  const H = 170;
  const left = 48;
  const right = 12;
  const top = 22;
  const bottom = 34;
  const plotW = W - left - right;
  const plotH = H - top - bottom;
  const span = Math.max(x1 - x0, 1e-9);
  const xs = (t) => left + ((t - x0) / span) * plotW;
  const floor = 1; // the log scale starts at 1 ms
  const ys =
    scale === "log"
      ? (ms) => (ms <= floor ? 0 : (Math.log10(ms / floor) / Math.log10(Math.max(ymax, floor * 10) / floor)) * plotH)
      : (ms) => (ms / ymax) * plotH;
  const base = top + plotH;
  const root = svg("svg", { width: W, height: H, viewBox: `0 0 ${W} ${H}`, class: "timeline", "data-instance": name });
  root.dataset.x0 = String(x0);
  root.dataset.x1 = String(x1);
  root.dataset.scale = scale;
  root.dataset.focusX = String(marks.length ? xs(marks[0].t) : 0);
  root.setAttribute("role", "img");
  root.setAttribute("aria-label", `${label}: ${steps.length} steps`);
  // y axis: values in ms
  const ticks = [];
  if (scale === "log") for (let v = 1; v <= ymax * 1.0001; v *= 10) ticks.push(v);
  else for (let v = 0, d = niceStep(ymax, 4); v <= ymax * 1.0001; v += d) ticks.push(v);
  for (const v of ticks) {
    const y = base - ys(v);
    root.append(svg("line", { class: "grid", x1: left, x2: left + plotW, y1: y, y2: y }));
    root.append(text(left - 4, y + 4, fmt(v, v < 10 && v % 1 ? 1 : 0), { "text-anchor": "end" }));
  }
  root.append(text(4, top - 6, "ms", { class: "unit" }));
  if (window) {
    const [w0, w1] = window;
    root.append(svg("rect", { class: "window", x: xs(w0), y: top, width: Math.max(xs(w1) - xs(w0), 1), height: plotH }));
  }
  const bars = [];
  steps.forEach((s, i) => {
    const [start, ms, prefillMs, , prefillTokens, decodeTokens] = s;
    const kind = kinds ? kinds[i] : prefillTokens ? "long" : "decode";
    const x = xs(start);
    const w = Math.max(((xUnit === "s" ? ms / 1000 : ms) / span) * plotW - 0.6, 1.5);
    const bar = svg("g", { class: `bar ${kind}`, "data-ms": ms, "data-kind": kind });
    const h = Math.max(ys(ms), 1.5); // the shortest step stays visible
    const hp = ms > 0 ? (h * prefillMs) / ms : 0;
    const hd = h - hp;
    if (hd > 0) bar.append(svg("rect", { class: "step decode", x, y: base - hd, width: w, height: hd }));
    if (hp > 0) {
      bar.append(svg("rect", { class: `step prefill ${kind}`, x, y: base - hd - hp, width: w, height: hp }));
    }
    bar.append(svg("rect", { class: "hit", x: x - 1, y: top, width: w + 2, height: plotH }));
    const tip = svg("title");
    tip.textContent = `${fmt(ms)} ms: ${prefillTokens} prefill + ${decodeTokens} decode tokens`;
    bar.append(tip);
    if (onSelect) bar.addEventListener("click", () => onSelect(i));
    root.append(bar);
    bars.push(bar);
  });
  root.append(svg("line", { class: "axis", x1: left, x2: left + plotW, y1: base, y2: base }));
  root.append(svg("line", { class: "axis", x1: left, x2: left, y1: top, y2: base }));
  // x axis: a few times, and the marks (arrival, first token)
  const d = niceStep(span, Math.max(2, Math.floor(plotW / 110)));
  for (let t = Math.ceil(x0 / d) * d; t <= x1 + 1e-9; t += d) {
    if (xs(t) > left + plotW - 24) break; // no label cut off at the right edge
    root.append(svg("line", { class: "axis", x1: xs(t), x2: xs(t), y1: base, y2: base + 4 }));
    const value = xUnit === "s" ? `${fmt(t, d < 1 ? 1 : 0)} s` : `${fmt(t, 0)} ms`;
    root.append(text(xs(t), base + 16, value, { "text-anchor": "middle" }));
  }
  marks.forEach((m, k) => {
    const x = xs(m.t);
    root.append(svg("line", { class: `mark ${m.cls}`, x1: x, x2: x, y1: top - 4, y2: base + 4 }));
    const anchor = x > left + plotW - 140 ? "end" : "start"; // the first mark under the axis, the second above the plot
    const attrs = { class: `mark-label ${m.cls}`, "text-anchor": anchor };
    root.append(text(x + (anchor === "end" ? -3 : 3), k === 0 ? H - 3 : top - 6, m.label, attrs));
  });
  if (target !== null && target <= ymax) {
    const y = base - ys(target);
    root.append(svg("line", { class: "target", x1: left, x2: left + plotW, y1: y, y2: y }));
    root.append(text(left + plotW - 4, y - 4, `ITL target ${target} ms`, { "text-anchor": "end", class: "target-label" }));
  }
  if (xUnit === "s") root.append(text(left + plotW, top - 6, "now", { "text-anchor": "end" }));
  return { root, bars };
}

// ---- step-through ---------------------------------------------------------------------------------------------

let step = null; // {run, index} into timelineBars
let playTimer = null;

function firstWindowStep(run) {
  const list = timelineBars[run];
  const i = list.findIndex((b) => b.s[0] >= -1e-6);
  return i < 0 ? 0 : i;
}

function selectStep(run, index) {
  const list = timelineBars[run];
  if (!list || !list.length) return;
  const clamped = Math.max(0, Math.min(list.length - 1, index));
  if (step) {
    const old = timelineBars[step.run][step.index];
    if (old) old.bar.classList.remove("current");
  }
  step = { run, index: clamped };
  const b = list[clamped];
  b.bar.classList.add("current");
  const scroller = b.bar.closest(".scroll");
  if (scroller && scroller.scrollWidth > scroller.clientWidth) {
    const box = b.bar.getBBox();
    if (box.x < scroller.scrollLeft + 10 || box.x + Math.min(box.width, 40) > scroller.scrollLeft + scroller.clientWidth - 10) {
      scroller.scrollLeft = box.x - scroller.clientWidth / 2;
    }
  }
  $("step-detail").replaceChildren(...stepDetail(b, clamped, list.length));
  $("step-through").dataset.step = String(clamped);
  $("step-through").dataset.run = String(run);
  $("step-prev").disabled = clamped === 0;
  $("step-next").disabled = clamped === list.length - 1;
  if (clamped === list.length - 1) pause();
}

function moveStep(delta) {
  if (!step) return;
  selectStep(step.run, step.index + delta);
}

function play() {
  if (!step) return;
  if (step.index === timelineBars[step.run].length - 1) selectStep(step.run, 0);
  $("step-play").textContent = "Pause";
  $("step-play").setAttribute("aria-pressed", "true");
  clearInterval(playTimer);
  playTimer = setInterval(() => moveStep(1), 700);
}

function pause() {
  clearInterval(playTimer);
  playTimer = null;
  $("step-play").textContent = "Play";
  $("step-play").setAttribute("aria-pressed", "false");
}

function stepKeys(event) {
  const keys = { ArrowRight: 1, ArrowDown: 1, ArrowLeft: -1, ArrowUp: -1 };
  if (event.key in keys) moveStep(keys[event.key]);
  else if (event.key === "Home" && step) selectStep(step.run, 0);
  else if (event.key === "End" && step) selectStep(step.run, timelineBars[step.run].length - 1);
  else if (event.key === " " || event.key === "k") playTimer ? pause() : play();
  else return;
  event.preventDefault();
}

// What one step carried and who waited for it, in words (a list of lines).
function stepDetail(b, index, count) {
  const { run, inst, i, s } = b;
  const [start, ms, prefillMs, decodeMs, prefillTokens, decodeTokens] = s;
  const kind = inst.kinds[i];
  const target = lastData.settings.itl_target_ms;
  const when =
    start < -1e-6
      ? `${fmt(-start, 1)} ms before the long prompt arrived`
      : `${fmt(start, 1)} to ${fmt(start + ms, 1)} ms after the long prompt arrived`;
  const lines = [`Step ${index + 1} of ${count} (${run.label}) on ${inst.name}, ${when}.`];
  let carried;
  if (kind === "long") {
    const mine = inst.steps.slice(0, i + 1).filter((_, k) => inst.kinds[k] === "long");
    const through = mine.reduce((n, t) => n + t[4], 0);
    const chunks = run.chunked ? Math.ceil(run.prompt_len / lastData.settings.chunk_size) : 1;
    carried =
      chunks === 1
        ? `the whole long prompt (${prefillTokens} tokens)`
        : `${prefillTokens} tokens of the long prompt (chunk ${mine.length} of ${chunks}: tokens ${through - prefillTokens + 1}–${through} of ${run.prompt_len})`;
  } else if (kind === "warmup") {
    carried = `${prefillTokens} tokens of the streams' own prompts (their warm-up, before the long prompt arrived)`;
  } else {
    carried = "no prefill";
  }
  carried += decodeTokens ? ` and ${plural(decodeTokens, "decode token")} (one for each stream in the step).` : ", and no decode tokens.";
  lines.push(`Carries ${carried}`);
  const bound = inst.bound ? inst.bound[i] : null;
  let time = prefillTokens
    ? `Took ${fmt(ms)} ms: about ${fmt(prefillMs)} ms of it prefill work and ${fmt(decodeMs)} ms decode work`
    : `Took ${fmt(ms)} ms, all of it decode work`;
  if (bound) {
    const [compute, memory] = bound;
    time += `; the cost model's matmuls take ${fmt(compute)} ms and its memory reads ${fmt(memory)} ms, so it is ${compute >= memory ? "compute-bound" : "memory-bound"}`;
  }
  lines.push(`${time}.`);
  let waited;
  if (decodeTokens) {
    const verdict = ms > target ? `over the ${target} ms ITL target` : `within the ${target} ms ITL target`;
    waited = `Each of these ${plural(decodeTokens, "stream")} waited ${fmt(ms)} ms for this token, ${verdict}.`;
  } else {
    waited = "No stream waited on this step (the streams decode elsewhere, or had not started).";
  }
  if (kind === "long" && start + ms < run.first_token_ms - 1e-6) waited += " The long prompt is still waiting for its first token.";
  if (kind === "long" && start + ms >= run.first_token_ms - 1e-6) waited += " This step makes the long prompt's first token.";
  lines.push(waited);
  return lines.map((line) => {
    const p = document.createElement("p");
    p.textContent = line;
    return p;
  });
}

// ---- the words under the timelines ------------------------------------------------------------------------------

function longSteps(run) {
  const out = [];
  for (const inst of run.instances) inst.steps.forEach((s, i) => inst.kinds[i] === "long" && out.push({ inst, s, i }));
  return out;
}

function caption(data, previous) {
  const [main, other] = data.runs;
  const st = data.settings;
  const f = main.figures;
  const target = st.itl_target_ms;
  const parts = [];
  const long = longSteps(main);
  const streams = plural(st.num_decodes, "stream");
  const where = long.length ? long[0].inst.name : "one instance";
  const withDecodes = long.filter((l) => l.s[5] > 0);
  if (main.chunked) {
    parts.push(
      `The ${st.prompt_len}-token prompt arrived while ${streams} were decoding; with chunk ${st.chunk_size} it took ${plural(long.length, "step")} on ${where}, and its first token came ${fmt(f.long_prompt_ttft_ms, 0)} ms after it arrived.`,
    );
  } else {
    parts.push(
      `The ${st.prompt_len}-token prompt arrived while ${streams} were decoding; with chunking off it went through in one step on ${where}, and its first token came ${fmt(f.long_prompt_ttft_ms, 0)} ms after it arrived.`,
    );
  }
  if (withDecodes.length) {
    const share = withDecodes.reduce((n, l) => n + l.s[2], 0) / withDecodes.reduce((n, l) => n + l.s[1], 0);
    const decodes = Math.max(...withDecodes.map((l) => l.s[5]));
    parts.push(
      `${withDecodes.length === 1 ? "That step" : "Each of those steps"} also carried a decode token for ${plural(decodes, "stream")}; prefill was about ${fmt(100 * share, 0)}% of ${withDecodes.length === 1 ? "its" : "their"} time, decode the rest.`,
    );
  } else if (long.length) {
    parts.push(`No decode shared a step with the prompt: the streams decode on other instances, so their steps stay short.`);
  }
  const windowMax = Math.max(0, ...main.instances.flatMap((inst) => inst.steps.filter((s) => s[0] >= -1e-6 && s[0] < main.first_token_ms && s[5] > 0).map((s) => s[1])));
  if (f.steps_over_target) {
    const why = main.chunked
      ? `each carried a ${st.chunk_size}-token chunk next to the decodes, and the chunk's prefill work made the step longer than the target`
      : "it carried the whole prompt";
    parts.push(
      `${f.steps_over_target} of ${f.steps_in_window} steps went over the ${target} ms ITL target (the longest ${fmt(windowMax)} ms): ${why}. The worst decode stall was ${fmt(f.worst_decode_stall_ms)} ms.`,
    );
  } else {
    parts.push(
      `None of the ${f.steps_in_window} steps went over the ${target} ms ITL target; the worst decode stall was ${fmt(f.worst_decode_stall_ms)} ms.`,
    );
  }
  const g = other.figures;
  const ratio = stallRatio(data);
  const off = main.chunked ? other : main;
  if (!longSteps(off).some((l) => l.s[5] > 0)) {
    const chunkedTtft = (main.chunked ? f : g).long_prompt_ttft_ms;
    const offTtft = (main.chunked ? g : f).long_prompt_ttft_ms;
    parts.push(
      `With chunking ${main.chunked ? "off" : "on"} (the lower row) the worst stall is ${fmt(g.worst_decode_stall_ms)} ms: chunking hardly changes it here, because the prompt never shares a step with the streams. It only moves the first token, ${fmt(Math.abs(chunkedTtft - offTtft), 0)} ms ${chunkedTtft >= offTtft ? "later" : "sooner"} when chunked.`,
    );
  } else if (main.chunked) {
    parts.push(
      `With chunking off (the lower row), one ${fmt(g.worst_decode_stall_ms, 0)} ms step freezes all ${streams} at once: a stall ${fmt(ratio, 1)}× this one, though its first token comes ${fmt(f.long_prompt_ttft_ms - g.long_prompt_ttft_ms, 0)} ms sooner.`,
    );
  } else {
    parts.push(
      `With chunking off, one ${fmt(f.worst_decode_stall_ms, 0)} ms step freezes all ${streams}. Chunked at ${st.chunk_size} (the lower row), the worst stall is ${fmt(g.worst_decode_stall_ms)} ms (${fmt(ratio, 1)}× lower) and the first token comes ${fmt(g.long_prompt_ttft_ms - f.long_prompt_ttft_ms, 0)} ms later.`,
    );
  }
  const shared = data.runs.some((run) => longSteps(run).some((l) => l.s[5] > 0));
  parts.push(shared ? tradeoff(data, previous) : "With the prompt on its own prefill instance, the chunk size only trades its TTFT (more, smaller steps take longer) against how long it holds that instance per step.");
  return parts.join(" ");
}

// The trade-off, compared with the previous run when only the chunk size moved.
function tradeoff(data, previous) {
  const general =
    "The trade-off: a smaller chunk puts less prefill in each step, so the worst stall drops, but the prompt needs more steps, each paying the fixed step cost and reading the weights again, so its first token comes later.";
  if (!previous || !previous.runs[0].chunked || !data.runs[0].chunked) return general;
  const same = Object.keys(data.settings).every((k) => k === "chunk_size" || data.settings[k] === previous.settings[k]);
  const [was, now] = [previous.settings.chunk_size, data.settings.chunk_size];
  if (!same || was === now) return general;
  const a = previous.runs[0].figures;
  const b = data.runs[0].figures;
  const stall = b.worst_decode_stall_ms < a.worst_decode_stall_ms ? "lower" : "higher";
  const ttft = b.long_prompt_ttft_ms > a.long_prompt_ttft_ms ? "later" : "sooner";
  return `From chunk ${was} to ${now}: the worst stall went from ${fmt(a.worst_decode_stall_ms)} to ${fmt(b.worst_decode_stall_ms)} ms (${stall}) and the first token from ${fmt(a.long_prompt_ttft_ms, 0)} to ${fmt(b.long_prompt_ttft_ms, 0)} ms (${ttft}). ${general}`;
}

function assumptions(data) {
  const a = data.assumptions;
  if (!a || a.kind !== "roofline") {
    return `Cost model: ${a ? a.name : data.cost_model}, a step-time fit of pdserve's own engine measured on this machine (pdserve sim --calibrate), not a GPU roofline.`;
  }
  const steps = data.runs[0].instances.flatMap((inst) => inst.steps.map((s, i) => ({ s, kind: inst.kinds[i], bound: inst.bound[i] })));
  const prefill = steps.filter((x) => x.kind === "long");
  const computeBound = prefill.filter((x) => x.bound && x.bound[0] >= x.bound[1]).length;
  const decodeOnly = steps.filter((x) => x.kind === "decode" && x.s[5] > 0);
  const memoryBound = decodeOnly.filter((x) => x.bound && x.bound[1] > x.bound[0]).length;
  let text =
    `Cost model: a roofline of ${a.model} (${fmt(a.params_b, 1)} B parameters, ${8 * a.dtype_bytes}-bit weights) on ${a.tp} × ${a.hardware}. ` +
    `Matmuls run at ${fmt(a.peak_tflops, 0)} TFLOP/s × ${fmt(100 * a.mfu, 0)}% MFU; weights and KV are read at ${fmt(a.mem_bw_tb_s, 2)} TB/s × ${fmt(100 * a.bw_efficiency, 0)}%; ` +
    `each kernel takes ${a.combine === "max" ? "the larger of the two" : a.combine === "sum" ? "the sum of the two" : "√(compute² + memory²) of the two (a roofline with a soft knee)"}, plus ${fmt(a.step_overhead_ms, 1)} ms a step and ${fmt(a.seq_overhead_us, 0)} µs a sequence (scheduling, launch, sampling). ` +
    `In this run the steps with a chunk of the long prompt are compute-bound (${computeBound} of ${prefill.length}) and the decode-only steps memory-bound (${memoryBound} of ${decodeOnly.length}).`;
  if (prefill.length && computeBound === prefill.length) {
    text +=
      a.combine === "max"
        ? " So a GPU with more memory bandwidth but the same FLOP/s (H200 against H100: both 989 TFLOP/s) cannot change the prefill steps, the worst stall or the TTFT; only the decode-only steps get shorter."
        : " So a GPU with more memory bandwidth but the same FLOP/s (H200 against H100: both 989 TFLOP/s) changes the prefill steps, the worst stall and the TTFT only a little (the soft knee still adds some of the memory time); the decode-only steps get shorter in proportion.";
  }
  return text;
}

function isLessonScenario(st) {
  return (
    st.prompt_len === 8192 && st.chunk_size === 1024 && st.chunking && st.num_decodes === 24 && st.itl_target_ms === 50
  );
}

// ---- the chunk-size sweep -----------------------------------------------------------------------------------------

let sweepData = null;

async function runSweep() {
  let settings;
  try {
    settings = playgroundSettings();
  } catch (e) {
    if (!(e instanceof FieldError)) throw e;
    sweepError(e.message);
    return;
  }
  const section = $("sweep");
  section.dataset.state = "loading";
  $("sweep-run").disabled = true;
  $("sweep-status").textContent = "running 7 chunk sizes…";
  try {
    const { response, body } = await postJson("/explorer/api/sweep", settings);
    if (!response.ok) {
      const error = body.error || {};
      sweepError(error.message ? inPageWords(error.message, error.field, LABELS) : `HTTP ${response.status}`);
      return;
    }
    sweepData = body;
    drawSweep(body);
    $("sweep-error").hidden = true;
    section.dataset.state = "ready";
  } catch (e) {
    sweepError(`The server did not answer (${e})`);
  } finally {
    $("sweep-run").disabled = false;
  }
}

function sweepError(message) {
  $("sweep-error").textContent = message;
  $("sweep-error").hidden = false;
  $("sweep-status").textContent = "";
  $("sweep-chart").replaceChildren();
  $("sweep-table").tBodies[0].replaceChildren();
  $("sweep").dataset.state = "error";
}

function drawSweep(data) {
  const target = data.settings.itl_target_ms;
  const points = data.points.filter((p) => !("skipped" in p));
  const knee = data.knee_chunk_size;
  $("sweep-status").textContent =
    (knee ? `Knee for the ${target} ms target: chunk ${knee}.` : `No chunk size meets the ${target} ms target here.`) +
    ` (${data.settings.prompt_len}-token prompt, ${data.settings.num_decodes} decodes; ran in ${fmt(data.elapsed_s, 1)} s)` +
    (points.length < data.points.length
      ? ` ${plural(data.points.length - points.length, "chunk size")} skipped, past the page's work limit: run them with pdserve sim.`
      : "");
  const rows = data.points.map((p) => {
    const tr = document.createElement("tr");
    tr.dataset.chunk = String(p.chunk_size);
    if (p.chunk_size === knee) tr.className = "knee";
    const cells =
      "skipped" in p
        ? [p.chunk_size, "skipped: over the page's work limit", "", "", ""]
        : [p.chunk_size, fmt(p.p99_itl_ms), fmt(p.worst_decode_stall_ms), fmt(p.prefill_throughput_tok_s, 0), fmt(p.long_prompt_ttft_ms, 0)];
    tr.replaceChildren(
      ...cells.map((v, i) => {
        const td = document.createElement("td");
        td.textContent = String(v);
        if (i === 1 && "skipped" in p) td.colSpan = 4;
        return td;
      }),
    );
    return tr;
  });
  $("sweep-table").tBodies[0].replaceChildren(...rows);
  if (!points.length) {
    $("sweep-chart").replaceChildren();
    return;
  }
  const W = Math.max(360, Math.min(760, Math.floor($("sweep").clientWidth - 2)));
  const H = 280;
  const left = 56;
  const right = 16;
  const top = 16;
  const bottom = 40;
  const xMin = Math.min(...points.map((p) => p.prefill_throughput_tok_s)) * 0.95;
  const xMax = Math.max(...points.map((p) => p.prefill_throughput_tok_s)) * 1.03;
  const yMax = Math.max(target * 1.3, ...points.map((p) => p.p99_itl_ms)) * 1.05;
  const xs = (v) => left + ((v - xMin) / (xMax - xMin || 1)) * (W - left - right);
  const ys = (v) => top + (1 - v / yMax) * (H - top - bottom);
  const root = svg("svg", { width: W, height: H, viewBox: `0 0 ${W} ${H}`, class: "sweep-chart" });
  root.setAttribute("role", "img");
  root.setAttribute("aria-label", "p99 ITL against prefill throughput, one point per chunk size");
  for (let v = 0, d = niceStep(yMax, 5); v <= yMax; v += d) {
    root.append(svg("line", { class: "grid", x1: left, x2: W - right, y1: ys(v), y2: ys(v) }));
    root.append(text(left - 4, ys(v) + 4, fmt(v, 0), { "text-anchor": "end" }));
  }
  for (let v = Math.ceil(xMin / niceStep(xMax - xMin, 4)) * niceStep(xMax - xMin, 4); v <= xMax; v += niceStep(xMax - xMin, 4)) {
    root.append(text(xs(v), H - bottom + 16, `${fmt(v / 1000, 0)}k`, { "text-anchor": "middle" }));
  }
  root.append(text(left, top - 4, "p99 ITL (ms)", { class: "unit" }));
  root.append(text(W - right, H - 4, "prefill throughput (tokens/s)", { "text-anchor": "end", class: "unit" }));
  root.append(svg("line", { class: "axis", x1: left, x2: W - right, y1: ys(0), y2: ys(0) }));
  root.append(svg("line", { class: "axis", x1: left, x2: left, y1: top, y2: ys(0) }));
  root.append(svg("line", { class: "target", x1: left, x2: W - right, y1: ys(target), y2: ys(target) }));
  root.append(text(left + 4, ys(target) - 4, `ITL target ${target} ms`, { class: "target-label" }));
  root.append(svg("polyline", { class: "sweep-line", points: points.map((p) => `${xs(p.prefill_throughput_tok_s)},${ys(p.p99_itl_ms)}`).join(" ") }));
  for (const p of points) {
    const x = xs(p.prefill_throughput_tok_s);
    const y = ys(p.p99_itl_ms);
    const g = svg("g", { class: p.chunk_size === knee ? "point knee" : "point", "data-chunk": p.chunk_size });
    g.append(svg("circle", { cx: x, cy: y, r: p.chunk_size === knee ? 7 : 4 }));
    if (p.chunk_size === knee) g.append(text(x + 10, y + 18, `knee: chunk ${p.chunk_size}`));
    else g.append(text(x - 6, y - 9, String(p.chunk_size), { "text-anchor": "end" }));
    root.append(g);
  }
  $("sweep-chart").replaceChildren(root);
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
    $("live-error").hidden = true; // the refresh's own trouble only; a refused burst keeps its message
    $("live").dataset.state = "ready";
  } catch (e) {
    $("live-error").textContent = `Live view: ${e.message || e}`;
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

  let target = Number($("live-target").value);
  if (!Number.isFinite(target) || target <= 0) target = null;
  let ymax = target ? target * 1.25 : 1;
  for (const w of data.workers) for (const s of w.steps) ymax = Math.max(ymax, s[1]);
  const width = Math.max(560, Math.floor($("workers").clientWidth - 32));
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
    const scroll = document.createElement("div");
    scroll.className = "scroll";
    const { root } = timeline(w.steps, { x0: -data.window_s, x1: 0, ymax, target, label: `${w.id} (${w.role})`, name: w.id, xUnit: "s", width });
    scroll.append(root);
    card.append(head, scroll);
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

function burstError(message) {
  $("burst-error").textContent = message;
  $("burst-error").hidden = false;
}

async function sendBurst(event) {
  event.preventDefault();
  let body;
  try {
    body = {
      mode: $("burst-mode").value || null,
      streams: wholeNumber($("burst-streams"), BURST_LABELS.streams),
      long_prompts: wholeNumber($("burst-long"), BURST_LABELS.long_prompts),
      long_prompt_tokens: wholeNumber($("burst-long-tokens"), BURST_LABELS.long_prompt_tokens),
    };
  } catch (e) {
    if (!(e instanceof FieldError)) throw e;
    burstError(e.message);
    return;
  }
  try {
    const { response, body: answer } = await postJson("/explorer/api/burst", body);
    if (!response.ok) {
      const error = answer.error || {};
      burstError(error.message ? inPageWords(error.message, error.field, BURST_LABELS) : `HTTP ${response.status}`);
      return;
    }
    sentBurst = burstNumber(answer.id);
    $("burst-status").textContent = `${answer.id} [${answer.mode}]: ${answer.requests} requests sent`;
    $("burst-status").dataset.burst = answer.id;
    $("burst-status").dataset.state = "running";
    $("burst-error").hidden = true;
    pollLive();
  } catch (e) {
    burstError(`Send burst: the server did not answer (${e.message || e})`);
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
  $("y-scale").addEventListener("change", () => {
    if (!lastData) return;
    const at = step;
    drawTimelines(lastData);
    if (at) selectStep(at.run, at.index);
  });
  $("step-prev").addEventListener("click", () => moveStep(-1));
  $("step-next").addEventListener("click", () => moveStep(1));
  $("step-play").addEventListener("click", () => (playTimer ? pause() : play()));
  $("step-through").addEventListener("keydown", stepKeys);
  $("pg-timelines").addEventListener("keydown", stepKeys);
  $("sweep-run").addEventListener("click", runSweep);
  $("burst-form").addEventListener("submit", sendBurst);
  for (const tab of document.querySelectorAll(".tab")) tab.addEventListener("click", () => show(tab.dataset.view));
  let resizeTimer = null;
  window.addEventListener("resize", () => {
    clearTimeout(resizeTimer);
    resizeTimer = setTimeout(() => {
      if (lastData) {
        const at = step;
        drawTimelines(lastData);
        if (at) selectStep(at.run, at.index);
      }
      if (sweepData) drawSweep(sweepData);
    }, 200);
  });
  updateControls();
  runPlayground();
  show(location.hash === "#live" ? "live" : "playground");
}

init();
