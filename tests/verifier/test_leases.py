"""Direct rounds on a real worker, Mosquitto and PostgreSQL: a leased session's device is answered
by the verifier itself, each round persisted before its verdict leaves."""

from __future__ import annotations

import asyncio
import uuid

import pytest
import sqlalchemy as sa
from sqlalchemy.engine import Engine
from test_worker import run_with_worker
from verifier_helpers import BusListener, greedy_reference, prompt_ids, target_pair

from broker import messages as m
from broker.mosquitto import PrivateMosquitto
from broker.topics import DeviceChannel, device_topic
from coordinator.db.engine import make_sessionmaker
from coordinator.db.models import DecodingSession, Round, SessionStatus
from coordinator.db.registry import DeviceRegistry
from verifier import outbox as outbox_module
from verifier.worker import VerifierWorker

PROMPT = 5
DEVICE = "lease-pi"


def _open(engine: Engine) -> str:
    """A session row as the coordinator creates it; the verifier's rounds refer to it."""
    sessions = make_sessionmaker(engine)
    DeviceRegistry(sessions, hash_iterations=10).provision(DEVICE, "pi")
    session_id = uuid.uuid4()
    with sessions.begin() as db:
        db.add(
            DecodingSession(
                id=session_id,
                device_id=DEVICE,
                task_type="chat",
                prompt="p",
                prompt_ids=list(prompt_ids(PROMPT)),
                temperature=0.0,
                top_p=1.0,
                seed=0,
                max_tokens=32,
                mode=m.Mode.DISTRIBUTED,
                draft_model="lookup",
                k=3,
                status=SessionStatus.ACTIVE,
                committed_ids=[],
                committed_len=len(prompt_ids(PROMPT)),
            )
        )
    return str(session_id)


def _lease(session_id: str, lease_id: str = "lease-1") -> m.SessionLease:
    _, tokenizer = target_pair()
    return m.SessionLease(
        lease_id=lease_id,
        session_id=session_id,
        device_id=DEVICE,
        prompt_len=len(prompt_ids(PROMPT)),
        context_ids=prompt_ids(PROMPT),
        next_round=0,
        max_tokens=32,
        eos_id=tokenizer.eos_id,
        policy=m.Policy(draft_model="lookup", k=3),
    )


def _ack(lease_id: str, held: bool) -> object:
    return lambda _t, message: (
        isinstance(message, m.LeaseAck) and message.lease_id == lease_id and message.held is held
    )


def _verdict(round_index: int) -> object:
    verdicts = device_topic(DEVICE, DeviceChannel.VERDICT)
    return lambda topic, message: (
        topic == verdicts and isinstance(message, m.Verdict) and message.round == round_index
    )


