// specfleet dashboard: helpers shared by every page (API calls, formatting, tables, paging).
"use strict";

const SF = (() => {
  const API = "/api/v1";
  const csrf = () => document.querySelector('meta[name="csrf-token"]')?.content ?? "";
  const isAdmin = () => document.querySelector('meta[name="user-role"]')?.content === "admin";

  class ApiError extends Error {
    constructor(status, detail) {
      super(detail);
      this.status = status;
    }
  }

  function detailText(body, status) {
    if (!body || body.detail === undefined) return `HTTP ${status}`;
    if (typeof body.detail === "string") return body.detail;
    // FastAPI validation errors: a list of {loc, msg}.
    return body.detail.map((d) => `${(d.loc || []).slice(1).join(".")}: ${d.msg}`).join("; ");
  }

  async function api(path, { method = "GET", body, params } = {}) {
    const url = new URL(API + path, location.origin);
    for (const [key, value] of Object.entries(params || {})) {
      if (value !== undefined && value !== null && value !== "") url.searchParams.set(key, value);
    }
    const headers = { Accept: "application/json" };
    if (method !== "GET") {
      headers["X-CSRF-Token"] = csrf();
      headers["Content-Type"] = "application/json";
    }
    const response = await fetch(url, {
      method,
      headers,
      body: body === undefined ? undefined : JSON.stringify(body),
      credentials: "same-origin",
    });
    if (response.status === 401) {
      location.href = `/login?next=${encodeURIComponent(location.pathname + location.search)}`;
      throw new ApiError(401, "logged out");
    }
    const text = await response.text();
    const data = text ? JSON.parse(text) : null;
    if (!response.ok) throw new ApiError(response.status, detailText(data, response.status));
    return data;
  }

  // el("td", {class: "num"}, "text", child, ...): a small DOM builder that never parses HTML.
  function el(tag, attrs, ...children) {
    const node = document.createElement(tag);
    for (const [key, value] of Object.entries(attrs || {})) {
      if (value === undefined || value === null || value === false) continue;
      if (key === "class") node.className = value;
      else if (key === "dataset") Object.assign(node.dataset, value);
      else if (key.startsWith("on")) node.addEventListener(key.slice(2), value);
      else node.setAttribute(key, value === true ? "" : value);
    }
    for (const child of children.flat()) {
      if (child === undefined || child === null || child === false) continue;
      node.append(child instanceof Node ? child : document.createTextNode(String(child)));
    }
    return node;
  }

  function toast(message, bad = false) {
    const box = document.getElementById("toast");
    if (!box) return;
    box.textContent = message;
    box.className = bad ? "toast bad" : "toast";
    box.hidden = false;
    clearTimeout(toast.timer);
    toast.timer = setTimeout(() => { box.hidden = true; }, 4000);
  }

  const fmt = {
    num(value, digits = 0) {
      return value === null || value === undefined ? "–" : Number(value).toFixed(digits);
    },
    pct(value) {
      return value === null || value === undefined ? "–" : `${(100 * value).toFixed(0)}%`;
    },
    alpha(value) {
      return value === null || value === undefined ? "–" : Number(value).toFixed(2);
    },
    ms(value) {
      if (value === null || value === undefined) return "–";
      return value >= 1000 ? `${(value / 1000).toFixed(2)} s` : `${value.toFixed(value < 10 ? 1 : 0)} ms`;
    },
    bytes(value) {
      const units = ["B", "KB", "MB", "GB"];
      let v = value, i = 0;
      while (v >= 1000 && i < units.length - 1) { v /= 1000; i += 1; }
      return `${v.toFixed(i ? 1 : 0)} ${units[i]}`;
    },
    ago(iso) {
      if (!iso) return "never";
      const seconds = (Date.now() - new Date(iso).getTime()) / 1000;
      if (seconds < 5) return "just now";
      if (seconds < 60) return `${Math.floor(seconds)} s ago`;
      if (seconds < 3600) return `${Math.floor(seconds / 60)} min ago`;
      if (seconds < 86400) return `${Math.floor(seconds / 3600)} h ago`;
      return new Date(iso).toLocaleDateString();
    },
    time(iso) {
      return iso ? new Date(iso).toLocaleString() : "–";
    },
  };

  function badge(value) {
    return el("span", { class: `badge badge-${value}` }, value);
  }

  function fillTable(table, rows, emptyText) {
    const body = table.tBodies[0];
    const columns = table.tHead.rows[0].cells.length;
    body.replaceChildren(
      ...(rows.length ? rows : [el("tr", {}, el("td", { colspan: columns, class: "muted" }, emptyText))]),
    );
  }

  // Paging under a table: calls load(skip) when a button is pressed.
  function pager(container, { skip, limit, count }, load) {
    const last = Math.max(0, count - 1);
    container.replaceChildren(
      el("span", { class: "muted small" }, count ? `${skip + 1}–${Math.min(skip + limit, count)} of ${count}` : ""),
      el("button", { class: "button small", type: "button", disabled: skip === 0, onclick: () => load(Math.max(0, skip - limit)) }, "← Previous"),
      el("button", { class: "button small", type: "button", disabled: skip + limit > last, onclick: () => load(skip + limit) }, "Next →"),
    );
  }

  // A rollout's devices by state, in the order a rollout moves them, worst outcomes last.
  const ROLLOUT_STATES = ["installed", "installing", "sent", "pending", "rolled_back", "failed"];
  const ROLLOUT_LABELS = {
    installed: "installed", installing: "installing", sent: "sent", pending: "not sent yet",
    rolled_back: "rolled back", failed: "failed",
  };

  // A stacked bar with one segment per non-empty state; each segment names its count.
  function rolloutBar(counts, total) {
    const bar = el("div", { class: "progress", role: "img" });
    const parts = [];
    for (const state of ROLLOUT_STATES) {
      const n = counts[state] || 0;
      if (!n) continue;
      parts.push(`${n} ${ROLLOUT_LABELS[state]}`);
      bar.append(el("span", {
        class: `seg seg-${state}`,
        style: `width:${(100 * n) / Math.max(1, total)}%`,
        title: `${n} ${ROLLOUT_LABELS[state]}`,
        dataset: { state, count: n },
      }));
    }
    bar.setAttribute("aria-label", parts.join(", ") || "no devices");
    return bar;
  }

  function debounce(fn, ms = 250) {
    let timer;
    return (...args) => { clearTimeout(timer); timer = setTimeout(() => fn(...args), ms); };
  }

  // A live tail of the event log; onEvent gets each new event. Shows state in #live-indicator.
  function tail(params, onEvent) {
    const url = new URL(`${API}/events/stream`, location.origin);
    for (const [key, value] of Object.entries(params || {})) url.searchParams.set(key, value);
    const source = new EventSource(url);
    const indicator = document.getElementById("live-indicator");
    const text = document.getElementById("live-text");
    const state = (on, label) => {
      if (indicator) indicator.classList.toggle("on", on);
      if (text) text.textContent = label;
    };
    source.onopen = () => state(true, "live");
    source.onerror = () => state(false, "reconnecting…");
    // Frames carry no `event:` name, so every kind arrives here; the kind is in the data.
    source.onmessage = (message) => onEvent(JSON.parse(message.data));
    return source;
  }

  return {
    api, el, toast, fmt, badge, fillTable, pager, debounce, tail, isAdmin, ApiError,
    rolloutBar, ROLLOUT_STATES, ROLLOUT_LABELS,
  };
})();
