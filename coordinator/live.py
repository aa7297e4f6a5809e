"""What the admin API needs from the running coordinator service: live load and session control.

The API and the dashboard read everything else from the database. These few things exist only
in the service's memory (verifier heartbeats) or need its bus connection (starting a session on
a device, cancelling one), so the service hands the app an object with this shape:
`create_app(settings, engine, control=coordinator)` or `app.state.control = coordinator`.
Without one, the API answers 503 for these calls and reports no live verifiers.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Protocol, runtime_checkable


@dataclass(frozen=True)
class VerifierLoad:
    """One verifier as its latest heartbeat described it."""

    verifier_id: str
    online: bool
    queue_depth: int  # drafts waiting for a batch
    in_flight: int  # drafts in the forward pass now
    sessions_cached: int  # sessions whose KV cache it holds
    max_batch: int
    target: str  # target model name@sha256 prefix
    last_heartbeat: datetime | None


@dataclass(frozen=True)
class SessionStartRequest:
    """An operator's "run this prompt on device X", validated by the API."""

    device_id: str
    prompt: str
    task_type: str
    max_tokens: int
    temperature: float
    top_p: float
    seed: int | None  # None: the service picks one (and stores it, so replay can verify)
    draft_model: str | None  # None: the policy picks
    k: int | None  # None: the policy picks
    actor: str  # who asked, for the service's own events


class ControlError(Exception):
    """A refused start or cancel; `status` is the HTTP status the API answers with."""

    def __init__(self, message: str, status: int = 409) -> None:
        super().__init__(message)
        self.status = status


@runtime_checkable
class CoordinatorControl(Protocol):
    def verifier_loads(self) -> Sequence[VerifierLoad]:
        """Every verifier known to the service, online or recently lost."""
        ...

    def broker_connected(self) -> bool:
        """The service holds its bus connection now (subscribed); `/readyz` reports it."""
        ...

    async def start_session(self, request: SessionStartRequest) -> uuid.UUID:
        """Persist the session, send the device its start command, return the session id.

        Raise ControlError (e.g. 409 when the device is offline or lacks the draft model).
        """
        ...

    async def cancel_session(self, session_id: uuid.UUID, *, reason: str, actor: str) -> None:
        """Stop a session that is active or suspended; ControlError if that cannot be done."""
        ...

    async def revoke_device(self, device_id: str, *, reason: str, actor: str) -> None:
        """The device was just retired in the registry: take its account off the broker (which
        disconnects it) and close its open sessions. ControlError if the broker refused."""
        ...
