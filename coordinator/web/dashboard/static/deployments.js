// Deployments page: every rollout with its devices by state; live through the event tail.
"use strict";

(() => {
  const { api, el, fmt, badge, fillTable, pager, debounce, tail, toast, rolloutBar } = SF;
  const LIMIT = 50;
  let skip = 0;

  const table = document.getElementById("deployments");
  const filters = {
    state: document.getElementById("filter-state"),
    model: document.getElementById("filter-model"),
  };

  function release(d) {
    const sha = d.artifact_sha256 ? d.artifact_sha256.slice(0, 12) : "–";
    return el("span", { title: d.artifact_sha256 || "" },
      d.version === null ? "" : `v${d.version} `, el("code", {}, sha));
  }

  function row(d) {
    const done = d.counts.installed + d.counts.failed + d.counts.rolled_back;
    return el("tr", { dataset: { deployment: d.id, state: d.state } },
      el("td", {}, el("a", { href: `/deployments/${d.id}` }, `#${d.id}`)),
      el("td", {}, el("strong", {}, d.model)),
      el("td", {}, release(d)),
      el("td", {}, badge(d.state)),
      el("td", { class: "progress-cell" }, rolloutBar(d.counts, d.devices),
        el("span", { class: "muted small" }, `${done} / ${d.devices} answered`)),
      el("td", { class: "num" }, d.waves ? `${Math.min(d.wave + 1, d.waves)} / ${d.waves}` : "–"),
      el("td", {}, el("div", { class: "chips" }, d.targets.map((t) => el("span", { class: "chip" }, t)))),
      el("td", {}, d.actor),
      el("td", { title: d.created_at }, fmt.ago(d.created_at)),
    );
  }

  async function load(newSkip = skip) {
    skip = newSkip;
    const params = { skip, limit: LIMIT };
    for (const [key, input] of Object.entries(filters)) params[key] = input.value.trim();
    try {
      const page = await api("/deployments", { params });
      fillTable(table, page.data.map(row), "No deployments yet.");
      document.getElementById("deployment-count").textContent =
        `${page.count} deployment${page.count === 1 ? "" : "s"}`;
      pager(document.getElementById("pager"), { skip, limit: LIMIT, count: page.count }, load);
      table.dataset.loaded = "true";
    } catch (error) {
      if (error.status !== 401) toast(error.message, true);
    }
  }

  for (const input of Object.values(filters)) input.addEventListener("input", debounce(() => load(0)));
  tail({ kind: "deployment." }, debounce(() => load(), 300));
  load(0);
})();
