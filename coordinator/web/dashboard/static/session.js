// Session page: the text with each token's provenance, the round timeline, and an animated replay.
"use strict";

(() => {
  const { api, el, fmt, toast, isAdmin } = SF;
  const sessionId = document.getElementById("session-id").dataset.session;
  const transcript = document.getElementById("transcript");
  const timeline = document.getElementById("timeline");
  const replayButton = document.getElementById("replay-button");
  const progress = document.getElementById("replay-progress");
  const LEGS = ["draft", "uplink", "queue", "verify", "downlink"];
  const KIND_LABEL = {
    accepted: "accepted draft token",
    corrected: "target-corrected token",
    provisional: "provisional (drafted offline), accepted",
    target: "target token",
  };
  const LIVE = new Set(["active", "suspended"]);
  const MIN_FRAME_MS = 40; // so that rounds recorded microseconds apart still animate visibly

  let detail = null;
  let replay = null; // {timer, index}

  function tokenSpan(token, round, rejected = false) {
    const kind = rejected ? "rejected" : token.kind;
    const label = rejected ? "drafted, rejected by the target" : KIND_LABEL[token.kind];
    return el("span", {
      class: `tok tok-${kind}`,
      dataset: { round: round.round, kind, token: token.id },
      title: `round ${round.round} · ${label} · id ${token.id}`,
    }, token.text);
  }

  // A round's spans in reading order: accepted drafts, the rejected tail, the target's token.
  function roundSpans(round) {
    const spans = [];
    const accepted = round.tokens.slice(0, round.n_accepted);
    const own = round.tokens.slice(round.n_accepted);
    for (const token of accepted) spans.push(tokenSpan(token, round));
    for (const token of round.rejected) spans.push(tokenSpan(token, round, true));
    for (const token of own) spans.push(tokenSpan(token, round));
    return spans;
  }

  function renderText(upTo = null) {
    const rounds = upTo === null ? detail.rounds : detail.rounds.slice(0, upTo);
    transcript.replaceChildren(...rounds.flatMap(roundSpans));
  }

  function fact(label, value) {
    return el("div", { class: "fact" }, el("dt", {}, label), el("dd", {}, value));
  }

  function renderFacts() {
    const s = detail.session;
    const st = detail.stats;
    const status = document.getElementById("session-status");
    status.textContent = s.status;
    status.className = `badge badge-${s.status}`;
    document.getElementById("facts").replaceChildren(
      fact("Device", el("a", { href: `/devices/${encodeURIComponent(s.device_id)}` }, s.device_id)),
      fact("Task", s.task_type),
      fact("Mode", s.mode),
      fact("Draft / k", `${s.draft_model || "–"} / ${s.k}`),
      fact("Sampling", s.temperature === 0 ? "greedy" : `T ${s.temperature}, top-p ${s.top_p}`),
      fact("Seed", s.seed),
      fact("Tokens", `${st.generated} / ${s.max_tokens}`),
      fact("Rounds", detail.rounds_count),
      fact(el("span", { class: "greek" }, "α"), fmt.alpha(st.alpha)),
      fact("Tokens/s", fmt.num(st.tokens_per_s, 1)),
      fact("Duration", st.duration_s === null ? "–" : `${st.duration_s.toFixed(2)} s`),
      fact("Started", fmt.time(s.created_at)),
    );
    document.getElementById("prompt").textContent = s.prompt;
    const legend = document.getElementById("legend");
    for (const [kind, count] of Object.entries(st.kinds)) {
      const chip = legend.querySelector(`.tok-${kind}`);
      if (chip) chip.dataset.count = count;
    }
    const cancel = document.getElementById("cancel-button");
    if (cancel) cancel.hidden = !(isAdmin() && LIVE.has(s.status));
    const problems = document.getElementById("problems");
    problems.hidden = !detail.problems.length;
    problems.replaceChildren(...detail.problems.map((p) => el("li", {}, p)));
  }

  // The decision itself (mode, draft, k); an adaptive round's inputs live under `decision`.
  function policyText(policy) {
    if (!policy) return null;
    return ["mode", "draft_model", "k"]
      .filter((key) => policy[key] !== undefined)
      .map((key) => `${key} ${policy[key]}`)
      .join(" · ");
  }

  function renderTimeline() {
    const maxTotal = Math.max(1e-9, ...detail.rounds.map((r) => r.total_ms || 0));
    let previousPolicy = null;
    timeline.replaceChildren(...detail.rounds.map((round) => {
      const boxes = [];
      for (let i = 0; i < round.k; i += 1) {
        const ok = i < round.n_accepted;
        boxes.push(el("i", { class: ok ? (round.provisional ? "prov" : "ok") : "", title: ok ? "accepted" : "rejected" }));
      }
      const legs = LEGS.filter((leg) => round.legs_ms[leg] !== undefined).map((leg) =>
        el("span", {
          class: `leg leg-${leg}`,
          style: `width:${(100 * round.legs_ms[leg]) / maxTotal}%`,
          title: `${leg} ${fmt.ms(round.legs_ms[leg])}`,
        }));
      const policy = policyText(round.policy);
      const changed = policy !== null && policy !== previousPolicy;
      previousPolicy = policy ?? previousPolicy;
      const text = `${round.n_accepted}/${round.k} accepted${round.provisional ? " (provisional)" : ""}`;
      return el("li", {
        class: changed && round.round > 0 ? "policy-change" : "",
        dataset: { round: round.round },
        title: `${text}; verifier ${round.verifier_id || "–"}`,
        onclick: () => highlight(round.round),
      },
        el("span", { class: "r-index" }, `#${round.round}`),
        el("span", { class: "r-accept", "aria-label": text }, boxes),
        el("span", { class: "r-legs" }, legs),
        el("span", { class: "r-total" }, fmt.ms(round.total_ms)),
        changed ? el("span", { class: "r-policy" }, `policy → ${policy}`) : null,
      );
    }));
  }

  function highlight(index) {
    for (const node of transcript.querySelectorAll(".tok.current")) node.classList.remove("current");
    for (const node of timeline.querySelectorAll("li.current")) node.classList.remove("current");
    for (const node of transcript.querySelectorAll(`.tok[data-round="${index}"]`)) node.classList.add("current");
    const item = timeline.querySelector(`li[data-round="${index}"]`);
    if (item) {
      item.classList.add("current");
      item.scrollIntoView({ block: "nearest" });
    }
  }

  function stopReplay(finished) {
    if (replay) clearTimeout(replay.timer);
    replay = null;
    transcript.classList.remove("replaying");
    replayButton.textContent = "▶ Replay";
    if (finished) {
      transcript.dataset.replay = "done";
      progress.textContent = `replayed ${detail.rounds.length} rounds`;
    }
  }

  function startReplay() {
    const speed = Number(document.getElementById("replay-speed").value) || 1;
    transcript.replaceChildren();
    transcript.classList.add("replaying");
    transcript.dataset.replay = "running";
    replayButton.textContent = "⏸ Stop";
    replay = { index: 0, timer: null };
    const step = () => {
      if (!replay) return;
      if (replay.index >= detail.rounds.length) {
        highlight(-1);
        stopReplay(true);
        return;
      }
      const round = detail.rounds[replay.index];
      transcript.append(...roundSpans(round));
      highlight(round.round);
      replay.index += 1;
      progress.textContent = `round ${replay.index} / ${detail.rounds.length}`;
      const next = detail.rounds[replay.index];
      const wait = next ? Math.max(MIN_FRAME_MS, (1000 * next.delay_s) / speed) : MIN_FRAME_MS;
      replay.timer = setTimeout(step, wait);
    };
    const first = detail.rounds[0];
    replay.timer = setTimeout(step, first ? Math.max(MIN_FRAME_MS, (1000 * first.delay_s) / speed) : 0);
  }

  replayButton.addEventListener("click", () => {
    if (!detail) return;
    if (replay) {
      stopReplay(false);
      renderText();
      progress.textContent = "";
    } else {
      startReplay();
    }
  });

  document.getElementById("show-rejected").addEventListener("change", (event) => {
    transcript.classList.toggle("show-rejected", event.target.checked);
  });

  const cancel = document.getElementById("cancel-button");
  if (cancel) {
    cancel.addEventListener("click", async () => {
      if (!confirm("Cancel this session? The device stops generating.")) return;
      try {
        await api(`/sessions/${sessionId}/cancel`, { method: "POST", body: { reason: "cancelled from the dashboard" } });
        toast("Cancellation sent");
        load();
      } catch (error) { toast(error.message, true); }
    });
  }

  async function load() {
    try {
      detail = await api(`/sessions/${sessionId}`);
    } catch (error) {
      if (error.status !== 401) {
        transcript.replaceChildren(el("p", { class: "error" }, error.message));
      }
      return;
    }
    renderFacts();
    if (!replay) renderText();
    renderTimeline();
    transcript.dataset.loaded = "true";
    if (LIVE.has(detail.session.status)) setTimeout(load, 2000);
  }

  load();
})();
