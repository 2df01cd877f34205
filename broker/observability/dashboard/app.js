// Steward dashboard: reads the broker's JSON API every REFRESH_MS and renders it.
// Vanilla JS, no dependencies. Everything shown is set with textContent (never innerHTML):
// task params, results and errors are user data.
"use strict";

const REFRESH_MS = 2000;
const TOKEN_KEY = "steward.apiToken";
const TASK_PAGE = 15;
const STATES = ["pending", "delayed", "waiting", "running", "finished", "error", "cancelled"];
const QUEUED = ["pending", "delayed", "waiting"];

const view = {
  search: { state: "", tenant: "", type: "" },
  before: null, // task id cursor of the shown page (null: newest)
  nextBefore: null,
  selectedTask: null,
  // Scroll the detail into view (and focus it) once it is shown: set when a task is opened,
  // kept until the first refresh has filled the tables above it (they move it down).
  reveal: false,
  loaded: false,
  // The selected task's shown output: fetched from offset on, appended (GET .../logs).
  output: { task: null, attempt: null, offset: 0, text: "", complete: false },
  timer: null,
  busy: false,
};

// --- small helpers ----------------------------------------------------------------------

function $(id) {
  return document.getElementById(id);
}

// h("td", {class: "x"}, "text", child, ...): an element; null/undefined children skipped.
function h(tag, attrs, ...children) {
  const el = document.createElement(tag);
  for (const [name, value] of Object.entries(attrs || {})) {
    if (value === null || value === undefined || value === false) continue;
    if (name.startsWith("on")) el.addEventListener(name.slice(2), value);
    else el.setAttribute(name, value === true ? "" : String(value));
  }
  for (const child of children.flat()) {
    if (child === null || child === undefined) continue;
    el.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return el;
}

const SVG_NS = "http://www.w3.org/2000/svg";
function svg(tag, attrs) {
  const el = document.createElementNS(SVG_NS, tag);
  for (const [name, value] of Object.entries(attrs || {})) el.setAttribute(name, String(value));
  return el;
}

// Replaces a table's rows; a link in them that had the keyboard focus keeps it (the same
// link in the new rows), or every refresh would throw a keyboard user back to the top.
function fillBody(table, rows, emptyText, columns) {
  const body = table.tBodies[0];
  const focused = document.activeElement;
  const href = focused && body.contains(focused) ? focused.getAttribute("href") : null;
  body.replaceChildren(
    ...(rows.length ? rows : [h("tr", {}, h("td", { class: "empty", colspan: columns }, emptyText))]),
  );
  if (href === null) return;
  const again = Array.from(body.querySelectorAll("a[href]")).find((a) => a.getAttribute("href") === href);
  if (again) again.focus({ preventScroll: true });
}

function badge(text, kind) {
  return h("span", { class: "badge " + (kind || text) }, text);
}

// A task's state, and "lost?" while its worker's connection is closed: it is presumed lost
// until the worker registers again or the heartbeat timeout declares it dead
// (docs/DESIGN.md §8, "Closed connections").
function taskBadges(t) {
  if (t.worker_state !== "disconnected") return badge(t.state);
  const title = "worker " + t.worker + " disconnected " + when(t.lost_suspected_at) +
    ": lost unless it reconnects before the heartbeat timeout";
  return h("span", { title: title }, badge(t.state), " ", badge("lost?", "lost"));
}

function duration(seconds) {
  if (seconds === null || seconds === undefined) return "—";
  const s = Math.floor(seconds);
  if (s < 60) return s + " s";
  if (s < 3600) return Math.floor(s / 60) + " min " + (s % 60) + " s";
  if (s < 86400) return Math.floor(s / 3600) + " h " + Math.floor((s % 3600) / 60) + " min";
  return Math.floor(s / 86400) + " d " + Math.floor((s % 86400) / 3600) + " h";
}

function ago(iso) {
  if (!iso) return "—";
  const seconds = (Date.now() - Date.parse(iso)) / 1000;
  if (!isFinite(seconds)) return iso;
  if (seconds < 1) return "just now";
  return duration(seconds) + " ago";
}

// "2026-11-22T10:00:00.123Z" -> "2026-11-22 10:00:00.123 UTC"
function when(iso) {
  return iso ? iso.replace("T", " ").replace(/Z$/, " UTC") : iso;
}

function timeCell(iso) {
  return h("td", { title: iso || "" }, ago(iso));
}

// The API's own representation: 0 means no limit (docs/API.md, PUT /api/v1/tenants).
function limit(n) {
  return n === 0 ? "0 (unlimited)" : String(n);
}

function pretty(value) {
  if (value === null || value === undefined) return "null";
  return JSON.stringify(value, null, 2);
}

function number(v) {
  return (Number.isInteger(v) ? v : +v.toFixed(2)).toLocaleString("en-US");
}

// The API's key, its value and its unit: "cpu: 2 cores", "memory_mb: 24,105 MB".
const UNITS = { cpu: (v) => (v === 1 ? " core" : " cores"), memory_mb: () => " MB" };
function resourceText(name, value) {
  return name + ": " + number(value) + (UNITS[name] ? UNITS[name](value) : "");
}

// A worker's task_types: how many tasks of each type it runs at once ("*": any type).
function capacityText(type, n) {
  return (type === "*" ? "any type" : type) + ": " + number(n) + " at once";
}

function chips(map, text) {
  const entries = Object.entries(map || {});
  if (!entries.length) return h("span", { class: "muted" }, "—");
  return h("div", { class: "chips" }, entries.map(([k, v]) => h("span", { class: "chip" }, text(k, v))));
}

// --- API access -----------------------------------------------------------------------

class ApiError extends Error {
  constructor(status, code, message) {
    super(message);
    this.status = status;
    this.code = code;
  }
}

function token() {
  return sessionStorage.getItem(TOKEN_KEY) || "";
}

async function api(path) {
  const headers = { Accept: "application/json" };
  const bearer = token();
  if (bearer) headers.Authorization = "Bearer " + bearer;
  let response;
  try {
    response = await fetch(path, { headers, cache: "no-store" });
  } catch (exc) {
    throw new ApiError(0, "network", "cannot reach this broker (" + exc.message + ")");
  }
  let body = null;
  try {
    body = await response.json();
  } catch (exc) {
    body = null;
  }
  if (!response.ok) {
    const error = (body && body.error) || {};
    throw new ApiError(response.status, error.code || "http_" + response.status, error.message || response.statusText);
  }
  return body;
}

function authProblem(errors) {
  return errors.find((e) => e instanceof ApiError && (e.status === 401 || e.status === 403));
}

function showBanner(errors) {
  const banner = $("banner");
  if (!errors.length) {
    banner.hidden = true;
    return;
  }
  const auth = authProblem(errors);
  if (auth) {
    banner.className = "banner auth";
    banner.textContent =
      auth.status === 401
        ? (token() ? "The API token was refused (401): " : "This cluster needs an API token (401): ") +
          auth.message + ". Enter a token above."
        : "This token may not read everything shown here (403): " + auth.message + ".";
  } else {
    banner.className = "banner";
    const first = errors[0];
    banner.textContent = "Could not refresh: " + (first.message || String(first)) +
      (errors.length > 1 ? " (and " + (errors.length - 1) + " more)" : "");
  }
  banner.hidden = false;
}

// --- renderers ---------------------------------------------------------------------------

// Task counts by state, summed over the tenants (every task belongs to one).
function renderCounts(brokers, tenants) {
  const counts = {};
  for (const t of tenants) for (const [s, n] of Object.entries(t.counts || {})) counts[s] = (counts[s] || 0) + n;
  const total = STATES.reduce((sum, s) => sum + (counts[s] || 0), 0);
  const cards = [
    h("div", { class: "card leader", id: "leader-card" },
      h("div", { class: "value" }, brokers.leader || "none"), h("div", { class: "label" }, "leader")),
    h("div", { class: "card" }, h("div", { class: "value" }, total), h("div", { class: "label" }, "tasks")),
    ...STATES.map((s) =>
      h("div", { class: "card " + s, "data-state": s },
        h("div", { class: "value" }, counts[s] || 0), h("div", { class: "label" }, s))),
  ];
  $("task-counts").replaceChildren(...cards);
}

function renderBrokers(status) {
  const rows = status.brokers.map((b) => {
    const pos = b.position ? b.position.ledger_id + ":" + b.position.entry_id : "—";
    let lag;
    if (b.is_leader) lag = h("span", { class: "lag-ok" }, "—");
    else if (b.behind_ledgers) lag = h("span", { class: "lag-behind" }, "older ledger");
    else if (b.lag_entries === null || b.lag_entries === undefined) lag = h("span", { class: "muted", title: b.error || "" }, "?");
    // Counted against the leader's last entry followers can apply (a trailing Confirm
    // marker excluded): 0 is in sync (docs/DESIGN.md §4).
    else if (b.lag_entries === 0) lag = h("span", { class: "lag-ok" }, "in sync");
    else lag = h("span", { class: "lag-behind" }, b.lag_entries + " entries");
    let uptime;
    if (b.reachable && b.uptime_secs !== null && b.uptime_secs !== undefined) uptime = duration(b.uptime_secs);
    else if (!b.reachable) {
      const seen = b.last_seen_secs_ago === null || b.last_seen_secs_ago === undefined
        ? "never seen" : "last seen " + duration(b.last_seen_secs_ago) + " ago";
      uptime = h("span", { class: "muted", title: b.error || "" }, (b.member === false ? "left · " : "") + seen);
    } else uptime = h("span", { class: "muted", title: b.error || "" }, "—");
    const here = b.id === status.answered_by;
    return h(
      "tr",
      { class: b.is_leader ? "leader" : null, "data-broker": b.id, "data-role": b.role, "data-leader": b.is_leader ? "true" : "false" },
      h("td", {}, b.is_leader ? h("span", { class: "star", title: "leader" }, "★") : null, h("b", {}, b.id),
        here ? h("span", { class: "muted" }, " (this page)") : null),
      h("td", {}, badge(b.is_leader && b.role !== "leader" && b.role !== "standalone" ? b.role + " (elected)" : b.role,
        b.is_leader ? "leader" : b.role)),
      h("td", { class: "mono", title: b.error || "" }, pos),
      h("td", {}, lag),
      h("td", { class: "uptime" }, uptime),
      h("td", {}, b.url ? h("a", { href: b.url + "/", title: "open this broker's dashboard" }, b.url.replace(/^https?:\/\//, "")) : "—"),
    );
  });
  fillBody($("brokers"), rows, "no brokers", 6);
  const leader = status.brokers.find((b) => b.is_leader);
  $("brokers-hint").textContent = status.brokers.length + (leader ? " · leader " + leader.id : " · no leader");
  const here = status.brokers.find((b) => b.id === status.answered_by);
  $("cluster-id").textContent = status.cluster_id ? "cluster " + status.cluster_id : "";
  const served = $("served-by");
  served.replaceChildren("served by ", h("b", {}, status.answered_by), here ? " (" + here.role + ")" : "");
}

function renderWorkers(workers) {
  const rows = workers.map((w) => {
    const shown = w.running.slice(0, 8).map((id) => taskLink(id, "chip link", "open task " + id));
    const more = w.running_tasks > shown.length ? h("span", { class: "muted" }, " +" + (w.running_tasks - shown.length)) : null;
    return h(
      "tr",
      { "data-worker": w.id },
      h("td", {}, h("b", {}, w.id), h("div", { class: "muted mono" }, w.address),
        w.tenants && w.tenants.length ? h("div", { class: "muted" }, "tenants: " + w.tenants.join(", ")) : null),
      h("td", { title: w.reason || (w.state === "disconnected" ? "disconnected " + when(w.updated_at) : "connected " + when(w.connected_at)) }, badge(w.state)),
      h("td", {}, chips(w.task_types, capacityText)),
      h("td", {}, chips(w.resources, resourceText)),
      h("td", {}, h("b", {}, w.running_tasks), " ", h("div", { class: "chips" }, shown), more),
    );
  });
  fillBody($("workers"), rows, "no workers connected", 5);
  const connected = workers.filter((w) => w.state === "connected").length;
  $("workers-hint").textContent = connected + " connected" + (workers.length > connected ? " of " + workers.length : "");
}

function renderTenants(tenants) {
  const rows = tenants.map((t) => {
    const c = t.counts || {};
    const queued = QUEUED.reduce((sum, s) => sum + (c[s] || 0), 0);
    return h(
      "tr",
      { "data-tenant": t.name },
      h("td", {}, h("b", {}, t.name)),
      h("td", { class: "num" }, +t.weight.toFixed(3)),
      h("td", { class: "num" }, limit(t.max_waiting)),
      h("td", { class: "num" }, limit(t.max_running)),
      h("td", { class: "num" }, queued),
      h("td", { class: "num" }, c.running || 0),
      h("td", { class: "num" }, c.finished || 0),
      h("td", { class: "num" }, c.error || 0),
    );
  });
  fillBody($("tenants"), rows, "no tenants yet", 8);
  $("tenants-hint").textContent = tenants.length + "";
}

// Periodic-task schedules (GET /api/v1/schedules: a tenant token sees its own). The last
// firing that ran a tick links to the task it created; a refused one says why.
function renderSchedules(schedules) {
  const rows = schedules.map((s) => {
    const every = s.cron !== null && s.cron !== undefined
      ? h("span", { class: "mono", title: "cron, UTC" }, s.cron)
      : "every " + duration(s.interval_s);
    const last = s.recent.length ? s.recent[s.recent.length - 1] : null;
    let fired = h("span", { class: "muted" }, "never");
    if (last) {
      fired = h("span", { title: last.tick }, ago(last.tick), " ",
        last.task_id !== null ? taskLink(last.task_id, null, "open task " + last.task_id) : h("span", { class: "muted" }, "no task"));
    }
    return h(
      "tr",
      { "data-schedule": s.tenant + "/" + s.name },
      h("td", {}, h("b", {}, s.name)),
      h("td", {}, s.tenant),
      h("td", { class: "mono" }, s.task.type),
      h("td", {}, every),
      h("td", { title: s.missed === "skip" ? "a tick later than " + s.grace_s + " s is skipped" : "" }, s.missed),
      s.paused
        ? h("td", { title: "paused since " + s.paused_at + "; next tick " + s.next_tick }, h("span", { class: "muted" }, "paused"))
        : h("td", { title: s.next_tick }, when(s.next_tick)),
      h("td", {}, fired, s.last_error ? h("div", { class: "error-text" }, s.last_error) : null),
      h("td", { class: "num" }, s.runs),
      h("td", { class: "num" }, s.skipped),
    );
  });
  fillBody($("schedules"), rows, "no schedules", 9);
  $("schedules-hint").textContent = schedules.length + "";
}

function chart(title, values, color, bucketS, note) {
  const width = 240;
  const height = 80;
  const max = Math.max(1, ...values);
  const step = width / values.length;
  const plot = svg("svg", { viewBox: `0 0 ${width} ${height}`, preserveAspectRatio: "none", role: "img" });
  // The chart's text alternative (a screen reader reads this, not the bars).
  const alt = svg("title", {});
  plot.append(alt);
  plot.append(svg("line", { x1: 0, y1: height - 0.5, x2: width, y2: height - 0.5, stroke: "#e3e8ee" }));
  values.forEach((v, i) => {
    if (!v) return;
    const barHeight = Math.max(1.5, (v / max) * (height - 6));
    const bar = svg("rect", {
      x: (i * step + 0.5).toFixed(2), y: (height - barHeight).toFixed(2),
      width: Math.max(1, step - 1).toFixed(2), height: barHeight.toFixed(2), fill: color, rx: 1,
    });
    const tip = svg("title", {});
    tip.textContent = v + " in " + bucketS + " s";
    bar.append(tip);
    plot.append(bar);
  });
  const total = values.reduce((a, b) => a + b, 0);
  // The newest bucket is still filling: the rate comes from the one before it.
  const last = values.length > 1 ? values[values.length - 2] : 0;
  const rate = last / bucketS;
  const rateText = (rate < 10 ? rate.toFixed(1) : Math.round(rate)) + "/s";
  alt.textContent = "tasks " + title + ": " + total + " in the last " + note.replace(/^-/, "") + ", " + rateText +
    " now, at most " + max + " per " + bucketS + " s";
  plot.setAttribute("aria-label", alt.textContent);
  return h(
    "div",
    { class: "chart", "data-chart": title },
    h("div", { class: "title" }, h("b", {}, title), h("span", {}, total + " total · " + rateText)),
    plot,
    h("div", { class: "axis" }, h("span", {}, note), h("span", {}, "now · peak " + max)),
  );
}

function renderCharts(series) {
  const minutes = Math.round((series.bucket_s * series.submitted.length) / 60);
  const note = "-" + minutes + " min";
  $("charts").replaceChildren(
    chart("submitted", series.submitted, "#2f6fde", series.bucket_s, note),
    chart("finished", series.finished, "#1f9d55", series.bucket_s, note),
    // The API's "failed" series counts the tasks that ended in the state `error`.
    chart("error", series.failed, "#d64545", series.bucket_s, note),
  );
  $("charts-hint").textContent = "last " + minutes + " min, per " + series.bucket_s + " s";
}

function renderTasks(list) {
  const rows = list.tasks.map((t) =>
    h(
      "tr",
      // The id is the row's control (a link: focusable, Enter opens it); a click anywhere
      // on the row does the same.
      { "data-task": t.id, class: t.id === view.selectedTask ? "selected" : null, onclick: () => goToTask(t.id) },
      h("td", { class: "mono" }, taskLink(t.id, null, "open task " + t.id)),
      h("td", { class: "mono" }, t.type),
      h("td", {}, t.tenant),
      h("td", {}, taskBadges(t)),
      h("td", {}, t.attempt + " / " + t.max_attempts),
      h("td", {}, t.worker || h("span", { class: "muted" }, "—")),
      timeCell(t.created_at),
      timeCell(t.updated_at),
    ));
  fillBody($("tasks"), rows, "no matching tasks", 8);
  view.nextBefore = list.next_before;
  $("tasks-older").disabled = list.next_before === null;
  $("tasks-newest").disabled = view.before === null;
  const filters = Object.entries(view.search).filter(([, v]) => v).map(([k, v]) => k + "=" + v);
  $("tasks-hint").textContent = "newest first" + (filters.length ? " · " + filters.join(", ") : "") +
    (view.before !== null ? " · before #" + view.before : "");
}

function field(name, value) {
  if (value === null || value === undefined || value === "") return null;
  return h("div", {}, h("dt", {}, name), h("dd", {}, value));
}

// A link to a task's detail (#task-N); the hash change opens it (see setup).
function taskLink(id, cls, label) {
  const open = (ev) => {
    ev.preventDefault();
    ev.stopPropagation(); // a row's own click would open it a second time
    goToTask(id);
  };
  return h("a", { href: "#task-" + id, class: cls, "aria-label": label, onclick: open }, "#" + id);
}

function renderDetail(task) {
  $("task-detail").hidden = false;
  $("task-detail").dataset.task = String(task.id);
  $("detail-title").replaceChildren("Task #" + task.id + " ", taskBadges(task));
  const tree = task.tree;
  const fields = [
    field("type", h("span", { class: "mono" }, task.type)),
    field("tenant", task.tenant),
    field("state", task.state),
    field("attempt", task.attempt + " of " + task.max_attempts),
    // Attempts lost with a worker do not count against max_attempts (docs/TASKS.md).
    field("lost", task.lost ? task.lost + " with a worker (max " + task.max_lost + ", not counted)" : null),
    field("worker", task.worker && task.worker_state === "disconnected" ?
      task.worker + " (disconnected " + when(task.lost_suspected_at) + ")" : task.worker),
    field("created", when(task.created_at)),
    field("updated", when(task.updated_at)),
    // Time queued, then the start of the (last) attempt (docs/API.md, "Task times").
    field("queued", task.queued_ms === null || task.queued_ms === undefined ? null :
      (task.queued_ms / 1000).toFixed(3) + " s"),
    field("started", when(task.started_at)),
    field("finished", when(task.finished_at)),
    field("deadline", when(task.deadline)),
    field("start after", when(task.start_after)),
    field("slot", task.slot),
    field("transaction", task.transaction),
    field("code", task.code ? h("span", { class: "mono", title: task.code }, task.code.slice(0, 12) + "…") : null),
    field("resources", Object.keys(task.resources || {}).length ? chips(task.resources, resourceText) : null),
    field("tree", tree ? h("span", {}, badge(tree.state, tree.state === "completed" ? "finished" : tree.state === "failed" ? "error" : "waiting"),
      " attempt " + tree.attempt + ", timeout " + tree.timeout_s + " s" + (tree.reason ? " — " + tree.reason : "")) : null),
    field("tree root", task.root !== null && task.root !== undefined && task.root !== task.id ? taskLink(task.root) : null),
    field("parent", task.parent !== null && task.parent !== undefined ? taskLink(task.parent) : null),
    field("progress", runningProgress(task)),
    field("priority", task.priority ? String(task.priority) : null),
    field("retry backoff", task.retry_backoff_s ? task.retry_backoff_s + " s × 2^(n-1)" +
      (task.retry_backoff_max_s ? ", at most " + task.retry_backoff_max_s + " s" : "") : null),
    field("after", task.after && task.after.length ? linkList(task.after) : null),
    field("waiting for", waitingFor(task)),
  ];
  $("detail-fields").replaceChildren(...fields.filter(Boolean));
  $("detail-params").textContent = pretty(task.params);
  const hasResult = task.result !== null && task.result !== undefined;
  $("detail-result-box").hidden = !hasResult && task.state !== "finished";
  $("detail-result").textContent = hasResult ? pretty(task.result) : "null";
  $("detail-error-box").hidden = !task.error;
  $("detail-error").textContent = task.error || "";
  for (const row of $("tasks").tBodies[0].rows) {
    row.classList.toggle("selected", row.dataset.task === String(task.id));
  }
  return Promise.all([refreshOutput(task), refreshTree(task)]);
}

function linkList(ids) {
  return h("span", { class: "links" }, ...ids.flatMap((id, i) => (i ? [" ", taskLink(id)] : [taskLink(id)])));
}

// What keeps a queued task from running: the dependencies not finished yet, or (delayed)
// its start time; nothing is shown for a task that may run now.
function waitingFor(task) {
  if (!QUEUED.includes(task.state)) return null;
  const deps = task.waiting_for || [];
  if (deps.length) return h("span", {}, linkList(deps), " to finish");
  if (task.state === "delayed" && task.start_after) return "its start time, " + when(task.start_after);
  return null;
}

// Progress only while the attempt that reported it runs: a task that failed, finished or
// waits for a retry keeps its last report in the API, which is no longer progress.
function runningProgress(task) {
  const progress = task.progress;
  if (!progress || task.state !== "running" || progress.attempt !== task.attempt) return null;
  return progressView(progress);
}

// A running task's latest ctx.progress: a bar and its message (untrusted text: textContent).
function progressView(progress) {
  const percent = Math.round(progress.fraction * 100) + "%";
  const bar = h("progress", { class: "task-progress", max: "1", value: String(progress.fraction),
    "aria-label": "progress " + percent });
  return h("span", {}, bar, percent + (progress.message ? " " + progress.message : "") +
    " (attempt " + progress.attempt + ", " + ago(progress.updated_at) + ")");
}

function treeBadge(state) {
  return badge(state, state === "completed" ? "finished" : state === "pending" ? "waiting" : "error");
}

// The tree the task belongs to (GET /api/v1/trees/{root}): its state, age, timeout, its
// tasks by state and the tasks whose acks it waits for (each a link to its detail).
async function refreshTree(task) {
  const box = $("detail-tree-box");
  if (task.root === null || task.root === undefined) {
    box.hidden = true;
    return;
  }
  let tree;
  try {
    tree = await api("/api/v1/trees/" + task.root);
  } catch (error) {
    box.hidden = error.status === 404; // its root was purged: nothing to show
    $("detail-tree-note").textContent = error.status === 404 ? "" : "(" + error.message + ")";
    $("detail-tree-fields").replaceChildren();
    return;
  }
  if ($("task-detail").dataset.task !== String(task.id)) return; // another was opened
  const counts = Object.fromEntries(Object.entries(tree.tasks).filter(([, n]) => n > 0));
  const anchors = tree.pending_anchors.map((id) => taskLink(id));
  const more = tree.pending_count > anchors.length ? " (of " + tree.pending_count + ")" : "";
  const fields = [
    field("root", taskLink(tree.root)),
    field("state", h("span", {}, treeBadge(tree.state), tree.reason ? " " + tree.reason : "")),
    field("run", String(tree.attempt)),
    field("age", duration(tree.age_s)),
    field("timeout", tree.timeout_s + " s" + (tree.deadline ? ", times out " + when(tree.deadline) : "")),
    field("ended", when(tree.ended_at)),
    field("tasks", chips(counts, (state, n) => n + " " + state)),
    field("awaited acks", tree.pending_count ? h("span", {}, tree.pending_count + ": ", ...anchors.flatMap((a, i) => i ? [" ", a] : [a]), more) : "none"),
  ];
  $("detail-tree-note").textContent = "#" + tree.root;
  $("detail-tree-fields").replaceChildren(...fields.filter(Boolean));
  box.hidden = false;
}

const OUTPUT_SHOWN_CHARS = 1024 * 1024;

// The attempt's captured stdout/stderr/ctx.logger output: untrusted text, set with
// textContent only. Fetched incrementally (offset) while the attempt runs.
async function refreshOutput(task) {
  const shown = view.output;
  if (shown.task !== task.id || shown.attempt !== task.attempt) {
    Object.assign(shown, { task: task.id, attempt: task.attempt, offset: 0, text: "", complete: false });
  }
  if (task.attempt < 1) {
    $("detail-output-box").hidden = true;
    return;
  }
  if (!shown.complete) {
    let logs;
    try {
      logs = await api("/api/v1/tasks/" + task.id + "/logs?attempt=" + task.attempt + "&offset=" + shown.offset);
    } catch (error) {
      $("detail-output-box").hidden = false;
      $("detail-output-note").textContent = "(" + error.message + ")";
      return;
    }
    if (shown.task !== task.id || shown.attempt !== task.attempt) return; // another was opened
    if (logs.truncated) shown.text += "[... earlier output dropped ...]\n";
    shown.text = (shown.text + logs.output).slice(-OUTPUT_SHOWN_CHARS);
    shown.offset = logs.next_offset;
    shown.complete = logs.complete;
    shown.available = logs.available || shown.text !== "";
  }
  $("detail-output-box").hidden = false;
  $("detail-output-note").textContent = !shown.available
    ? "(none captured for attempt " + task.attempt + ")"
    : "attempt " + task.attempt + (shown.complete ? (shown.text === "" ? ": empty" : "") : ", live");
  $("detail-output").textContent = shown.text;
  $("detail-output").hidden = shown.text === ""; // no empty black box under "(none captured ...)"
}

function showDetailError(id, error) {
  $("task-detail").hidden = false;
  $("task-detail").dataset.task = String(id);
  $("detail-title").textContent = "Task #" + id;
  $("detail-fields").replaceChildren(h("div", {}, h("dt", {}, "error"), h("dd", {}, error.message)));
  $("detail-params").textContent = "";
  $("detail-result-box").hidden = true;
  $("detail-error-box").hidden = true;
  $("detail-output-box").hidden = true;
  $("detail-tree-box").hidden = true;
}

// --- refresh -----------------------------------------------------------------------------

function tasksQuery() {
  const params = new URLSearchParams({ limit: String(TASK_PAGE) });
  for (const [k, v] of Object.entries(view.search)) if (v) params.set(k, v);
  if (view.before !== null) params.set("before", String(view.before));
  return "/api/v1/tasks/recent?" + params.toString();
}

async function refresh() {
  if (view.busy) return;
  view.busy = true;
  const errors = [];
  const guard = (promise, render) =>
    promise.then(render).catch((error) => {
      errors.push(error);
    });
  try {
    const brokers = api("/api/v1/cluster/brokers");
    const tenants = api("/api/v1/tenants");
    const jobs = [
      guard(brokers, renderBrokers),
      guard(tenants, (body) => renderTenants(body.tenants)),
      guard(Promise.all([brokers, tenants]), ([b, t]) => renderCounts(b, t.tenants)),
      guard(api("/api/v1/workers"), (body) => renderWorkers(body.workers)),
      guard(api("/api/v1/stats/throughput"), renderCharts),
      guard(api(tasksQuery()), renderTasks),
      guard(api("/api/v1/schedules"), (body) => renderSchedules(body.schedules)),
    ];
    if (view.selectedTask !== null) {
      const id = view.selectedTask;
      jobs.push(api("/api/v1/tasks/" + id).then(renderDetail, (error) => {
        if (error.status === 404) showDetailError(id, error);
        else errors.push(error);
      }));
    }
    await Promise.all(jobs);
    // A failed read is reported once (the cards share the brokers' and tenants' reads).
    const unique = errors.filter((e, i) => errors.findIndex((o) => o.message === e.message) === i);
    showBanner(unique);
    $("updated").textContent = unique.length ? "refresh failed" : "updated " + new Date().toLocaleTimeString();
    view.loaded = true;
    revealDetail();
  } finally {
    view.busy = false;
  }
}

function schedule() {
  clearTimeout(view.timer);
  view.timer = null;
  if (!$("auto-refresh").checked) return;
  view.timer = setTimeout(async () => {
    await refresh();
    schedule();
  }, REFRESH_MS);
}

async function refreshNow() {
  await refresh();
  schedule();
}

// Brings the opened detail to the top of the window and moves the keyboard focus to its
// title; before the first refresh has rendered, the tables above it are still growing, so
// that refresh does it (a fresh load of /#task-N).
function revealDetail() {
  const detail = $("task-detail");
  if (!view.reveal || !view.loaded || detail.hidden) return;
  view.reveal = false;
  detail.scrollIntoView({ block: "start" });
  $("detail-title").focus({ preventScroll: true });
}

function openTask(id) {
  view.selectedTask = id;
  view.reveal = true;
  api("/api/v1/tasks/" + id).then(
    (task) => {
      renderDetail(task);
      revealDetail();
    },
    (error) => {
      if (error.status === 401 || error.status === 403) showBanner([error]);
      showDetailError(id, error);
      revealDetail();
    },
  );
}

function hashTask() {
  const match = /^#task-(\d{1,18})$/.exec(location.hash);
  return match ? Number(match[1]) : null;
}

// Every way of opening a task goes through the address (#task-N), so it can be shared and
// the Back button returns; the hashchange listener opens it.
function goToTask(id) {
  if (hashTask() === id) openTask(id);
  else location.hash = "task-" + id;
}

// --- wiring ------------------------------------------------------------------------------

function setup() {
  $("token-input").value = token();
  $("token-form").addEventListener("submit", (ev) => {
    ev.preventDefault();
    const value = $("token-input").value.trim();
    if (value) sessionStorage.setItem(TOKEN_KEY, value);
    else sessionStorage.removeItem(TOKEN_KEY);
    refreshNow();
  });
  $("token-clear").addEventListener("click", () => {
    sessionStorage.removeItem(TOKEN_KEY);
    $("token-input").value = "";
    refreshNow();
  });
  $("auto-refresh").addEventListener("change", schedule);
  $("task-search").addEventListener("submit", (ev) => {
    ev.preventDefault();
    const id = $("search-id").value.trim();
    view.search = {
      state: $("search-state").value,
      tenant: $("search-tenant").value.trim(),
      type: $("search-type").value.trim(),
    };
    view.before = null;
    if (id) {
      if (/^\d{1,18}$/.test(id)) goToTask(Number(id));
      else {
        view.reveal = true;
        showDetailError(id, new Error("a task id is a number: type digits only, e.g. 42"));
        revealDetail();
      }
    }
    refreshNow();
  });
  $("search-reset").addEventListener("click", () => {
    for (const name of ["search-id", "search-tenant", "search-type"]) $(name).value = "";
    $("search-state").value = "";
    view.search = { state: "", tenant: "", type: "" };
    view.before = null;
    refreshNow();
  });
  $("tasks-older").addEventListener("click", () => {
    if (view.nextBefore === null) return;
    view.before = view.nextBefore;
    refreshNow();
  });
  $("tasks-newest").addEventListener("click", () => {
    view.before = null;
    refreshNow();
  });
  $("detail-close").addEventListener("click", () => {
    const id = view.selectedTask;
    view.selectedTask = null;
    view.reveal = false;
    $("task-detail").hidden = true;
    for (const row of $("tasks").tBodies[0].rows) row.classList.remove("selected");
    if (hashTask() !== null) history.replaceState(null, "", location.pathname + location.search);
    // The keyboard focus goes back to the task's row when it is shown.
    const link = document.querySelector('#tasks tr[data-task="' + id + '"] a');
    if (link) link.focus();
  });
  window.addEventListener("hashchange", () => {
    const id = hashTask();
    if (id !== null) openTask(id);
  });
  const id = hashTask();
  if (id !== null) openTask(id);
  refreshNow();
}

document.addEventListener("DOMContentLoaded", setup);
