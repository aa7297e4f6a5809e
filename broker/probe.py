"""Orchestrator probes over the bus: a verifier's retained heartbeat, read once."""

from __future__ import annotations

import asyncio
import secrets
import time
from dataclasses import dataclass

from broker import messages as m
from broker.client import BrokerAddress, BusConnectionError, ConnectOptions, connect
from broker.topics import VerifierChannel, verifier_topic

# A heartbeat is retained and sent every second (verifier.worker.HEARTBEAT_S): past this many
# missed beats the verifier's loop is stuck, or it died without its Last Will reaching us.
DEFAULT_MAX_AGE_S = 15.0
# The broker hands a retained message over with the SUBACK; longer means there is none.
RETAINED_WAIT_S = 3.0


class BrokerUnreachable(Exception):
    """The probe could not ask: the broker refused or did not answer. Says nothing of the
    verifier, so a liveness probe should not restart it for this."""


@dataclass(frozen=True)
class HeartbeatVerdict:
    healthy: bool
    reason: str


async def read_heartbeat(
    address: BrokerAddress, username: str | None, password: str | None, verifier_id: str
) -> m.VerifierStatus | None:
    """The verifier's retained status, or None if it has never published one."""
    options = ConnectOptions(
        client_id=f"probe-{verifier_id[:40]}-{secrets.token_hex(3)}",
        username=username,
        password=password,
        keepalive_s=10,
    )
    topic = verifier_topic(verifier_id, VerifierChannel.STATUS)
    try:
        async with connect(address, options) as client:
            await client.subscribe(topic)
            async with asyncio.timeout(RETAINED_WAIT_S):
                async for incoming in client.messages():
                    if incoming.topic == topic:
                        status = m.decode(incoming.payload)
                        return status if isinstance(status, m.VerifierStatus) else None
    except TimeoutError:
        return None
    except BusConnectionError as exc:
        raise BrokerUnreachable(str(exc)) from exc
    return None


def judge_heartbeat(
    status: m.VerifierStatus | None, max_age_s: float, now: float | None = None
) -> HeartbeatVerdict:
    if status is None:
        return HeartbeatVerdict(False, "no heartbeat retained on the broker")
    if status.state is not m.DeviceState.ONLINE:
        return HeartbeatVerdict(False, f"the verifier says {status.state.value}")
    age = (time.time() if now is None else now) - status.at
    if age > max_age_s:
        return HeartbeatVerdict(False, f"the last heartbeat is {age:.1f} s old (> {max_age_s} s)")
    return HeartbeatVerdict(True, f"online, heartbeat {max(age, 0.0):.1f} s old")
