// Events page: the audit log, filtered and paged, with new events arriving live at the top.
"use strict";

(() => {
  const { api, el, fmt, fillTable, pager, debounce, tail, toast } = SF;
  const LIMIT = 100;
  let skip = 0;
  const table = document.getElementById("events");
  const filters = {
    kind: document.getElementById("filter-kind"),
    actor: document.getElementById("filter-actor"),
    device_id: document.getElementById("filter-device"),
  };

  function row(e, fresh = false) {
    const detail = Object.keys(e.detail).length ? JSON.stringify(e.detail) : "";
    return el("tr", { class: fresh ? "flash" : "", dataset: { event: e.id, kind: e.kind } },
      el("td", { title: e.at }, fmt.time(e.at)),
      el("td", {}, el("code", {}, e.kind)),
      el("td", {}, e.actor),
      el("td", {}, e.device_id || ""),
      el("td", {}, e.session_id ? el("a", { href: `/sessions/${e.session_id}`, class: "mono" }, e.session_id.slice(0, 8)) : ""),
      el("td", { class: "detail-cell" }, detail),
    );
  }

  function params() {
    const result = {};
    for (const [key, input] of Object.entries(filters)) result[key] = input.value.trim();
    return result;
  }

  async function load(newSkip = skip) {
    skip = newSkip;
    try {
      const page = await api("/events", { params: { ...params(), skip, limit: LIMIT } });
      fillTable(table, page.data.map((e) => row(e)), "No events match.");
      document.getElementById("event-count").textContent = `${page.count} event${page.count === 1 ? "" : "s"}`;
      pager(document.getElementById("pager"), { skip, limit: LIMIT, count: page.count }, load);
    } catch (error) {
      if (error.status !== 401) toast(error.message, true);
    }
  }

  function matches(e) {
    const f = params();
    if (f.kind && !(f.kind.endsWith(".") ? e.kind.startsWith(f.kind) : e.kind === f.kind)) return false;
    if (f.actor && e.actor !== f.actor) return false;
    if (f.device_id && e.device_id !== f.device_id) return false;
    return true;
  }

  tail({}, (e) => {
    if (skip !== 0 || !matches(e)) return;
    const body = table.tBodies[0];
    if (body.querySelector("td[colspan]")) body.replaceChildren();
    body.prepend(row(e, true));
    while (body.rows.length > LIMIT) body.deleteRow(-1);
  });
  for (const input of Object.values(filters)) input.addEventListener("input", debounce(() => load(0)));
  load(0);
})();
