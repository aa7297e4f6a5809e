"""The simulator's input files: a calibration, a fleet, a workload and an SLO (TOML or JSON).

Every file is validated whole before a simulation starts; a bad one is refused with one line
that names the file and the field (`fleet.toml: devices.0.link: unknown network profile ...`).
docs/sim.md describes each field.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar

import tomllib
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from netem.profiles import PROFILES

Ms = Annotated[float, Field(ge=0.0, allow_inf_nan=False)]
PositiveMs = Annotated[float, Field(gt=0.0, allow_inf_nan=False)]
Probability = Annotated[float, Field(ge=0.0, le=1.0)]
MAX_POSITIONS = 16  # drafted positions a calibration describes (the policy's K_MAX)
# A link with no delay of its own: processes on one host, as the benchmarks run them.
LOOPBACK = "loopback"


class SimInputError(Exception):
    """A simulator input that cannot be used; its message is one line."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


# -- calibration -----------------------------------------------------------------------------


class VerifierProfile(_Strict):
    """What one kind of verifier costs: passes timed by shape, and prefill."""

    passes: list[tuple[int, int, PositiveMs]] = Field(min_length=1)  # (rows, positions, ms)
    prefill_fixed_ms: Ms = 0.0
    prefill_ms_per_token: Ms = 0.0
    pass_cv: Annotated[float, Field(ge=0.0, le=1.0)] = 0.05  # pass-to-pass variation (std/mean)
    max_batch: int = Field(default=32, ge=1)
    # What a run's own passes cost against the profile's, by rows (interpolated between): the
    # profile is timed alone, and a run's passes share their host and hold longer contexts.
    scale: list[tuple[int, Annotated[float, Field(gt=0.0)]]] = Field(default_factory=list)
    source: str = ""

    def prefill_ms(self, tokens: int) -> float:
        """One prompt's prefill of `tokens` positions, alone in its pass."""
        return self.prefill_fixed_ms + self.prefill_ms_per_token * tokens

    def scale_at(self, rows: int) -> float:
        if not self.scale:
            return 1.0
        points = sorted(self.scale)
        if rows <= points[0][0]:
            return points[0][1]
        for (r1, f1), (r2, f2) in itertools.pairwise(points):
            if rows <= r2:
                return f1 + (f2 - f1) * (rows - r1) / (r2 - r1)
        return points[-1][1]

    @field_validator("passes")
    @classmethod
    def _shapes(cls, passes: list[tuple[int, int, float]]) -> list[tuple[int, int, float]]:
        for rows, positions, _ in passes:
            if rows < 1 or positions < 1:
                raise ValueError("every pass needs rows >= 1 and positions >= 1")
        return passes


class PositionRates(_Strict):
    """A drafter on a task, per drafted position i (1-based, index i - 1):
    fill[i]: P(it proposes token i | it proposed i - 1 and the window allows i);
    accept[i]: P(the target accepts token i | it was proposed and 1..i-1 were accepted)."""

    fill: list[Probability] = Field(min_length=1, max_length=MAX_POSITIONS)
    accept: list[Probability] = Field(min_length=1, max_length=MAX_POSITIONS)
    rounds: int = Field(default=0, ge=0)  # rounds it was fitted on


