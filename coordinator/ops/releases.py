"""Model releases on the coordinator: the Ed25519 release key and a content-addressed store.

An artifact is an uncompressed tar of one model directory (manifest, model file, tokenizer and
what else the builder wrote), built deterministically so that the same directory always gives
the same sha256. It is stored as `<home>/artifacts/<sha256>.tar` and served by the API; devices
get its sha256, size and the release key's signature in the `deploy_model` command.

Each model name's releases are numbered in `<home>/releases/<name>.json`: a new
artifact gets the next version, the same artifact keeps its own, and `current` is the version
last sent out (devices refuse anything older unless it is signed as a rollback from `current`).

Devices download with a download token: the release key's signature over (artifact sha256,
device id, expiry), minted per device as its command is sent. The API checks it with the public
key, so the device's bus credential never travels over HTTP, and a token opens one artifact, for
one device, for minutes.
"""

from __future__ import annotations

import base64
import binascii
import json
import os
import secrets
import tarfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from broker.model_release import ModelRelease, public_key_pem, sign_release
from inference.artifacts import (
    MANIFEST_FILE,
    ArtifactError,
    ModelManifest,
    load_manifest,
    sha256_file,
)

KEY_FILE = "release-ed25519.pem"
PUBLIC_KEY_FILE = "release-ed25519.pub.pem"
ARTIFACTS_DIR = "artifacts"
KEYS_DIR = "keys"
ARTIFACT_SUFFIX = ".tar"
RELEASES_DIR = "releases"
# Signatures over download tokens must never verify as release statements, nor the reverse.
DOWNLOAD_TOKEN_DOMAIN = b"specfleet/v1/artifact-download\n"
MAX_DOWNLOAD_TOKEN_CHARS = 1024


class ReleaseStoreError(Exception):
    """A model directory that cannot be released, or a key file that cannot be read."""


def keys_dir(home: Path) -> Path:
    return home / KEYS_DIR


def artifacts_dir(home: Path) -> Path:
    return home / ARTIFACTS_DIR


def artifact_path(home: Path, sha256: str) -> Path:
    return artifacts_dir(home) / f"{sha256}{ARTIFACT_SUFFIX}"


