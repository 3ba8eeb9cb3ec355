/* zinf dashboard: fills the server-rendered page from the JSON API (/api/...) and draws the charts
 * with plotly.js (served by the app itself, no CDN). One entry point per page, chosen by
 * <body data-page>. Every chart div gets data-points="N" once drawn (N points plotted), so that a
 * browser test can tell a drawn chart from an empty one; a failed chart gets data-error.
 *
 * Live: the overview polls /api/runs/ID/steps?after_step=LAST every 2 s while the run is running
 * and appends the new steps to the step-time and loss charts (Plotly.extendTraces); the other
 * charts and tables of a running run are re-fetched every 10 s. #live-indicator shows the state.
 */
"use strict";

const RUN_ID = document.body.dataset.runId;
const PLOT_CONFIG = { responsive: true, displaylogo: false };
const POLL_MS = 2000; // live steps
const REFRESH_MS = 10000; // the other charts and tables of a running run
const STEP_PARTS = ["compute", "stall", "optimizer", "migration", "other"]; // the step-time figure's traces, in order

// ------------------------------------------------------------------------------- helpers
async function getJSON(url) {
  const response = await fetch(url, { headers: { Accept: "application/json" } });
  const body = await response.json();
  if (!response.ok) throw new Error(body.detail ? String(body.detail) : `${response.status} ${response.statusText}`);
  return body;
}

function showError(el, err) {
  if (el.classList.contains("js-plotly-plot")) Plotly.purge(el); // the next draw starts afresh
  el.dataset.error = err.message;
  el.replaceChildren();
  const p = document.createElement("p");
  p.className = "error";
  p.textContent = err.message;
  el.appendChild(p);
}

/* Remove an error message drawn in place of a chart (a drawn chart is left alone: Plotly.react updates it). */
function clearError(el) {
  if (el.dataset.error === undefined) return;
  delete el.dataset.error;
  el.replaceChildren();
}

const fmt = {
  int: (v) => (v === null || v === undefined ? "" : Number(v).toLocaleString("en-US")),
  num: (v, digits = 4) => (v === null || v === undefined ? "" : Number(v).toPrecision(digits)),
  s: (v) => (v === null || v === undefined ? "" : `${Number(v).toPrecision(4)} s`),
  pct: (v) => (v === null || v === undefined ? "" : `${(100 * v).toFixed(1)}%`),
  bytes: (v) => {
    if (v === null || v === undefined) return "";
    const units = [["TB", 1e12], ["GB", 1e9], ["MB", 1e6], ["kB", 1e3]];
    for (const [unit, scale] of units) if (Math.abs(v) >= scale) return `${(v / scale).toFixed(2)} ${unit}`;
    return `${v} B`;
  },
  date: (v) => (v ? String(v).replace("T", " ").replace(/\.\d+/, "").replace(/\+00:00$|Z$/, " UTC") : ""),
  text: (v) => (v === null || v === undefined ? "" : String(v)),
};

/* Fill a <table> from rows: columns are {key, label, fmt, num, cls, link}. */
function fillTable(table, rows, columns, { sort = null, onHeader = null, onRow = null } = {}) {
  const headRow = document.createElement("tr");
  for (const col of columns) {
    const th = document.createElement("th");
    th.textContent = col.label;
    th.dataset.key = col.key;
    if (col.num) th.classList.add("num");
    if (sort && sort.key === col.key) th.classList.add(sort.order === "desc" ? "sorted-desc" : "sorted-asc");
    if (onHeader) th.addEventListener("click", () => onHeader(col));
    headRow.appendChild(th);
  }
  table.tHead.replaceChildren(headRow);
  const body = table.tBodies[0];
  body.replaceChildren();
  for (const row of rows) {
    const tr = document.createElement("tr");
    for (const col of columns) {
      const td = document.createElement("td");
      const text = (col.fmt || fmt.text)(row[col.key], row);
      if (col.link) {
        const a = document.createElement("a");
        a.href = col.link(row);
        a.textContent = text;
        td.appendChild(a);
      } else if (col.badge) {
        const span = document.createElement("span");
        span.className = `badge ${text}`;
        span.textContent = text;
        td.appendChild(span);
      } else {
        td.textContent = text;
      }
      if (col.num) td.classList.add("num");
      if (col.cls) td.classList.add(typeof col.cls === "function" ? col.cls(row) : col.cls);
      if (col.key === "name" || col.key === "shard") td.title = text;
      tr.appendChild(td);
    }
    if (onRow) tr.addEventListener("click", () => onRow(row, tr));
    body.appendChild(tr);
  }
  table.dataset.rows = String(rows.length);
}

