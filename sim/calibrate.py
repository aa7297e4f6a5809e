"""`specfleet sim calibrate`: the simulator's parameters from measured runs.

Three sources, each optional but the first two:
- the database of a run (`--database-url`): every round's drafter, window, drafted and accepted
  tokens (acceptance per position, by drafter and task), draft times on devices and on the
  verifier host, and every session's prompt and answer lengths;
- benchmark JSON (`--bench-json`, `bench e2e`'s): the agents' per-round waits split into compute,
  queue and overhead, their turnarounds, and their sessions' wall times, for the service times
  beyond compute (a direct round's, a session's open);
- the verifier's cost (`--profile FILE` from `specfleet sim profile`, or `--measure`): passes
  of B rows and T positions timed on this host, and prefill.
What could not be fitted is listed in the calibration's `unfit`, with the default used instead.
"""

from __future__ import annotations

import json
import statistics
import time
from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sim.inputs import MAX_POSITIONS, Calibration, PositionRates, VerifierProfile

PRIOR_WEIGHT = 4.0  # rounds' worth of belief that a deep position does what the one before did
PROFILE_ROWS = (1, 2, 4, 8, 16, 32)
PROFILE_POSITIONS = (1, 2, 3, 5, 9)
PREFILL_LENGTHS = (16, 48, 96)
# Positions already cached in each row of a profiled pass: a chat prompt (~40 tokens) and half
# of a 48-token answer. Attention and the cache's copies grow with it: at 32 a 32-row pass cost
# 84 ms where sessions under way paid ~115.
PROFILE_CONTEXT = 64
DEFAULT_BROKER_HOP_MS = 0.15  # one QoS 1 publish through Mosquitto on loopback, bench bus p50


@dataclass
class _Counts:
    """Per position: how often it was reachable, and how often it went on."""

    reached: list[float] = field(default_factory=lambda: [0.0] * MAX_POSITIONS)
    went_on: list[float] = field(default_factory=lambda: [0.0] * MAX_POSITIONS)

    def add(self, reached_to: int, went_on_to: int) -> None:
        for i in range(min(reached_to, MAX_POSITIONS)):
            self.reached[i] += 1
            if i < went_on_to:
                self.went_on[i] += 1

    def rates(self, toward: Sequence[float] | None = None) -> list[float]:
        """Each position's rate, pulled toward the position before's (the first: 0.5), or
        toward `toward`'s rate at the same position."""
        out: list[float] = []
        for i in range(MAX_POSITIONS):
            if toward is not None:
                pull = toward[min(i, len(toward) - 1)]
            else:
                pull = 0.5 if i == 0 else out[-1]
            out.append((self.went_on[i] + pull * PRIOR_WEIGHT) / (self.reached[i] + PRIOR_WEIGHT))
        return out


@dataclass
class _Tables:
    fill: _Counts = field(default_factory=_Counts)
    accept: _Counts = field(default_factory=_Counts)
    rounds: int = 0

    def add(self, window: int, drafted: int, accepted: int) -> None:
        # Position i (0-based) of the fill is reachable when the window allows it and the
        # drafter proposed every token before it; of the accept, when it was proposed and
        # every token before it was accepted.
        self.fill.add(min(window, drafted + 1), drafted)
        self.accept.add(min(drafted, accepted + 1), accepted)
        self.rounds += 1

    def rates(self, toward: PositionRates | None = None) -> PositionRates:
        fill = self.fill.rates(toward.fill if toward is not None else None)
        accept = self.accept.rates(toward.accept if toward is not None else None)
        return PositionRates(fill=fill, accept=accept, rounds=self.rounds)


@dataclass(frozen=True)
class RecordedRound:
    """The columns of one stored round that calibration reads."""

    session_id: str
    round_index: int
    mode: str
    draft_model: str | None
    drafted: int
    n_accepted: int
    window: int
    t_draft_ms: float | None
    t_verify_ms: float | None = None
    pass_rows: int | None = None  # the rows of its pass, where the round records them
    t_queue_ms: float | None = None


@dataclass(frozen=True)
class RecordedSession:
    session_id: str
    task: str
    prompt_tokens: int
    generated: int
    max_tokens: int
    finished: bool


