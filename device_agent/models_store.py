"""The agent's model store: signed downloads, checks, atomic swaps, smoke drafts, rollback.

Layout under the models directory, which `inference.drafts` reads as it is:

    <models_dir>/<name>                -> .versions/<name>/<artifact sha256>   (a symlink)
    <models_dir>/.versions/<name>/<sha256>/manifest.json, model file, tokenizer, ...
    <models_dir>/.versions/<name>.release.json   {"highest": N, "active": N}: signed versions
    <models_dir>/.staging/<random>/    downloads and extractions in progress

A release is installed in this order, and any failure before the swap leaves the active model
untouched: check the command's Ed25519 signature, check its signed version (above every version
installed before, or a signed rollback from the active one), download with the command's
download token (never past the signed size; the bus credential is never sent), check
size and sha256, extract the tar (plain files only), check the manifest against the release and
its files against the manifest, swap the symlink (one rename), run a smoke draft through the same
loading path the drafting loop uses, and on failure swap the previous version back.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import http.client
import json
import logging
import os
import secrets
import shutil
import tarfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Protocol

from broker import messages as m
from broker.model_release import (
    DeployModelArgs,
    ReleaseError,
    load_public_key,
    verify_release,
)
from broker.topics import DeviceChannel, device_topic
from inference.artifacts import (
    MANIFEST_FILE,
    ArtifactError,
    check_same_vocabulary,
    load_manifest,
    sha256_file,
    with_vocab,
)

if TYPE_CHECKING:
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

    from broker.client import BusClient
    from device_agent.settings import AgentSettings

log = logging.getLogger(__name__)

VERSIONS_DIR = ".versions"
STAGING_DIR = ".staging"
# The active version and the one it replaced (the rollback target) are kept; older ones go.
KEEP_VERSIONS = 2
RECORD_SUFFIX = ".release.json"
DOWNLOAD_CHUNK = 1 << 20
# Per socket operation, not for the whole download: a slow link may take minutes for a model.
DOWNLOAD_TIMEOUT_S = 60.0
MAX_ARCHIVE_MEMBERS = 64
# The smoke draft: a few prompt positions, then a few greedy steps, every logit finite.
SMOKE_PROMPT_IDS = (100, 200, 300)
SMOKE_STEPS = 4


class InstallStage(str, Enum):
    """Where an install stopped; every stage before SWAP leaves the active model untouched."""

    SIGNATURE = "signature"
    VERSION = "version"
    DOWNLOAD = "download"
    CHECK = "check"
    EXTRACT = "extract"
    SWAP = "swap"
    SMOKE = "smoke"


class InstallError(Exception):
    def __init__(self, stage: InstallStage, reason: str) -> None:
        super().__init__(f"{stage.value}: {reason}")
        self.stage = stage
        self.reason = reason


OutcomeState = Literal["installed", "already_installed", "refused", "rolled_back", "failed"]


@dataclass(frozen=True)
class InstallOutcome:
    """What one install did; `rolled_back` and `refused` both leave the previous model active."""

    name: str
    sha256: str
    state: OutcomeState
    active_sha256: str | None  # what serves now
    previous_sha256: str | None = None
    stage: InstallStage | None = None
    error: str = ""
    smoke_tokens: tuple[int, ...] = ()
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return self.state in ("installed", "already_installed")

    def result(self) -> dict[str, Any]:
        """The command acknowledgement's `result`."""
        return {
            "model": self.name,
            "sha256": self.sha256,
            "state": self.state,
            "active_sha256": self.active_sha256,
            "previous_sha256": self.previous_sha256,
            "stage": self.stage.value if self.stage else None,
            "rolled_back": self.state in ("refused", "rolled_back"),
            "smoke_tokens": list(self.smoke_tokens),
            "seconds": round(self.seconds, 3),
        }


@dataclass(frozen=True)
class ReleaseRecord:
    """The signed release versions of one model on this device."""

    highest: int  # the newest ever installed: anything not above it needs a signed rollback
    active: int  # the one serving now (0: none, or a model placed by hand)


class Fetcher(Protocol):
    def fetch(self, url: str, dest: Path, max_bytes: int, token: str = "") -> None:
        """Write the body at `url` to `dest`; never more than `max_bytes`. `token` is the
        command's download token."""
        ...


