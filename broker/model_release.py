"""Signed model releases: the `deploy_model` command's arguments and the Ed25519 check of both ends.

The coordinator signs a release statement (model name, format, artifact sha256 and size, and
the release's version) with its release key; the agent checks that signature with the public key
from its bundle before it downloads anything, then checks the downloaded bytes against the signed
size and sha256. So a forged command, a tampered artifact and a truncated download are all
refused, and a signed artifact cannot be installed under another model's name.

Versions count up per model name. A device installs only a version above every one it has
installed, so a replayed older release is refused; going back is a rollback, which the statement
itself must say: `rollback_from` names the version it replaces, and a device takes it only while
that version is the one it serves.

The artifact is fetched with `download_token`, a short-lived grant for this artifact and this
device (see coordinator.releases); it is not part of the statement. The device's bus credential
never goes over HTTP.
"""

from __future__ import annotations

import base64
import binascii
import json
from typing import Any, Literal

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

# Signatures made for one purpose must never verify for another.
STATEMENT_DOMAIN = b"specfleet/v1/model-release\n"
# A draft model is tens of megabytes; the cap bounds what a device agrees to download.
MAX_ARTIFACT_BYTES = 4 * 1024**3
SHA256_PATTERN = r"^[0-9a-f]{64}$"
MAX_VERSION = 2**31 - 1
ED25519_SIGNATURE_BYTES = 64

ModelFormat = Literal["onnx", "tflite"]


class ReleaseError(Exception):
    """Arguments that do not validate, or a signature that does not verify."""


class ModelRelease(BaseModel):
    """What the release key vouches for."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
    format: ModelFormat
    sha256: str = Field(pattern=SHA256_PATTERN)  # of the artifact (a tar of the model directory)
    size_bytes: int = Field(ge=1, le=MAX_ARTIFACT_BYTES)
    version: int = Field(ge=1, le=MAX_VERSION)
    # Set on a rollback only: the newer version this one replaces.
    rollback_from: int | None = Field(default=None, ge=2, le=MAX_VERSION)

    @model_validator(mode="after")
    def _rollback_goes_back(self) -> ModelRelease:
        if self.rollback_from is not None and self.rollback_from <= self.version:
            raise ValueError("a rollback goes to an older version than the one it replaces")
        return self

    def statement(self) -> bytes:
        """The exact bytes that are signed: canonical JSON after a domain prefix."""
        body = json.dumps(self.model_dump(), sort_keys=True, separators=(",", ":"))
        return STATEMENT_DOMAIN + body.encode()


class DeployModelArgs(BaseModel):
    """`Command.args` of a `deploy_model` command."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    deployment_id: int = Field(ge=0)
    name: str
    format: ModelFormat
    sha256: str
    size_bytes: int
    version: int
    rollback_from: int | None = None
    url: str = Field(min_length=8, max_length=2048, pattern=r"^https?://")
    signature: str = Field(min_length=1, max_length=256)  # base64 of 64 bytes
    # Sent as `Authorization: Bearer` with the download; empty for a server that needs none.
    download_token: str = Field(default="", max_length=1024)

    @property
    def release(self) -> ModelRelease:
        return ModelRelease(
            name=self.name,
            format=self.format,
            sha256=self.sha256,
            size_bytes=self.size_bytes,
            version=self.version,
            rollback_from=self.rollback_from,
        )

    def to_args(self) -> dict[str, Any]:
        return self.model_dump()

    @classmethod
    def from_args(cls, args: dict[str, Any]) -> DeployModelArgs:
        try:
            parsed = cls.model_validate(args)
            parsed.release  # noqa: B018 - validates the release fields too
        except ValidationError as exc:
            first = exc.errors(include_url=False)[0]
            where = ".".join(str(p) for p in first["loc"]) or "args"
            raise ReleaseError(f"invalid deploy_model arguments: {where}: {first['msg']}") from None
        return parsed


def sign_release(key: Ed25519PrivateKey, release: ModelRelease) -> str:
    return base64.b64encode(key.sign(release.statement())).decode()


def verify_release(public_key: Ed25519PublicKey, release: ModelRelease, signature: str) -> None:
    """Raise ReleaseError unless `signature` is the release key's signature of `release`."""
    try:
        raw = base64.b64decode(signature, validate=True)
    except (binascii.Error, ValueError):
        raise ReleaseError("signature is not base64") from None
    if len(raw) != ED25519_SIGNATURE_BYTES:
        raise ReleaseError(f"signature has {len(raw)} bytes, not {ED25519_SIGNATURE_BYTES}")
    try:
        public_key.verify(raw, release.statement())
    except InvalidSignature:
        raise ReleaseError("signature does not verify with the release key") from None


def public_key_pem(key: Ed25519PrivateKey) -> bytes:
    return key.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )


def load_public_key(pem: bytes) -> Ed25519PublicKey:
    try:
        key = serialization.load_pem_public_key(pem)
    except ValueError as exc:
        raise ReleaseError(f"not a PEM public key: {exc}") from None
    if not isinstance(key, Ed25519PublicKey):
        raise ReleaseError("the release key must be an Ed25519 public key")
    return key