def read_database(
    url: str,
) -> tuple[list[RecordedSession], list[RecordedRound], list[tuple[int, int, float]]]:
    """Sessions and rounds of a specfleet database, oldest first, and the passes its host
    streams' rounds record: (rows, positions, ms), a session's first round (a prefill) left
    out."""
    import sqlalchemy as sa
    from sqlalchemy.orm import Session as DbSession

    from coordinator.db.models import DecodingSession, Round, SessionStatus

    engine = sa.create_engine(url)
    try:
        with DbSession(engine) as db:
            sessions = [
                RecordedSession(
                    str(row.id),
                    row.task_type,
                    len(row.prompt_ids),
                    len(row.committed_ids),
                    row.max_tokens,
                    row.status is SessionStatus.FINISHED,
                )
                for row in db.scalars(
                    sa.select(DecodingSession).order_by(DecodingSession.created_at)
                )
            ]
            fixed_k = {
                str(sid): k
                for sid, k in db.execute(sa.select(DecodingSession.id, DecodingSession.k))
            }
            rounds = []
            previous_k: dict[str, int] = {}
            query = sa.select(Round).order_by(Round.session_id, Round.round_index)
            for row in db.scalars(query):
                sid = str(row.session_id)
                policy = row.policy or {}
                chosen = policy.get("pass", {}).get("k") if isinstance(policy, dict) else None
                window = chosen if chosen is not None else previous_k.get(sid, fixed_k[sid])
                if isinstance(policy, dict) and isinstance(policy.get("k"), int):
                    previous_k[sid] = policy["k"]
                drafted = len(row.draft_tokens)
                rounds.append(
                    RecordedRound(
                        sid,
                        row.round_index,
                        row.mode.value,
                        row.draft_model,
                        drafted,
                        row.n_accepted,
                        max(int(window), drafted),
                        row.t_draft_ms,
                        row.t_verify_ms,
                        _pass_rows(policy),
                        row.t_queue_ms,
                    )
                )
            passes = [
                (int(policy["pass"]["rows"]), len(tokens) + 1, float(ms))
                for policy, tokens, ms, index in db.execute(
                    sa.select(
                        Round.policy, Round.draft_tokens, Round.t_verify_ms, Round.round_index
                    )
                )
                if isinstance(policy, dict)
                and isinstance(policy.get("pass"), dict)
                and ms
                and index
            ]
    finally:
        engine.dispose()
    return sessions, rounds, passes


def _pass_rows(policy: Any) -> int | None:
    if isinstance(policy, dict) and isinstance(policy.get("pass"), dict):
        rows = policy["pass"].get("rows")
        return int(rows) if isinstance(rows, int) else None
    return None


def _drafter(r: RecordedRound) -> str | None:
    """The drafter of a round that drafted by a window of ours, in a mode the fleet runs (not
    local); None for any other round."""
    return r.draft_model if r.window > 0 and r.mode != "local" else None


def fit_acceptance(
    sessions: Sequence[RecordedSession], rounds: Iterable[RecordedRound]
) -> dict[str, dict[str, PositionRates]]:
    """Per drafter: per task and pooled over tasks ("*")."""
    task_of = {s.session_id: s.task for s in sessions}
    tables: dict[str, dict[str, _Tables]] = defaultdict(lambda: defaultdict(_Tables))
    for r in rounds:
        drafter = _drafter(r)
        if drafter is None:
            continue
        for task in (task_of.get(r.session_id, "chat"), "*"):
            tables[drafter][task].add(r.window, r.drafted, r.n_accepted)
    return {
        drafter: {task: t.rates() for task, t in by_task.items()}
        for drafter, by_task in tables.items()
    }


PROMPT_MIN_ROUNDS = 8  # a drafter's rounds on a prompt below this: the prompt has no table


def fit_prompt_acceptance(
    sessions: Sequence[RecordedSession],
    rounds: Iterable[RecordedRound],
    documents: Sequence[dict[str, Any]],
    acceptance: dict[str, dict[str, PositionRates]],
) -> dict[str, dict[str, PositionRates]]:
    """Per drafter, per benchmark prompt (the JSON's `prompt_id` of each session): its rates
    on that prompt, each position pulled toward its task's (`acceptance`). Acceptance varies
    from prompt to prompt within a task more than by task, and a benchmark's runs are of
    particular prompts: a wave of bench e2e ends with its session that accepts least."""
    prompt_of = {
        str(s.get("session_id") or "").replace("-", ""): str(s["prompt_id"])
        for document in documents
        for s in document.get("sessions", [])
        if s.get("prompt_id") is not None
    }
    task_of = {s.session_id: s.task for s in sessions}
    tables: dict[str, dict[str, _Tables]] = defaultdict(lambda: defaultdict(_Tables))
    tasks: dict[str, str] = {}
    for r in rounds:
        prompt = prompt_of.get(r.session_id.replace("-", ""))
        drafter = _drafter(r)
        if prompt is None or drafter is None:
            continue
        tables[drafter][prompt].add(r.window, r.drafted, r.n_accepted)
        tasks[prompt] = task_of.get(r.session_id, "chat")
    out: dict[str, dict[str, PositionRates]] = {}
    for drafter, by_prompt in tables.items():
        by_task = acceptance.get(drafter, {})
        fitted = {
            prompt: t.rates(by_task.get(tasks[prompt]) or by_task.get("*"))
            for prompt, t in by_prompt.items()
            if t.rounds >= PROMPT_MIN_ROUNDS
        }
        if fitted:
            out[drafter] = fitted
    return out