@dataclass(frozen=True)
class HttpFetcher:
    """Plain urllib: nothing beyond the standard library on the device.

    The device sends only the command's download token (`Authorization: Bearer`), a grant for
    this one artifact that expires within minutes; never its bus credential. Proxies come from
    the settings only, never from the environment.
    """

    proxy: str | None = None
    timeout_s: float = DOWNLOAD_TIMEOUT_S

    def fetch(self, url: str, dest: Path, max_bytes: int, token: str = "") -> None:
        proxies = {"http": self.proxy, "https": self.proxy} if self.proxy else {}
        opener = urllib.request.build_opener(urllib.request.ProxyHandler(proxies))
        request = urllib.request.Request(url)
        if token:
            request.add_header("Authorization", f"Bearer {token}")
        written = 0
        try:
            with opener.open(request, timeout=self.timeout_s) as response, dest.open("wb") as out:
                while chunk := response.read(DOWNLOAD_CHUNK):
                    written += len(chunk)
                    if written > max_bytes:
                        raise InstallError(
                            InstallStage.DOWNLOAD, f"more than the signed {max_bytes} bytes"
                        )
                    out.write(chunk)
        except urllib.error.HTTPError as exc:
            raise InstallError(InstallStage.DOWNLOAD, f"HTTP {exc.code} from {url}") from None
        except (urllib.error.URLError, http.client.HTTPException, OSError) as exc:
            raise InstallError(InstallStage.DOWNLOAD, f"{url}: {exc!r}") from None


def smoke_draft(models_dir: Path, name: str, model_format: str) -> list[int]:
    """Load the active `name` the way the drafting loop does and draft a few greedy tokens."""
    import numpy as np

    from inference.drafts import find_draft, load_draft
    from inference.proposers import head_token_ids

    info = find_draft(models_dir, name, model_format)  # type: ignore[arg-type]
    runtime = load_draft(models_dir, name, model_format, threads=1)  # type: ignore[arg-type]
    bos = int(info.manifest.config.get("bos_id", 1))
    prompt = [bos, *SMOKE_PROMPT_IDS]
    cache = runtime.new_cache()
    logits = runtime.forward(prompt, cache)
    if logits.shape != (len(prompt), runtime.vocab_size):
        raise ValueError(f"logits of shape {logits.shape}, expected ({len(prompt)}, vocab)")
    head_ids = head_token_ids(runtime)
    tokens: list[int] = []
    for _ in range(SMOKE_STEPS):
        row = logits[-1]
        if not np.isfinite(row).all():
            raise ValueError("the draft produced non-finite logits")
        column = int(row.argmax())
        token = int(head_ids[column]) if head_ids is not None else column
        tokens.append(token)
        logits = runtime.forward([token], cache)
    return tokens


SmokeCheck = Callable[[Path, str, str], list[int]]


def _fsync_dir(directory: Path) -> None:
    # The rename is durable only once the directory itself is on disk (a power cut on a Pi).
    with contextlib.suppress(OSError):
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def extract_artifact(archive: Path, dest: Path, max_bytes: int) -> None:
    """Extract an uncompressed tar of plain files with plain names; anything else is refused."""
    dest.mkdir(parents=True)
    total = 0
    seen: set[str] = set()
    try:
        with tarfile.open(archive, mode="r:") as tar:
            for count, member in enumerate(tar, start=1):
                name = member.name
                if count > MAX_ARCHIVE_MEMBERS:
                    raise InstallError(InstallStage.EXTRACT, "too many files in the artifact")
                if not member.isfile():
                    raise InstallError(InstallStage.EXTRACT, f"{name!r} is not a plain file")
                if "/" in name or "\\" in name or name.startswith(".") or name in seen:
                    raise InstallError(InstallStage.EXTRACT, f"refused file name {name!r}")
                total += member.size
                if total > max_bytes:
                    raise InstallError(InstallStage.EXTRACT, "files larger than the artifact")
                seen.add(name)
                source = tar.extractfile(member)
                if source is None:
                    raise InstallError(InstallStage.EXTRACT, f"cannot read {name!r}")
                with source, (dest / name).open("wb") as out:
                    shutil.copyfileobj(source, out, DOWNLOAD_CHUNK)
    except tarfile.TarError as exc:
        raise InstallError(InstallStage.EXTRACT, f"not a tar archive: {exc}") from None