def test_a_leased_session_is_answered_by_its_verifier(
    mosquitto: PrivateMosquitto, pg_clean_engine: Engine
) -> None:
    session_id = _open(pg_clean_engine)
    reference = greedy_reference(PROMPT, 12)
    url = pg_clean_engine.url.render_as_string(hide_password=False)

    def stored() -> list[Round]:
        with make_sessionmaker(pg_clean_engine)() as db:
            query = sa.select(Round).where(Round.session_id == uuid.UUID(session_id))
            return list(db.scalars(query.order_by(Round.round_index)))

    async def body(worker: VerifierWorker, listener: BusListener) -> None:
        status = await listener.status(lambda s: s.state == m.DeviceState.ONLINE)
        assert status.leases
        await listener.client.publish(worker.work_topic, m.encode(_lease(session_id)))
        await listener.other(_ack("lease-1", True))
        await listener.status(lambda s: session_id in s.leased)  # a restarted coordinator sees it

        # Round 0: the reference's first two tokens, then a wrong one.
        tokens = (reference[0], reference[1], (reference[2] + 1) % 49152)
        draft = m.Draft(
            session_id=session_id,
            round=0,
            base_len=len(prompt_ids(PROMPT)),
            tokens=tokens,
            draft_model="lookup",
        )
        draft_topic = device_topic(DEVICE, DeviceChannel.DRAFT)
        await listener.client.publish(draft_topic, m.encode(draft))
        verdict = await listener.other(_verdict(0))
        assert isinstance(verdict, m.Verdict)
        assert (verdict.n_accepted, verdict.next_token) == (2, reference[2])
        assert verdict.verifier_id == worker.config.verifier_id
        done = await listener.other(lambda _t, msg: isinstance(msg, m.RoundDone))
        assert isinstance(done, m.RoundDone) and done.committed == tuple(reference[:3])
        rows = await asyncio.to_thread(stored)
        assert [(r.round_index, r.n_accepted, r.next_token) for r in rows] == [(0, 2, reference[2])]

        # The same draft again: the stored verdict, and no second round.
        await listener.client.publish(draft_topic, m.encode(draft))
        for _ in range(100):
            if sum(1 for _t, msg in listener.others if _verdict(0)(_t, msg)) == 2:
                break
            await asyncio.sleep(0.02)
        again = [msg for t, msg in listener.others if _verdict(0)(t, msg)]
        assert len(again) == 2
        assert again[1].model_copy(update={"sent_at": 0}) == verdict.model_copy(
            update={"sent_at": 0}
        )
        assert len(await asyncio.to_thread(stored)) == 1

        # A draft that does not fit: refused with the reason, and the state to resync from.
        wrong = draft.model_copy(update={"round": 5})
        await listener.client.publish(draft_topic, m.encode(wrong))
        error = await listener.other(lambda _t, msg: isinstance(msg, m.ErrorReply))
        assert isinstance(error, m.ErrorReply) and "expected round 1" in error.reason
        state = await listener.other(lambda _t, msg: isinstance(msg, m.SessionState))
        assert isinstance(state, m.SessionState) and state.next_round == 1

        # Given back: its drafts are no longer answered here.
        end = m.LeaseEnd(lease_id="lease-1", session_id=session_id)
        await listener.client.publish(worker.work_topic, m.encode(end))
        ack = await listener.other(_ack("lease-1", False))
        assert isinstance(ack, m.LeaseAck) and ack.next_round == 1
        later = draft.model_copy(update={"round": 1, "base_len": draft.base_len + 3})
        await listener.client.publish(draft_topic, m.encode(later))
        await asyncio.sleep(1.0)
        assert not any(_verdict(1)(t, msg) for t, msg in listener.others)
        assert len(await asyncio.to_thread(stored)) == 1

    run_with_worker(
        mosquitto,
        body,
        database_url=url,
        subscriptions=(device_topic(DEVICE, DeviceChannel.VERDICT),),
    )


