// Device page: its agent, telemetry, installed drafts (with release and sha256), rollouts and
// sessions; live through the event tail of this device.
"use strict";

(() => {
  const { api, el, fmt, badge, fillTable, tail, toast, debounce } = SF;
  const deviceId = document.getElementById("device-id").dataset.device;
  const SESSIONS = 20;
  const POLL_MS = 5000; // telemetry writes no events, so the page is also polled
  const SOURCE_LABEL = {
    rollout: "rollout",
    registry: "registry (not rolled out)",
    device: "the device's report",
  };

  function fact(label, value) {
    return el("div", { class: "fact" }, el("dt", {}, label), el("dd", {}, value));
  }

  function shortSha(sha) {
    return sha ? el("code", { title: sha }, sha.slice(0, 12)) : "–";
  }

  function renderDevice(d, rate) {
    const device = d.device;
    const status = document.getElementById("device-status");
    status.textContent = device.status;
    status.className = `badge badge-${device.status}`;
    document.getElementById("status-reason").textContent = device.status_reason || "";
    const hardware = Object.entries(device.hardware).map(([k, v]) => `${k} ${v}`).join(", ");
    document.getElementById("facts").replaceChildren(
      fact("Kind", device.kind),
      fact("Agent version", d.agent_version || "–"),
      fact("Runtimes", d.runtimes.join(", ") || "–"),
      fact("Last seen", el("span", { title: device.last_seen || "" }, fmt.ago(device.last_seen))),
      fact(el("span", {}, el("span", { class: "greek" }, "α"), " (15 min)"), fmt.alpha(rate?.alpha ?? null)),
      fact("Tokens/s (15 min)", fmt.num(rate?.tokens_per_s ?? null, 1)),
      fact("Tags", device.tags.length ? el("div", { class: "chips" }, device.tags.map((t) => el("span", { class: "chip" }, t))) : "–"),
      fact("Hardware", hardware || "–"),
      fact("Registered", fmt.time(device.created_at)),
    );
    const t = device.telemetry || {};
    document.getElementById("telemetry").replaceChildren(
      fact("RTT", t.rtt_ms === undefined || t.rtt_ms === null ? "–" : fmt.ms(t.rtt_ms)),
      fact("CPU", t.cpu_percent === undefined || t.cpu_percent === null ? "–" : `${fmt.num(t.cpu_percent)}%`),
      fact("Memory", t.memory_percent === undefined || t.memory_percent === null ? "–" : `${fmt.num(t.memory_percent)}%`),
      fact("Battery", t.battery_percent === undefined || t.battery_percent === null ? "–" : `${fmt.num(t.battery_percent)}%`),
      fact("Temperature", t.thermal_c === undefined || t.thermal_c === null ? "–" : `${fmt.num(t.thermal_c, 1)} °C`),
      fact("Quarantined drafts", t.quarantined_drafts || "none"),
      fact("Memory free", t.memory_available_mb === undefined || t.memory_available_mb === null ? "–" : `${fmt.num(t.memory_available_mb)} MB`),
      fact("Drafts over memory", t.drafts_over_memory || "none"),
    );
    document.getElementById("telemetry-at").textContent =
      device.telemetry_at ? `reported ${fmt.ago(device.telemetry_at)}` : "no telemetry yet";

    fillTable(document.getElementById("drafts"), d.drafts.map((m) => el("tr", { dataset: { draft: m.name, source: m.source } },
      el("td", {}, el("strong", {}, m.name)),
      el("td", {}, m.version === null ? "–" : `v${m.version}`),
      el("td", {}, shortSha(m.sha256)),
      el("td", {}, m.format || "–"),
      el("td", {}, m.deployment_id === null
        ? SOURCE_LABEL[m.source]
        : el("a", { href: `/deployments/${m.deployment_id}` }, `deployment #${m.deployment_id}`)),
      el("td", { title: m.installed_at || "" }, m.installed_at ? fmt.ago(m.installed_at) : "–"),
    )), "No drafts reported.");

    fillTable(document.getElementById("device-deployments"), d.deployments.map((r) => el("tr", { dataset: { deployment: r.deployment_id, state: r.state } },
      el("td", {}, el("a", { href: `/deployments/${r.deployment_id}` }, `#${r.deployment_id}`)),
      el("td", {}, r.model),
      el("td", {}, r.version === null ? "–" : `v${r.version}`),
      el("td", { class: "num" }, r.wave + 1),
      el("td", {}, badge(r.state)),
      el("td", { class: "detail-cell" }, r.detail || "–"),
    )), "Never in a rollout.");
  }

  function renderSessions(page) {
    fillTable(document.getElementById("device-sessions"), page.data.map((s) => el("tr", { dataset: { session: s.id } },
      el("td", {}, el("a", { href: `/sessions/${s.id}`, class: "mono", title: s.id }, s.id.slice(0, 8))),
      el("td", {}, badge(s.status)),
      el("td", {}, s.task_type),
      el("td", {}, s.mode),
      el("td", {}, `${s.draft_model || "–"} / ${s.k}`),
      el("td", { class: "num" }, s.generated_len),
      el("td", { class: "num" }, fmt.alpha(s.alpha)),
      el("td", { title: s.created_at }, fmt.ago(s.created_at)),
    )), "No sessions yet.");
    document.getElementById("session-count").textContent = page.count > page.data.length
      ? `newest ${page.data.length} of ${page.count}` : `${page.count} session${page.count === 1 ? "" : "s"}`;
  }

  async function load() {
    try {
      const [detail, sessions, stats] = await Promise.all([
        api(`/devices/${encodeURIComponent(deviceId)}/detail`),
        api("/sessions", { params: { device_id: deviceId, limit: SESSIONS } }),
        api("/stats/fleet", { params: { window_s: 900 } }),
      ]);
      renderDevice(detail, stats.data.find((r) => r.device_id === deviceId));
      renderSessions(sessions);
      document.getElementById("facts").dataset.loaded = "true";
    } catch (error) {
      if (error.status === 401) return;
      if (error.status === 404) {
        document.getElementById("facts").replaceChildren(el("p", { class: "error" }, error.message));
        return;
      }
      toast(error.message, true);
    }
  }

  tail({ device_id: deviceId }, debounce(() => load(), 300));
  setInterval(load, POLL_MS);
  load();
})();
