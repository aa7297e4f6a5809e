"""API schemas (pydantic), kept apart from the ORM tables so that neither leaks into the other."""

from __future__ import annotations

import uuid
from datetime import datetime
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from broker.messages import Mode
from coordinator.db.models import (
    AdminRole,
    DeploymentState,
    DeviceDeploymentState,
    DeviceKind,
    DeviceStatus,
    ModelRole,
    SessionStatus,
)
from coordinator.replay import TokenKind


class Message(BaseModel):
    detail: str


# --- who is asking -------------------------------------------------------------------------------


class MePublic(BaseModel):
    name: str
    role: AdminRole


# --- devices -------------------------------------------------------------------------------------


class DevicePublic(BaseModel):
    """A device as operators see it; the credential hash never leaves the database."""

    model_config = ConfigDict(from_attributes=True)

    id: str
    kind: DeviceKind
    status: DeviceStatus
    status_reason: str | None
    tags: list[str]
    hardware: dict[str, Any]
    installed_models: list[str]
    last_seen: datetime | None
    telemetry: dict[str, Any] | None
    telemetry_at: datetime | None
    created_at: datetime


class DevicesPublic(BaseModel):
    data: list[DevicePublic]
    count: int  # matching devices in all, not only this page


class DeviceTagsUpdate(BaseModel):
    model_config = ConfigDict(extra="forbid")

    tags: list[str] = Field(max_length=64)


class DeviceRetire(BaseModel):
    model_config = ConfigDict(extra="forbid")

    reason: str = Field(default="", max_length=255)


class InstalledDraftPublic(BaseModel):
    """A draft the device reports installed, with the release that put it there if one did."""

    name: str
    # "rollout": the artifact a rollout installed (sha256 of the release tar, its version);
    # "registry": not rolled out, the models table's entry (sha256 of the model file);
    # "device": only the device's word (built-in drafters such as lookup, or unregistered ones).
    source: Literal["rollout", "registry", "device"]
    sha256: str | None
    version: int | None
    format: str | None
    deployment_id: int | None
    installed_at: datetime | None


class DeviceDeploymentPublic(BaseModel):
    """One device's part in one rollout."""

    deployment_id: int
    model: str
    version: int | None
    wave: int
    state: DeviceDeploymentState
    detail: str | None
    updated_at: datetime


class DeviceDetailPublic(BaseModel):
    device: DevicePublic
    agent_version: str | None  # from the agent's last status that brought it online
    runtimes: list[str]
    agent_reported_at: datetime | None
    drafts: list[InstalledDraftPublic]
    deployments: list[DeviceDeploymentPublic]  # newest first


# --- sessions and rounds -------------------------------------------------------------------------


class SessionPublic(BaseModel):
    id: uuid.UUID
    device_id: str
    task_type: str
    prompt: str
    mode: Mode
    status: SessionStatus
    draft_model: str | None
    k: int
    temperature: float
    top_p: float
    seed: int
    max_tokens: int
    prompt_len: int
    committed_len: int
    generated_len: int
    rounds: int
    drafted: int
    accepted: int
    alpha: float | None  # accepted / drafted
    created_at: datetime
    updated_at: datetime
    finished_at: datetime | None


class SessionsPublic(BaseModel):
    data: list[SessionPublic]
    count: int


class TokenPublic(BaseModel):
    id: int
    kind: TokenKind
    text: str


class RoundPublic(BaseModel):
    round: int
    base_len: int
    committed_len: int
    draft_model: str | None
    k: int
    n_accepted: int
    next_token: int
    provisional: bool
    verifier_id: str | None
    policy: dict[str, Any] | None
    legs_ms: dict[str, float]
    total_ms: float | None
    created_at: datetime
    delay_s: float  # replay: the wait before this round is shown (recorded gap, capped)
    tokens: list[TokenPublic]  # committed by this round
    rejected: list[TokenPublic]  # drafted and thrown away


class RoundsPublic(BaseModel):
    data: list[RoundPublic]
    count: int


class SessionStatsPublic(BaseModel):
    generated: int
    drafted: int
    accepted: int
    alpha: float | None
    duration_s: float | None
    tokens_per_s: float | None
    kinds: dict[TokenKind, int]


class SessionDetailPublic(BaseModel):
    session: SessionPublic
    text: str
    stats: SessionStatsPublic
    rounds: list[RoundPublic]
    rounds_count: int  # all rounds; `rounds` holds the first MAX_DETAIL_ROUNDS
    problems: list[str]  # what a rebuild from the rounds found wrong, if anything