class Calibration(_Strict):
    """Every parameter the simulator takes from measurements (`specfleet sim calibrate`)."""

    version: Literal[1] = 1
    verifiers: dict[str, VerifierProfile] = Field(min_length=1)  # by kind: cpu, gpu-...
    acceptance: dict[str, dict[str, PositionRates]] = Field(min_length=1)  # drafter -> task
    # By drafter, then a benchmark prompt's id: what the drafter did on that prompt, pulled
    # towards its task's rates (a replay draws a session of that prompt from it).
    prompt_acceptance: dict[str, dict[str, PositionRates]] = Field(default_factory=dict)
    host_draft_ms_per_token: dict[str, Ms] = Field(default_factory=dict)  # by drafter
    # By drafter, a pass's drafting per window token as a + b n for its n rows drafted together
    # (the verifier's DraftCost): [a, b]. A drafter not here costs host_draft_ms_per_token a row.
    host_draft_terms: dict[str, tuple[Ms, Ms]] = Field(default_factory=dict)
    # Drafting on a device, by device class then drafter.
    device_draft_ms_per_token: dict[str, dict[str, Ms]] = Field(default_factory=dict)
    answer_tokens: dict[str, list[Annotated[int, Field(ge=1)]]] = Field(min_length=1)  # by task
    prompt_tokens: dict[str, list[Annotated[int, Field(ge=1)]]] = Field(min_length=1)
    # A direct round's time beyond drafting, links and compute, as measured (samples).
    round_service_ms: list[Ms] = Field(min_length=1)
    # Of that, what holds the CPU that serves it (one round after another); the rest is a delay
    # (None: all of it).
    round_cpu_ms: Ms | None = None
    agent_turn_ms: Ms = 0.5  # the agent's own time between a verdict and its next draft
    coordinator_round_ms: Ms = 0.5  # the coordinator's work on one streamed round
    open_ms: Ms = 20.0  # a session's open beyond the modelled legs (API, database, policy)
    close_ms: Ms = 0.0  # after the last verdict, until the session reports done
    broker_hop_ms: Ms = 0.1  # one publish through the broker on loopback
    # After the agent's MQTT client is connected again (its back-off is broker/client.py's),
    # until its session's rounds flow again: the resume.
    reconnect_ms: Ms = 0.0
    # What bench adaptive's emulated links (a userspace netem proxy per agent, on the
    # benchmark's shared host) add to a round trip beyond their profile; `sim validate` adds it
    # to those links. Field links have no proxy: plans leave it out.
    emulated_link_ms: Ms = 0.0
    # Per benchmark run (`e2e xN`, `adaptive PHASE`): its verifier passes' cost over the
    # calibrated one, the shared host's speed while it ran; `sim validate` replays with it.
    host_speed: dict[str, PositiveMs] = Field(default_factory=dict)
    unfit: list[str] = Field(default_factory=list)  # what calibration could not fit, and why
    sources: list[str] = Field(default_factory=list)

    @model_validator(mode="after")
    def _tasks_known(self) -> Calibration:
        missing = set(self.prompt_tokens) - set(self.answer_tokens)
        if missing:
            raise ValueError(f"prompt_tokens has tasks with no answer_tokens: {sorted(missing)}")
        return self


# -- a fleet, a workload, an SLO -------------------------------------------------------------


class LinkSpec(_Strict):
    """A device's link to the broker: a netem profile, optionally with loss and outages."""

    profile: str = "lan"
    loss: Probability = 0.0  # per message; a lost one is sent again after retransmit_ms
    retransmit_ms: Ms = 200.0  # TCP's minimum retransmission timeout
    outage_every_s: Annotated[float, Field(gt=0.0)] | None = None  # mean time between outages
    outage_s: Ms = 0.0

    @field_validator("profile")
    @classmethod
    def _known(cls, profile: str) -> str:
        if profile == LOOPBACK:
            return profile
        if profile not in PROFILES or PROFILES[profile].offline:
            known = ", ".join([LOOPBACK, *(name for name, p in PROFILES.items() if not p.offline)])
            raise ValueError(f"unknown network profile {profile!r}; known: {known}")
        return profile


Percent = Annotated[float, Field(ge=0.0, le=100.0)]


class BatterySpec(_Strict):
    """A device class on battery: where its charge starts, what drains it, and the floor below
    which its agent asks to be spared the drafting (`Telemetry.battery_floor_percent`). The
    rates are assumptions to give per class: a phone of ~17 Wh drafting at ~2 W loses ~0.2% a
    minute to the drafting, and ~0.15% a minute to the rest of it in use."""

    # Each device's charge at the start is drawn evenly between the two (a fleet's batteries
    # are anywhere between nearly empty and full).
    start_percent: tuple[Percent, Percent] = (20.0, 100.0)
    draft_percent_per_min: Ms = 0.2  # per minute of drafting (the device's CPU busy on drafts)
    idle_percent_per_min: Ms = 0.15  # per minute, drafting or not
    floor_percent: Percent | None = None  # None: the coordinator's default floor (20%)
    charging_share: Probability = 0.0  # of the class's devices, plugged in (never drained)

    @model_validator(mode="after")
    def _ordered(self) -> BatterySpec:
        low, high = self.start_percent
        if low > high:
            raise ValueError(f"start_percent: {low:g} is above {high:g}")
        return self


