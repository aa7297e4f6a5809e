"""What an adaptive session opening is rated beside: the host streams running, and the sessions
of its wave opened in a host mode whose streams have not started yet (their first round waits on
its prefill). The count alone, on the coordinator's own book: no bus or database is involved."""

from __future__ import annotations

from types import SimpleNamespace

from broker import messages as m
from coordinator.db.models import SessionStatus
from coordinator.runtime.adaptation import AdaptiveBook
from coordinator.runtime.session_state import LiveSession


def _live(
    session_id: str, mode: m.Mode, *, next_round: int = 0, streaming: bool = False
) -> LiveSession:
    return LiveSession(
        id=session_id,
        device_id="dev",
        prompt_ids=[1, 2, 3],
        generated=[],
        next_round=next_round,
        sampling=m.SamplingSpec(),
        max_tokens=8,
        task_type="chat",
        policy=m.Policy(mode=mode, draft_model="hybrid", k=0),
        status=SessionStatus.ACTIVE,
        streaming=streaming,
    )


def _book(sessions: list[LiveSession], streams: list[str], verifiers: int = 1) -> SimpleNamespace:
    running = {sid: SimpleNamespace(request=SimpleNamespace(session_id=sid)) for sid in streams}
    infos = [SimpleNamespace(streams=running)] + [
        SimpleNamespace(streams={}) for _ in range(verifiers - 1)
    ]
    return SimpleNamespace(
        pool=SimpleNamespace(live=lambda: infos), live={s.id: s for s in sessions}
    )


def test_an_opening_session_counts_the_host_sessions_of_its_wave_not_yet_streaming() -> None:
    sessions = [
        _live("new", m.Mode.DISTRIBUTED),
        _live("waiting-1", m.Mode.PLAIN),  # opened in a host mode, its first round not done
        _live("waiting-2", m.Mode.CLOUD),
        _live("on-device", m.Mode.DISTRIBUTED),  # drafts on its device: no stream to come
        _live("streaming", m.Mode.PLAIN, next_round=3, streaming=True),
        _live("between", m.Mode.CLOUD, next_round=1),  # its stream is being asked for
    ]
    book = _book(sessions, streams=["streaming"])
    beside = AdaptiveBook._streams_beside
    assert beside(book, "new") == 1.0  # type: ignore[arg-type]
    assert beside(book, "new", opening=True) == 3.0  # type: ignore[arg-type]
    # Ended sessions do not count, nor does the session itself; the mean is per live verifier.
    sessions[1].status = SessionStatus.FINISHED
    assert beside(book, "waiting-2", opening=True) == 1.0  # type: ignore[arg-type]
    assert beside(_book(sessions, ["streaming"], verifiers=2), "new", opening=True) == 1.0  # type: ignore[arg-type]


def test_a_streaming_sessions_load_leaves_out_its_own_stream() -> None:
    """A round of a session is one row beside `load` others: a lone stream is at load 0, not 1
    (at 1 it was priced as a pass of two rows, with its host drafting at twice its cost)."""
    streaming = _live("lone", m.Mode.CLOUD, next_round=5, streaming=True)
    on_device = _live("device", m.Mode.DISTRIBUTED, next_round=5)

    def book(*loads: int) -> SimpleNamespace:
        infos = [SimpleNamespace(load=load) for load in loads]
        return SimpleNamespace(pool=SimpleNamespace(live=lambda: infos))

    load_beside = AdaptiveBook._load_beside
    assert load_beside(book(1), streaming) == 0.0  # type: ignore[arg-type]
    assert load_beside(book(3), streaming) == 2.0  # type: ignore[arg-type]
    assert load_beside(book(1, 0), streaming) == 0.0  # type: ignore[arg-type]  # the mean's share
    # A device-drafted round's request has left the verifier's count when its result is in.
    assert load_beside(book(1), on_device) == 1.0  # type: ignore[arg-type]
    assert load_beside(book(), streaming) == 0.0  # type: ignore[arg-type]