/* A table read from a paged API route: limit/offset, with previous/next buttons. */
function pagedTable({ prefix, url, columns, limit = 50, sort = null, onRow = null }) {
  const table = document.getElementById(`${prefix}-table`);
  const info = document.getElementById(`${prefix}-info`);
  const prev = document.getElementById(`${prefix}-prev`);
  const next = document.getElementById(`${prefix}-next`);
  const state = { offset: 0, total: 0, sort };
  async function load() {
    try {
      const page = await getJSON(url(state.offset, limit, state.sort));
      state.total = page.total;
      const onHeader = state.sort ? (col) => {
        if (state.sort.key === col.key) state.sort.order = state.sort.order === "desc" ? "asc" : "desc";
        else state.sort = { key: col.key, order: col.num ? "desc" : "asc" };
        state.offset = 0;
        load();
      } : null;
      fillTable(table, page.rows, columns, { sort: state.sort, onHeader, onRow });
      const last = Math.min(page.offset + page.rows.length, page.total);
      info.textContent = page.total ? `${page.offset + 1}–${last} of ${page.total}` : "none";
      prev.disabled = state.offset === 0;
      next.disabled = last >= page.total;
    } catch (err) {
      info.textContent = err.message;
    }
  }
  prev.addEventListener("click", () => { state.offset = Math.max(0, state.offset - limit); load(); });
  next.addEventListener("click", () => { state.offset += limit; load(); });
  return { load, state };
}

// ------------------------------------------------------------------------------- charts
async function drawFigure(div) {
  try {
    const out = await getJSON(`/api/runs/${RUN_ID}/figures/${div.dataset.figure}`);
    clearError(div);
    await Plotly.react(div, out.figure.data, out.figure.layout, PLOT_CONFIG);
    div.dataset.points = String(out.points);
    return out;
  } catch (err) {
    showError(div, err);
    return null;
  }
}

function pageCharts() {
  return [...document.querySelectorAll(".chart[data-figure]")];
}

/* The indicator in the nav bar: running (polling), finished, crashed or offline. */
const live = {
  el: document.getElementById("live-indicator"),
  set(state, text) {
    if (!this.el) return;
    this.el.dataset.state = state;
    this.el.className = `live state-${state}`;
    this.el.textContent = text || (state === "running" ? "live" : state);
  },
};

/* Re-run refresh() every REFRESH_MS while the run is running (pages other than the overview). */
function whileRunning(refresh) {
  if (document.body.dataset.status !== "running") return;
  live.set("running");
  const tick = async () => {
    let run;
    try {
      run = await getJSON(`/api/runs/${RUN_ID}`);
    } catch (err) {
      live.set("offline", "connection lost");
      setTimeout(tick, REFRESH_MS);
      return;
    }
    await refresh();
    live.set(run.status);
    if (run.status === "running") setTimeout(tick, REFRESH_MS);
  };
  setTimeout(tick, REFRESH_MS);
}

// ------------------------------------------------------------------------------ pages
async function initRuns() {
  const table = document.getElementById("runs-table");
  const columns = [
    { key: "run_id", label: "run", num: true, link: (r) => `/runs/${r.run_id}` },
    { key: "name", label: "name", cls: "name" },
    { key: "status", label: "status", badge: true },
    { key: "model", label: "model" },
    { key: "hardware", label: "hardware", cls: "name" },
    { key: "started_at", label: "started", fmt: fmt.date },
    { key: "steps", label: "steps", num: true, fmt: fmt.int },
    { key: "median_step_s", label: "median step", num: true, fmt: fmt.s },
    { key: "last_loss", label: "last loss", num: true, fmt: (v) => fmt.num(v, 5) },
    { key: "stall_fraction", label: "stall", num: true, fmt: fmt.pct },
  ];
  async function load() {
    try {
      const out = await getJSON("/api/runs");
      fillTable(table, out.runs, columns);
      if (!out.runs.length) table.tBodies[0].innerHTML = '<tr><td class="muted">no runs recorded yet</td></tr>';
      if (out.runs.some((r) => r.status === "running")) setTimeout(load, REFRESH_MS / 2);
    } catch (err) {
      showError(table.tBodies[0], err);
    }
  }
  await load();
}