class ThermalSpec(_Strict):
    """A device class's heat: its temperature follows its drafting duty (the share of time its
    CPU drafts) towards ambient_c + rise_c x duty, with a time constant; past throttle_c its
    drafting slows by throttle_factor, and past limit_c (the agent's
    `Telemetry.thermal_limit_c`) it asks to be spared the drafting."""

    ambient_c: float = Field(default=30.0, ge=-50.0, le=100.0)
    start_c: float | None = Field(default=None, ge=-50.0, le=150.0)  # None: ambient_c
    rise_c: Ms = 45.0  # above ambient at full drafting duty, once settled
    time_constant_s: PositiveMs = 120.0
    limit_c: float | None = Field(default=None, ge=0.0, le=200.0)  # None: the coordinator's 80
    throttle_c: float | None = Field(default=None, ge=0.0, le=200.0)  # None: never throttles
    throttle_factor: Annotated[float, Field(ge=1.0)] = 2.0


class DeviceClassSpec(_Strict):
    name: str = Field(min_length=1)
    count: int = Field(ge=1)
    link: LinkSpec = LinkSpec()
    # Per-token draft cost by drafter; what is not given comes from the calibration's class
    # of the same name, then its first class.
    draft_ms_per_token: dict[str, Ms] = Field(default_factory=dict)
    drafters: list[str] = Field(default_factory=lambda: ["hybrid"], min_length=1)
    # Thermal limit: after this much drafting, drafting slows by throttle_factor.
    throttle_after_s: Annotated[float, Field(gt=0.0)] | None = None
    throttle_factor: Annotated[float, Field(ge=1.0)] = 1.0
    # A battery and a temperature, reported to the coordinator's policy every telemetry_s (the
    # agent's telemetry interval), which spares a device past a limit the drafting.
    battery: BatterySpec | None = None
    thermal: ThermalSpec | None = None
    telemetry_s: PositiveMs = 5.0


class VerifierSpec(_Strict):
    kind: str = "cpu"
    count: int = Field(default=1, ge=0)


class BrokerSpec(_Strict):
    hop_ms: Ms | None = None  # per publish; the calibration's when not given
    max_messages_per_s: Annotated[float, Field(gt=0.0)] | None = None


class FleetSpec(_Strict):
    devices: list[DeviceClassSpec] = Field(min_length=1)
    verifiers: list[VerifierSpec] = Field(default_factory=lambda: [VerifierSpec()], min_length=1)
    broker: BrokerSpec = BrokerSpec()
    sessions_per_device: int = Field(default=8, ge=1)
    # Coordinators sharing the sessions (by a hash of the session), each on a CPU of its own.
    coordinators: int = Field(default=1, ge=1)


class WorkloadSpec(_Strict):
    sessions_per_s: Annotated[float, Field(gt=0.0)]
    tokens_per_session: int = Field(default=48, ge=1)
    duration_s: Annotated[float, Field(gt=0.0)] = 60.0
    warmup_s: Ms = 10.0
    task_mix: dict[str, Annotated[float, Field(gt=0.0)]] = Field(default_factory=dict)
    # "adaptive": the production policy; "distributed" or "cloud" with a fixed drafter and k.
    mode: Literal["adaptive", "distributed", "cloud", "plain"] = "adaptive"
    drafter: str = "hybrid"
    k: int = Field(default=4, ge=0, le=16)


class SloSpec(_Strict):
    tbt_p95_ms: PositiveMs  # time between tokens, 95th percentile
    max_verifiers: int = Field(default=256, ge=1)


M = TypeVar("M", bound=BaseModel)


def parse(document: Any, model: type[M], name: str) -> M:
    """Validate a parsed document; a SimInputError naming the first bad field."""
    try:
        return model.model_validate(document)
    except ValidationError as exc:
        error = exc.errors()[0]
        where = ".".join(str(part) for part in error["loc"]) or "(top level)"
        raise SimInputError(f"{name}: {where}: {error['msg']}") from None


def load(path: Path, model: type[M]) -> M:
    """A TOML (by suffix .toml) or JSON file as `model`."""
    try:
        text = path.read_text()
    except OSError as exc:
        raise SimInputError(f"cannot read {path}: {exc.strerror or exc}") from None
    try:
        document = tomllib.loads(text) if path.suffix == ".toml" else json.loads(text)
    except (tomllib.TOMLDecodeError, json.JSONDecodeError) as exc:
        kind = path.suffix.lstrip(".") or "JSON"
        raise SimInputError(f"{path.name}: not valid {kind}: {exc}") from None
    return parse(document, model, path.name)
