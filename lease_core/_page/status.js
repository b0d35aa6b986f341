// The status page: one view at a time, chosen by the address's fragment, each read with
// one request per refresh:
//   #                      the overview: every job and workflow, filtered, searched, paged
//   #job=NAME              one job's or workflow's latest runs
//   #run=NAME@SLOT         one run, its steps and its recovery log
// Built with textContent only, so names from the store are never parsed as HTML.
// With a token, a job's or workflow's view has trigger/pause/resume buttons, a run's view
// (a job's or a workflow's) retry/cancel: POST operations, which always need the token.
// The overview marks paused jobs and workflows with or without a token (it is state).
// Each refresh drops the answer of the one before it (a slower answer never redraws over a
// newer view), and a request unanswered in TIMEOUT_MS is an error, not a wait forever.
// A hidden tab (another tab in front, a minimised window) reads nothing: the page refreshes
// at once when it is shown again.
"use strict";

let REFRESH_MS = 3000;  // let: the browser test shortens it
let TIMEOUT_MS = 10000;  // let: the browser test shortens it
const PER_PAGE = 50;
const FILTERS = ["all", "running", "failed", "ok", "never"];
let timer = null;
let reading = null;  // the AbortController of the newest refresh
let shown = null;    // which view #view holds ("overview", "job NAME", "run ID"), or null
window.anarchonRequests = 0;   // read by the browser test: requests made so far,
window.anarchonRefreshes = 0;  // and refreshes (one request each)
window.anarchonRenderMs = null; // how long the last render took

// The fragment holds the view and, when the server needs one, the bearer token
// (#token=...): the fragment never leaves the browser; the token is sent as a header.
// A "+" in the fragment is itself (a base64 token has them), not a space as in a query:
// the page writes spaces as %20 (go), so a "+" there was typed or pasted. So is a "&" not
// followed by one of the page's keys (a token typed with "&" in it): the page writes a
// "&" inside a value as %26.
const KEYS = ["token", "job", "run", "status", "q", "page"];
function params() {
  const pieces = [];
  for (const piece of location.hash.slice(1).split("&")) {
    if (pieces.length && !KEYS.includes(piece.split("=")[0])) {
      pieces[pieces.length - 1] += "%26" + piece;
    } else {
      pieces.push(piece);
    }
  }
  return new URLSearchParams(pieces.join("&").replace(/\+/g, "%2B"));
}

function go(changes) {
  const next = new URLSearchParams();
  const token = params().get("token");
  if (token) next.set("token", token);
  for (const [key, value] of Object.entries(changes)) {
    if (value !== null && value !== "" && value !== undefined) next.set(key, value);
  }
  location.hash = next.toString().replace(/\+/g, "%20");
}

function link(text, changes, attrs) {
  // data-key: the same link in the next redraw, to focus again (keepFocus)
  const a = el("a", { href: "#", "data-key": "go " + JSON.stringify(changes), ...(attrs || {}) },
               text);
  a.addEventListener("click", (event) => { event.preventDefault(); go(changes); });
  return a;
}

async function getJson(path) {
  const token = params().get("token");
  const headers = token ? { Authorization: "Bearer " + token } : {};
  const signal = reading.signal;
  window.anarchonRequests += 1;
  const response = await fetch(path, { headers, cache: "no-store", signal });
  const body = await response.json().catch(() => ({}));
  signal.throwIfAborted();  // a newer refresh started, or this one timed out
  if (!response.ok) {
    const hint = response.status === 401 ? " (open this page as /#token=YOUR-TOKEN)" : "";
    throw new Error((body.error || response.statusText) + hint);
  }
  return body;
}

// --- operations (only with a token: every POST needs it) --------------------------------

let notice = null;  // what the last operation answered, shown in its view until it changes
let sending = null;  // the operation whose answer is awaited: the others wait for it

async function postJson(path) {
  const token = params().get("token");
  window.anarchonRequests += 1;
  // An operation unanswered in TIMEOUT_MS is reported, not awaited forever (the buttons
  // would stay disabled); the server may still have made it, which the view then shows.
  const late = new AbortController();
  const timeout = setTimeout(() => late.abort(new Error(
    `no answer in ${TIMEOUT_MS / 1000} s; it may still have been made, as the view will show`)),
    TIMEOUT_MS);
  try {
    const response = await fetch(path, { method: "POST", cache: "no-store", signal: late.signal,
                                         headers: { Authorization: "Bearer " + token } });
    const body = await response.json().catch(() => ({}));
    late.signal.throwIfAborted();
    if (!response.ok) throw new Error(body.error || response.statusText);
    return body;
  } catch (error) {
    throw late.signal.aborted ? late.signal.reason : error;
  } finally {
    clearTimeout(timeout);
  }
}

