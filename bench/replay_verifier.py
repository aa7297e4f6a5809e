"""A replay verifier: a LOAD TOOL for the control plane, not a verifier.

It speaks the verifier's side of the bus (retained heartbeat with a Last Will, verify requests
in, verify results out) and answers from recorded target answers (`bench.recorded`), so that
`specfleet bench fleet` can put thousands of sessions' rounds through the coordinator, the broker
and the database without a model. It never verifies anything: it is never used where output or
correctness is tested.

With the fleet's database (`--database-url`) it takes session leases as a verifier does
(`verifier.leases.LeaseBook`, the same code): it reads a leased session's drafts from the device's
topic, persists each round (group commit) before its verdict goes to the device, and reports the
round to the coordinator, so that a distributed round costs what it costs in production: one bus
round trip and one commit. Without one it takes no leases, and every round crosses the
coordinator (the path of a verifier that has no database).

    python -m bench.replay_verifier --broker-url mqtt://127.0.0.1:1883 --id replay-0 \
        [--database-url URL]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import signal
import time
from pathlib import Path
from typing import Any

from bench.recorded import (
    DEFAULT_ANSWERS,
    EOS_ID,
    VOCAB_SIZE,
    RecordingError,
    ReplayTarget,
    load_answers,
)
from broker import messages as m
from broker.client import (
    BrokerAddress,
    BusClient,
    ConnectOptions,
    Will,
    run_with_reconnect,
)
from broker.topics import (
    DRAFT_CHANNELS,
    DeviceChannel,
    VerifierChannel,
    device_subscription,
    device_topic,
    verifier_topic,
)
from coordinator.db.engine import make_engine
from coordinator.db.round_writer import RoundWriter
from core.aio import run_service, task_group
from verifier.leases import LeaseBook, Verified, no_lease
from verifier.outbox import Outbox, heartbeat

log = logging.getLogger(__name__)

HEARTBEAT_S = 1.0
# What it says it is, so that nobody takes it for a target.
TARGET_NAME = "replay-of-recorded-answers"
MAX_BATCH = 64


class ReplayVerifier:
    def __init__(
        self, verifier_id: str, target: ReplayTarget, writer: RoundWriter | None = None
    ) -> None:
        self.verifier_id = verifier_id
        self.target = target
        self.status_topic = verifier_topic(verifier_id, VerifierChannel.STATUS)
        self.work_topic = verifier_topic(verifier_id, VerifierChannel.WORK)
        self.result_topic = verifier_topic(verifier_id, VerifierChannel.RESULT)
        self.answered = 0  # verdicts given, both ways
        self.direct = 0  # of them, rounds of a session leased here
        self.refused = 0
        # A direct round's time here, from its report to the coordinator (ms): the round from
        # its draft's arrival until its verdict was queued for the bus, and of that the commit.
        self.held_ms: list[float] = []
        self.persist_ms: list[float] = []
        self.outbox = Outbox()
        self.writer = writer
        self.leases: LeaseBook | None = None
        if writer is not None:
            self.leases = LeaseBook(
                verifier_id, writer, self._verify_leased, self._to_device, self._to_coordinator
            )

    def status(self, state: m.DeviceState) -> m.VerifierStatus:
        return m.VerifierStatus(
            verifier_id=self.verifier_id,
            state=state,
            at=time.time(),
            max_batch=MAX_BATCH,
            heartbeat_s=HEARTBEAT_S,
            target=TARGET_NAME,
            leases=self.leases is not None,
            leased=() if self.leases is None else tuple(self.leases.sessions)[:4096],
            vocab_size=VOCAB_SIZE,
            eos_id=EOS_ID,
        )

    def answer(self, request: m.VerifyRequest) -> m.VerifyResult:
        """The recorded answer's verdict on the draft; an error result for what a recording
        cannot answer (cloud rounds, streams, an unknown context)."""
        started = time.perf_counter()
        result = m.VerifyResult(
            request_id=request.request_id,
            session_id=request.session_id,
            round=request.round,
            base_len=len(request.context_ids),
            verifier_id=self.verifier_id,
        )
        if request.cloud_k is not None or request.stream is not None:
            self.refused += 1
            return result.model_copy(update={"error": "a replay verifier drafts nothing"})
        try:
            replayed = self.target.verify(request.context_ids, request.tokens)
        except RecordingError as exc:
            self.refused += 1
            return result.model_copy(update={"error": str(exc)[:1024]})
        self.answered += 1
        return result.model_copy(
            update={
                "n_accepted": replayed.n_accepted,
                "next_token": replayed.next_token,
                "verify_ms": (time.perf_counter() - started) * 1000.0,
            }
        )

    async def _verify_leased(self, request: m.VerifyRequest, received_at: float) -> Verified:
        """A leased round, answered from the recording at once (no batch to wait for)."""
        started = time.perf_counter()
        try:
            replayed = self.target.verify(request.context_ids, request.tokens)
        except RecordingError as exc:
            self.refused += 1
            return Verified(0, None, error=str(exc)[:1024])
        return Verified(
            replayed.n_accepted,
            replayed.next_token,
            queue_ms=(started - received_at) * 1000.0,
            verify_ms=(time.perf_counter() - started) * 1000.0,
        )

    def _to_device(self, device_id: str, message: m.Message | bytes) -> None:
        self.outbox.put(device_topic(device_id, DeviceChannel.VERDICT), message)

    def _to_coordinator(self, message: m.Message) -> None:
        if isinstance(message, m.RoundDone):  # a direct round, persisted and answered
            self.answered += 1
            self.direct += 1
            if message.t_held_ms is not None:
                self.held_ms.append(message.t_held_ms)
            if message.t_persist_ms is not None:
                self.persist_ms.append(message.t_persist_ms)
        self.outbox.put(self.result_topic, message)

    def counts(self) -> dict[str, Any]:
        """What it answered, and each direct round's time here (ms, in the order answered)."""
        return {
            "answered": self.answered,
            "direct": self.direct,
            "refused": self.refused,
            "held_ms": self.held_ms,
            "persist_ms": self.persist_ms,
        }

    async def serve(self, client: BusClient) -> None:
        await client.subscribe(self.work_topic)
        if self.leases is not None:
            for channel in DRAFT_CHANNELS:
                await client.subscribe(device_subscription(channel))
        online = m.encode(self.status(m.DeviceState.ONLINE))
        await client.publish(self.status_topic, online, retain=True)
        async with task_group() as tasks:
            tasks.create_task(self._heartbeat(client), name=f"{self.verifier_id}-heartbeat")
            tasks.create_task(self.outbox.publish(client, self.verifier_id),
                              name=f"{self.verifier_id}-publish")  # fmt: skip
            async for incoming in client.messages():
                if incoming.topic != self.work_topic:
                    self._on_device_message(incoming.topic, incoming.payload)
                    continue
                try:
                    message = m.decode(incoming.payload)
                except m.BusError as exc:
                    log.warning("refused a payload on %s: %s", incoming.topic, exc.reason)
                    continue
                if isinstance(message, m.VerifyRequest):
                    self.outbox.put(self.result_topic, m.encode(self.answer(message)))
                elif isinstance(message, m.SessionLease | m.LeaseEnd):
                    self._on_lease_message(message)

    def _on_lease_message(self, message: m.SessionLease | m.LeaseEnd) -> None:
        if self.leases is not None:
            self.leases.on_lease_message(message)
        elif isinstance(message, m.SessionLease):
            reason = "this replay verifier has no database: it takes no leases"
            self._to_coordinator(no_lease(message, self.verifier_id, reason))

    def _on_device_message(self, topic: str, payload: bytes) -> None:
        if self.leases is not None:
            self.leases.on_device_message(topic, payload)

    async def _heartbeat(self, client: BusClient) -> None:
        """A retained status every HEARTBEAT_S on a fixed beat, at QoS 0 (as a verifier's)."""

        def status() -> bytes:
            return m.encode(self.status(m.DeviceState.ONLINE))

        await heartbeat(client, self.status_topic, status, HEARTBEAT_S)


