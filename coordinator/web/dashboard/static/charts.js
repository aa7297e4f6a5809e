// Charts page: hand-drawn SVG line and bar charts over the /stats and /verifiers endpoints.
"use strict";

(() => {
  const { api, el, toast } = SF;
  const NS = "http://www.w3.org/2000/svg";
  const COLORS = ["#1f6feb", "#10b981", "#f59e0b", "#8b5cf6", "#ef4444", "#0ea5e9", "#64748b", "#d946ef"];
  const H = 240, PAD = { left: 52, right: 12, top: 18, bottom: 28 };
  const VERIFIER_POINTS = 150; // 5 minutes of samples at one every 2 s
  const verifierHistory = new Map(); // verifier id -> [{t, y}]

  function svg(tag, attrs, ...children) {
    const node = document.createElementNS(NS, tag);
    for (const [key, value] of Object.entries(attrs || {})) node.setAttribute(key, value);
    for (const child of children) {
      if (child === null || child === undefined) continue;
      node.append(typeof child === "string" ? document.createTextNode(child) : child);
    }
    return node;
  }

  // Drawn at the container's own pixel width, so text keeps its size on any screen.
  function width(container) {
    return Math.max(320, Math.floor(container.clientWidth));
  }

  function frame(W) {
    return svg("svg", { viewBox: `0 0 ${W} ${H}`, width: W, height: H, role: "img" });
  }

  function empty(container, text) {
    const W = width(container);
    const root = frame(W);
    root.append(svg("text", { x: W / 2, y: H / 2, "text-anchor": "middle", class: "empty" }, text));
    container.replaceChildren(root);
  }

  // The y axis for values up to `value`: a step of 1, 2 or 5 times a power of ten giving at most
  // 5 gridlines (whole steps only where the values are counts), and labels with as many
  // decimals as the step needs, so no two gridlines read the same.
  function yScale(value, { integer = false } = {}) {
    const target = Math.max(value, integer ? 1 : 1e-9) / 5;
    let power = 10 ** Math.floor(Math.log10(target));
    if (integer) power = Math.max(1, power);
    let step = power;
    for (const m of [1, 2, 5, 10]) if (m * power >= target) { step = m * power; break; }
    const top = Math.max(step, Math.ceil(value / step - 1e-9) * step);
    const decimals = Math.max(0, -Math.floor(Math.log10(step) + 1e-9));
    return { top, step, label: (v) => v.toFixed(decimals) };
  }

  function yAxis(root, W, scale, title) {
    const plotH = H - PAD.top - PAD.bottom;
    const ticks = Math.round(scale.top / scale.step);
    for (let i = 0; i <= ticks; i += 1) {
      const value = scale.step * i;
      const y = PAD.top + plotH - (plotH * i) / ticks;
      root.append(svg("line", { x1: PAD.left, x2: W - PAD.right, y1: y, y2: y, class: i ? "grid" : "axis" }));
      root.append(svg("text", { x: PAD.left - 6, y: y + 4, "text-anchor": "end", class: "tick" }, scale.label(value)));
    }
    if (title) root.append(svg("text", { x: 4, y: 10, class: "axis-title" }, title));
  }

  // series: [{label, color, points: [{t: ms since epoch, y}]}]; `span` is the time one point
  // stands for (a bucket): half of it pads each end, so no point sits on the axis and a lone
  // point sits mid-chart.
  function lineChart(container, series, { yMax, integer, format, emptyText, title, span = 60000 }) {
    const points = series.flatMap((s) => s.points);
    if (!points.length) { empty(container, emptyText); return; }
    const tMin = Math.min(...points.map((p) => p.t)) - span / 2;
    const tMax = Math.max(...points.map((p) => p.t)) + span / 2;
    const scale = yScale(yMax ?? Math.max(...points.map((p) => p.y)), { integer });
    const top = scale.top;
    const W = width(container);
    const plotW = W - PAD.left - PAD.right, plotH = H - PAD.top - PAD.bottom;
    const x = (t) => PAD.left + (plotW * (t - tMin)) / (tMax - tMin);
    const y = (v) => PAD.top + plotH - (plotH * v) / top;
    const root = frame(W);
    yAxis(root, W, scale, title);
    for (const fraction of [0, 0.5, 1]) {
      const t = tMin + fraction * (tMax - tMin);
      root.append(svg("text", { x: x(t), y: H - 8, "text-anchor": fraction === 0 ? "start" : fraction === 1 ? "end" : "middle" },
        new Date(t).toLocaleTimeString([], { hour: "2-digit", minute: "2-digit" })));
    }
    for (const s of series) {
      if (!s.points.length) continue;
      const path = s.points.map((p, i) => `${i ? "L" : "M"}${x(p.t).toFixed(1)},${y(p.y).toFixed(1)}`).join("");
      root.append(svg("path", { d: path, fill: "none", stroke: s.color, "stroke-width": 2, "vector-effect": "non-scaling-stroke" }));
      // Markers where there are few points; a lone point gets a larger one (it has no line).
      const radius = s.points.length === 1 ? 4.5 : 2.5;
      for (const p of s.points.length <= 60 ? s.points : []) {
        root.append(svg("circle", { cx: x(p.t), cy: y(p.y), r: radius, fill: s.color, class: "point" },
          svg("title", {}, `${s.label}: ${format(p.y)} at ${new Date(p.t).toLocaleTimeString()}`)));
      }
    }
    container.replaceChildren(root);
  }

  // bars: [{label, value, extra?}] where extra (drawn lighter, behind) is e.g. a p95.
  function barChart(container, bars, { format, integer, emptyText, title, unit = "" }) {
    if (!bars.some((b) => b.value || b.extra)) { empty(container, emptyText); return; }
    const scale = yScale(Math.max(...bars.map((b) => Math.max(b.value || 0, b.extra || 0))), { integer });
    const top = scale.top;
    const W = width(container);
    const plotW = W - PAD.left - PAD.right, plotH = H - PAD.top - PAD.bottom;
    const slot = plotW / bars.length;
    const root = frame(W);
    yAxis(root, W, scale, title);
    bars.forEach((b, i) => {
      const x0 = PAD.left + i * slot + slot * 0.15;
      const width = slot * 0.7;
      if (b.extra) {
        const h = (plotH * b.extra) / top;
        root.append(svg("rect", { x: x0, y: PAD.top + plotH - h, width, height: h, class: "bar-p95" },
          svg("title", {}, `${b.label}: ${format(b.extra)} (p95)`)));
      }
      const h = (plotH * (b.value || 0)) / top;
      root.append(svg("rect", { x: x0, y: PAD.top + plotH - h, width, height: h, class: "bar", rx: 2 },
        svg("title", {}, `${b.label}: ${format(b.value || 0)}`)));
      root.append(svg("text", { x: x0 + width / 2, y: H - 8, "text-anchor": "middle", class: "bar-label" }, b.label));
    });
    if (unit) root.append(svg("text", { x: W - PAD.right, y: 10, "text-anchor": "end", class: "axis-title" }, unit));
    container.replaceChildren(root);
  }

  function legend(container, series) {
    container.replaceChildren(...series.map((s) =>
      el("span", {}, el("i", { style: `background:${s.color}` }), s.label)));
  }

  const windowSelect = document.getElementById("window");

  async function drawStats() {
    const window_s = windowSelect.value;
    try {
      const [acceptance, latency] = await Promise.all([
        api("/stats/acceptance", { params: { window_s, bucket_s: Math.max(10, Math.round(window_s / 60)) } }),
        api("/stats/latency", { params: { window_s } }),
      ]);
      const series = acceptance.data.map((s, i) => ({
        label: `${s.draft_model} · ${s.task_type}`,
        color: COLORS[i % COLORS.length],
        points: s.points.map((p) => ({ t: new Date(p.start).getTime(), y: p.alpha })),
      }));
      const bucketMs = 1000 * Math.max(10, Math.round(window_s / 60));
      lineChart(document.getElementById("chart-acceptance"), series,
        { yMax: 1, format: (v) => v.toFixed(2), emptyText: "No drafted rounds in this window",
          title: "α", span: bucketMs });
      legend(document.getElementById("legend-acceptance"), series);

      const edges = latency.rtt_ms.edges;
      const rttBars = latency.rtt_ms.counts.map((count, i) => ({
        label: edges[i + 1] === null ? `≥${edges[i]}` : `<${edges[i + 1]}`,
        value: count,
      }));
      barChart(document.getElementById("chart-rtt"), rttBars,
        { format: (v) => `${v.toFixed(0)} rounds`, integer: true, title: "rounds",
          unit: "round trip, ms", emptyText: "No measured round trips in this window" });

      const legBars = latency.legs.map((l) => ({ label: l.leg, value: l.p50_ms, extra: l.p95_ms }));
      barChart(document.getElementById("chart-legs"), legBars,
        { format: (v) => `${v >= 100 ? v.toFixed(0) : v.toFixed(1)} ms`, title: "ms",
          emptyText: "No timed rounds in this window" });
    } catch (error) {
      if (error.status !== 401) toast(error.message, true);
    }
  }

  async function sampleVerifiers() {
    const container = document.getElementById("chart-verifiers");
    try {
      const verifiers = await api("/verifiers");
      if (!verifiers.live) {
        empty(container, "No coordinator service attached: verifier load is live data");
        return;
      }
      const now = Date.now();
      for (const v of verifiers.data) {
        const history = verifierHistory.get(v.verifier_id) || [];
        history.push({ t: now, y: v.queue_depth });
        verifierHistory.set(v.verifier_id, history.slice(-VERIFIER_POINTS));
      }
      const series = [...verifierHistory.entries()].map(([id, points], i) => ({
        label: id, color: COLORS[i % COLORS.length], points,
      }));
      lineChart(container, series, { format: (v) => v.toFixed(0), integer: true, title: "queued",
        span: 10000, emptyText: "No verifier has reported yet" });
      legend(document.getElementById("legend-verifiers"), series);
    } catch (error) {
      if (error.status !== 401) toast(error.message, true);
    }
  }

  windowSelect.addEventListener("change", drawStats);
  let resizeTimer;
  window.addEventListener("resize", () => {
    clearTimeout(resizeTimer);
    resizeTimer = setTimeout(() => { drawStats(); sampleVerifiers(); }, 200);
  });
  drawStats();
  sampleVerifiers();
  setInterval(drawStats, 15000);
  setInterval(sampleVerifiers, 2000);
})();