def fit_draft_costs(rounds: Iterable[RecordedRound]) -> tuple[dict[str, float], dict[str, float]]:
    """Median draft ms per drafted token: on devices and on the verifier host, by drafter."""
    device: dict[str, list[float]] = defaultdict(list)
    host: dict[str, list[float]] = defaultdict(list)
    for r in rounds:
        if r.draft_model is None or r.t_draft_ms is None:
            continue
        if r.mode == "distributed" and r.drafted:
            device[r.draft_model].append(r.t_draft_ms / r.drafted)
        elif r.mode == "cloud" and r.window:
            host[r.draft_model].append(r.t_draft_ms / r.window)
    return (
        {d: statistics.median(v) for d, v in device.items()},
        {d: statistics.median(v) for d, v in host.items()},
    )


def fit_lengths(
    sessions: Iterable[RecordedSession],
) -> tuple[dict[str, list[int]], dict[str, list[int]]]:
    """Answer lengths (a session that reached max_tokens counts as that long: the answer went
    on) and prompt lengths, by task."""
    answers: dict[str, list[int]] = defaultdict(list)
    prompts: dict[str, list[int]] = defaultdict(list)
    for s in sessions:
        if not s.finished or s.generated < 1:
            continue
        answers[s.task].append(s.generated)
        prompts[s.task].append(s.prompt_tokens)
    return dict(answers), dict(prompts)


@dataclass(frozen=True)
class BenchTimings:
    round_service_ms: list[float]  # overhead of each device-drafted round, less two broker hops
    round_cpu_ms: float | None  # the part of it that holds the control plane's CPU
    agent_turn_ms: float | None
    open_ms: float | None


def fit_bench(document: dict[str, Any], device_draft_ms: float, hop_ms: float) -> BenchTimings:
    """Service times from a `bench e2e` JSON: what its rounds and sessions spent beyond compute."""
    # From lone sessions' rounds: what one round costs the services when nothing else is
    # running. Under load the same work queues for the CPUs it shares, which the simulation
    # models; loaded rounds' overhead holds that queueing already.
    levels = {str(r["label"]): int(r["sessions"]) for r in document.get("runs", [])}
    rounds = document.get("rounds", [])
    lone = [r for r in rounds if levels.get(str(r.get("run"))) == 1] or rounds
    service = [max(0.0, r["wait_ms"] - r["verify_ms"] - r["queue_ms"] - 2 * hop_ms) for r in lone]
    turns = [ms for s in _bus_sessions(document) for ms in s.get("turnaround_ms", [])]
    # A lone session's time outside its rounds: its open, the first window, its end.
    outside = [
        float(s["elapsed_s"]) * 1e3 - sum(s["wait_ms"]) - sum(s.get("turnaround_ms", []))
        for s in _bus_sessions(document)
        if levels.get(str(s.get("run"))) == 1
    ]
    # The share of that service that queues: rounds verified in one pass are served one after
    # another on the control plane's CPU (the agents' and the verifier's bus side), so the
    # median round of a pass of B waits for (B - 1) / 2 others; the slope of the overhead over
    # B, twice, is what one round holds that CPU for.
    pairs = [
        (r["batch_size"] - 1, r["wait_ms"] - r["verify_ms"] - r["queue_ms"])
        for r in rounds
        if isinstance(r.get("batch_size"), int) and r["batch_size"] >= 1
    ]
    cpu_ms = None
    if len({x for x, _ in pairs}) >= 3:
        mean_x = statistics.fmean(x for x, _ in pairs)
        mean_y = statistics.fmean(y for _, y in pairs)
        var = sum((x - mean_x) ** 2 for x, _ in pairs)
        slope = sum((x - mean_x) * (y - mean_y) for x, y in pairs) / var
        cpu_ms = min(max(0.0, 2.0 * slope), statistics.median(service)) if service else None
    return BenchTimings(
        round_service_ms=service,
        round_cpu_ms=cpu_ms,
        agent_turn_ms=max(0.0, statistics.median(turns) - device_draft_ms) if turns else None,
        open_ms=statistics.median(outside) if outside else None,
    )


STREAMED_SHARE = 0.9  # of an adaptive run's rounds streamed (cloud, plain) to time them by
STREAMED_MIN_ROUNDS = 100


