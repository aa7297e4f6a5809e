"""Prometheus metrics of the coordinator: speculative-decoding counters as vLLM names them,
round latency per leg, and gauges read from the database and the live service at scrape time."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import sqlalchemy as sa
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from sqlalchemy.orm import Session, sessionmaker

from coordinator.db.models import DecodingSession, Device, DeviceStatus, Round, SessionStatus
from coordinator.live import VerifierLoad

# vLLM exposes `vllm:spec_decode_*`; the same names under our prefix let its dashboards be reused.
PREFIX = "specfleet:"
LEGS = ("draft", "uplink", "queue", "verify", "downlink")
# Seconds: loopback rounds take about a millisecond, a congested 4G one a second or more.
LATENCY_BUCKETS = (
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
)  # fmt: skip
MAX_POSITION_LABEL = 64  # k is at most 64 (the Policy's bound), so positions stay bounded


@dataclass(frozen=True)
class RoundLegs:
    """Milliseconds spent in each leg of one round; None where it was not measured."""

    draft_ms: float | None = None
    uplink_ms: float | None = None
    queue_ms: float | None = None
    verify_ms: float | None = None
    downlink_ms: float | None = None

    def items(self) -> Iterator[tuple[str, float]]:
        values = (self.draft_ms, self.uplink_ms, self.queue_ms, self.verify_ms, self.downlink_ms)
        for leg, value in zip(LEGS, values, strict=True):
            if value is not None:
                yield leg, value


class _DatabaseGauges(Collector):
    """Sessions by state and devices by status, counted by the database when scraped."""

    def __init__(self, sessions: sessionmaker[Session]) -> None:
        self._sessions = sessions

    def collect(self) -> Iterator[Metric]:
        with self._sessions() as db:
            states = sa.select(DecodingSession.status, sa.func.count()).group_by(
                DecodingSession.status
            )
            statuses = sa.select(Device.status, sa.func.count()).group_by(Device.status)
            by_state = {state: n for state, n in db.execute(states)}
            by_status = {status: n for status, n in db.execute(statuses)}
        sessions = GaugeMetricFamily(
            PREFIX + "sessions", "Decoding sessions by state.", labels=["state"]
        )
        for state in SessionStatus:
            sessions.add_metric([state.value], by_state.get(state, 0))
        yield sessions
        devices = GaugeMetricFamily(PREFIX + "devices", "Devices by status.", labels=["status"])
        for status in DeviceStatus:
            devices.add_metric([status.value], by_status.get(status, 0))
        yield devices
        yield GaugeMetricFamily(
            PREFIX + "devices_online",
            "Devices online now.",
            value=by_status.get(DeviceStatus.ONLINE, 0),
        )


class _LiveGauges(Collector):
    """Verifier load as the running service last heard it."""

    def __init__(self, loads: Callable[[], Sequence[VerifierLoad]]) -> None:
        self._loads = loads

    def collect(self) -> Iterator[Metric]:
        queue = GaugeMetricFamily(
            PREFIX + "verifier_queue_depth",
            "Drafts waiting for a verification batch, per verifier.",
            labels=["verifier"],
        )
        in_flight = GaugeMetricFamily(
            PREFIX + "verifier_in_flight",
            "Drafts in a verifier's forward pass now.",
            labels=["verifier"],
        )
        online = GaugeMetricFamily(PREFIX + "verifiers_online", "Verifiers online now.")
        loads = list(self._loads())
        for load in loads:
            queue.add_metric([load.verifier_id], load.queue_depth)
            in_flight.add_metric([load.verifier_id], load.in_flight)
        online.add_metric([], sum(1 for load in loads if load.online))
        yield queue
        yield in_flight
        yield online


class _AcceptanceLength(Collector):
    def __init__(self, metrics: CoordinatorMetrics) -> None:
        self._metrics = metrics

    def collect(self) -> Iterator[Metric]:
        family = GaugeMetricFamily(
            PREFIX + "spec_decode_mean_acceptance_length",
            "Committed tokens per verified draft (1 + accepted / drafts), per draft model.",
            labels=["draft_model"],
        )
        for draft_model, (drafts, accepted) in self._metrics.totals().items():
            if drafts:
                family.add_metric([draft_model], 1.0 + accepted / drafts)
        yield family


class CoordinatorMetrics:
    """One per coordinator process; the decoding loop calls `observe_round` for every verdict.

    Counters live in this process and restart at zero with it, as Prometheus expects; gauges of
    sessions and devices are counted by the database at scrape time, so every coordinator
    shard reports the same truth.
    """

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        self._lock = threading.Lock()
        self._totals: dict[str, tuple[int, int]] = {}  # draft model -> (drafts, accepted)
        self._live: _LiveGauges | None = None
        self._database: _DatabaseGauges | None = None
        self.num_drafts = Counter(
            PREFIX + "spec_decode_num_drafts",
            "Verified drafts (rounds with k > 0).",
            ["draft_model"],
            registry=self.registry,
        )
        self.num_draft_tokens = Counter(
            PREFIX + "spec_decode_num_draft_tokens",
            "Drafted tokens sent for verification.",
            ["draft_model"],
            registry=self.registry,
        )
        self.num_accepted_tokens = Counter(
            PREFIX + "spec_decode_num_accepted_tokens",
            "Drafted tokens the target accepted.",
            ["draft_model"],
            registry=self.registry,
        )
        self.num_accepted_tokens_per_pos = Counter(
            PREFIX + "spec_decode_num_accepted_tokens_per_pos",
            "Accepted drafted tokens by position in the draft (0 is the first).",
            ["draft_model", "position"],
            registry=self.registry,
        )
        self.committed_tokens = Counter(
            PREFIX + "committed_tokens",
            "Tokens committed by verdicts (accepted plus the target's own).",
            ["draft_model"],
            registry=self.registry,
        )
        self.leg_latency = Histogram(
            PREFIX + "round_leg_latency_seconds",
            "Time of each leg of a round: draft, uplink, queue, verify, downlink.",
            ["leg"],
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.round_latency = Histogram(
            PREFIX + "round_latency_seconds",
            "Sum of the measured legs of a round.",
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.registry.register(_AcceptanceLength(self))

    def observe_round(
        self,
        *,
        draft_model: str | None,
        k: int,
        n_accepted: int,
        committed: int,
        legs: RoundLegs,
    ) -> None:
        """Count one verified round: k drafted, n_accepted kept, `committed` tokens committed."""
        if not 0 <= n_accepted <= k:
            raise ValueError(f"n_accepted {n_accepted} outside 0..k={k}")
        model = draft_model or "none"
        if k > 0:
            self.num_drafts.labels(model).inc()
            self.num_draft_tokens.labels(model).inc(k)
            self.num_accepted_tokens.labels(model).inc(n_accepted)
            for position in range(min(n_accepted, MAX_POSITION_LABEL)):
                self.num_accepted_tokens_per_pos.labels(model, str(position)).inc()
            with self._lock:
                drafts, accepted = self._totals.get(model, (0, 0))
                self._totals[model] = (drafts + 1, accepted + n_accepted)
        self.committed_tokens.labels(model).inc(committed)
        total_ms = 0.0
        for leg, ms in legs.items():
            self.leg_latency.labels(leg).observe(ms / 1e3)
            total_ms += ms
        if any(True for _ in legs.items()):
            self.round_latency.observe(total_ms / 1e3)

    def observe_row(self, row: Round) -> None:
        """`observe_round` from a persisted round (a SessionBook round observer can call it)."""
        self.observe_round(
            draft_model=row.draft_model,
            k=row.k,
            n_accepted=row.n_accepted,
            committed=row.committed_len - row.base_len,
            legs=RoundLegs(
                draft_ms=row.t_draft_ms,
                uplink_ms=row.t_uplink_ms,
                queue_ms=row.t_queue_ms,
                verify_ms=row.t_verify_ms,
                downlink_ms=row.t_downlink_ms,
            ),
        )

    def totals(self) -> dict[str, tuple[int, int]]:
        with self._lock:
            return dict(self._totals)

    def bind_database(self, sessions: sessionmaker[Session]) -> None:
        """Count sessions and devices from this database at scrape time."""
        if self._database is None:
            self._database = _DatabaseGauges(sessions)
            self.registry.register(self._database)

    def bind_live(self, loads: Callable[[], Sequence[VerifierLoad]]) -> None:
        """Read verifier load from the live service at scrape time (at most one source)."""
        if self._live is not None:
            self.registry.unregister(self._live)
        self._live = _LiveGauges(loads)
        self.registry.register(self._live)

    def render(self) -> bytes:
        """The registry in the Prometheus text exposition format."""
        return generate_latest(self.registry)