class SessionStart(BaseModel):
    model_config = ConfigDict(extra="forbid")

    device_id: str = Field(min_length=1, max_length=64)
    prompt: str = Field(min_length=1, max_length=64 * 1024)
    task_type: str = Field(default="chat", min_length=1, max_length=32)
    max_tokens: int = Field(default=128, ge=1, le=8192)
    temperature: float = Field(default=0.0, ge=0.0, le=10.0, allow_inf_nan=False)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0, allow_inf_nan=False)
    seed: int | None = Field(default=None, ge=0, le=2**63 - 1)
    draft_model: str | None = Field(default=None, min_length=1, max_length=128)
    k: int | None = Field(default=None, ge=0, le=64)


class SessionCancel(BaseModel):
    model_config = ConfigDict(extra="forbid")

    reason: str = Field(default="cancelled by an operator", max_length=256)


class SessionStarted(BaseModel):
    id: uuid.UUID


# --- models --------------------------------------------------------------------------------------


class ModelPublic(BaseModel):
    name: str
    role: ModelRole
    format: str
    sha256: str
    size_bytes: int
    tokenizer_sha256: str
    location: str | None
    precision: str | None
    registered: bool  # a row in the models table
    on_disk: bool  # a manifest in the coordinator's models directory
    # Both exist and their sha256 differ: the registry points at other bytes than are on disk.
    sha256_mismatch: bool
    created_at: datetime | None


class ModelsPublic(BaseModel):
    data: list[ModelPublic]
    count: int


# --- deployments ---------------------------------------------------------------------------------


class DeploymentPublic(BaseModel):
    id: int
    model: str
    artifact_sha256: str | None
    version: int | None  # the release store's number for that artifact, when it is known
    state: DeploymentState
    wave: int  # the wave rolled out now, or last
    waves: int
    targets: list[str]  # the device ids and tags asked for
    wave_percent: float | None
    abort_at_percent: float | None
    actor: str
    devices: int
    counts: dict[DeviceDeploymentState, int]  # devices per state, every state present
    created_at: datetime
    updated_at: datetime


class DeploymentsPublic(BaseModel):
    data: list[DeploymentPublic]
    count: int


class DeploymentDevicePublic(BaseModel):
    model_config = ConfigDict(from_attributes=True)

    device_id: str
    wave: int
    state: DeviceDeploymentState
    detail: str | None
    updated_at: datetime


class DeploymentDetailPublic(BaseModel):
    deployment: DeploymentPublic
    devices: list[DeploymentDevicePublic]  # by wave, then device id


class DeploymentAbort(BaseModel):
    model_config = ConfigDict(extra="forbid")

    reason: str = Field(default="", max_length=255)


# --- verifiers -----------------------------------------------------------------------------------


class VerifierPublic(BaseModel):
    model_config = ConfigDict(from_attributes=True)

    verifier_id: str
    online: bool
    queue_depth: int
    in_flight: int
    sessions_cached: int
    max_batch: int
    target: str
    last_heartbeat: datetime | None


class VerifiersPublic(BaseModel):
    data: list[VerifierPublic]
    count: int
    live: bool  # False: no coordinator service is attached to this API process


# --- events --------------------------------------------------------------------------------------


class EventPublic(BaseModel):
    model_config = ConfigDict(from_attributes=True)

    id: int
    at: datetime
    kind: str
    device_id: str | None
    session_id: uuid.UUID | None
    actor: str
    detail: dict[str, Any]


class EventsPublic(BaseModel):
    data: list[EventPublic]
    count: int


# --- statistics ----------------------------------------------------------------------------------


class DeviceRatePublic(BaseModel):
    device_id: str
    rounds: int
    drafted: int
    accepted: int
    committed: int
    alpha: float | None
    tokens_per_s: float | None


class FleetStatsPublic(BaseModel):
    window_s: int
    data: list[DeviceRatePublic]


class AcceptancePointPublic(BaseModel):
    start: datetime
    drafted: int
    accepted: int
    alpha: float


class AcceptanceSeriesPublic(BaseModel):
    draft_model: str
    task_type: str
    points: list[AcceptancePointPublic]


class AcceptancePublic(BaseModel):
    bucket_s: int
    data: list[AcceptanceSeriesPublic]


class HistogramPublic(BaseModel):
    edges: list[float | None]  # None stands for +infinity (JSON has none)
    counts: list[int]


class LegSummaryPublic(BaseModel):
    leg: str
    count: int
    mean_ms: float | None
    p50_ms: float | None
    p95_ms: float | None


class LatencyPublic(BaseModel):
    rtt_ms: HistogramPublic
    legs: list[LegSummaryPublic]