def fit_coordinator_round_ms(documents: Sequence[dict[str, Any]]) -> float | None:
    """The coordinator's CPU time per streamed round, from `bench e2e`'s CPU by process (part
    7): its process's CPU over the adaptive arm's waves at the widest level whose rounds were
    nearly all streamed, less what it burns with no round to serve (its CPU per second over
    plain serving's waves of the same level), per round; the median over the documents. The
    process holds the benchmark's load generator too, which asks for whole answers (one
    reply a session): the session's open and close are in the figure, spread over its rounds."""
    fits = []
    for document in documents:
        runs = [r for r in document.get("runs", []) if "cpu_ms_per_token" in r]
        streamed = [
            r
            for r in runs
            if r.get("arm") == "adaptive"
            and int(r.get("rounds") or 0) >= STREAMED_MIN_ROUNDS
            and sum(r.get("round_modes", {}).get(mode, 0) for mode in ("cloud", "plain"))
            >= STREAMED_SHARE * int(r["rounds"])
        ]
        if not streamed:
            continue
        run = max(streamed, key=lambda r: int(r["sessions"]))
        busy_ms = float(run["cpu_ms_per_token"]["coordinator"]) * int(run["tokens"])
        plain = next(
            (r for r in runs if r.get("arm") == "plain" and r["sessions"] == run["sessions"]),
            None,
        )
        if plain is not None and float(plain.get("wall_s") or 0.0) > 0.0:
            idle_ms = float(plain["cpu_ms_per_token"]["coordinator"]) * int(plain["tokens"])
            busy_ms -= idle_ms / float(plain["wall_s"]) * float(run["wall_s"])
        fits.append(max(0.0, busy_ms) / int(run["rounds"]))
    return statistics.median(fits) if fits else None


def _bus_sessions(document: dict[str, Any]) -> list[dict[str, Any]]:
    return [s for s in document.get("sessions", []) if s.get("arm") != "plain" and "wait_ms" in s]


# -- the verifier's cost ---------------------------------------------------------------------


def measure_profile(
    models_dir: Path | None = None,
    threads: int = 1,
    rows: Sequence[int] = PROFILE_ROWS,
    positions: Sequence[int] = PROFILE_POSITIONS,
    kind: str = "cpu",
    context: int = PROFILE_CONTEXT,
    target: str | None = None,
    provider: str = "cpu",
) -> VerifierProfile:
    """Time passes of every (rows, positions) and prefills of a few lengths, as the verifier's
    inference process runs them (the same runtime, fp32, `threads` ONNX Runtime threads), for
    the target named `target` (default: SmolLM2) on the execution provider `provider`."""
    from tqdm import tqdm

    from modelbuild.target_build import load_target
    from verifier.child import profile_passes

    runtime, _ = load_target(
        models_dir, threads=threads, allow_spinning=False, name=target, provider=provider
    )
    shapes = [(b, t) for b in rows for t in positions]
    passes: list[tuple[int, int, float]] = []
    for shape in tqdm(shapes, desc=f"profile {kind}", unit="shape"):
        passes += profile_passes(runtime, [shape], repeats=2, context=context)
    prefill: list[tuple[int, float]] = []
    for length in PREFILL_LENGTHS:
        best = float("inf")
        for _ in range(3):
            cache = runtime.new_cache()
            t0 = time.perf_counter()
            runtime.forward(list(range(1, length + 1)), cache)
            best = min(best, (time.perf_counter() - t0) * 1e3)
        prefill.append((length, best))
    fixed, per_token = _line(prefill)
    return VerifierProfile(
        passes=passes,
        prefill_fixed_ms=fixed,
        prefill_ms_per_token=per_token,
        source=(
            f"measured by specfleet sim profile: {runtime.name} on {provider}, {threads} "
            f"thread(s), context {context}, {time.strftime('%Y-%m-%d')}"
        ),
    )


def fit_host_drafting(rounds: Iterable[RecordedRound]) -> dict[str, tuple[float, float]]:
    """Per host drafter, its passes' drafting per window token as a + b n for the n rows it
    drafted together in a pass (the verifier's `DraftCost`): a pass's rows share its verify
    time and record its rows, each row's draft time its share. A drafter seen at one batch size
    only is priced per row (a = 0), as the verifier prices it until it sees another."""
    passes: dict[tuple[str, float, int | None], list[RecordedRound]] = defaultdict(list)
    for r in rounds:
        timed = r.t_draft_ms is not None and r.t_verify_ms is not None
        if r.mode == "cloud" and r.draft_model and r.window and timed:
            passes[(r.draft_model, r.t_verify_ms or 0.0, r.pass_rows)].append(r)
    points: dict[str, list[tuple[int, float]]] = defaultdict(list)
    for (drafter, _, _), rows in passes.items():
        widest = max(r.window for r in rows)
        total = sum(r.t_draft_ms or 0.0 for r in rows)
        points[drafter].append((len(rows), total / widest))
    terms: dict[str, tuple[float, float]] = {}
    for drafter, seen in points.items():
        if len({n for n, _ in seen}) > 1:
            terms[drafter] = _line(seen)
        else:
            terms[drafter] = (0.0, statistics.median(y / n for n, y in seen))
    return terms


