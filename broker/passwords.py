"""Credentials in Mosquitto 2's PBKDF2-SHA512 format: one stored hash serves us and the broker."""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import secrets
from dataclasses import dataclass

# Mosquitto 2 writes `$7$<iterations>$<base64 salt>$<base64 sha512 pbkdf2>`, 12-byte salt.
MOSQUITTO_PBKDF2_PREFIX = "$7$"
SALT_BYTES = 12
# Our salts are 12 URL-safe characters (72 random bits), not raw bytes: EMQX's built-in
# database keeps a salt as text, so the same hash then serves Mosquitto and EMQX alike.
SALT_ALPHABET_BYTES = 9  # token_urlsafe(9) is 12 characters
# Credentials are 256-bit random tokens, so stretching adds little; the broker pays this cost on
# every CONNECT, and a reconnect storm of a whole fleet must not stall it (about 10 ms each here).
DEFAULT_ITERATIONS = 20_000
CREDENTIAL_BYTES = 32


class CredentialHashError(ValueError):
    """A stored hash that is not in Mosquitto's PBKDF2-SHA512 format."""


def new_credential() -> str:
    """A fresh random secret, URL-safe so that it survives shells, env files and MQTT clients."""
    return secrets.token_urlsafe(CREDENTIAL_BYTES)


def hash_credential(
    credential: str, *, iterations: int = DEFAULT_ITERATIONS, salt: bytes | None = None
) -> str:
    """The Mosquitto `$7$` hash of `credential`, with a fresh salt unless one is given."""
    if iterations < 1:
        raise ValueError("iterations must be positive")
    salt = secrets.token_urlsafe(SALT_ALPHABET_BYTES).encode() if salt is None else salt
    digest = hashlib.pbkdf2_hmac("sha512", credential.encode(), salt, iterations)
    return (
        f"{MOSQUITTO_PBKDF2_PREFIX}{iterations}$"
        f"{base64.b64encode(salt).decode()}${base64.b64encode(digest).decode()}"
    )


def _parse(encoded: str) -> tuple[int, bytes, bytes]:
    parts = encoded.split("$")
    # "$7$101$salt$hash" splits into ["", "7", "101", "salt", "hash"].
    if len(parts) != 5 or parts[0] != "" or parts[1] != "7":
        raise CredentialHashError("not a Mosquitto PBKDF2-SHA512 ($7$) hash")
    try:
        iterations = int(parts[2])
        salt = base64.b64decode(parts[3], validate=True)
        digest = base64.b64decode(parts[4], validate=True)
    except (ValueError, binascii.Error) as exc:
        raise CredentialHashError(f"malformed Mosquitto hash: {exc}") from exc
    if iterations < 1 or len(digest) != hashlib.sha512().digest_size:
        raise CredentialHashError("malformed Mosquitto hash: bad iterations or digest length")
    return iterations, salt, digest


@dataclass(frozen=True)
class Pbkdf2Parts:
    """A `$7$` hash taken apart: what another broker's PBKDF2-SHA512 check needs."""

    iterations: int
    salt: bytes
    digest: bytes  # 64 bytes


def pbkdf2_parts(encoded: str) -> Pbkdf2Parts:
    iterations, salt, digest = _parse(encoded)
    return Pbkdf2Parts(iterations, salt, digest)


def check_credential_hash(encoded: str) -> str:
    """`encoded` itself if it is a well-formed `$7$` hash; raises CredentialHashError otherwise."""
    _parse(encoded)
    return encoded


def verify_credential(credential: str, encoded: str) -> bool:
    """True if `credential` matches the stored hash; comparison in constant time."""
    iterations, salt, digest = _parse(encoded)
    candidate = hashlib.pbkdf2_hmac("sha512", credential.encode(), salt, iterations)
    return hmac.compare_digest(candidate, digest)
