"""Model releases on the coordinator: the Ed25519 release key and a content-addressed store.

An artifact is an uncompressed tar of one model directory (manifest, model file, tokenizer and
what else the builder wrote), built deterministically so that the same directory always gives
the same sha256. It is stored as `<home>/artifacts/<sha256>.tar` and served by the API; devices
get its sha256, size and the release key's signature in the `deploy_model` command.
"""

from __future__ import annotations

import os
import secrets
import tarfile
from dataclasses import dataclass
from pathlib import Path

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from broker.model_release import ModelRelease, public_key_pem, sign_release
from inference.artifacts import ArtifactError, ModelManifest, load_manifest, sha256_file

KEY_FILE = "release-ed25519.pem"
PUBLIC_KEY_FILE = "release-ed25519.pub.pem"
ARTIFACTS_DIR = "artifacts"
KEYS_DIR = "keys"
ARTIFACT_SUFFIX = ".tar"


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


def store_release(home: Path, model_dir: Path) -> StoredRelease:
    """Pack `model_dir` into the store (once per content) and sign what devices will check."""
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
    release = ModelRelease(
        name=manifest.name, format=manifest.format, sha256=sha256, size_bytes=size
    )
    signature = sign_release(load_or_create_release_key(home), release)
    return StoredRelease(manifest, release, signature, path)