def _line(points: Sequence[tuple[int, float]]) -> tuple[float, float]:
    """Least-squares intercept and slope, both kept >= 0."""
    n = len(points)
    mean_x = sum(x for x, _ in points) / n
    mean_y = sum(y for _, y in points) / n
    var = sum((x - mean_x) ** 2 for x, _ in points)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in points) / var if var else 0.0
    slope = max(0.0, slope)
    return max(0.0, mean_y - slope * mean_x), slope


SCALE_ROWS = (1, 2, 4, 8, 16, 32)  # where the run's passes are compared with the profile


def fit_scale(
    profile: VerifierProfile, passes: Sequence[tuple[int, int, float]]
) -> list[tuple[int, float]]:
    """Per batch size, the median of (measured / profiled) over a run's passes of about that
    size (each pass counted once per row it held, as the rounds record it)."""
    from sim.engine import ProfileCost

    profiled = ProfileCost(profile.model_copy(update={"scale": []}))
    ratios: dict[int, list[float]] = defaultdict(list)
    for rows, positions, ms in passes:
        nearest = min(SCALE_ROWS, key=lambda r: abs(r - rows))
        ratios[nearest].append(ms / profiled.predict(rows, positions))
    return [(rows, statistics.median(v)) for rows, v in sorted(ratios.items()) if len(v) >= 5]


def run_keys(document: dict[str, Any]) -> dict[str, str]:
    """Session id (hex) -> the run of a benchmark JSON it ran in, as `sim validate` names the
    run's host speed: `e2e LABEL` (an arm at a level of bench e2e, e.g. `e2e hybrid x4`) or
    `adaptive PHASE CONFIG`."""
    keys: dict[str, str] = {}
    for s in document.get("sessions", []):
        sid = str(s.get("session_id") or "").replace("-", "")
        if not sid:
            continue
        if document.get("benchmark") == "adaptive":
            keys[sid] = f"adaptive {s.get('phase')} {s.get('config')}"
        elif s.get("run") is not None:
            keys[sid] = f"e2e {s.get('run')}"
    return keys


def plain_passes(documents: Sequence[dict[str, Any]]) -> list[tuple[str | None, int, int, float]]:
    """bench e2e's plain-serving decode passes: (`e2e LABEL`, rows, 1, ms)."""
    out: list[tuple[str | None, int, int, float]] = []
    for document in documents:
        for run in document.get("runs", []):
            sizes, times = run.get("batch_sizes") or [], run.get("pass_ms") or []
            if run.get("arm") == "plain" and len(sizes) == len(times):
                key = f"e2e {run.get('label')}"
                out += [(key, int(b), 1, float(ms)) for b, ms in zip(sizes, times, strict=True)]
    return out


RUN_COST_MIN_PASSES = 30  # fewer timed passes than this: the profile's figures stay


def run_passes(
    rounds: Iterable[RecordedRound], documents: Sequence[dict[str, Any]]
) -> list[tuple[str | None, int, int, float]]:
    """Every timed pass of a run: (its benchmark run's key, rows, positions, ms). The rows come
    from the round (host streams record them) or from bench e2e's JSON; positions are the
    widest row's drafted tokens + 1; a pass with a session's first round (a prefill) is left
    out."""
    keys: dict[str, str] = {}
    rows_of: dict[tuple[str, int], int] = {}
    for document in documents:
        keys.update(run_keys(document))
        for r in document.get("rounds", []):
            sid = str(r.get("session_id") or "").replace("-", "")
            if isinstance(r.get("batch_size"), int) and isinstance(r.get("round"), int):
                rows_of[sid, r["round"]] = r["batch_size"]
    # The rounds of one pass record the same time: one pass, as wide as its widest, with as
    # many rows as it recorded (or as rounds share its time, where none recorded them).
    sharing = Counter(r.t_verify_ms for r in rounds if r.t_verify_ms)
    found: dict[tuple[int, float], tuple[str | None, int, int, float]] = {}
    for r in rounds:
        sid = r.session_id.replace("-", "")
        if not (r.t_verify_ms and r.round_index):
            continue
        rows = r.pass_rows or rows_of.get((sid, r.round_index)) or sharing[r.t_verify_ms]
        seen = found.get((rows, r.t_verify_ms))
        positions = max(r.drafted + 1, seen[2] if seen else 1)
        found[rows, r.t_verify_ms] = (keys.get(sid), rows, positions, r.t_verify_ms)
    return list(found.values())


