"""Every topic of the bus, under `specfleet/v1/`; both ends build topics through this module."""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import Enum

ROOT = "specfleet/v1"

# Device ids are MQTT usernames and topic levels, so they must be free of wildcards and separators.
DEVICE_ID_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")


class DeviceChannel(str, Enum):
    """Topics below `dev/{device_id}/`; `uplink` says who may publish on it."""

    STATUS = "status"  # retained presence; the Last Will publishes "offline" here
    TELEMETRY = "telemetry"
    SESSION = "session"  # open (or resume) and close a decoding session
    DRAFT = "draft"
    # A leased session's next window after a direct verdict: read by the verifiers only, so the
    # coordinator does not wake for every direct round. Resends go on `draft`, which both read.
    DIRECT = "direct"
    ACK = "ack"  # command acknowledgements
    VERDICT = "verdict"  # verdicts, session states and error replies
    COMMAND = "cmd"

    @property
    def uplink(self) -> bool:
        """True where the device publishes, False where it only reads."""
        return self not in (DeviceChannel.VERDICT, DeviceChannel.COMMAND)


UPLINK_CHANNELS = tuple(c for c in DeviceChannel if c.uplink)
# Where a device sends drafts: `draft` (read by the coordinator and the verifiers) and `direct`
# (a leased session's next window after a direct verdict, read by the verifiers only).
DRAFT_CHANNELS = (DeviceChannel.DRAFT, DeviceChannel.DIRECT)
DOWNLINK_CHANNELS = tuple(c for c in DeviceChannel if not c.uplink)


def validate_device_id(device_id: str) -> str:
    if not DEVICE_ID_PATTERN.fullmatch(device_id):
        raise ValueError(
            f"invalid device id {device_id!r}: use 1-64 letters, digits, '_', '.', '-', "
            "starting with a letter or digit"
        )
    return device_id


def device_topic(device_id: str, channel: DeviceChannel) -> str:
    return device_topic_pattern(validate_device_id(device_id), channel)


def device_topic_pattern(device_level: str, channel: DeviceChannel) -> str:
    """A device topic with any text as its device level: a broker's placeholder such as
    EMQX's `${username}`. Use `device_topic` for a real device."""
    return f"{ROOT}/dev/{device_level}/{channel.value}"


def device_subscription(channel: DeviceChannel) -> str:
    """Subscription to one channel of every device (the coordinator's side)."""
    return f"{ROOT}/dev/+/{channel.value}"


@dataclass(frozen=True)
class ParsedDeviceTopic:
    device_id: str
    channel: DeviceChannel


_DEVICE_TOPIC = re.compile(rf"^{re.escape(ROOT)}/dev/([^/]+)/([^/]+)$")


def parse_device_topic(topic: str) -> ParsedDeviceTopic | None:
    """The device and channel of a device topic; None for any other topic."""
    match = _DEVICE_TOPIC.fullmatch(topic)
    if match is None:
        return None
    device_id, channel = match.groups()
    if not DEVICE_ID_PATTERN.fullmatch(device_id):
        return None
    try:
        return ParsedDeviceTopic(device_id, DeviceChannel(channel))
    except ValueError:
        return None


class VerifierChannel(str, Enum):
    """Topics below `verifier/{verifier_id}/`: cloud-internal, between coordinator and verifiers."""

    STATUS = "status"  # retained heartbeat with load; the Last Will publishes "offline" here
    WORK = "work"  # verify requests, coordinator -> verifier
    RESULT = "result"  # verify results, verifier -> coordinator


VERIFIER_ROOT = f"{ROOT}/verifier"


def verifier_topic(verifier_id: str, channel: VerifierChannel) -> str:
    return f"{VERIFIER_ROOT}/{validate_device_id(verifier_id)}/{channel.value}"


def verifier_subscription(channel: VerifierChannel) -> str:
    return f"{VERIFIER_ROOT}/+/{channel.value}"


_VERIFIER_TOPIC = re.compile(rf"^{re.escape(VERIFIER_ROOT)}/([^/]+)/([^/]+)$")


@dataclass(frozen=True)
class ParsedVerifierTopic:
    verifier_id: str
    channel: VerifierChannel


def parse_verifier_topic(topic: str) -> ParsedVerifierTopic | None:
    match = _VERIFIER_TOPIC.fullmatch(topic)
    if match is None:
        return None
    verifier_id, channel = match.groups()
    try:
        return ParsedVerifierTopic(verifier_id, VerifierChannel(channel))
    except ValueError:
        return None