def test_a_round_report_waits_for_the_next_pass(
    mosquitto: PrivateMosquitto, pg_clean_engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A direct round's RoundDone leaves once the next pass is handed to the inference process,
    not between the verdict and the device's next draft (with no pass it would wait 30 s here);
    the next draft comes on the direct topic, where a malformed one is refused by the holder."""
    monkeypatch.setattr(outbox_module, "REPORT_HOLD_S", 30.0)
    session_id = _open(pg_clean_engine)
    reference = greedy_reference(PROMPT, 8)
    url = pg_clean_engine.url.render_as_string(hide_password=False)
    base_len = len(prompt_ids(PROMPT))
    draft_topic = device_topic(DEVICE, DeviceChannel.DRAFT)
    direct_topic = device_topic(DEVICE, DeviceChannel.DIRECT)

    def done(round_index: int) -> object:
        return lambda _t, msg: isinstance(msg, m.RoundDone) and msg.round == round_index

    async def body(worker: VerifierWorker, listener: BusListener) -> None:
        await listener.client.publish(worker.work_topic, m.encode(_lease(session_id)))
        await listener.other(_ack("lease-1", True))
        first = m.Draft(
            session_id=session_id,
            round=0,
            base_len=base_len,
            tokens=(reference[0], (reference[1] + 1) % 49152),
            draft_model="lookup",
        )
        await listener.client.publish(draft_topic, m.encode(first))
        verdict = await listener.other(_verdict(0))
        assert isinstance(verdict, m.Verdict) and verdict.n_accepted == 1
        await asyncio.sleep(0.5)
        assert not any(done(0)(t, msg) for t, msg in listener.others)
        assert worker.leases is not None and worker.leases.sessions[session_id].next_round == 1

        second = m.Draft(
            session_id=session_id,
            round=1,
            base_len=base_len + 2,
            tokens=(reference[2],),
            draft_model="lookup",
        )
        # On the direct topic, as an agent sends the window after a direct verdict.
        assert verdict.direct
        await listener.client.publish(direct_topic, m.encode(second))
        report = await listener.other(done(0), timeout_s=10.0)
        assert isinstance(report, m.RoundDone)
        assert report.committed == tuple(reference[:2])
        answered = await listener.other(_verdict(1))
        assert isinstance(answered, m.Verdict) and answered.direct

        # The coordinator does not read that topic: a malformed draft there is refused here.
        await listener.client.publish(direct_topic, b'{"type": "draft", "round": -1}')
        error = await listener.other(lambda _t, msg: isinstance(msg, m.ErrorReply))
        assert isinstance(error, m.ErrorReply) and error.refused_type is m.Refused.DRAFT
        assert error.reason

    run_with_worker(
        mosquitto,
        body,
        database_url=url,
        subscriptions=(device_topic(DEVICE, DeviceChannel.VERDICT),),
    )


def test_a_verifier_without_the_database_refuses_leases(mosquitto: PrivateMosquitto) -> None:
    async def body(worker: VerifierWorker, listener: BusListener) -> None:
        status = await listener.status(lambda s: s.state == m.DeviceState.ONLINE)
        assert not status.leases
        lease = _lease(str(uuid.uuid4()), "lease-x")
        await listener.client.publish(worker.work_topic, m.encode(lease))
        ack = await listener.other(_ack("lease-x", False))
        assert isinstance(ack, m.LeaseAck) and "no database" in ack.reason

    run_with_worker(mosquitto, body)


def _persist_round_elsewhere(engine: Engine, session_id: str, committed: list[int]) -> None:
    """Round 0 as another answerer stored it (the coordinator, or the lease's last holder)."""
    sessions = make_sessionmaker(engine)
    with sessions.begin() as db:
        row = db.get(DecodingSession, uuid.UUID(session_id))
        assert row is not None
        db.add(
            Round(
                session_id=row.id,
                round_index=0,
                base_len=len(row.prompt_ids),
                draft_tokens=committed[:-1],
                draft_model="lookup",
                k=len(committed) - 1,
                mode=m.Mode.DISTRIBUTED,
                n_accepted=len(committed) - 1,
                next_token=committed[-1],
                committed_len=len(row.prompt_ids) + len(committed),
                verifier_id="another",
            )
        )
        row.committed_ids = committed
        row.committed_len = len(row.prompt_ids) + len(committed)


def test_a_lease_behind_the_database_resumes_from_it(
    mosquitto: PrivateMosquitto, pg_clean_engine: Engine
) -> None:
    """A round this lease had not heard of is in the database already: the verifier takes the
    session's state from there and tells the device, rather than refusing the round forever."""
    session_id = _open(pg_clean_engine)
    reference = greedy_reference(PROMPT, 12)
    url = pg_clean_engine.url.render_as_string(hide_password=False)

    async def body(worker: VerifierWorker, listener: BusListener) -> None:
        await listener.status(lambda s: s.state == m.DeviceState.ONLINE)
        await listener.client.publish(worker.work_topic, m.encode(_lease(session_id)))
        await listener.other(_ack("lease-1", True))
        stored = list(reference[:3])
        await asyncio.to_thread(_persist_round_elsewhere, pg_clean_engine, session_id, stored)

        draft = m.Draft(
            session_id=session_id,
            round=0,
            base_len=len(prompt_ids(PROMPT)),
            tokens=(reference[0], reference[1]),
            draft_model="lookup",
        )
        await listener.client.publish(device_topic(DEVICE, DeviceChannel.DRAFT), m.encode(draft))
        state = await listener.other(lambda _t, msg: isinstance(msg, m.SessionState))
        assert isinstance(state, m.SessionState)
        assert (state.next_round, list(state.generated_ids)) == (1, stored)
        assert not any(isinstance(msg, m.ErrorReply) for _t, msg in listener.others)

        # The device resynchronised: its next round is answered and persisted.
        following = draft.model_copy(
            update={"round": 1, "base_len": draft.base_len + 3, "tokens": (reference[3],)}
        )
        await listener.client.publish(
            device_topic(DEVICE, DeviceChannel.DRAFT), m.encode(following)
        )
        verdict = await listener.other(_verdict(1))
        assert isinstance(verdict, m.Verdict) and verdict.base_len == draft.base_len + 3

    run_with_worker(
        mosquitto,
        body,
        database_url=url,
        subscriptions=(device_topic(DEVICE, DeviceChannel.VERDICT),),
    )