PREFILL_MIN_PASSES = 3  # fewer passes that prefilled than this: the profile's prefill stays
PREFILL_SCALE_LIMITS = (0.5, 4.0)


def fit_prefill_scale(
    rounds: Iterable[RecordedRound],
    sessions: Iterable[RecordedSession],
    documents: Sequence[dict[str, Any]],
    profile: VerifierProfile,
    host_speed: dict[str, float],
) -> float | None:
    """How much more than the profile's prefills the verifier's passes that prefilled cost in
    the benchmark's runs, as the simulator prices such a pass (the pass's own shape at the run's
    speed, plus each new session's prefill at the run's speed): the median over bench e2e's
    passes that held a session's first round, of (ms / speed - pass) / the pass's prefills, each
    prompt's own, summed (`prefills_ms`, as the simulator prices them): the verifier prefills
    a wave's new sessions one after another within the pass."""
    from sim.engine import ProfileCost, prefills_ms

    keys = {sid: key for document in documents for sid, key in run_keys(document).items()}
    prompt = {s.session_id.replace("-", ""): s.prompt_tokens for s in sessions}
    by_pass: dict[float, list[RecordedRound]] = defaultdict(list)
    for r in rounds:
        if r.t_verify_ms:
            by_pass[r.t_verify_ms].append(r)
    cost = ProfileCost(profile)
    factors: list[float] = []
    for ms, members in by_pass.items():
        first = [r for r in members if r.round_index == 0]
        key = keys.get(first[0].session_id.replace("-", "")) if first else None
        if key is None or not key.startswith("e2e ") or key not in host_speed:
            continue
        tokens = [prompt.get(r.session_id.replace("-", "")) for r in first]
        if any(t is None for t in tokens):
            continue
        prefills = prefills_ms(profile, [int(t or 0) for t in tokens])
        positions = max(r.drafted for r in members) + 1
        rest = cost.predict(len(members), positions)
        factors.append((ms / host_speed[key] - rest) / prefills)
    if len(factors) < PREFILL_MIN_PASSES:
        return None
    low, high = PREFILL_SCALE_LIMITS
    return min(max(statistics.median(factors), low), high)


def plain_prefill_speed(
    documents: Sequence[dict[str, Any]], profile: VerifierProfile
) -> dict[str, float]:
    """Per plain-serving run of bench e2e (`e2e LABEL prefill`): the median of its prompts'
    prefills (each its own pass) over the profile's. Runs written before bench e2e timed them
    have none, and the simulator prices their prefills at the run's decode speed."""
    out: dict[str, float] = {}
    for document in documents:
        ratios: dict[str, list[float]] = defaultdict(list)
        for s in document.get("sessions", []):
            ms, tokens = s.get("prefill_ms"), s.get("prompt_len")
            if isinstance(ms, (int, float)) and isinstance(tokens, int) and s.get("run"):
                ratios[f"e2e {s['run']} prefill"].append(float(ms) / profile.prefill_ms(tokens))
        out |= {key: statistics.median(v) for key, v in ratios.items() if len(v) >= 3}
    return out


def fit_run_cost(passes: Sequence[tuple[str | None, int, int, float]]) -> tuple[float, ...] | None:
    """ms = a + b rows + c rows (positions - 1), fitted (least squares, coefficients >= 0) on
    the medians of the run's passes by shape, each weighted by its count: the target's pass
    cost as the run paid it, with its contexts and its host's load, smoothed over shapes."""
    import numpy as np

    groups: dict[tuple[int, int], list[float]] = defaultdict(list)
    for _, rows, positions, ms in passes:
        groups[rows, positions].append(ms)
    if sum(len(v) for v in groups.values()) < RUN_COST_MIN_PASSES:
        return None
    shapes = sorted(groups)
    x = np.array([[1.0, b, b * (t - 1)] for b, t in shapes])
    y = np.array([statistics.median(groups[s]) for s in shapes])
    w = np.sqrt(np.array([len(groups[s]) for s in shapes], dtype=float))
    active = [0, 1, 2]
    while True:  # drop a coefficient that comes out negative and fit the rest again
        coef, *_ = np.linalg.lstsq(x[:, active] * w[:, None], y * w, rcond=None)
        if (coef >= 0).all() or len(active) == 1:
            break
        active.pop(int(np.argmin(coef)))
    full = [0.0, 0.0, 0.0]
    for i, value in zip(active, coef, strict=True):
        full[i] = max(0.0, float(value))
    return tuple(full)