function operations(buttons) {
  if (!params().get("token")) return el("span", {});
  const bar = el("p", { class: "operations" }, ...buttons.map(([label, path]) => {
    // aria-disabled, not disabled: the focus stays on the button pressed
    const button = el("button", { type: "button", "data-operation": label,
                                  "data-key": "operation " + label,
                                  "aria-disabled": String(sending !== null) }, label);
    button.addEventListener("click", async () => {
      if (sending !== null) return;  // one POST at a time: a double click triggers once
      const view = location.hash;
      sending = label;
      for (const other of bar.querySelectorAll("button")) {
        other.setAttribute("aria-disabled", "true");
      }
      let answer;
      try {
        const body = await postJson(path);
        answer = { ok: true, text: `${label}: done` + (body.id ? ` (${body.id})` : "") };
      } catch (error) {
        answer = { ok: false, text: `${label}: ${error.message}` };
      } finally {
        sending = null;
      }
      if (location.hash === view) {  // the answer belongs to the view it was made in
        notice = answer;
        announce(answer.text);
      }
      refresh();
    });
    return button;
  }));
  if (notice) bar.append(el("span", { id: "op-result", class: notice.ok ? "ok" : "error" },
                            notice.text));
  return bar;
}

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs || {})) {
    if (key === "class") node.className = value;
    else node.setAttribute(key, value);
  }
  for (const child of children) {
    node.append(child instanceof Node ? child : document.createTextNode(child ?? "-"));
  }
  return node;
}

function status(text) {
  return el("span", { class: "status " + text }, text.replace("_", " "));
}

function shortTime(iso) {
  return iso.replace("T", " ").replace(".000+", "+").replace("+00:00", "Z");
}

function time(iso) {
  return iso ? el("time", { datetime: iso }, shortTime(iso)) : "-";
}

// When a run waiting for its retry (store status retrying: no lease) will be retried:
// "retry at 14:03:07Z" that day (UTC, as every time on the page), else with its date.
function retryAt(iso) {
  const today = iso.slice(0, 10) === new Date().toISOString().slice(0, 10);
  return el("span", { class: "retry-at" }, "retry at ",
    el("time", { datetime: iso, title: shortTime(iso) },
       today ? iso.slice(11, 19) + "Z" : shortTime(iso)));
}

function seconds(ms) {
  if (ms === null || ms === undefined) return "-";
  if (ms < 1000) return `${ms} ms`;
  if (ms < 120000) return `${(ms / 1000).toFixed(1)} s`;
  return `${(ms / 60000).toFixed(1)} min`;
}

function table(headings, rows) {
  return el("table", {},
    el("thead", {}, el("tr", {}, ...headings.map((h) => el("th", {}, h)))),
    el("tbody", {}, ...rows));
}

// Who holds or held a run: a run queued by an operation (a trigger) has no attempt yet, and
// its instance_id names who asked (as `anarchon status` says), not a holder.
function holder(run) {
  return run.attempt === 0 ? `queued by ${run.instance_id}, not claimed yet`
    : `attempt ${run.attempt} by ${run.instance_id}`;
}

// --- the overview -----------------------------------------------------------------------

function inProgress(row) {
  if (row.running.length === 0) return "-";
  return el("span", {}, ...row.running.flatMap((r, i) => {
    const step = r.step ? `${r.step}: ` : "";
    const lease = r.handed_over ? "handed over at a stop or retried, next attempt not claimed yet"
      : r.status === "retrying" ? (r.retry_at ? "failed, " : "failed, waiting for its retry")
      : r.lease_left_ms > 0 ? `lease ${seconds(r.lease_left_ms)} left`
        : `lease expired ${seconds(-r.lease_left_ms)} ago`;
    const text = r.attempt === 0 ? `${step}${holder(r)}` : `${step}${holder(r)}, ${lease}`;
    // "failed, retry at 14:03:07Z": when the retry of a run waiting for it is due
    const shown = r.retry_at ? el("span", {}, text, retryAt(r.retry_at)) : text;
    return [...(i ? [el("br")] : []), link(shown, { run: r.id }, { class: "run-link" })];
  }));
}

// A redraw replaces the links and buttons: the one that had the keyboard's focus gets it
// back in the new drawing (its data-key or id names it), so a keyboard user keeps their
// place across refreshes.
function keepFocus(draw) {
  const focused = document.activeElement;
  const key = focused && focused !== document.body ? focused.dataset.key || focused.id : "";
  draw();
  if (key && !focused.isConnected) {
    const again = document.querySelector(`[data-key="${CSS.escape(key)}"]`)
      || document.getElementById(key);
    if (again) again.focus({ preventScroll: true });
  }
}