def check_model_dir(directory: Path, args: DeployModelArgs) -> None:
    """The manifest names this release, and the files it lists have its sizes and hashes."""
    try:
        manifest = load_manifest(directory)
    except ArtifactError as exc:
        raise InstallError(InstallStage.CHECK, str(exc)) from None
    if manifest.name != args.name or manifest.format != args.format:
        raise InstallError(
            InstallStage.CHECK,
            f"the artifact holds {manifest.name} ({manifest.format}), "
            f"not {args.name} ({args.format})",
        )
    model_path = directory / manifest.file
    tokenizer_path = directory / manifest.tokenizer_file
    for path in (model_path, tokenizer_path):
        if path.parent != directory or not path.is_file():
            raise InstallError(InstallStage.CHECK, f"the manifest's {path.name} is missing")
    if model_path.stat().st_size != manifest.size_bytes:
        raise InstallError(InstallStage.CHECK, "the model file's size disagrees with its manifest")
    if sha256_file(model_path) != manifest.sha256:
        raise InstallError(
            InstallStage.CHECK, "the model file's sha256 disagrees with its manifest"
        )
    if sha256_file(tokenizer_path) != manifest.tokenizer_sha256:
        raise InstallError(InstallStage.CHECK, "the tokenizer's sha256 disagrees with its manifest")