def fit_emulated_link(
    rounds: Iterable[RecordedRound], documents: Sequence[dict[str, Any]], service_ms: float
) -> float | None:
    """What `bench adaptive`'s emulated links add to a distributed round beyond their profile's
    RTT (the userspace netem proxy, on the benchmark's shared host): the median over its
    device-drafted rounds (a session's first left out) of the agent's wait less the pass, the
    queue, the profile's RTT and the median service time of a round on loopback."""
    from netem.profiles import PROFILES

    by_round = {(r.session_id.replace("-", ""), r.round_index): r for r in rounds}
    extra: list[float] = []
    for document in documents:
        if document.get("benchmark") != "adaptive":
            continue
        blip = str(document.get("settings", {}).get("blip_profile", "wifi"))
        for s in document.get("sessions", []):
            phase = "wifi" if s.get("phase") == "blip" else str(s.get("phase"))
            profile = PROFILES.get(blip if s.get("phase") == "blip" else phase)
            if profile is None:
                continue
            rtt = profile.up.latency_ms + profile.down.latency_ms
            sid = str(s.get("session_id") or "").replace("-", "")
            for i, wait in enumerate(s.get("wait_ms", [])):
                r = by_round.get((sid, i))
                if i == 0 or r is None or r.mode != "distributed" or r.t_verify_ms is None:
                    continue
                extra.append(wait - r.t_verify_ms - (r.t_queue_ms or 0.0) - rtt - service_ms)
    return max(0.0, statistics.median(extra)) if len(extra) >= 10 else None


# A pass that took this many times the run's typical ratio to the model stalled (the host
# descheduled the target): it is left out of the run's speed, which the simulator's own noise
# and the bench's other passes already carry.
STALL_RATIO = 2.0


def fit_host_speed(
    profile: VerifierProfile, passes: Sequence[tuple[str | None, int, int, float]]
) -> dict[str, float]:
    """Per benchmark run (an arm at a level of bench e2e, a configuration in a phase of bench
    adaptive): the median of its target passes' measured cost over the calibrated one. A shared
    host's speed drifts from minute to minute; this is how fast the target's passes ran while
    that run was measured (plain serving's passes, in a process of their own, count for its
    own runs)."""
    from sim.engine import ProfileCost

    cost = ProfileCost(profile)
    timed: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for key, rows, positions, ms in passes:
        if key is not None:
            timed[key].append((ms, cost.predict(rows, positions)))
    speed: dict[str, float] = {}
    for key, pairs in sorted(timed.items()):
        if len(pairs) < 5:
            continue
        typical = statistics.median(ms / predicted for ms, predicted in pairs)
        kept = [(ms, p) for ms, p in pairs if ms / p <= STALL_RATIO * typical]
        speed[key] = sum(ms for ms, _ in kept) / sum(p for _, p in kept)
    return speed


# -- everything together -----------------------------------------------------------------------


