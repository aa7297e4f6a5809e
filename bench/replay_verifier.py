"""A replay verifier: a LOAD TOOL for the control plane, not a verifier.

It speaks the verifier's side of the bus (retained heartbeat with a Last Will, verify requests
in, verify results out) and answers from recorded target answers (`bench.recorded`), so that
`specfleet bench fleet` can put thousands of sessions' rounds through the coordinator, the broker
and the database without a model. It never verifies anything: it is never used where output or
correctness is tested. It takes no session leases, so every round crosses the coordinator.

    python -m bench.replay_verifier --broker-url mqtt://127.0.0.1:1883 --id replay-0
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import time
from pathlib import Path

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
from broker.topics import VerifierChannel, verifier_topic
from core.aio import task_group

log = logging.getLogger(__name__)

HEARTBEAT_S = 1.0
# What it says it is, so that nobody takes it for a target.
TARGET_NAME = "replay-of-recorded-answers"
MAX_BATCH = 64


class ReplayVerifier:
    def __init__(self, verifier_id: str, target: ReplayTarget) -> None:
        self.verifier_id = verifier_id
        self.target = target
        self.status_topic = verifier_topic(verifier_id, VerifierChannel.STATUS)
        self.work_topic = verifier_topic(verifier_id, VerifierChannel.WORK)
        self.result_topic = verifier_topic(verifier_id, VerifierChannel.RESULT)
        self.answered = 0
        self.refused = 0

    def status(self, state: m.DeviceState) -> m.VerifierStatus:
        return m.VerifierStatus(
            verifier_id=self.verifier_id,
            state=state,
            at=time.time(),
            max_batch=MAX_BATCH,
            heartbeat_s=HEARTBEAT_S,
            target=TARGET_NAME,
            leases=False,
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

    async def serve(self, client: BusClient) -> None:
        await client.subscribe(self.work_topic)
        online = m.encode(self.status(m.DeviceState.ONLINE))
        await client.publish(self.status_topic, online, retain=True)
        async with task_group() as tasks:
            tasks.create_task(self._heartbeat(client), name=f"{self.verifier_id}-heartbeat")
            async for incoming in client.messages():
                try:
                    message = m.decode(incoming.payload)
                except m.BusError as exc:
                    log.warning("refused a payload on %s: %s", incoming.topic, exc.reason)
                    continue
                if isinstance(message, m.VerifyRequest):
                    reply = m.encode(self.answer(message))
                    await client.publish(self.result_topic, reply)
                elif isinstance(message, m.SessionLease):
                    log.warning(
                        "a lease for %s: this replay verifier takes none", message.session_id
                    )

    async def _heartbeat(self, client: BusClient) -> None:
        while True:
            await asyncio.sleep(HEARTBEAT_S)
            status = m.encode(self.status(m.DeviceState.ONLINE))
            await client.publish(self.status_topic, status, retain=True)


async def run_replay_verifier(broker_url: str, verifier_id: str, answers: Path) -> None:
    verifier = ReplayVerifier(verifier_id, ReplayTarget(load_answers(answers)))
    offline = m.encode(verifier.status(m.DeviceState.OFFLINE))
    options = ConnectOptions(
        client_id=f"specfleet-verifier-{verifier_id}",
        will=Will(verifier.status_topic, offline, retain=True),
    )
    try:
        await run_with_reconnect(BrokerAddress.from_url(broker_url), options, verifier.serve)
    finally:
        log.info("replay verifier %s: %d answered, %d refused", verifier_id,
                 verifier.answered, verifier.refused)  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--broker-url", required=True)
    parser.add_argument("--id", dest="verifier_id", default="replay-0")
    parser.add_argument("--answers", type=Path, default=DEFAULT_ANSWERS)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(run_replay_verifier(args.broker_url, args.verifier_id, args.answers))


if __name__ == "__main__":
    main()
