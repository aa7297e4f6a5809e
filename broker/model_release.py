"""Signed model releases: the `deploy_model` command's arguments and the Ed25519 check of both ends.

The coordinator signs a release statement (model name, format, artifact sha256 and size) with
its release key; the agent checks that signature with the public key from its bundle before it
downloads anything, then checks the downloaded bytes against the signed size and sha256. So a
forged command, a tampered artifact and a truncated download are all refused, and a signed
artifact cannot be installed under another model's name.
"""

from __future__ import annotations

import base64
import binascii
import json
from typing import Any, Literal

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from pydantic import BaseModel, ConfigDict, Field, ValidationError

# Signatures made for one purpose must never verify for another.
STATEMENT_DOMAIN = b"specfleet/v1/model-release\n"
# A draft model is tens of megabytes; the cap bounds what a device agrees to download.
MAX_ARTIFACT_BYTES = 4 * 1024**3
SHA256_PATTERN = r"^[0-9a-f]{64}$"
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
    url: str = Field(min_length=8, max_length=2048, pattern=r"^https?://")
    signature: str = Field(min_length=1, max_length=256)  # base64 of 64 bytes

    @property
    def release(self) -> ModelRelease:
        return ModelRelease(
            name=self.name, format=self.format, sha256=self.sha256, size_bytes=self.size_bytes
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