@dataclass
class ModelStore:
    """Installs signed releases under `models_dir`; one install at a time."""

    models_dir: Path
    release_key: Ed25519PublicKey | None
    fetcher: Fetcher = field(default_factory=HttpFetcher)
    smoke: SmokeCheck = smoke_draft
    # Called with a model name after its active version changed (caches of loaded runtimes).
    on_change: Callable[[str], None] | None = None
    # The vocabulary hash of the target this device drafts for (its tokenizer's), or None
    # before it has one: a draft of another vocabulary is refused before it is swapped in.
    vocabulary: Callable[[], str | None] | None = None
    # The last failed install of each model name (refused or rolled back), until one succeeds.
    failures: dict[str, str] = field(default_factory=dict, init=False, repr=False)
    _lock: asyncio.Lock = field(default_factory=asyncio.Lock, init=False, repr=False)
    _tasks: set[asyncio.Task[None]] = field(default_factory=set, init=False, repr=False)

    @classmethod
    def from_settings(cls, settings: AgentSettings) -> ModelStore:
        key = None
        if settings.release_key_file is not None:
            key = load_public_key(settings.release_key_file.read_bytes())
        fetcher = HttpFetcher(settings.http_proxy)
        return cls(settings.resolved_models_dir, key, fetcher)

    # --- reading ---------------------------------------------------------------------------

    def _link(self, name: str) -> Path:
        return self.models_dir / name

    def _versions(self, name: str) -> Path:
        return self.models_dir / VERSIONS_DIR / name

    def _record_path(self, name: str) -> Path:
        return self.models_dir / VERSIONS_DIR / f"{name}{RECORD_SUFFIX}"

    def release_record(self, name: str) -> ReleaseRecord:
        """The signed versions of `name` seen here; (0, 0) before the first signed install."""
        path = self._record_path(name)
        if not path.is_file():
            return ReleaseRecord(0, 0)
        document = json.loads(path.read_text())
        return ReleaseRecord(int(document["highest"]), int(document["active"]))

    def _write_record(self, name: str, record: ReleaseRecord) -> None:
        path = self._record_path(name)
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text(json.dumps({"highest": record.highest, "active": record.active}))
        os.replace(tmp, path)
        _fsync_dir(path.parent)

    def _check_version(self, args: DeployModelArgs) -> None:
        """Newer than every version installed here, or a signed rollback from the active one."""
        record = self.release_record(args.name)
        if args.rollback_from is None:
            if args.version <= record.highest:
                raise InstallError(
                    InstallStage.VERSION,
                    f"release {args.version} of {args.name} is not newer than release "
                    f"{record.highest}, installed before; going back needs a signed rollback",
                )
        elif args.rollback_from != record.active:
            raise InstallError(
                InstallStage.VERSION,
                f"a rollback from release {args.rollback_from} of {args.name}, "
                f"but release {record.active or 'none'} is active here",
            )

    def active(self, name: str) -> str | None:
        """The artifact sha256 serving `name`; "local" for a model put there by hand; else None."""
        link = self._link(name)
        if link.is_symlink():
            return Path(os.readlink(link)).name
        return "local" if (link / MANIFEST_FILE).is_file() else None

    def installed(self) -> dict[str, str]:
        """Model name -> active version, for every model with a manifest."""
        if not self.models_dir.is_dir():
            return {}
        found = {}
        for entry in sorted(self.models_dir.iterdir()):
            if not entry.name.startswith(".") and (entry / MANIFEST_FILE).is_file():
                version = self.active(entry.name)
                if version is not None:
                    found[entry.name] = version
        return found

    # --- installing --------------------------------------------------------------------------

    def _point(self, name: str, version_dir: Path | None) -> None:
        """Make `name` serve `version_dir` (None removes it) with one atomic rename."""
        link = self._link(name)
        if version_dir is None:
            with contextlib.suppress(FileNotFoundError):
                link.unlink()
        else:
            swap = self.models_dir / f".{name}.swap"
            with contextlib.suppress(FileNotFoundError):
                swap.unlink()
            os.symlink(version_dir.relative_to(self.models_dir), swap)
            os.replace(swap, link)
        _fsync_dir(self.models_dir)
        if self.on_change is not None:
            self.on_change(name)

    def _adopt_local(self, name: str) -> None:
        """A model directory placed by hand becomes version "local", so it can be rolled back to."""
        link = self._link(name)
        if link.is_dir() and not link.is_symlink():
            versions = self._versions(name)
            versions.mkdir(parents=True, exist_ok=True)
            target = versions / "local"
            if target.exists():
                shutil.rmtree(target)
            link.rename(target)
            self._point(name, target)

    def _prune(self, name: str, keep: set[str]) -> None:
        versions = self._versions(name)
        for entry in sorted(versions.iterdir()) if versions.is_dir() else []:
            if entry.name not in keep:
                shutil.rmtree(entry, ignore_errors=True)

    def install(self, args: DeployModelArgs) -> InstallOutcome:
        """Blocking; callers on the event loop use `deploy`."""
        started = time.monotonic()
        name, sha = args.name, args.sha256
        previous = self.active(name)

        def outcome(state: OutcomeState, **kwargs: Any) -> InstallOutcome:
            if state in ("refused", "rolled_back"):
                self.failures[name] = str(kwargs.get("error", state))
            else:
                self.failures.pop(name, None)
            return InstallOutcome(
                name=name,
                sha256=sha,
                state=state,
                active_sha256=self.active(name),
                previous_sha256=previous,
                seconds=time.monotonic() - started,
                **kwargs,
            )

        if previous == sha:
            return outcome("already_installed")
        staging = self.models_dir / STAGING_DIR / secrets.token_hex(8)
        try:
            try:
                self._verify_and_unpack(args, staging)
            except InstallError as exc:
                log.warning("refused %s %s: %s", name, sha[:12], exc)
                return outcome("refused", stage=exc.stage, error=str(exc))
            except OSError as exc:  # the disk filled up while extracting; nothing was swapped
                error = f"storage: {exc}"
                log.warning("refused %s %s: %s", name, sha[:12], error)
                return outcome("refused", error=error[:1000])
            self._adopt_local(name)
            previous_dir = self._versions(name) / previous if previous else None
            version_dir = self._versions(name) / sha
            if version_dir.exists():  # a half-finished earlier attempt
                shutil.rmtree(version_dir)
            version_dir.parent.mkdir(parents=True, exist_ok=True)
            (staging / "model").rename(version_dir)
            self._point(name, version_dir)
            try:
                tokens = self.smoke(self.models_dir, name, args.format)
            except Exception as exc:  # any failure of the new model means: put the old one back
                self._point(name, previous_dir)
                shutil.rmtree(version_dir, ignore_errors=True)
                error = f"{InstallStage.SMOKE.value}: {type(exc).__name__}: {exc}"
                log.warning("rolled %s back to %s: %s", name, previous, error)
                return outcome("rolled_back", stage=InstallStage.SMOKE, error=error[:1000])
            record = self.release_record(name)
            self._write_record(name, ReleaseRecord(max(record.highest, args.version), args.version))
            self._prune(name, {sha, *([previous] if previous else [])})
            log.info("installed %s %s (was %s)", name, sha[:12], previous)
            return outcome("installed", smoke_tokens=tuple(tokens))
        finally:
            shutil.rmtree(staging, ignore_errors=True)

    def _verify_and_unpack(self, args: DeployModelArgs, staging: Path) -> None:
        if self.release_key is None:
            raise InstallError(InstallStage.SIGNATURE, "no release key configured on this device")
        try:
            verify_release(self.release_key, args.release, args.signature)
        except ReleaseError as exc:
            raise InstallError(InstallStage.SIGNATURE, str(exc)) from None
        self._check_version(args)
        staging.mkdir(parents=True)
        free = shutil.disk_usage(staging).free
        needed = 2 * args.size_bytes  # the archive and its extraction, side by side
        if free < needed:
            raise InstallError(
                InstallStage.DOWNLOAD,
                f"no space: {free / 1e6:.0f} MB free, the release needs {needed / 1e6:.0f} MB",
            )
        archive = staging / "artifact.tar"
        self.fetcher.fetch(args.url, archive, args.size_bytes, args.download_token)
        size = archive.stat().st_size
        if size != args.size_bytes:
            raise InstallError(
                InstallStage.CHECK, f"got {size} bytes, the release says {args.size_bytes}"
            )
        digest = hashlib.sha256()
        with archive.open("rb") as stream:
            while chunk := stream.read(DOWNLOAD_CHUNK):
                digest.update(chunk)
        if digest.hexdigest() != args.sha256:
            raise InstallError(InstallStage.CHECK, "sha256 mismatch: the artifact was altered")
        extract_artifact(archive, staging / "model", args.size_bytes)
        archive.unlink()
        check_model_dir(staging / "model", args)
        self._check_vocabulary(staging / "model")

    def _check_vocabulary(self, directory: Path) -> None:
        """A draft must share the vocabulary of the target this device drafts for."""
        expected = self.vocabulary() if self.vocabulary is not None else None
        manifest = with_vocab(directory, load_manifest(directory))  # check_model_dir read it
        if expected is None or manifest.role != "draft":
            return
        try:
            check_same_vocabulary(manifest, expected, "this device's target")
        except ArtifactError as exc:
            raise InstallError(InstallStage.CHECK, str(exc)) from None

    async def deploy(self, args: DeployModelArgs) -> InstallOutcome:
        async with self._lock:
            return await asyncio.to_thread(self.install, args)

    # --- the bus command ---------------------------------------------------------------------

    async def answer_deploy(self, client: BusClient, command: m.Command, device_id: str) -> None:
        """Install and acknowledge; a lost acknowledgement is harmless, re-sending is idempotent."""
        try:
            args = DeployModelArgs.from_args(command.args)
        except ReleaseError as exc:
            ack = m.CommandAck(
                command_id=command.command_id,
                device_id=device_id,
                ok=False,
                error=str(exc)[:1000],
                result={"state": "refused", "rolled_back": True},
                at=time.time(),
            )
        else:
            outcome = await self.deploy(args)
            ack = m.CommandAck(
                command_id=command.command_id,
                device_id=device_id,
                ok=outcome.ok,
                error=outcome.error[:1000],
                result=outcome.result(),
                at=time.time(),
            )
        try:
            await client.publish(device_topic(device_id, DeviceChannel.ACK), m.encode(ack))
        except Exception as exc:  # the link dropped; the coordinator will ask again
            log.warning("could not acknowledge %s: %s", command.command_id, exc)

    def start_deploy(self, client: BusClient, command: m.Command, device_id: str) -> None:
        """Run `answer_deploy` beside the receive loop, which must keep serving other commands."""
        task = asyncio.create_task(
            self.answer_deploy(client, command, device_id), name=f"deploy-{command.command_id}"
        )
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
