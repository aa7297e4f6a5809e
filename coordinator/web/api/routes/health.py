"""`/healthz` and `/readyz` for orchestrators: open, outside /api/v1, and cheap."""

from __future__ import annotations

import logging

import sqlalchemy as sa
from anyio import fail_after, to_thread
from fastapi import APIRouter, Request, Response, status
from sqlalchemy.orm import Session, sessionmaker

from coordinator.web.api.deps import OptionalControlDep

router = APIRouter(tags=["health"])
log = logging.getLogger(__name__)

# A probe that waits longer than the orchestrator's own timeout (Kubernetes: 1 s by default)
# answers nothing useful; a database this slow counts as not answering.
DATABASE_PROBE_TIMEOUT_S = 0.8


@router.get("/healthz", response_class=Response)
def liveness() -> Response:
    """The process serves requests. It says nothing of the database or the broker: restarting
    a coordinator because PostgreSQL is down would only add a restart to the outage."""
    return Response("ok\n", media_type="text/plain")


def _database_answers(sessions: sessionmaker[Session]) -> None:
    with sessions() as db:
        db.execute(sa.text("SELECT 1"))


async def _database_problem(request: Request) -> str | None:
    try:
        with fail_after(DATABASE_PROBE_TIMEOUT_S):
            await to_thread.run_sync(
                _database_answers, request.app.state.sessions, abandon_on_cancel=True
            )
    except TimeoutError:
        return f"the database did not answer within {DATABASE_PROBE_TIMEOUT_S} s"
    except sa.exc.SQLAlchemyError as exc:
        log.warning("readiness: the database refused a query: %s", exc)
        return f"the database refused a query: {type(exc).__name__}"
    return None


@router.get("/readyz", response_class=Response)
async def readiness(request: Request, control: OptionalControlDep) -> Response:
    """Ready to take traffic: the database answers and the coordinator holds its broker
    connection. 503 with one reason per line otherwise."""
    problems = []
    database = await _database_problem(request)
    if database is not None:
        problems.append(database)
    if control is None:
        problems.append("no coordinator service is attached to this API process")
    elif not control.broker_connected():
        problems.append("the coordinator is not connected to the broker")
    if problems:
        return Response(
            "".join(f"{p}\n" for p in problems),
            status_code=status.HTTP_503_SERVICE_UNAVAILABLE,
            media_type="text/plain",
        )
    return Response("ready\n", media_type="text/plain")