function lastX(div) {
  const trace = div.data && div.data[0];
  let last = -Infinity;
  if (trace && trace.x) for (const x of trace.x) if (x > last) last = x;
  return last;
}

async function initOverview() {
  const charts = pageCharts();
  await Promise.all(charts.map(drawFigure));
  const stepDiv = document.getElementById("chart-step-time");
  const lossDiv = document.getElementById("chart-loss");
  const stepsLabel = document.getElementById("summary-steps");
  let lastStep = lastX(stepDiv);
  let wasRunning = document.body.dataset.status === "running";
  let lastRefresh = Date.now();

  function append(rows) {
    const xs = rows.map((r) => r.step);
    if (stepDiv.data) {
      const update = {
        x: STEP_PARTS.map(() => xs),
        y: STEP_PARTS.map((part) => rows.map((r) => r[`${part}_s`])),
        customdata: STEP_PARTS.map(() => rows.map((r) => r.wall_s)),
      };
      Plotly.extendTraces(stepDiv, update, STEP_PARTS.map((_, i) => i));
      dropEmptyNote(stepDiv);
      stepDiv.dataset.points = String(Number(stepDiv.dataset.points || 0) + xs.length * STEP_PARTS.length);
    }
    const withLoss = rows.filter((r) => r.loss !== null);
    if (lossDiv.data && withLoss.length) {
      Plotly.extendTraces(lossDiv, { x: [withLoss.map((r) => r.step)], y: [withLoss.map((r) => r.loss)] }, [0]);
      dropEmptyNote(lossDiv);
      lossDiv.dataset.points = String(Number(lossDiv.dataset.points || 0) + withLoss.length);
    }
    showStepCount();
  }

  function showStepCount() {
    if (stepsLabel && stepDiv.data && stepDiv.data[0]) stepsLabel.textContent = String(stepDiv.data[0].x.length);
  }

  async function poll() {
    let out;
    try {
      const after = Number.isFinite(lastStep) ? `&after_step=${lastStep}` : "";
      out = await getJSON(`/api/runs/${RUN_ID}/steps?limit=1000${after}`);
    } catch (err) {
      live.set("offline", "connection lost");
      setTimeout(poll, 5 * POLL_MS);
      return;
    }
    const rows = out.steps.filter((r) => r.step > lastStep);
    if (rows.length) {
      append(rows);
      lastStep = rows[rows.length - 1].step;
    }
    live.set(out.status);
    if (out.has_more) return poll();
    if (out.status === "running") {
      wasRunning = true;
      if (rows.length && Date.now() - lastRefresh > REFRESH_MS) {
        lastRefresh = Date.now();
        charts.filter((c) => c !== stepDiv && c !== lossDiv).forEach(drawFigure);
      }
      setTimeout(poll, POLL_MS);
    } else if (wasRunning) {
      // the run just ended: redraw everything once from the final data (plan markers included)
      wasRunning = false;
      await Promise.all(charts.map(drawFigure));
      showStepCount();
    }
  }
  showStepCount();
  await poll();
}

/* Remove a figure's "no ... recorded" note once it has data. */
function dropEmptyNote(div) {
  const notes = (div.layout && div.layout.annotations) || [];
  const kept = notes.filter((a) => !String(a.text || "").startsWith("no "));
  if (kept.length !== notes.length) Plotly.relayout(div, { annotations: kept });
}