def calibrate(
    database_url: str | Sequence[str],
    profile: VerifierProfile,
    bench_document: dict[str, Any] | Sequence[dict[str, Any]] | None = None,
    device_class: str = "bench",
    broker_hop_ms: float | None = None,
) -> Calibration:
    """`bench_document`: `bench e2e` JSON (service times, and each level's host speed), and
    `bench adaptive` JSON (each phase's host speed), one or several."""
    documents = [bench_document] if isinstance(bench_document, dict) else [*(bench_document or [])]
    e2e = [d for d in documents if d.get("benchmark") != "adaptive"]
    bench_document = e2e[0] if e2e else None
    sessions: list[RecordedSession] = []
    rounds: list[RecordedRound] = []
    passes: list[tuple[int, int, float]] = []
    for url in [database_url] if isinstance(database_url, str) else database_url:
        more = read_database(url)
        sessions += more[0]
        rounds += more[1]
        passes += more[2]
    unfit: list[str] = []
    acceptance = fit_acceptance(sessions, rounds)
    if not acceptance:
        raise ValueError("the database holds no drafted rounds to fit acceptance on")
    prompt_acceptance = fit_prompt_acceptance(sessions, rounds, documents, acceptance)
    device_draft, host_draft = fit_draft_costs(rounds)
    if not host_draft:
        unfit.append("host draft cost: no cloud round measured it (0.2 ms/token used)")
    answers, prompts = fit_lengths(sessions)
    if not answers:
        raise ValueError("the database holds no finished session to fit answer lengths on")
    hop = DEFAULT_BROKER_HOP_MS if broker_hop_ms is None else broker_hop_ms
    if broker_hop_ms is None:
        unfit.append(f"broker hop: not measured here ({DEFAULT_BROKER_HOP_MS} ms used)")
    values: dict[str, Any] = {}
    if bench_document is None:
        unfit.append("service times: no benchmark JSON (defaults used)")
        service = [1.0]
    else:
        median_draft = statistics.median(device_draft.values()) if device_draft else 0.0
        timings = fit_bench(bench_document, median_draft, hop)
        service = timings.round_service_ms or [1.0]
        if not timings.round_service_ms:
            unfit.append("direct round service time: the JSON has no device-drafted rounds")
        if timings.round_cpu_ms is not None:
            values["round_cpu_ms"] = timings.round_cpu_ms
        else:
            unfit.append("direct round CPU share: too few pass sizes in the JSON (all of it)")
        if timings.agent_turn_ms is not None:
            values["agent_turn_ms"] = timings.agent_turn_ms
        if timings.open_ms is not None:
            values["open_ms"] = max(0.0, timings.open_ms)
        else:
            unfit.append("session open time: no single-session level in the JSON")
    coordinator_ms = fit_coordinator_round_ms(e2e)
    if coordinator_ms is not None:
        values["coordinator_round_ms"] = coordinator_ms
    else:
        unfit.append(
            "coordinator time per streamed round: no bench e2e run with CPU by process over "
            "mostly streamed rounds (0.5 ms used)"
        )
    timed = run_passes(rounds, documents)
    # The shape of the cost from bench e2e's passes where there are enough (they span 1 to 32
    # rows; bench adaptive's, 1 to 3), its level in each run from that run's own (host_speed).
    e2e_timed = [p for p in timed if p[0] is not None and p[0].startswith("e2e ")]
    model = fit_run_cost(e2e_timed) or fit_run_cost(timed)
    if model is not None:
        a, b, c = model
        profile = profile.model_copy(
            update={
                "passes": [
                    (rows, t, a + b * rows + c * rows * (t - 1))
                    for rows in PROFILE_ROWS
                    for t in PROFILE_POSITIONS
                ],
                "scale": [],
                "source": f"the run's {len(timed)} timed passes: ms = {a:.2f} + {b:.3f} rows "
                f"+ {c:.3f} rows (positions - 1); prefill from {profile.source}",
            }
        )
    elif passes:
        profile = profile.model_copy(update={"scale": fit_scale(profile, passes)})
        unfit.append(f"pass cost: under {RUN_COST_MIN_PASSES} timed passes (profile, scaled)")
    else:
        unfit.append("the run's own pass costs: no host-stream round recorded one (profile as is)")
    host_speed = fit_host_speed(profile, [*timed, *plain_passes(documents)])
    prefill_scale = fit_prefill_scale(rounds, sessions, documents, profile, host_speed)
    if prefill_scale is not None:
        profile = profile.model_copy(
            update={
                "prefill_fixed_ms": profile.prefill_fixed_ms * prefill_scale,
                "prefill_ms_per_token": profile.prefill_ms_per_token * prefill_scale,
                "source": f"{profile.source}, times {prefill_scale:.2f} as the run's passes "
                "that prefilled paid it",
            }
        )
    elif e2e:
        unfit.append(
            f"prefill: under {PREFILL_MIN_PASSES} passes of bench e2e prefilled (profile as is)"
        )
    host_speed |= plain_prefill_speed(documents, profile)
    if any(d.get("benchmark") == "adaptive" for d in documents):
        emulated = fit_emulated_link(rounds, documents, statistics.median(service))
        if emulated is not None:
            values["emulated_link_ms"] = emulated
        else:
            unfit.append("emulated link: under 10 device-drafted rounds in bench adaptive (0 used)")
    if documents and not host_speed:
        unfit.append("host speed per run: no run of the JSON had 5 passes to time (1.0 used)")
    return Calibration(
        verifiers={"cpu": profile},
        acceptance=acceptance,
        prompt_acceptance=prompt_acceptance,
        host_draft_ms_per_token=host_draft,
        host_draft_terms=fit_host_drafting(rounds),
        device_draft_ms_per_token={device_class: device_draft} if device_draft else {},
        answer_tokens=answers,
        prompt_tokens=prompts,
        round_service_ms=sorted(service),
        host_speed=host_speed,
        broker_hop_ms=hop,
        unfit=unfit,
        sources=[f"rounds: {len(rounds)}, sessions: {len(sessions)}"],
        **values,
    )


def write(calibration: Calibration, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(calibration.model_dump(mode="json"), indent=1) + "\n")
