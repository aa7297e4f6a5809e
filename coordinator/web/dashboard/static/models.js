// Models page: the registry and the models directory, with sha256 and sizes.
"use strict";

(() => {
  const { api, el, fmt, fillTable, pager, toast } = SF;
  const LIMIT = 100;
  let skip = 0;
  const table = document.getElementById("models");
  const filters = { role: document.getElementById("filter-role"), format: document.getElementById("filter-format") };

  function where(m) {
    const chips = [];
    if (m.registered) chips.push(el("span", { class: "chip", title: m.location || "" }, "registry"));
    if (m.on_disk) chips.push(el("span", { class: "chip" }, "on disk"));
    if (m.sha256_mismatch) chips.push(el("span", { class: "badge badge-failed", title: "the registry's sha256 differs from the file on disk" }, "sha256 mismatch"));
    return el("div", { class: "chips" }, chips);
  }

  function row(m) {
    return el("tr", { dataset: { model: m.name } },
      el("td", {}, el("strong", {}, m.name)),
      el("td", {}, m.role),
      el("td", {}, m.format),
      el("td", {}, m.precision || "–"),
      el("td", { class: "num", title: `${m.size_bytes} bytes` }, fmt.bytes(m.size_bytes)),
      el("td", { class: "mono", title: m.sha256 }, m.sha256.slice(0, 16) + "…"),
      el("td", { class: "mono", title: m.tokenizer_sha256 }, m.tokenizer_sha256.slice(0, 10) + "…"),
      el("td", {}, where(m)),
    );
  }

  async function load(newSkip = skip) {
    skip = newSkip;
    const params = { skip, limit: LIMIT };
    for (const [key, input] of Object.entries(filters)) params[key] = input.value;
    try {
      const page = await api("/models", { params });
      fillTable(table, page.data.map(row), "No models: build the target with `specfleet models build-target`.");
      document.getElementById("model-count").textContent = `${page.count} model${page.count === 1 ? "" : "s"}`;
      pager(document.getElementById("pager"), { skip, limit: LIMIT, count: page.count }, load);
    } catch (error) {
      if (error.status !== 401) toast(error.message, true);
    }
  }

  for (const input of Object.values(filters)) input.addEventListener("change", () => load(0));
  load(0);
})();