def load_or_create_release_key(home: Path) -> Ed25519PrivateKey:
    """The coordinator's release key, created (0600) on first use; its public half beside it."""
    directory = keys_dir(home)
    path = directory / KEY_FILE
    if path.exists():
        try:
            key = serialization.load_pem_private_key(path.read_bytes(), password=None)
        except ValueError as exc:
            raise ReleaseStoreError(f"{path}: not a PEM private key ({exc})") from None
        if not isinstance(key, Ed25519PrivateKey):
            raise ReleaseStoreError(f"{path}: not an Ed25519 key")
        return key
    directory.mkdir(parents=True, exist_ok=True)
    key = Ed25519PrivateKey.generate()
    pem = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    tmp = path.with_name(f".{path.name}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as handle:
        handle.write(pem)
    # link, not replace: a concurrent first use must not swap the key under the other's feet.
    try:
        os.link(tmp, path)
    except FileExistsError:
        tmp.unlink()
        return load_or_create_release_key(home)
    tmp.unlink()
    (directory / PUBLIC_KEY_FILE).write_bytes(public_key_pem(key))
    return key


def release_public_key_pem(home: Path) -> bytes:
    return public_key_pem(load_or_create_release_key(home))


def pack_model_dir(directory: Path, out: Path) -> None:
    """Write a deterministic tar of the plain files of a model directory (sorted, no metadata)."""
    with tarfile.open(out, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        for path in sorted(directory.iterdir()):
            if not path.is_file() or path.name.startswith("."):
                continue
            info = tarfile.TarInfo(path.name)
            info.size = path.stat().st_size
            info.mode = 0o644
            info.mtime = 0
            with path.open("rb") as stream:
                tar.addfile(info, stream)


@dataclass(frozen=True)
class StoredRelease:
    """A packed, signed model directory in the artifact store."""

    manifest: ModelManifest
    release: ModelRelease
    signature: str  # base64 Ed25519 over release.statement()
    path: Path


def _index_path(home: Path, name: str) -> Path:
    return home / RELEASES_DIR / f"{name}.json"


def _read_index(home: Path, name: str) -> dict[str, Any]:
    path = _index_path(home, name)
    if not path.is_file():
        return {"current": None, "versions": {}}
    try:
        index: dict[str, Any] = json.loads(path.read_text())
    except ValueError as exc:
        raise ReleaseStoreError(f"{path}: not JSON ({exc})") from None
    return index


def _write_index(home: Path, name: str, index: dict[str, Any]) -> None:
    path = _index_path(home, name)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
    tmp.write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    tmp.replace(path)


def current_version(home: Path, name: str) -> int | None:
    """The version of `name` last sent out, if any."""
    current = _read_index(home, name)["current"]
    return int(current) if current is not None else None


def release_versions(home: Path, name: str) -> dict[str, int]:
    """Each stored artifact of `name` (by sha256) with its release version."""
    versions: dict[str, dict[str, Any]] = _read_index(home, name)["versions"]
    return {entry["sha256"]: int(version) for version, entry in versions.items()}


def store_release(home: Path, model_dir: Path) -> StoredRelease:
    """Pack `model_dir` into the store (once per content), number it and sign what devices check.

    The signed statement is for the release's own version, with no rollback: sending an older
    artifact again is refused by devices that have a newer one (see `rollback_release`), and
    leaves the current release as it was.
    """
    try:
        manifest = load_manifest(model_dir)
    except ArtifactError as exc:
        raise ReleaseStoreError(str(exc)) from None
    store = artifacts_dir(home)
    store.mkdir(parents=True, exist_ok=True)
    partial = store / f".{secrets.token_hex(8)}.partial"
    try:
        pack_model_dir(model_dir, partial)
        sha256 = sha256_file(partial)
        size = partial.stat().st_size
        path = artifact_path(home, sha256)
        partial.replace(path)  # same content, same name: a concurrent writer is harmless
    finally:
        partial.unlink(missing_ok=True)
    index = _read_index(home, manifest.name)
    versions: dict[str, dict[str, Any]] = index["versions"]
    version = next((int(v) for v, e in versions.items() if e["sha256"] == sha256), None)
    if version is None:
        # New content is the newest release; the same content again changes nothing here.
        version = max((int(v) for v in versions), default=0) + 1
        versions[str(version)] = {"sha256": sha256, "size_bytes": size, "format": manifest.format}
        index["current"] = version
        _write_index(home, manifest.name, index)
    release = ModelRelease(
        name=manifest.name, format=manifest.format, sha256=sha256, size_bytes=size, version=version
    )
    signature = sign_release(load_or_create_release_key(home), release)
    return StoredRelease(manifest, release, signature, path)


def _stored_manifest(path: Path, what: str) -> ModelManifest:
    """The manifest inside a stored artifact."""
    try:
        with tarfile.open(path, mode="r:") as tar:
            member = tar.extractfile(MANIFEST_FILE)
            if member is None:
                raise ReleaseStoreError(f"{path}: no {MANIFEST_FILE}")
            return ModelManifest.from_json(json.loads(member.read()))
    except (OSError, KeyError, ValueError, tarfile.TarError, ArtifactError) as exc:
        raise ReleaseStoreError(f"{what}: the stored artifact is unusable ({exc})") from None


def released_manifest(home: Path, name: str) -> ModelManifest | None:
    """The manifest of `name`'s current release, None with no usable one."""
    current = _read_index(home, name)["current"]
    if current is None:
        return None
    entry = _read_index(home, name)["versions"][str(current)]
    path = artifact_path(home, entry["sha256"])
    return _stored_manifest(path, f"{name} {current}") if path.is_file() else None


def rollback_release(home: Path, name: str, version: int) -> StoredRelease:
    """Sign a rollback of `name` from its current version to the older, stored `version`."""
    index = _read_index(home, name)
    current = index["current"]
    entry = index["versions"].get(str(version))
    if entry is None:
        known = ", ".join(sorted(index["versions"], key=int)) or "none"
        raise ReleaseStoreError(f"{name} has no release {version} (released: {known})")
    if current is None or version >= int(current):
        raise ReleaseStoreError(
            f"{name} {version} is not older than the current release ({current}): deploy it"
        )
    path = artifact_path(home, entry["sha256"])
    manifest = _stored_manifest(path, f"{name} {version}")
    release = ModelRelease(
        name=name,
        format=entry["format"],
        sha256=entry["sha256"],
        size_bytes=entry["size_bytes"],
        version=version,
        rollback_from=int(current),
    )
    signature = sign_release(load_or_create_release_key(home), release)
    index["current"] = version
    _write_index(home, name, index)
    return StoredRelease(manifest, release, signature, path)


def _b64(raw: bytes) -> str:
    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def issue_download_token(
    key: Ed25519PrivateKey, sha256: str, device_id: str, ttl_s: float, *, now: float | None = None
) -> str:
    """A grant to download artifact `sha256`, for `device_id`, until `ttl_s` from now."""
    expires = int((time.time() if now is None else now) + ttl_s)
    claims = json.dumps(
        {"sha256": sha256, "device": device_id, "exp": expires},
        sort_keys=True,
        separators=(",", ":"),
    ).encode()
    signature = key.sign(DOWNLOAD_TOKEN_DOMAIN + claims)
    return f"{_b64(claims)}.{_b64(signature)}"


def check_download_token(
    public_key: Ed25519PublicKey, token: str, sha256: str, *, now: float | None = None
) -> str | None:
    """The device a valid, unexpired token for artifact `sha256` was issued to; else None."""
    body, dot, signature = token.partition(".")
    if not dot or len(token) > MAX_DOWNLOAD_TOKEN_CHARS:
        return None
    try:
        claims_bytes = _unb64(body)
        public_key.verify(_unb64(signature), DOWNLOAD_TOKEN_DOMAIN + claims_bytes)
        claims = json.loads(claims_bytes)
    except (binascii.Error, ValueError, InvalidSignature):
        return None
    if not isinstance(claims, dict) or claims.get("sha256") != sha256:
        return None
    device, expires = claims.get("device"), claims.get("exp")
    if not isinstance(device, str) or not isinstance(expires, int):
        return None
    if (time.time() if now is None else now) > expires:
        return None
    return device


def release_on_demand(home: Path, models_dir: Path, name: str) -> StoredRelease | None:
    """The release a device that lacks draft `name` gets (drafts on demand): its current
    release, signed afresh as that version with no rollback (the device has no version of it),
    or, with none yet, a new release of `models_dir/name` when that is a draft built here.
    None when there is neither."""
    index = _read_index(home, name)
    current = index["current"]
    if current is not None:
        entry = index["versions"][str(current)]
        path = artifact_path(home, entry["sha256"])
        if path.is_file():
            manifest = _stored_manifest(path, f"{name} {current}")
            release = ModelRelease(
                name=name,
                format=entry["format"],
                sha256=entry["sha256"],
                size_bytes=entry["size_bytes"],
                version=int(current),
            )
            signature = sign_release(load_or_create_release_key(home), release)
            return StoredRelease(manifest, release, signature, path)
    model_dir = models_dir / name
    if not (model_dir / MANIFEST_FILE).is_file():
        return None
    stored = store_release(home, model_dir)
    if stored.manifest.role != "draft":
        raise ReleaseStoreError(f"{name} is a {stored.manifest.role}; only drafts go to devices")
    return stored
