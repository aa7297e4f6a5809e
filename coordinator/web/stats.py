"""Fleet statistics read from the rounds table: α and speed per device, acceptance over time,
RTT and leg-time distributions. Portable SQL, with bucketing done here rather than in SQL."""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timezone

import sqlalchemy as sa
from sqlalchemy.orm import Session

from coordinator.db.models import DecodingSession, Round

# Rounds read for one chart at most; older ones fall outside the window first.
MAX_CHART_ROUNDS = 100_000
RTT_EDGES_MS = (0.0, 1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0, 200.0, 500.0, 1000.0, math.inf)
LEG_COLUMNS = {
    "draft": Round.t_draft_ms,
    "uplink": Round.t_uplink_ms,
    "queue": Round.t_queue_ms,
    "verify": Round.t_verify_ms,
    "downlink": Round.t_downlink_ms,
}


@dataclass(frozen=True)
class DeviceRate:
    """A device's decoding over a window of rounds."""

    device_id: str
    rounds: int
    drafted: int
    accepted: int
    committed: int
    round_ms: float  # sum of the measured legs of its rounds

    @property
    def alpha(self) -> float | None:
        return self.accepted / self.drafted if self.drafted else None

    @property
    def tokens_per_s(self) -> float | None:
        """Committed tokens per second of round time: the speed while it decodes."""
        return self.committed / (self.round_ms / 1e3) if self.round_ms > 0 else None


def _round_ms() -> sa.ColumnElement[float]:
    total: sa.ColumnElement[float] = sa.literal(0.0)
    for column in LEG_COLUMNS.values():
        total = total + sa.func.coalesce(column, 0.0)
    return total


def device_rates(db: Session, since: datetime) -> dict[str, DeviceRate]:
    query = (
        sa.select(
            DecodingSession.device_id,
            sa.func.count(Round.id),
            sa.func.coalesce(sa.func.sum(Round.k), 0),
            sa.func.coalesce(sa.func.sum(Round.n_accepted), 0),
            sa.func.coalesce(sa.func.sum(Round.committed_len - Round.base_len), 0),
            sa.func.coalesce(sa.func.sum(_round_ms()), 0.0),
        )
        .join(DecodingSession, DecodingSession.id == Round.session_id)
        .where(Round.created_at >= since)
        .group_by(DecodingSession.device_id)
    )
    return {
        device_id: DeviceRate(device_id, int(n), int(k), int(acc), int(com), float(ms))
        for device_id, n, k, acc, com, ms in db.execute(query)
    }


@dataclass(frozen=True)
class AcceptancePoint:
    start: datetime
    drafted: int
    accepted: int

    @property
    def alpha(self) -> float:
        return self.accepted / self.drafted


@dataclass(frozen=True)
class AcceptanceSeries:
    draft_model: str
    task_type: str
    points: tuple[AcceptancePoint, ...]


def _bucket(at: datetime, bucket_s: int) -> datetime:
    seconds = int(at.timestamp()) // bucket_s * bucket_s
    return datetime.fromtimestamp(seconds, tz=timezone.utc)


def acceptance_series(
    db: Session,
    since: datetime,
    bucket_s: int,
    *,
    draft_model: str | None = None,
    task_type: str | None = None,
) -> list[AcceptanceSeries]:
    """Drafted and accepted tokens per time bucket, one series per (draft model, task type)."""
    query = (
        sa.select(
            Round.created_at,
            Round.draft_model,
            DecodingSession.task_type,
            Round.k,
            Round.n_accepted,
        )
        .join(DecodingSession, DecodingSession.id == Round.session_id)
        .where(Round.created_at >= since, Round.k > 0)
        .order_by(Round.created_at.desc())
        .limit(MAX_CHART_ROUNDS)
    )
    if draft_model is not None:
        query = query.where(Round.draft_model == draft_model)
    if task_type is not None:
        query = query.where(DecodingSession.task_type == task_type)
    buckets: dict[tuple[str, str], dict[datetime, list[int]]] = defaultdict(dict)
    for at, model, task, k, accepted in db.execute(query):
        slot = buckets[(model or "none", task)].setdefault(_bucket(at, bucket_s), [0, 0])
        slot[0] += k
        slot[1] += accepted
    return [
        AcceptanceSeries(
            model,
            task,
            tuple(AcceptancePoint(start, d, a) for start, (d, a) in sorted(points.items())),
        )
        for (model, task), points in sorted(buckets.items())
    ]


@dataclass(frozen=True)
class HistogramBins:
    edges: tuple[float, ...]  # [n+1]; the last may be inf
    counts: tuple[int, ...]  # [n]


def histogram(values: Sequence[float], edges: Sequence[float]) -> HistogramBins:
    counts = [0] * (len(edges) - 1)
    for value in values:
        for i in range(len(counts)):
            if edges[i] <= value < edges[i + 1]:
                counts[i] += 1
                break
    return HistogramBins(tuple(edges), tuple(counts))


def rtt_histogram(db: Session, since: datetime) -> HistogramBins:
    """Bus round trip per round: uplink plus downlink, where both legs were measured."""
    rtt = (Round.t_uplink_ms + Round.t_downlink_ms).label("rtt")
    query = (
        sa.select(rtt)
        .where(
            Round.created_at >= since,
            Round.t_uplink_ms.is_not(None),
            Round.t_downlink_ms.is_not(None),
        )
        .limit(MAX_CHART_ROUNDS)
    )
    return histogram([float(v) for v in db.scalars(query) if v is not None], RTT_EDGES_MS)


@dataclass(frozen=True)
class LegSummary:
    leg: str
    count: int
    mean_ms: float | None
    p50_ms: float | None
    p95_ms: float | None


def _quantile(sorted_values: Sequence[float], q: float) -> float | None:
    if not sorted_values:
        return None
    return sorted_values[min(len(sorted_values) - 1, int(q * len(sorted_values)))]


def leg_summaries(db: Session, since: datetime) -> list[LegSummary]:
    summaries = []
    for leg, column in LEG_COLUMNS.items():
        rows = db.scalars(
            sa.select(column)
            .where(Round.created_at >= since, column.is_not(None))
            .limit(MAX_CHART_ROUNDS)
        )
        values = sorted(float(v) for v in rows if v is not None)
        mean = sum(values) / len(values) if values else None
        summaries.append(
            LegSummary(leg, len(values), mean, _quantile(values, 0.5), _quantile(values, 0.95))
        )
    return summaries