async def run_replay_verifier(
    broker_url: str,
    verifier_id: str,
    answers: Path,
    database_url: str | None = None,
    report: Path | None = None,
) -> None:
    """Serve until cancelled (SIGTERM cancels it); then log what it answered, and write it as
    JSON to `report` when given."""
    main_task = asyncio.current_task()
    assert main_task is not None
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, main_task.cancel)
    writer = None if database_url is None else RoundWriter(make_engine(database_url))
    verifier = ReplayVerifier(verifier_id, ReplayTarget(load_answers(answers)), writer)
    offline = m.encode(verifier.status(m.DeviceState.OFFLINE))
    options = ConnectOptions(
        client_id=f"specfleet-verifier-{verifier_id}",
        will=Will(verifier.status_topic, offline, retain=True),
    )
    try:
        async with task_group() as tasks:
            if writer is not None:
                tasks.create_task(writer.run(), name=f"{verifier_id}-round-writer")
            tasks.create_task(
                run_with_reconnect(BrokerAddress.from_url(broker_url), options, verifier.serve),
                name=f"{verifier_id}-bus",
            )
    finally:
        counts = verifier.counts()
        log.info("replay verifier %s: %d answered (%d direct), %d refused", verifier_id,
                 verifier.answered, verifier.direct, verifier.refused)  # fmt: skip
        if report is not None:
            report.write_text(json.dumps(counts))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--broker-url", required=True)
    parser.add_argument("--id", dest="verifier_id", default="replay-0")
    parser.add_argument("--answers", type=Path, default=DEFAULT_ANSWERS)
    parser.add_argument(
        "--database-url", default=None, help="the fleet's database: take session leases"
    )
    parser.add_argument(
        "--report", type=Path, default=None, help="write what it answered here (JSON) at exit"
    )
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    with contextlib.suppress(KeyboardInterrupt, asyncio.CancelledError):
        run_service(
            run_replay_verifier(
                args.broker_url, args.verifier_id, args.answers, args.database_url, args.report
            )
        )


if __name__ == "__main__":
    main()
