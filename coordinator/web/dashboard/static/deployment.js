// One deployment: its waves with each device's state, and (admins) aborting the rollout.
"use strict";

(() => {
  const { api, el, fmt, badge, fillTable, tail, toast, isAdmin, debounce, rolloutBar, ROLLOUT_STATES, ROLLOUT_LABELS } = SF;
  const deploymentId = Number(document.getElementById("deployment-id").dataset.deployment);
  const ABORTABLE = new Set(["pending", "rolling", "paused"]);
  const ANSWERED = new Set(["installed", "failed", "rolled_back"]);
  const POLL_MS = 5000; // a device's outcome writes an event, but a missed tail frame must not stick
  let detail = null;

  function fact(label, value) {
    return el("div", { class: "fact" }, el("dt", {}, label), el("dd", {}, value));
  }

  function renderFacts(d) {
    const state = document.getElementById("deployment-state");
    state.textContent = d.state;
    state.className = `badge badge-${d.state}`;
    document.getElementById("facts").replaceChildren(
      fact("Model", d.model),
      fact("Release", d.version === null ? "–" : `v${d.version}`),
      fact("Artifact sha256", el("code", { title: d.artifact_sha256 || "" }, (d.artifact_sha256 || "–").slice(0, 16))),
      fact("To", d.targets.join(", ") || "–"),
      fact("Devices", d.devices),
      fact("Waves", d.waves ? `${Math.min(d.wave + 1, d.waves)} of ${d.waves} reached` : "–"),
      fact("Wave size", d.wave_percent === null ? "–" : `${d.wave_percent}%`),
      fact("Abort at", d.abort_at_percent === null ? "–" : `${d.abort_at_percent}% failed`),
      fact("By", d.actor),
      fact("Started", fmt.time(d.created_at)),
      fact("Updated", fmt.ago(d.updated_at)),
    );
    const progress = document.getElementById("progress");
    progress.replaceWith(Object.assign(rolloutBar(d.counts, d.devices), { id: "progress", className: "progress progress-large" }));
    document.getElementById("state-legend").replaceChildren(...ROLLOUT_STATES
      .filter((s) => d.counts[s])
      .map((s) => el("span", { class: "legend-state" }, el("i", { class: `seg seg-${s}` }), `${d.counts[s]} ${ROLLOUT_LABELS[s]}`)));
    const abort = document.getElementById("abort-button");
    if (abort) abort.hidden = !(isAdmin() && ABORTABLE.has(d.state));
  }

  // Where a wave stands: not started, running (some devices unanswered) or finished.
  function waveState(rows, d) {
    if (rows.every((r) => r.state === "pending")) {
      return d.state === "rolling" || d.state === "pending" ? "waiting" : "never started";
    }
    return rows.every((r) => ANSWERED.has(r.state)) ? "finished" : "running";
  }

  function renderWaves(d, devices) {
    const waves = new Map();
    for (const row of devices) {
      if (!waves.has(row.wave)) waves.set(row.wave, []);
      waves.get(row.wave).push(row);
    }
    const sections = [...waves.entries()].sort((a, b) => a[0] - b[0]).map(([index, rows]) => {
      const counts = {};
      for (const r of rows) counts[r.state] = (counts[r.state] || 0) + 1;
      const state = waveState(rows, d);
      const table = el("table", { class: "table" },
        el("thead", {}, el("tr", {}, el("th", {}, "Device"), el("th", {}, "State"), el("th", {}, "Detail"), el("th", {}, "Updated"))),
        el("tbody"));
      fillTable(table, rows.map((r) => el("tr", { dataset: { device: r.device_id, state: r.state } },
        el("td", {}, el("a", { href: `/devices/${encodeURIComponent(r.device_id)}` }, r.device_id)),
        el("td", {}, badge(r.state)),
        el("td", { class: "detail-cell" }, r.detail || (r.state === "pending" ? ROLLOUT_LABELS.pending : "–")),
        el("td", { title: r.updated_at }, fmt.ago(r.updated_at)),
      )), "No devices.");
      return el("section", { class: "panel wave", dataset: { wave: index, state } },
        el("div", { class: "toolbar" },
          el("h2", {}, `Wave ${index + 1}`),
          el("span", { class: `badge badge-wave-${state.replace(" ", "-")}` }, state),
          el("span", { class: "spacer" }),
          el("span", { class: "muted small" }, `${rows.length} device${rows.length === 1 ? "" : "s"}`)),
        rolloutBar(counts, rows.length),
        el("div", { class: "table-wrap" }, table));
    });
    document.getElementById("waves").replaceChildren(...(sections.length ? sections : [el("p", { class: "muted" }, "No devices.")]));
  }

  async function load() {
    try {
      detail = await api(`/deployments/${deploymentId}`);
    } catch (error) {
      if (error.status !== 401) {
        document.getElementById("waves").replaceChildren(el("p", { class: "error" }, error.message));
      }
      return;
    }
    renderFacts(detail.deployment);
    renderWaves(detail.deployment, detail.devices);
    document.getElementById("waves").dataset.loaded = "true";
  }

  const abort = document.getElementById("abort-button");
  if (abort) {
    abort.addEventListener("click", async () => {
      const reason = prompt(`Abort deployment #${deploymentId}? No further wave starts; the wave in flight finishes.\nReason:`, "");
      if (reason === null) return;
      try {
        await api(`/deployments/${deploymentId}/abort`, { method: "POST", body: { reason } });
        toast(`Deployment #${deploymentId} aborted`);
        load();
      } catch (error) { toast(error.message, true); }
    });
  }

  const reload = debounce(load, 200);
  tail({ kind: "deployment." }, (event) => {
    if (event.detail?.deployment_id === deploymentId) reload();
  });
  setInterval(() => { if (detail && ABORTABLE.has(detail.deployment.state)) load(); }, POLL_MS);
  load();
})();
