"""`/stats`: fleet-wide numbers from the rounds table, for the fleet view and the charts."""

from __future__ import annotations

import math
from datetime import timedelta
from typing import Annotated

import sqlalchemy as sa
from fastapi import APIRouter, Query

from coordinator.db.models import Device, utcnow
from coordinator.web.api.deps import SessionDep
from coordinator.web.api.schemas import (
    AcceptancePointPublic,
    AcceptancePublic,
    AcceptanceSeriesPublic,
    DeviceRatePublic,
    FleetStatsPublic,
    HistogramPublic,
    LatencyPublic,
    LegSummaryPublic,
)
from coordinator.web.stats import acceptance_series, device_rates, leg_summaries, rtt_histogram

WEEK_S = 7 * 24 * 3600
# At most this many buckets per series, so a long window with a small bucket stays cheap.
MAX_BUCKETS = 2000

router = APIRouter(prefix="/stats", tags=["stats"])

WindowQuery = Annotated[int, Query(ge=1, le=WEEK_S, description="seconds back from now")]


@router.get("/fleet", response_model=FleetStatsPublic)
def fleet_rates(db: SessionDep, window_s: WindowQuery = 900) -> FleetStatsPublic:
    """α and committed tokens per second of round time, per device, over the last window."""
    rates = device_rates(db, utcnow() - timedelta(seconds=window_s))
    ids = db.scalars(sa.select(Device.id).order_by(Device.id)).all()
    data = []
    for device_id in ids:
        rate = rates.get(device_id)
        data.append(
            DeviceRatePublic(
                device_id=device_id,
                rounds=rate.rounds if rate else 0,
                drafted=rate.drafted if rate else 0,
                accepted=rate.accepted if rate else 0,
                committed=rate.committed if rate else 0,
                alpha=rate.alpha if rate else None,
                tokens_per_s=rate.tokens_per_s if rate else None,
            )
        )
    return FleetStatsPublic(window_s=window_s, data=data)


@router.get("/acceptance", response_model=AcceptancePublic)
def acceptance(
    db: SessionDep,
    window_s: WindowQuery = 3600,
    bucket_s: Annotated[int, Query(ge=1, le=WEEK_S)] = 60,
    draft_model: Annotated[str | None, Query(min_length=1, max_length=128)] = None,
    task_type: Annotated[str | None, Query(min_length=1, max_length=32)] = None,
) -> AcceptancePublic:
    """α per time bucket, one series per (draft model, task type)."""
    bucket_s = max(bucket_s, math.ceil(window_s / MAX_BUCKETS))
    series = acceptance_series(
        db,
        utcnow() - timedelta(seconds=window_s),
        bucket_s,
        draft_model=draft_model,
        task_type=task_type,
    )
    return AcceptancePublic(
        bucket_s=bucket_s,
        data=[
            AcceptanceSeriesPublic(
                draft_model=s.draft_model,
                task_type=s.task_type,
                points=[
                    AcceptancePointPublic(
                        start=p.start, drafted=p.drafted, accepted=p.accepted, alpha=p.alpha
                    )
                    for p in s.points
                ],
            )
            for s in series
        ],
    )


@router.get("/latency", response_model=LatencyPublic)
def latency(db: SessionDep, window_s: WindowQuery = 3600) -> LatencyPublic:
    """The bus round trip (uplink + downlink) as a histogram, and every leg's mean and tails."""
    since = utcnow() - timedelta(seconds=window_s)
    bins = rtt_histogram(db, since)
    return LatencyPublic(
        rtt_ms=HistogramPublic(
            edges=[None if math.isinf(e) else e for e in bins.edges], counts=list(bins.counts)
        ),
        legs=[
            LegSummaryPublic(
                leg=s.leg, count=s.count, mean_ms=s.mean_ms, p50_ms=s.p50_ms, p95_ms=s.p95_ms
            )
            for s in leg_summaries(db, since)
        ],
    )