// What screen readers announce (#announce, a live region): an operation's answer and a
// read that fails, once each; not the store time of every refresh.
function announce(text) {
  const region = document.getElementById("announce");
  if (region.textContent !== text) region.textContent = text;
}

function overviewRow(row) {
  const last = row.last;
  return el("tr", { "data-job": row.name, "data-kind": row.kind, "data-state": row.state,
                    "data-running": String(row.running.length) },
    el("td", {}, link(row.name, { job: row.name }),
      ...(row.paused
        ? [" ", el("span", { class: "paused", title: `paused by ${row.paused}` }, "paused")]
        : [])),
    el("td", {}, el("span", { class: "kind" }, row.kind)),
    el("td", {}, row.schedule ?? "-"),
    el("td", {}, last ? link(status(last.status), { run: last.id }) : el("span", { class: "muted" }, "never")),
    el("td", {}, last ? time(last.finished_at) : "-"),
    el("td", {}, last ? seconds(last.duration_ms) : "-"),
    el("td", {}, time(row.next_at)),
    el("td", {}, inProgress(row)));
}

function renderToolbar(data) {
  const filters = document.getElementById("filters");
  filters.replaceChildren(...FILTERS.map((f) => {
    const button = el("button", { type: "button", "data-filter": f, "data-key": "filter " + f,
                                  "aria-pressed": String(f === data.status) },
      `${f} (${data.counts[f]})`);
    button.addEventListener("click", () => go({ status: f === "all" ? null : f,
                                                q: params().get("q") }));
    return button;
  }));
  const pager = document.getElementById("pager");
  const move = (page) => go({ status: params().get("status"), q: params().get("q"), page });
  const prev = el("button", { type: "button", id: "prev" }, "‹ previous");
  const next = el("button", { type: "button", id: "next" }, "next ›");
  prev.disabled = data.page <= 1;
  next.disabled = data.page >= data.pages;
  prev.addEventListener("click", () => move(data.page - 1));
  next.addEventListener("click", () => move(data.page + 1));
  pager.replaceChildren(prev, el("span", { id: "page" }, `page ${data.page} of ${data.pages}, ${data.total} jobs`), next);
}

async function overview(p) {
  const query = new URLSearchParams({ status: p.get("status") || "all", q: p.get("q") || "",
                                      page: p.get("page") || "1", per_page: String(PER_PAGE) });
  const data = await getJson("overview?" + query);
  const started = performance.now();
  // Counts are of the jobs the search matches: none is not an empty store.
  const empty = data.total ? `no job on page ${data.page}: the last is page ${data.pages}`
    : data.counts.all || data.query.trim() ? "no job matches" : "no jobs recorded yet";
  keepFocus(() => {
    renderToolbar(data);
    document.getElementById("view").replaceChildren(data.rows.length
      ? table(["job", "kind", "schedule", "last run", "finished", "took", "next slot",
               "in progress"], data.rows.map(overviewRow))
      : el("p", { class: "empty" }, empty));
  });
  window.anarchonRenderMs = performance.now() - started;
  return data.now;
}

// --- one job, one run -------------------------------------------------------------------

function stepsTable(run) {
  return table(["step", "status", "attempt", "holder", "started", "finished", "lease expires"],
    run.steps.map((step) => el("tr", { "data-step": step.name, "data-status": step.status },
      el("td", {}, step.name), el("td", {}, status(step.status)),
      el("td", {}, step.attempt === null ? "-" : String(step.attempt)),
      el("td", {}, step.attempt === 0 ? `queued by ${step.instance_id}` : step.instance_id),
      el("td", {}, time(step.started_at)),
      el("td", {}, time(step.finished_at)),
      el("td", {}, step.retry_at ? retryAt(step.retry_at) : time(step.lease_expires_at)))));
}

function logTable(entries) {
  if (entries.length === 0) return el("p", { class: "empty" }, "no recorded attempts");
  return table(["at", "step", "attempt", "event", "instance", "detail"],
    entries.map((e) => el("tr", { "data-event": e.event },
      el("td", {}, time(e.at)), el("td", {}, e.step), el("td", {}, String(e.attempt)),
      el("td", {}, status(e.event)), el("td", {}, e.instance_id), el("td", {}, e.detail))));
}

