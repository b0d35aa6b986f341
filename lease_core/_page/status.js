// The status page: reads the JSON API every few seconds and renders it. Built with
// textContent only, so names from the store are never parsed as HTML.
"use strict";

const REFRESH_MS = 3000;
const RUNS_PER_JOB = 3;
let timer = null;

// A bearer token, when the server needs one, is given in the fragment: /#token=...
// The fragment never leaves the browser; the token is sent as the Authorization header.
function token() {
  return new URLSearchParams(location.hash.slice(1)).get("token");
}

async function getJson(path) {
  const headers = token() ? { Authorization: "Bearer " + token() } : {};
  const response = await fetch(path, { headers, cache: "no-store" });
  const body = await response.json().catch(() => ({}));
  if (!response.ok) {
    const hint = response.status === 401 ? " (open this page as /#token=YOUR-TOKEN)" : "";
    throw new Error((body.error || response.statusText) + hint);
  }
  return body;
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
  return el("span", { class: "status " + text }, text);
}

function shortTime(iso) {
  return iso.replace("T", " ").replace(".000+", "+").replace("+00:00", "Z");
}

function time(iso) {
  return iso ? el("time", { datetime: iso }, shortTime(iso)) : "-";
}

function table(headings, rows) {
  return el("table", {},
    el("thead", {}, el("tr", {}, ...headings.map((h) => el("th", {}, h)))),
    el("tbody", {}, ...rows));
}

function stepsTable(run) {
  return table(["step", "status", "attempt", "holder", "started", "finished", "lease expires"],
    run.steps.map((step) => el("tr", { "data-step": step.name, "data-status": step.status },
      el("td", {}, step.name), el("td", {}, status(step.status)),
      el("td", {}, step.attempt === null ? "-" : String(step.attempt)),
      el("td", {}, step.instance_id), el("td", {}, time(step.started_at)),
      el("td", {}, time(step.finished_at)), el("td", {}, time(step.lease_expires_at)))));
}

function logTable(entries) {
  if (entries.length === 0) return el("p", { class: "empty" }, "no recorded attempts");
  return table(["at", "step", "attempt", "event", "instance", "detail"],
    entries.map((e) => el("tr", { "data-event": e.event },
      el("td", {}, time(e.at)), el("td", {}, e.step), el("td", {}, String(e.attempt)),
      el("td", {}, status(e.event)), el("td", {}, e.instance_id), el("td", {}, e.detail))));
}

function runCard(run, log) {
  const card = el("section", { class: "run", "data-run": run.id, "data-status": run.status },
    el("h3", {}, time(run.scheduled_at), " ", status(run.status)));
  if (run.kind === "workflow") {
    card.append(stepsTable(run));
  } else {
    const stored = run.store_status === run.status ? "" : ` (${run.store_status.replace("_", " ")})`;
    card.append(el("p", { class: "muted" }, `attempt ${run.attempt} by ${run.instance_id}${stored}`));
  }
  card.append(el("h3", {}, "recovery log"), logTable(log));
  return card;
}

async function refresh() {
  clearTimeout(timer);
  const state = document.getElementById("state");
  try {
    const data = await getJson("jobs?limit=" + RUNS_PER_JOB);
    const runs = data.jobs.flatMap((job) => job.runs);
    const logs = await Promise.all(
      runs.map((run) => getJson("jobs/" + encodeURIComponent(run.id) + "/recovery-log")));
    const logOf = new Map(runs.map((run, i) => [run.id, logs[i]]));
    const sections = data.jobs.map((job) => el("article", { "data-job": job.name },
      el("h2", {}, job.name, " ", el("span", { class: "kind" }, job.kind)),
      ...(job.runs.length ? job.runs.map((run) => runCard(run, logOf.get(run.id)))
        : [el("p", { class: "empty" }, "no runs recorded")])));
    document.getElementById("jobs").replaceChildren(
      ...(sections.length ? sections : [el("p", { class: "empty" }, "no jobs recorded yet")]));
    state.className = "";
    state.textContent = `store time ${shortTime(data.now)}, refreshed every ${REFRESH_MS / 1000} s`;
  } catch (error) {
    state.className = "error";
    state.textContent = "cannot read the status: " + error.message;
  } finally {
    clearTimeout(timer);
    timer = setTimeout(refresh, REFRESH_MS);
  }
}

window.addEventListener("hashchange", refresh);
refresh();
