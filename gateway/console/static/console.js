// The console's live parts: the turns list and a turn's page follow the server-sent events of
// /console/live; the approvals editor checks the arguments against the tool's schema as one
// types. No library: the pages work without this script, only less live.
"use strict";

function cell(text) {
  const td = document.createElement("td");
  td.textContent = text;
  return td;
}

function link(href, text) {
  const a = document.createElement("a");
  a.href = href;
  a.textContent = text;
  return a;
}

function when(seconds) {
  return seconds ? new Date(seconds * 1000).toISOString().replace("T", " ").slice(0, 19) : "";
}

function renderRow(tr, row) {
  tr.replaceChildren();
  tr.dataset.turn = row.turn_id;
  tr.dataset.updated = row.updated_at;
  const first = document.createElement("td");
  first.append(link("/console/turns/" + row.turn_id, row.turn_id));
  if (row.parent_turn_id) {
    const span = document.createElement("span");
    span.className = "child";
    span.textContent = " child of " + row.parent_turn_id;
    first.append(span);
  }
  tr.append(first, cell(row.agent));
  const session = document.createElement("td");
  if (row.session_id) session.append(link("/console/sessions/" + row.session_id, row.session_id));
  tr.append(session);
  const status = cell(row.status + (row.waiting ? " (" + row.waiting + ")" : ""));
  status.className = "status";
  status.dataset.status = row.status;
  tr.append(status, cell(row.step === null ? "" : String(row.step)), cell(when(row.created_at)),
            cell(row.finish_reason));
}

function followList(table) {
  const body = table.tBodies[0];
  const wanted = {agent: table.dataset.agent, status: table.dataset.status,
                  session: table.dataset.session};
  const counts = {};
  document.querySelectorAll(".count[data-status]").forEach((el) => {
    counts[el.dataset.status] = el.querySelector("strong");
  });
  const known = new Map();
  body.querySelectorAll("tr[data-turn]").forEach((tr) => {
    const status = tr.querySelector(".status").dataset.status;
    known.set(tr.dataset.turn, status);
  });
  function count(status, by) {
    const el = counts[status];
    if (el) el.textContent = String(Number(el.textContent) + by);
  }
  function applyRow(row) {
    const before = known.get(row.turn_id);
    if (before !== row.status) {
      if (before) count(before, -1);
      count(row.status, 1);
      known.set(row.turn_id, row.status);
    }
    const shown = (!wanted.agent || row.agent === wanted.agent) &&
                  (!wanted.status || row.status === wanted.status) &&
                  (!wanted.session || row.session_id === wanted.session);
    let tr = body.querySelector('tr[data-turn="' + CSS.escape(row.turn_id) + '"]');
    if (!shown) {
      if (tr) tr.remove();
      return;
    }
    if (tr && Number(tr.dataset.updated) > row.updated_at) return;
    if (!tr) {
      tr = document.createElement("tr");
      body.prepend(tr);
      const empty = document.getElementById("empty");
      if (empty) empty.remove();
    }
    renderRow(tr, row);
  }
  const source = new EventSource(table.dataset.live);
  source.addEventListener("reload", () => window.location.reload());
  source.addEventListener("row", (message) => applyRow(JSON.parse(message.data).row));
  // the feed is open: what changed between the page's read and now comes once more
  source.addEventListener("ready", async () => {
    const response = await fetch("/console/rows?since=" + table.dataset.since);
    if (response.ok) (await response.json()).forEach(applyRow);
  });
}

function openInPlace(root) {
  root.querySelectorAll("details[data-src]").forEach((details) => {
    details.addEventListener("toggle", async () => {
      if (!details.open || details.dataset.loaded) return;
      const response = await fetch(details.dataset.src);
      details.querySelector(".subtree").innerHTML = await response.text();
      details.dataset.loaded = "1";
      openInPlace(details);
    });
  });
}

function followTurn(box) {
  const text = document.getElementById("live-text");
  const status = document.getElementById("turn-status");
  const steps = new Map();
  let pending = null;
  async function refresh() {
    pending = null;
    const response = await fetch(box.dataset.src);
    if (response.ok) {
      // what the person opened stays open (and loads again) across the refresh
      const opened = [...box.querySelectorAll("details[open][data-src]")]
        .map((d) => d.dataset.src);
      box.innerHTML = await response.text();
      openInPlace(box);
      opened.forEach((src) => {
        const details = box.querySelector('details[data-src="' + CSS.escape(src) + '"]');
        if (details) details.open = true;
      });
      const now = document.getElementById("fragment-status");
      if (now && status) status.textContent = now.textContent;
    }
  }
  function soon() {
    if (!pending) pending = setTimeout(refresh, 150);
  }
  const source = new EventSource(box.dataset.live);
  source.addEventListener("reload", soon);
  source.addEventListener("ready", soon);  // what changed between the page's read and now
  source.addEventListener("delta", (message) => {
    const d = JSON.parse(message.data);
    if (d.turn_id !== box.dataset.turn) return;
    const parts = d.restarted || !steps.has(d.step) ? [] : steps.get(d.step);
    parts[d.seq] = d.text;
    steps.set(d.step, parts);
    // a page that joined late, or a gap in seq: "…" where text is missing (the step's saved
    // answer shows in the timeline once the step completes)
    text.textContent = [...steps.keys()].sort((a, b) => a - b).map((k) => {
      const got = steps.get(k);
      return Array.from(got, (piece) => (piece === undefined ? "…" : piece)).join("")
        .replace(/…+/g, "…");
    }).join("\n");
    document.getElementById("live-text-section").hidden = false;
  });
  source.addEventListener("row", (message) => {
    const change = JSON.parse(message.data);
    if (change.turn_id === box.dataset.turn && status) {
      const row = change.row;
      status.textContent = row.status + (row.waiting ? " (" + row.waiting + ")" : "");
    }
    soon();
  });
}

function checkArguments(form) {
  const area = form.querySelector("textarea[name=arguments]");
  const said = form.querySelector(".check");
  let timer = null;
  async function check() {
    const response = await fetch("/console/approvals/check", {
      method: "POST",
      headers: {"content-type": "application/json"},
      body: JSON.stringify({tool: form.dataset.tool, arguments: area.value}),
    });
    const problems = (await response.json()).problems;
    said.textContent = problems.length ? problems.join("; ") : "Valid for the tool's schema.";
    said.className = problems.length ? "check error" : "check ok";
    area.setAttribute("aria-invalid", problems.length ? "true" : "false");
  }
  area.addEventListener("input", () => {
    clearTimeout(timer);
    timer = setTimeout(check, 250);
  });
}

document.addEventListener("DOMContentLoaded", () => {
  const table = document.getElementById("turns");
  if (table) followList(table);
  const box = document.getElementById("timeline");
  if (box) {
    openInPlace(box);
    followTurn(box);
  }
  document.querySelectorAll("form.decide").forEach(checkArguments);
});
