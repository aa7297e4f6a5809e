"""What the coordinator asks a verifier for when it opens a session's host stream."""

from __future__ import annotations

import asyncio

from sqlalchemy.engine import Engine

from broker import messages as m
from coordinator.db.engine import make_sessionmaker
from coordinator.db.registry import DeviceRegistry
from coordinator.runtime.quotas import Quotas
from coordinator.runtime.round_model import CLOUD_STREAM_ROUNDS
from coordinator.runtime.sessions import SessionBook
from coordinator.runtime.verifiers import VerifierPool
from core.settings import Settings
from inference.artifacts import TargetIdentity
from tests.coordinator.test_direct_round_reports import Published, _admit
from tests.coordinator.test_round_writer import DEVICE, PROMPT_IDS, open_session

TRIED = "hybrid+eagle-h1"
TARGET = TargetIdentity("target", "1" * 64, "2" * 64, 1000, 7)


def test_a_stream_trying_a_drafter_runs_past_the_decision_that_ends_the_try(
    sqlite_engine: Engine,
) -> None:
    """A drafter being tried streams for a whole answer like any other: the decision after its
    round 8 ends the try, and the coordinator ends the stream only where that decision chooses
    another drafter (`RoundPipeline._host_stream`). A try's stream cut at the decision always
    ended, and the session's next round waited a bus round trip for the next stream, a pass
    behind the sessions beside it."""
    sessions = make_sessionmaker(sqlite_engine)
    DeviceRegistry(sessions, hash_iterations=10).provision(DEVICE, "pi")
    session_id = open_session(sessions)

    async def scenario() -> m.VerifyRequest:
        published = Published()
        book = SessionBook(sessions, VerifierPool(published), published, admit=_admit,
                           quotas=Quotas.from_settings(Settings()), idle_timeout_s=600,
                           target=TARGET)  # fmt: skip
        live = await book.get(str(session_id))
        assert live is not None
        live.policy_task = "chat"
        live.policy = live.policy.model_copy(
            update={"mode": m.Mode.CLOUD, "draft_model": TRIED, "k": 4}
        )
        book.policy.exploration.exploring[TRIED] = live.id
        return book._stream_request(live)

    request = asyncio.run(scenario())
    assert request.stream is not None
    assert (request.cloud_draft, request.round) == (TRIED, 0)
    assert request.context_ids == tuple(PROMPT_IDS)
    assert request.stream.rounds == CLOUD_STREAM_ROUNDS
    assert request.stream.adaptive and request.stream.eos_id == TARGET.eos_id
