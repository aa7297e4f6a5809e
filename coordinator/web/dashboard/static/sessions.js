// Sessions page: a filtered, paged list, and (for admins) starting a session on a device.
"use strict";

(() => {
  const { api, el, fmt, badge, fillTable, pager, debounce, toast } = SF;
  const LIMIT = 50;
  let skip = 0;

  const table = document.getElementById("sessions");
  const filters = {
    status: document.getElementById("filter-status"),
    mode: document.getElementById("filter-mode"),
    device_id: document.getElementById("filter-device"),
    task_type: document.getElementById("filter-task"),
    draft_model: document.getElementById("filter-draft"),
  };

  function row(s) {
    const link = el("a", { href: `/sessions/${s.id}`, class: "mono", title: s.id }, s.id.slice(0, 8));
    return el("tr", { dataset: { session: s.id } },
      el("td", {}, link),
      el("td", {}, s.device_id),
      el("td", {}, s.task_type),
      el("td", {}, badge(s.status)),
      el("td", {}, s.mode),
      el("td", {}, s.draft_model || "–"),
      el("td", { class: "num" }, s.k),
      el("td", { class: "num" }, s.generated_len),
      el("td", { class: "num" }, s.rounds),
      el("td", { class: "num" }, fmt.alpha(s.alpha)),
      el("td", { title: s.created_at }, fmt.ago(s.created_at)),
    );
  }

  async function load(newSkip = skip) {
    skip = newSkip;
    const params = { skip, limit: LIMIT };
    for (const [key, input] of Object.entries(filters)) params[key] = input.value.trim();
    try {
      const page = await api("/sessions", { params });
      fillTable(table, page.data.map(row), "No sessions match.");
      document.getElementById("session-count").textContent = `${page.count} session${page.count === 1 ? "" : "s"}`;
      pager(document.getElementById("pager"), { skip, limit: LIMIT, count: page.count }, load);
    } catch (error) {
      if (error.status !== 401) toast(error.message, true);
    }
  }

  async function fillDevices() {
    const select = document.getElementById("start-device");
    if (!select) return;
    const page = await api("/devices", { params: { status: "online", limit: 1000 } });
    select.replaceChildren(
      ...(page.data.length
        ? page.data.map((d) => el("option", { value: d.id }, `${d.id} (${d.kind})`))
        : [el("option", { value: "" }, "no device online")]),
    );
  }

  const form = document.getElementById("start-form");
  if (form) {
    form.addEventListener("submit", async (event) => {
      event.preventDefault();
      const data = new FormData(form);
      const result = document.getElementById("start-result");
      result.textContent = "starting…";
      try {
        const started = await api("/sessions", {
          method: "POST",
          body: {
            device_id: data.get("device_id"),
            prompt: data.get("prompt"),
            task_type: data.get("task_type"),
            max_tokens: Number(data.get("max_tokens")),
            temperature: Number(data.get("temperature")),
          },
        });
        result.replaceChildren("started ", el("a", { href: `/sessions/${started.id}` }, started.id.slice(0, 8)));
        load(0);
      } catch (error) {
        result.textContent = error.message;
      }
    });
    document.getElementById("start-panel").addEventListener("toggle", fillDevices);
  }

  for (const input of Object.values(filters)) input.addEventListener("input", debounce(() => load(0)));
  setInterval(() => load(), 5000);
  load(0);
})();
