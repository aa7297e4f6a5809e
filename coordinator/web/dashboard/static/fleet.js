// Fleet page: devices with status, drafts, RTT, α and speed; live through the event tail.
"use strict";

(() => {
  const { api, el, fmt, badge, fillTable, pager, debounce, tail, toast, isAdmin } = SF;
  const LIMIT = 50;
  const POLL_MS = 5000; // telemetry changes write no events, so the table is also polled
  let skip = 0;
  let known = new Map(); // device id -> status, to flash rows that changed

  const table = document.getElementById("devices");
  const filters = {
    status: document.getElementById("filter-status"),
    kind: document.getElementById("filter-kind"),
    tag: document.getElementById("filter-tag"),
  };

  async function editTags(device) {
    const text = prompt(`Tags of ${device.id} (comma-separated)`, device.tags.join(", "));
    if (text === null) return;
    const tags = text.split(",").map((t) => t.trim()).filter(Boolean);
    try {
      await api(`/devices/${encodeURIComponent(device.id)}/tags`, { method: "PUT", body: { tags } });
      toast(`Tags of ${device.id} saved`);
      load();
    } catch (error) { toast(error.message, true); }
  }

  async function retire(device) {
    const reason = prompt(`Retire ${device.id} for good? Its credential stops working.\nReason:`, "");
    if (reason === null) return;
    try {
      await api(`/devices/${encodeURIComponent(device.id)}/retire`, { method: "POST", body: { reason } });
      toast(`${device.id} retired`);
      load();
    } catch (error) { toast(error.message, true); }
  }

  function row(device, rate) {
    const rtt = device.telemetry?.rtt_ms;
    const changed = known.has(device.id) && known.get(device.id) !== device.status;
    const drafts = device.installed_models.length
      ? el("div", { class: "chips" }, device.installed_models.map((m) => el("span", { class: "chip" }, m)))
      : el("span", { class: "muted" }, "none");
    const actions = isAdmin() && device.status !== "retired"
      ? el("div", { class: "row" },
          el("button", { class: "button small", type: "button", onclick: () => editTags(device) }, "Tags"),
          el("button", { class: "button small danger", type: "button", onclick: () => retire(device) }, "Retire"))
      : "";
    return el("tr", { class: changed ? "flash" : "", dataset: { device: device.id, status: device.status } },
      el("td", {}, el("span", { class: `status-dot ${device.status}` }),
        el("a", { href: `/devices/${encodeURIComponent(device.id)}` }, el("strong", {}, device.id))),
      el("td", {}, device.kind),
      el("td", {}, badge(device.status)),
      el("td", {}, drafts),
      el("td", { class: "num" }, rtt === undefined ? "–" : fmt.ms(rtt)),
      el("td", { class: "num" }, fmt.alpha(rate?.alpha ?? null)),
      el("td", { class: "num" }, fmt.num(rate?.tokens_per_s ?? null, 1)),
      el("td", { title: device.last_seen || "" }, fmt.ago(device.last_seen)),
      el("td", {}, el("div", { class: "chips" }, device.tags.map((t) => el("span", { class: "chip" }, t)))),
      el("td", { class: "actions-col" }, actions),
    );
  }

  async function summary() {
    const [online, active, verifiers, stats] = await Promise.all([
      api("/devices", { params: { status: "online", limit: 1 } }),
      api("/sessions", { params: { status: "active", limit: 1 } }),
      api("/verifiers"),
      api("/stats/fleet", { params: { window_s: 900 } }),
    ]);
    document.getElementById("sum-online").textContent = online.count;
    document.getElementById("sum-sessions").textContent = active.count;
    document.getElementById("sum-verifiers").textContent = verifiers.live
      ? verifiers.data.filter((v) => v.online).length : "–";
    const drafted = stats.data.reduce((sum, r) => sum + r.drafted, 0);
    const accepted = stats.data.reduce((sum, r) => sum + r.accepted, 0);
    document.getElementById("sum-alpha").textContent = drafted ? (accepted / drafted).toFixed(2) : "–";
    return new Map(stats.data.map((r) => [r.device_id, r]));
  }

  async function load(newSkip = skip) {
    skip = newSkip;
    try {
      const params = { skip, limit: LIMIT };
      for (const [key, input] of Object.entries(filters)) params[key] = input.value.trim();
      const [page, rates] = await Promise.all([api("/devices", { params }), summary()]);
      fillTable(table, page.data.map((d) => row(d, rates.get(d.id))), "No devices match.");
      known = new Map(page.data.map((d) => [d.id, d.status]));
      document.getElementById("device-count").textContent = `${page.count} device${page.count === 1 ? "" : "s"}`;
      pager(document.getElementById("pager"), { skip, limit: LIMIT, count: page.count }, load);
    } catch (error) {
      if (error.status !== 401) toast(error.message, true);
    }
  }

  for (const input of Object.values(filters)) input.addEventListener("input", debounce(() => load(0)));
  tail({ kind: "device." }, () => load());
  setInterval(() => load(), POLL_MS);
  load(0);
})();