async function job(name) {
  const data = await getJson("runs/" + encodeURIComponent(name) + "?limit=20");
  const rows = data.runs.map((run) => el("tr", { "data-run": run.id, "data-status": run.status },
    el("td", {}, link(time(run.scheduled_at), { run: run.id })),
    el("td", {}, status(run.status)),
    el("td", {}, run.kind === "workflow"
      ? el("span", {}, ...run.steps.map((s) => status(s.status)))
      : el("span", {}, holder(run), ...(run.retry_at ? [", ", retryAt(run.retry_at)] : []))),
    el("td", {}, time(run.kind === "workflow" ? run.attempts[0]?.claimed_at : run.started_at)),
    el("td", {}, time(run.finished_at))));
  keepFocus(() => document.getElementById("view").replaceChildren(
    el("article", { "data-job": data.name },
      el("p", {}, link("‹ every job", {})),
      el("h2", {}, data.name, " ", el("span", { class: "kind" }, data.kind)),
      operations(["trigger", "pause", "resume"].map(
        (op) => [op, "jobs/" + encodeURIComponent(data.name) + "/" + op])),
      rows.length ? table(["slot", "status", data.kind === "workflow" ? "steps" : "attempt",
                           "started", "finished"], rows)
        : el("p", { class: "empty" }, "no runs recorded"))));
  return data.now;
}

async function run(id) {
  const data = await getJson("jobs/" + encodeURIComponent(id) + "?log=1");
  const card = el("section", { class: "run", "data-run": data.id, "data-status": data.status },
    el("h3", {}, time(data.scheduled_at), " ", status(data.status)));
  if (data.kind === "workflow") {
    card.append(stepsTable(data));
  } else {
    const stored = data.store_status === data.status ? "" : ` (${data.store_status.replace("_", " ")})`;
    card.append(el("p", { class: "muted" }, `${holder(data)}${stored}`,
                   ...(data.retry_at ? [", ", retryAt(data.retry_at)] : [])));
  }
  // A workflow's run too: a retry resumes it at the step that failed, a cancel cancels
  // its step in progress (the operations find the step).
  card.append(operations(["retry", "cancel"].map(
    (op) => [op, "jobs/" + encodeURIComponent(data.id) + "/" + op])));
  card.append(el("h3", {}, "recovery log"), logTable(data.recovery_log));
  keepFocus(() => document.getElementById("view").replaceChildren(
    el("article", { "data-job": data.name },
      el("p", {}, link("‹ every job", {}), " · ", link(data.name, { job: data.name })),
      el("h2", {}, data.name, " ", el("span", { class: "kind" }, data.kind)), card)));
  return null;
}

async function refresh() {
  clearTimeout(timer);
  if (reading) reading.abort();  // its answer, when it comes, would be older than this one's
  const mine = reading = new AbortController();
  const late = setTimeout(
    () => mine.abort(new Error(`no answer in ${TIMEOUT_MS / 1000} s`)), TIMEOUT_MS);
  window.anarchonRefreshes += 1;
  const state = document.getElementById("state");
  const view = document.getElementById("view");
  const p = params();
  const where = p.get("run") ? "run " + p.get("run") : p.get("job") ? "job " + p.get("job")
    : "overview";
  document.getElementById("toolbar").hidden = where !== "overview";
  const search = document.getElementById("search");
  if (document.activeElement !== search) search.value = p.get("q") || "";
  try {
    const now = p.get("run") ? await run(p.get("run"))
      : p.get("job") ? await job(p.get("job")) : await overview(p);
    shown = where;
    view.classList.remove("stale");
    state.className = "";
    state.textContent = (now ? `store time ${shortTime(now)}, ` : "")
      + `refreshed every ${REFRESH_MS / 1000} s`;
    if (document.getElementById("announce").textContent.startsWith("cannot read")) {
      announce("");
    }
  } catch (error) {
    if (mine !== reading) return;  // a newer refresh answers instead
    // What is drawn is an earlier read: dimmed, or gone when it is another view's.
    if (shown === where) view.classList.add("stale");
    else { view.replaceChildren(); shown = null; }
    state.className = "error";
    state.textContent = "cannot read the status: " + error.message
      + (shown ? " (what is shown is from an earlier read)" : "");
    announce(state.textContent);
  } finally {
    clearTimeout(late);
    if (mine === reading) {
      clearTimeout(timer);
      timer = setTimeout(tick, REFRESH_MS);
    }
  }
}

// The periodic refresh: none while the tab is hidden (visibilitychange refreshes then).
function tick() {
  if (!document.hidden) refresh();
}

let typing = null;
document.getElementById("search").addEventListener("input", (event) => {
  clearTimeout(typing);
  typing = setTimeout(() => go({ status: params().get("status"), q: event.target.value }), 250);
});
document.getElementById("home").addEventListener("click", (event) => {
  event.preventDefault();
  go({});
});
document.addEventListener("visibilitychange", () => {
  if (!document.hidden) refresh();  // what the store holds now, not when the tab was hidden
});
window.addEventListener("hashchange", () => {
  notice = null;  // an operation's answer belongs to the view it was made in
  refresh();
});
refresh();
