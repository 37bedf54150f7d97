// minillm's live dashboard: polls /metrics (same origin), parses Prometheus' text format, keeps
// `window_s` seconds of scrapes and draws numbers and <canvas> charts. No library, no other origin.
"use strict";
const P = "minillm:";
const opts = {window: +document.body.dataset.windowS, poll: +document.body.dataset.pollMs,
              rate: +document.body.dataset.rateS};
const COLORS = ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf"];
// [{t: seconds, samples: [{name, labels, value}] or null, memo: {series key: value}}], oldest first.
// A scrape's plotted values are computed once (memo); its samples are kept only while a newer
// scrape's rate may still reach back to it (about rate_s), so a long window stays small.
const scrapes = [];
let polls = 0;

// ---- Prometheus' text format -> samples ---------------------------------------------------------
function parseLabels(text) {
  const out = {};
  const re = /([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"/g;
  let m;
  while ((m = re.exec(text)) !== null) {
    out[m[1]] = m[2].replace(/\\(.)/g, (_, c) => (c === "n" ? "\n" : c));
  }
  return out;
}

function parseMetrics(text) {
  const samples = [];
  for (const line of text.split("\n")) {
    if (!line || line[0] === "#") continue;
    const brace = line.indexOf("{");
    const space = brace >= 0 ? line.indexOf(" ", line.lastIndexOf("}")) : line.indexOf(" ");
    const name = line.slice(0, brace >= 0 ? brace : space);
    const labels = brace >= 0 ? parseLabels(line.slice(brace + 1, line.lastIndexOf("}"))) : {};
    const raw = line.slice(space + 1).trim().split(" ")[0];
    samples.push({name, labels, value: raw === "+Inf" ? Infinity : raw === "-Inf" ? -Infinity : parseFloat(raw)});
  }
  return samples;
}

// ---- reading a scrape ----------------------------------------------------------------------------
function matches(sample, name, want) {
  if (sample.name !== name) return false;
  for (const k in want) if (sample.labels[k] !== want[k]) return false;
  return true;
}

// The sum over every sample of `name` whose labels include `want`; null when there is none.
function value(samples, name, want = {}) {
  let sum = null;
  for (const s of samples) if (matches(s, name, want)) sum = (sum ?? 0) + s.value;
  return sum;
}

function labelValues(samples, name, label) {
  const seen = new Set();
  for (const s of samples) if (s.name === name && label in s.labels) seen.add(s.labels[label]);
  return [...seen].sort((a, b) => a.localeCompare(b, undefined, {numeric: true}));
}

// The scrape `rate_s` before the newest (the oldest one if none is that old).
function earlier(i) {
  let j = i;
  while (j > 0 && scrapes[i].t - scrapes[j].t < opts.rate) j--;
  return j === i ? null : scrapes[j];
}

function rate(i, name, want = {}) {
  const then = earlier(i), now = scrapes[i];
  if (!then || !then.samples) return null;
  const a = value(then.samples, name, want) ?? 0, b = value(now.samples, name, want) ?? 0;
  return (b >= a ? b - a : b) / (now.t - then.t);          // a counter that went back: restarted
}

// Prometheus' histogram_quantile over the bucket deltas between scrape i and `rate_s` before it.
function quantile(i, q, name) {
  const then = earlier(i), now = scrapes[i];
  if (!then || !then.samples) return null;
  const bucket = P + name + "_bucket", le = x => (x === "+Inf" ? Infinity : Number(x));
  const les = labelValues(now.samples, bucket, "le").map(le).sort((a, b) => a - b);
  const count = (samples, bound) => samples.reduce(
    (acc, x) => acc + (x.name === bucket && le(x.labels.le) === bound ? x.value : 0), 0);
  const counts = les.map(b => count(now.samples, b) - count(then.samples, b));
  return histogramQuantile(q, les, counts);
}

// q in [0, 1] of a histogram: `les` the sorted upper bounds (the last +Inf), `counts` cumulative.
function histogramQuantile(q, les, counts) {
  const total = counts[counts.length - 1];
  if (!(total > 0)) return null;
  const rank = q * total;
  for (let k = 0; k < les.length; k++) {
    if (counts[k] >= rank) {
      if (les[k] === Infinity) return les.length > 1 ? les[k - 1] : null;
      const lo = k === 0 ? 0 : les[k - 1], below = k === 0 ? 0 : counts[k - 1];
      return counts[k] === below ? lo : lo + (les[k] - lo) * (rank - below) / (counts[k] - below);
    }
  }
  return null;
}

// ---- what the page shows -------------------------------------------------------------------------
const TOTALS = [
  ["request_success_total", "finished"], ["request_success_total", "stop", {finished_reason: "stop"}],
  ["request_success_total", "length", {finished_reason: "length"}],
  ["request_aborted_total", "aborted"], ["request_rejected_total", "rejected (queue full)"],
  ["request_queue_timeouts_total", "queue timeouts"], ["num_preemptions_total", "preemptions"],
  ["prompt_tokens_total", "prompt tokens"], ["generation_tokens_total", "output tokens"],
  ["prefix_cache_hits_total", "prefix-cache hit tokens"],
  ["spec_decode_num_draft_tokens_total", "draft tokens"],
  ["spec_decode_num_accepted_tokens_total", "accepted draft tokens"],
  ["spec_decode_steps_skipped_total", "steps speculation skipped"],
  ["kv_offload_stored_blocks_total", "blocks to host tier"],
  ["kv_offload_restored_blocks_total", "blocks back from host"],
  ["slo_adjustments_total", "budget moves down", {direction: "down"}],
  ["slo_adjustments_total", "budget moves up", {direction: "up"}],
];
const NOW = [
  ["num_requests_running", "running"], ["num_requests_waiting", "waiting"],
  ["kv_cache_blocks_in_use", "KV blocks used"], ["kv_cache_blocks_cached", "KV blocks cached"],
  ["kv_cache_blocks_free", "KV blocks free"], ["kv_cache_blocks_total", "KV blocks"],
  ["kv_cache_usage_perc", "KV usage (fraction)"], ["kv_offload_blocks_in_use", "host-tier blocks used"],
  ["kv_offload_blocks_total", "host-tier blocks"], ["spec_decode_enabled", "speculating (1/0)"],
  ["slo_max_num_batched_tokens", "token budget"], ["slo_ttft_p95_seconds", "controller TTFT P95 (s)"],
  ["slo_tpot_p95_seconds", "controller TPOT P95 (s)"],
];
const byPriority = kind => s => labelValues(s, `${P}num_requests_${kind}_by_priority`, "priority")
  .map(p => ({label: `${kind} p${p}`, metric: `num_requests_${kind}_by_priority`, labels: {priority: p}}));
const gauge = (label, metric, labels) => ({label, metric, labels, at: (i, m, l) => value(scrapes[i].samples, P + m, l)});
const perSec = (label, metric, labels) => ({label, metric, labels, derived: "rate", at: (i, m, l) => rate(i, P + m, l)});
const pct = q => ({label: `P${q}`, derived: `p${q}`, at: (i, m) => quantile(i, q / 100, m)});
const CHARTS = [
  {title: "requests / s", series: () => [perSec("finished", "request_success_total"), perSec("aborted", "request_aborted_total")]},
  {title: "output tokens / s", series: () => [perSec("output", "generation_tokens_total"), perSec("prompt", "prompt_tokens_total")]},
  ...[["TTFT", "time_to_first_token_seconds"], ["TPOT", "time_per_output_token_seconds"],
      ["ITL", "inter_token_latency_seconds"]].map(([t, m]) => ({title: `${t} (s)`,
        series: () => [50, 95, 99].map(q => ({...pct(q), metric: m}))})),
  {title: "running and waiting", series: s => [gauge("running", "num_requests_running"),
    gauge("waiting", "num_requests_waiting"), ...byPriority("running")(s).map(x => gauge(x.label, x.metric, x.labels)),
    ...byPriority("waiting")(s).map(x => gauge(x.label, x.metric, x.labels))]},
  {title: "KV blocks (device)", series: () => [gauge("used", "kv_cache_blocks_in_use"),
    gauge("cached", "kv_cache_blocks_cached"), gauge("free", "kv_cache_blocks_free")]},
  {title: "KV blocks (host tier)", series: () => [gauge("used", "kv_offload_blocks_in_use"),
    gauge("total", "kv_offload_blocks_total")]},
  {title: "preemptions, rejections, queue timeouts (so far)", series: () => [
    gauge("preemptions", "num_preemptions_total"), gauge("rejections", "request_rejected_total"),
    gauge("queue timeouts", "request_queue_timeouts_total")]},
  {title: "speculative decoding", series: () => [{label: "accepted / drafted", metric: "spec_decode_num_accepted_tokens_total",
    derived: "ratio", at: i => { const d = rate(i, P + "spec_decode_num_draft_tokens_total");
      return d > 0 ? rate(i, P + "spec_decode_num_accepted_tokens_total") / d : null; }},
    gauge("speculating", "spec_decode_enabled")]},
  {title: "SLO controller: token budget", series: () => [gauge("budget", "slo_max_num_batched_tokens")]},
  {title: "SLO controller: P95 against target (s)", series: () => ["ttft", "tpot"].flatMap(k => [
    gauge(`${k.toUpperCase()} P95`, `slo_${k}_p95_seconds`), gauge(`${k.toUpperCase()} target`, `slo_${k}_p95_target_seconds`)])},
];

function fmt(v) {
  if (v === null || v === undefined || Number.isNaN(v)) return "\u2014";
  return Number.isInteger(v) ? String(v) : String(Number(v.toPrecision(4)));
}

function tile(parent, metric, label, labels) {
  const div = document.createElement("div"), name = document.createElement("div"), num = document.createElement("div");
  div.className = "tile"; name.className = "label"; num.className = "value";
  name.textContent = label;
  num.dataset.metric = P + metric;
  if (labels) num.dataset.labels = JSON.stringify(labels);
  div.append(name, num); parent.append(div);
  return num;
}

function showTiles(samples) {
  for (const [id, list, extra] of [["tiles-total", TOTALS, []], ["tiles-now", NOW,
      ["running", "waiting"].flatMap(k => byPriority(k)(samples))]]) {
    const box = document.getElementById(id);
    const all = list.map(([m, l, labels]) => ({metric: m, label: l, labels})).concat(extra);
    const key = JSON.stringify(all);
    if (box.dataset.key !== key) {
      box.replaceChildren();
      for (const x of all) tile(box, x.metric, x.label, x.labels);
      box.dataset.key = key;
    }
    const nums = box.querySelectorAll(".value");
    all.forEach((x, k) => { nums[k].textContent = fmt(value(samples, P + x.metric, x.labels || {})); });
  }
}

// ---- charts ----------------------------------------------------------------------------------------
function chartBox(chart) {
  if (chart.box) return chart.box;
  const box = document.createElement("div"), h = document.createElement("h3");
  box.className = "chart"; h.textContent = chart.title;
  chart.canvas = document.createElement("canvas");
  chart.legend = document.createElement("div"); chart.legend.className = "legend";
  box.append(h, chart.canvas, chart.legend);
  document.getElementById("charts").append(box);
  return (chart.box = box);
}

function point(i, s, title) {
  const h = scrapes[i], key = JSON.stringify([title, s.label, s.metric, s.labels]);
  if (!(key in h.memo)) h.memo[key] = h.samples ? s.at(i, s.metric, s.labels) : null;
  return h.memo[key];
}

function drawChart(chart) {
  chartBox(chart);
  const series = chart.series(scrapes[scrapes.length - 1].samples);
  const newest = scrapes[scrapes.length - 1].t;
  const lines = series.map(s => scrapes.map((h, i) => [h.t - newest, point(i, s, chart.title)]));
  const c = chart.canvas, dpr = window.devicePixelRatio || 1;
  c.width = Math.max(1, Math.round(c.clientWidth * dpr)); c.height = Math.max(1, Math.round(c.clientHeight * dpr));
  const g = c.getContext("2d"), W = c.width, H = c.height, L = 48 * dpr, B = 18 * dpr;
  g.fillStyle = "#fff"; g.fillRect(0, 0, W, H);
  const finite = lines.flat().map(p => p[1]).filter(v => v !== null && Number.isFinite(v));
  const most = finite.reduce((a, b) => Math.max(a, b), 0), top = most > 0 ? most * 1.1 : 1;
  const x = t => L + (W - L - 4 * dpr) * (1 + t / opts.window), y = v => (H - B) - (H - B - 6 * dpr) * v / top;
  g.strokeStyle = "#e3e7ec"; g.fillStyle = "#5a6472"; g.font = `${10 * dpr}px sans-serif`; g.lineWidth = dpr;
  for (let k = 0; k <= 4; k++) {
    const v = top * k / 4;
    g.beginPath(); g.moveTo(L, y(v)); g.lineTo(W, y(v)); g.stroke();
    g.fillText(fmt(v), 2 * dpr, y(v) + 3 * dpr);
  }
  g.fillText(`-${opts.window} s`, L, H - 4 * dpr); g.fillText("now", W - 24 * dpr, H - 4 * dpr);
  let drawn = 0;
  lines.forEach((pts, k) => {
    g.strokeStyle = COLORS[k % COLORS.length]; g.lineWidth = 2 * dpr; g.beginPath();
    let pen = false;
    for (const [t, v] of pts) {
      if (v === null || !Number.isFinite(v)) { pen = false; continue; }
      if (pen) g.lineTo(x(t), y(v)); else g.moveTo(x(t), y(v));
      pen = true; drawn++;
    }
    g.stroke();
  });
  c.dataset.points = String(drawn);
  const key = JSON.stringify(series.map(s => [s.label, s.metric, s.labels]));
  if (chart.legend.dataset.key !== key) {               // rebuilt only when the series change
    chart.legend.replaceChildren(...series.map((s, k) => legendItem(s, k)));
    chart.legend.dataset.key = key;
  }
  chart.legend.querySelectorAll(".value").forEach((num, k) => {
    num.textContent = fmt(lines[k][lines[k].length - 1][1]);
  });
}

function legendItem(s, k) {
  const item = document.createElement("span"), sw = document.createElement("span"), num = document.createElement("span");
  sw.className = "swatch"; sw.style.background = COLORS[k % COLORS.length];
  num.className = "value"; num.dataset.metric = P + s.metric;
  if (s.labels) num.dataset.labels = JSON.stringify(s.labels);
  if (s.derived) num.dataset.derived = s.derived;
  item.append(sw, s.label, num);
  return item;
}

// ---- the loop ----------------------------------------------------------------------------------------
async function poll() {
  const status = document.getElementById("status");
  try {
    const response = await fetch("/metrics", {cache: "no-store"});
    if (!response.ok) throw new Error(`/metrics answered ${response.status}`);
    const samples = parseMetrics(await response.text()), t = performance.now() / 1000;
    scrapes.push({t, samples, memo: {}});
    while (scrapes.length > 2 && t - scrapes[1].t > opts.window) scrapes.shift();
    const model = samples.find(s => s.labels.model_name);
    document.getElementById("model").textContent = model ? model.labels.model_name : "";
    showTiles(samples);
    for (const chart of CHARTS) drawChart(chart);
    const keep = Math.ceil(opts.rate * 1000 / opts.poll) + 3;     // scrapes a rate may reach back to
    for (let k = 0; k < scrapes.length - keep; k++) scrapes[k].samples = null;
    polls++;
    status.className = ""; status.dataset.polls = String(polls);
    status.textContent = `${polls} scrapes of /metrics, the last at ${new Date().toLocaleTimeString()}; every ${opts.poll} ms`;
  } catch (err) {
    status.className = "error";
    status.textContent = `cannot read /metrics: ${err.message}`;
  }
  setTimeout(poll, opts.poll);
}

document.getElementById("window").textContent = String(opts.window);
document.getElementById("rate").textContent = String(opts.rate);
for (const el of document.querySelectorAll(".rate")) el.textContent = String(opts.rate);
poll();