async function initShards() {
  const charts = pageCharts();
  const tier = (v) => `tier-${v}`;
  const table = pagedTable({
    prefix: "shards",
    limit: 50,
    sort: { key: "accesses_per_step", order: "desc" },
    url: (offset, limit, sort) => `/api/runs/${RUN_ID}/shards?limit=${limit}&offset=${offset}&sort=${sort.key}&order=${sort.order}`,
    columns: [
      { key: "shard_index", label: "#", num: true },
      { key: "name", label: "shard", cls: "name" },
      { key: "module", label: "module", cls: "name" },
      { key: "kind", label: "kind" },
      { key: "state_bytes", label: "state", num: true, fmt: fmt.bytes },
      { key: "param_tier", label: "param home", cls: (r) => tier(r.param_tier) },
      { key: "optim_tier", label: "optimizer home", cls: (r) => tier(r.optim_tier) },
      { key: "accesses_per_step", label: "accesses / step", num: true, fmt: (v) => fmt.num(v, 3) },
      { key: "read_bytes_per_step", label: "read / step", num: true, fmt: fmt.bytes },
      { key: "fetch_s_per_step", label: "fetch s / step", num: true, fmt: (v) => fmt.num(v, 3) },
      { key: "stall_s_per_step", label: "stall s / step", num: true, fmt: (v) => fmt.num(v, 3) },
    ],
  });
  await Promise.all([...charts.map(drawFigure), table.load()]);
  whileRunning(() => Promise.all([...charts.map(drawFigure), table.load()]));
}

async function initPlans() {
  const charts = pageCharts();
  const plansTable = document.getElementById("plans-table");
  const title = document.getElementById("assignments-title");
  let planId = null;
  const assignments = pagedTable({
    prefix: "assignments",
    limit: 50,
    url: (offset, limit) => `/api/plans/${planId}/assignments?limit=${limit}&offset=${offset}`,
    columns: [
      { key: "shard_index", label: "#", num: true },
      { key: "shard", label: "shard", cls: "name" },
      { key: "param_tier", label: "param home", cls: (r) => `tier-${r.param_tier}` },
      { key: "optim_tier", label: "optimizer home", cls: (r) => `tier-${r.optim_tier}` },
      { key: "score", label: "score", num: true, fmt: (v) => fmt.num(v, 4) },
    ],
  });
  const migrations = pagedTable({
    prefix: "migrations",
    limit: 50,
    url: (offset, limit) => `/api/runs/${RUN_ID}/migrations?limit=${limit}&offset=${offset}`,
    columns: [
      { key: "step", label: "after step", num: true },
      { key: "plan_version", label: "plan", num: true },
      { key: "shard", label: "shard", cls: "name" },
      { key: "state", label: "home" },
      { key: "src_tier", label: "from", cls: (r) => `tier-${r.src_tier}` },
      { key: "dst_tier", label: "to", cls: (r) => `tier-${r.dst_tier}` },
      { key: "bytes", label: "bytes", num: true, fmt: fmt.bytes },
      { key: "seconds", label: "seconds", num: true, fmt: (v) => fmt.num(v, 3) },
    ],
  });
  const planColumns = [
    { key: "version", label: "version", num: true },
    { key: "created_step", label: "after step", num: true },
    { key: "policy", label: "policy" },
    { key: "dram_budget_bytes", label: "DRAM budget", num: true, fmt: fmt.bytes },
    { key: "predicted_step_s", label: "predicted step", num: true, fmt: fmt.s },
    { key: "measured_step_s", label: "measured step", num: true, fmt: fmt.s },
    { key: "adopted", label: "adopted", fmt: (v) => (v ? "yes" : "no") },
    { key: "migrated_bytes", label: "migrated", num: true, fmt: fmt.bytes },
    { key: "assignments", label: "shards placed", num: true },
    { key: "reason", label: "why", cls: "name", fmt: (v) => (v === null || v === undefined ? "" : typeof v === "string" ? v : JSON.stringify(v)) },
  ];
  async function loadPlans() {
    try {
      const page = await getJSON(`/api/runs/${RUN_ID}/plans?limit=1000`);
      fillTable(plansTable, page.rows, planColumns, {
        onRow: (row, tr) => {
          for (const other of plansTable.tBodies[0].rows) other.classList.remove("selected");
          tr.classList.add("selected");
          planId = row.plan_id;
          title.textContent = `Placement of plan v${row.version}`;
          assignments.state.offset = 0;
          assignments.load();
        },
      });
      if (!page.rows.length) plansTable.tBodies[0].innerHTML = '<tr><td class="muted">no plans recorded (a static placement)</td></tr>';
    } catch (err) {
      showError(plansTable.tBodies[0], err);
    }
  }
  await Promise.all([...charts.map(drawFigure), loadPlans(), migrations.load()]);
  whileRunning(() => Promise.all([...charts.map(drawFigure), loadPlans(), migrations.load()]));
}

