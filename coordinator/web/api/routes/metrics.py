"""`/metrics`: Prometheus text format, outside /api/v1 where scrapers expect it."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response
from prometheus_client import CONTENT_TYPE_LATEST

from coordinator.web.api.deps import MetricsDep, SettingsDep, get_current_user

router = APIRouter(tags=["metrics"])


@router.get("/metrics", response_class=Response)
def scrape(request: Request, metrics: MetricsDep, settings: SettingsDep) -> Response:
    """Open on the quickstart; in production a scraper sends a (viewer's) bearer token."""
    if settings.environment == "production":
        get_current_user(request)
    return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)
