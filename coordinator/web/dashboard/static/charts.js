// Charts page: uPlot charts (static/vendor/uplot, from the npm registry) over the /stats and
// /verifiers endpoints.
"use strict";

(() => {
  const { api, el, toast } = SF;
  const COLORS = ["#1f6feb", "#10b981", "#f59e0b", "#8b5cf6", "#ef4444", "#0ea5e9", "#64748b", "#d946ef"];
  const H = 240;
  // The page's own colours (app.css, light or dark): uPlot draws on a canvas, outside CSS.
  const css = getComputedStyle(document.documentElement);
  const MUTED = css.getPropertyValue("--muted").trim() || "#667085";
  const GRID = css.getPropertyValue("--line").trim() || "#e4e7ec";
  const VERIFIER_POINTS = 150; // 5 minutes of samples at one every 2 s
  // Gridline steps for counts: whole numbers only, so no two ticks read the same.
  const COUNT_INCRS = [1, 2, 5, 10, 20, 50, 100, 200, 500, 1e3, 2e3, 5e3, 1e4, 2e4, 5e4, 1e5, 1e6];
  const verifierHistory = new Map(); // verifier id -> [{t, y}]
  // Container id -> its uPlot, to resize it (the browser tests read them too).
  const charts = {};
  window.SFCharts = charts;

  // Drawn at the container's own pixel width, so text keeps its size on any screen.
  function width(container) {
    return Math.max(320, Math.floor(container.clientWidth));
  }

  function forget(container) {
    charts[container.id]?.destroy();
    delete charts[container.id];
  }

  function empty(container, text) {
    forget(container);
    container.replaceChildren(el("p", { class: "chart-empty" }, text));
  }

  function draw(container, options, data) {
    forget(container);
    container.replaceChildren();
    charts[container.id] = new uPlot({ width: width(container), height: H, ...options }, data, container);
  }

  function axis(label, extra) {
    return { label, stroke: MUTED, grid: { stroke: GRID, width: 1 }, ticks: { stroke: GRID, width: 1 }, ...extra };
  }

  // A y axis from 0 to a round top (1, 2 or 5 times a power of ten) above the largest value;
  // counts reach at least 1, so that an axis of zeros still has two gridlines.
  function fromZero(integer) {
    return (u, min, max) => {
      const value = Math.max(max ?? 0, integer ? 1 : 1e-9);
      const power = 10 ** Math.floor(Math.log10(value));
      const top = [1, 2, 5, 10].map((m) => m * power).find((t) => t >= value * (1 - 1e-9));
      return [0, top];
    };
  }

  // series: [{label, color, points: [{t: ms since epoch, y}]}]; `span` is the time one point
  // stands for (a bucket): half of it pads each end, so no point sits on the axis and a lone
  // point sits mid-chart. Series share one time axis; a series has no value (null) where
  // another has one, and its line spans such gaps.
  function lineChart(container, series, { yRange, integer, format, emptyText, yLabel, span = 60000 }) {
    const shown = series.filter((s) => s.points.length);
    if (!shown.length) { empty(container, emptyText); return; }
    const times = [...new Set(shown.flatMap((s) => s.points.map((p) => p.t)))].sort((a, b) => a - b);
    const index = new Map(times.map((t, i) => [t, i]));
    const columns = shown.map((s) => {
      const column = times.map(() => null);
      for (const p of s.points) column[index.get(p.t)] = p.y;
      return column;
    });
    const pad = span / 2000;
    const xMin = times[0] / 1000 - pad, xMax = times[times.length - 1] / 1000 + pad;
    draw(container, {
      legend: { show: false },
      scales: { x: { time: true, range: () => [xMin, xMax] }, y: { range: yRange ?? fromZero(integer) } },
      axes: [axis(null), axis(yLabel, integer ? { incrs: COUNT_INCRS } : {})],
      series: [
        {},
        ...shown.map((s) => ({
          label: s.label,
          stroke: s.color,
          width: 2,
          spanGaps: true,
          value: (u, v) => (v === null ? "–" : format(v)),
          // Markers where there are few points; a lone point gets a larger one (it has no line).
          points: { show: s.points.length <= 60, size: s.points.length === 1 ? 10 : 6, fill: s.color },
        })),
      ],
    }, [times.map((t) => t / 1000), ...columns]);
  }

  // Bars over named slots. bars: [{label, value, extra?}]: `extra` (drawn lighter, behind) is
  // e.g. a p95 beside a p50. The slots are the x axis, labelled with `xLabel` (its unit).
  function barChart(container, bars, { format, integer, emptyText, yLabel, xLabel, names = ["value", "extra"] }) {
    if (!bars.some((b) => b.value || b.extra)) { empty(container, emptyText); return; }
    const slots = bars.map((_, i) => i);
    const paths = uPlot.paths.bars({ size: [0.7, 80], radius: 0.1 });
    const withExtra = bars.some((b) => b.extra);
    // The legend (bars with an `extra`) names the slot under the cursor, not its index.
    const series = [{ label: xLabel, value: (u, i) => bars[i]?.label ?? "–" }];
    const data = [slots];
    if (withExtra) {
      series.push({ label: names[1], fill: "rgba(31, 111, 235, 0.35)", stroke: "rgba(31, 111, 235, 0.35)",
        paths, points: { show: false }, value: (u, v) => (v === null ? "–" : format(v)) });
      data.push(bars.map((b) => b.extra ?? null));
    }
    series.push({ label: names[0], fill: COLORS[0], stroke: COLORS[0], paths, points: { show: false },
      value: (u, v) => (v === null ? "–" : format(v)) });
    data.push(bars.map((b) => b.value || 0));
    draw(container, {
      legend: { show: withExtra },
      cursor: { points: { show: false } },
      scales: { x: { time: false, range: () => [-0.5, bars.length - 0.5] }, y: { range: fromZero(integer) } },
      axes: [
        axis(xLabel, { splits: () => slots, values: (u, splits) => splits.map((i) => bars[i]?.label ?? ""),
          grid: { show: false } }),
        axis(yLabel, integer ? { incrs: COUNT_INCRS } : {}),
      ],
      series,
    }, data);
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
        { yRange: [0, 1], format: (v) => v.toFixed(2), emptyText: "No drafted rounds in this window",
          yLabel: "α (accepted / drafted)", span: bucketMs });
      legend(document.getElementById("legend-acceptance"), series);

      const edges = latency.rtt_ms.edges;
      const rttBars = latency.rtt_ms.counts.map((count, i) => ({
        label: edges[i + 1] === null ? `≥${edges[i]}` : `<${edges[i + 1]}`,
        value: count,
      }));
      barChart(document.getElementById("chart-rtt"), rttBars,
        { format: (v) => `${v.toFixed(0)} rounds`, integer: true, yLabel: "rounds",
          xLabel: "round trip, ms", emptyText: "No measured round trips in this window" });

      const legBars = latency.legs.map((l) => ({ label: l.leg, value: l.p50_ms, extra: l.p95_ms }));
      barChart(document.getElementById("chart-legs"), legBars,
        { format: (v) => `${v >= 100 ? v.toFixed(0) : v.toFixed(1)} ms`, yLabel: "ms", xLabel: "leg",
          names: ["p50", "p95"], emptyText: "No timed rounds in this window" });
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
      lineChart(container, series, { format: (v) => v.toFixed(0), integer: true,
        yLabel: "requests queued", span: 10000, emptyText: "No verifier has reported yet" });
      legend(document.getElementById("legend-verifiers"), series);
    } catch (error) {
      if (error.status !== 401) toast(error.message, true);
    }
  }

  windowSelect.addEventListener("change", drawStats);
  let resizeTimer;
  window.addEventListener("resize", () => {
    clearTimeout(resizeTimer);
    resizeTimer = setTimeout(() => {
      for (const [id, chart] of Object.entries(charts)) {
        chart.setSize({ width: width(document.getElementById(id)), height: H });
      }
    }, 200);
  });
  drawStats();
  sampleVerifiers();
  setInterval(drawStats, 15000);
  setInterval(sampleVerifiers, 2000);
})();