/* "8GiB", "512MB", "1e9" or 1000000 -> bytes; null when it does not parse. */
function parseSize(text) {
  const m = /^\s*([0-9.eE+]+)\s*([kKmMgGtT]?)(i?)[bB]?\s*$/.exec(String(text || ""));
  if (!m) return null;
  const power = { "": 0, k: 1, m: 2, g: 3, t: 4 }[m[2].toLowerCase()];
  const value = Number(m[1]) * (m[3] ? 1024 : 1000) ** power;
  return Number.isFinite(value) ? Math.round(value) : null;
}

async function initWhatIf() {
  const slider = document.getElementById("whatif-budget");
  const label = document.getElementById("whatif-budget-label");
  const result = document.getElementById("whatif-result");
  const chart = document.getElementById("chart-what-if");
  const table = document.getElementById("whatif-table");
  const columns = [
    { key: "dram_budget_bytes", label: "DRAM budget", num: true, fmt: fmt.bytes },
    { key: "budget_fraction", label: "of the state", num: true, fmt: fmt.pct },
    { key: "predicted_step_s", label: "predicted step", num: true, fmt: fmt.s },
    { key: "speedup", label: "speed-up", num: true, fmt: (v) => (v === null ? "" : `${Number(v).toFixed(2)}×`) },
    { key: "dram_used_bytes", label: "DRAM used", num: true, fmt: fmt.bytes },
    { key: "feasible", label: "fits", fmt: (v) => (v ? "yes" : "no") },
  ];
  let asked = 0; // answers to older slider positions are dropped

  async function show(budget) {
    const mine = ++asked;
    let out;
    try {
      out = await getJSON(`/api/runs/${RUN_ID}/what-if` + (budget === null ? "" : `?budget=${budget}`));
    } catch (err) {
      if (mine === asked) showError(chart, err);
      return null;
    }
    if (mine !== asked) return out;
    clearError(chart);
    await Plotly.react(chart, out.figure.figure.data, out.figure.figure.layout, PLOT_CONFIG);
    chart.dataset.points = String(out.figure.points);
    chart.dataset.budget = budget === null ? "" : String(budget);
    fillTable(table, out.rows, columns);
    const c = out.chosen;
    result.textContent = c
      ? (c.feasible
        ? `At ${fmt.bytes(c.dram_budget_bytes)} of DRAM: ${fmt.s(c.predicted_step_s)} a step, ${Number(c.speedup).toFixed(2)}× the all-NVMe placement.`
        : `${fmt.bytes(c.dram_budget_bytes)} of DRAM is too small for the working set.`)
      : "";
    return out;
  }

  const first = await show(null);
  if (!first || !first.rows.length) return;
  const most = Math.max(...first.rows.map((r) => r.dram_budget_bytes));
  const step = Math.max(1, Math.round(most / 200));
  slider.min = "0";
  slider.max = String(step * 200);
  slider.step = String(step);
  const configured = parseSize(slider.dataset.configured);
  const start = configured !== null && configured <= step * 200 ? configured : first.rows[Math.floor(first.rows.length / 2)].dram_budget_bytes;
  slider.value = String(Math.round(start / step) * step);
  slider.disabled = false;
  label.textContent = fmt.bytes(Number(slider.value));
  await show(Number(slider.value));

  let timer = null;
  slider.addEventListener("input", () => {
    label.textContent = fmt.bytes(Number(slider.value));
    clearTimeout(timer);
    timer = setTimeout(() => show(Number(slider.value)), 150);
  });
}

const PAGES = { runs: initRuns, overview: initOverview, shards: initShards, plans: initPlans, "what-if": initWhatIf };
const init = PAGES[document.body.dataset.page];
if (init) init();
