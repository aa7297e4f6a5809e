"""The agent's model store against real signed artifacts of a real draft, over real HTTP."""

from __future__ import annotations

import http.server
import io
import shutil
import tarfile
import threading
from pathlib import Path
from typing import ClassVar

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from deploy_support import FileServer, broken_release, copy_release

from broker.model_release import DeployModelArgs, ModelRelease, load_public_key, sign_release
from coordinator.ops.releases import (
    artifacts_dir,
    release_public_key_pem,
    rollback_release,
    store_release,
)
from device_agent.models_store import (
    VERSIONS_DIR,
    HttpFetcher,
    InstallStage,
    ModelStore,
    ReleaseRecord,
    smoke_draft,
)
from device_agent.settings import load_agent_settings
from inference.drafts import find_draft


@pytest.fixture
def coordinator_home(tmp_path: Path) -> Path:
    return tmp_path / "coordinator"


@pytest.fixture
def store(tmp_path: Path, coordinator_home: Path) -> ModelStore:
    key = load_public_key(release_public_key_pem(coordinator_home))
    return ModelStore(tmp_path / "device" / "models", key, HttpFetcher())


def release_args(
    home: Path, model_dir: Path, server: FileServer, www: Path, *, deployment_id: int = 1
) -> DeployModelArgs:
    stored = store_release(home, model_dir)
    shutil.copy(stored.path, www / stored.path.name)
    return DeployModelArgs(
        deployment_id=deployment_id,
        **stored.release.model_dump(),
        url=server.url(stored.path.name),
        signature=stored.signature,
    )


def test_install_upgrade_and_idempotent_redeploy(
    store: ModelStore,
    coordinator_home: Path,
    draft_dir: Path,
    tmp_path: Path,
    file_server: tuple[FileServer, Path],
) -> None:
    server, www = file_server
    first = release_args(coordinator_home, draft_dir, server, www)
    outcome = store.install(first)
    assert outcome.state == "installed", outcome.error
    assert store.active(first.name) == first.sha256
    assert len(outcome.smoke_tokens) > 0
    # The drafting loop's loader finds it where it always looks.
    assert find_draft(store.models_dir, first.name, "onnx").manifest.name == first.name

    assert store.install(first).state == "already_installed"

    second_dir = copy_release(draft_dir, tmp_path / "v2" / draft_dir.name, note="v2")
    second = release_args(coordinator_home, second_dir, server, www, deployment_id=2)
    assert second.sha256 != first.sha256
    outcome = store.install(second)
    assert outcome.state == "installed", outcome.error
    assert outcome.previous_sha256 == first.sha256
    assert store.active(second.name) == second.sha256
    kept = sorted(p.name for p in (store.models_dir / VERSIONS_DIR / second.name).iterdir())
    assert kept == sorted([first.sha256, second.sha256])
    assert store.installed() == {second.name: second.sha256}


def test_a_model_that_fails_its_smoke_draft_is_rolled_back(
    store: ModelStore,
    coordinator_home: Path,
    draft_dir: Path,
    tmp_path: Path,
    file_server: tuple[FileServer, Path],
) -> None:
    server, www = file_server
    good = release_args(coordinator_home, draft_dir, server, www)
    assert store.install(good).state == "installed"
    bad_dir = broken_release(draft_dir, tmp_path / "bad" / draft_dir.name)
    bad = release_args(coordinator_home, bad_dir, server, www, deployment_id=2)

    outcome = store.install(bad)

    assert outcome.state == "rolled_back"
    assert outcome.stage is InstallStage.SMOKE
    assert outcome.active_sha256 == good.sha256 == store.active(good.name)
    assert not (store.models_dir / VERSIONS_DIR / good.name / bad.sha256).exists()
    # The old model keeps serving: it loads and drafts as before.
    assert smoke_draft(store.models_dir, good.name, "onnx")


def test_a_new_model_that_fails_its_smoke_draft_is_removed(
    store: ModelStore,
    coordinator_home: Path,
    draft_dir: Path,
    tmp_path: Path,
    file_server: tuple[FileServer, Path],
) -> None:
    server, www = file_server
    bad_dir = broken_release(draft_dir, tmp_path / "bad" / draft_dir.name)
    outcome = store.install(release_args(coordinator_home, bad_dir, server, www))
    assert outcome.state == "rolled_back"
    assert outcome.active_sha256 is None
    assert store.installed() == {}


def _tamper_flip(data: bytes) -> bytes:
    middle = len(data) // 2
    return data[:middle] + bytes([data[middle] ^ 0xFF]) + data[middle + 1 :]


@pytest.mark.parametrize(
    ("alter", "stage", "message"),
    [
        (_tamper_flip, InstallStage.CHECK, "sha256 mismatch"),
        (lambda data: data[: len(data) // 2], InstallStage.CHECK, "the release says"),
        (lambda data: data + b"\0" * 512, InstallStage.DOWNLOAD, "more than the signed"),
    ],
    ids=["tampered", "truncated", "padded"],
)
def test_an_altered_artifact_is_refused_and_the_old_model_keeps_serving(
    store: ModelStore,
    coordinator_home: Path,
    draft_dir: Path,
    tmp_path: Path,
    file_server: tuple[FileServer, Path],
    alter: object,
    stage: InstallStage,
    message: str,
) -> None:
    server, www = file_server
    good = release_args(coordinator_home, draft_dir, server, www)
    assert store.install(good).state == "installed"
    new_dir = copy_release(draft_dir, tmp_path / "v2" / draft_dir.name, note="v2")
    new = release_args(coordinator_home, new_dir, server, www, deployment_id=2)
    served = www / f"{new.sha256}.tar"
    served.write_bytes(alter(served.read_bytes()))  # type: ignore[operator]

    outcome = store.install(new)

    assert outcome.state == "refused"
    assert outcome.stage is stage
    assert message in outcome.error
    assert store.active(good.name) == good.sha256
    assert smoke_draft(store.models_dir, good.name, "onnx")
    assert not any((store.models_dir / ".staging").iterdir())


def test_signature_from_another_key_is_refused_before_any_download(
    store: ModelStore,
    coordinator_home: Path,
    draft_dir: Path,
    file_server: tuple[FileServer, Path],
) -> None:
    server, www = file_server
    genuine = release_args(coordinator_home, draft_dir, server, www)
    forged = genuine.model_copy(
        update={"signature": sign_release(Ed25519PrivateKey.generate(), genuine.release)}
    )
    (www / f"{genuine.sha256}.tar").unlink()  # a download would fail with HTTP 404 instead
    outcome = store.install(forged)
    assert outcome.state == "refused"
    assert outcome.stage is InstallStage.SIGNATURE


def test_a_signed_artifact_cannot_be_installed_under_another_name(
    store: ModelStore,
    coordinator_home: Path,
    draft_dir: Path,
    file_server: tuple[FileServer, Path],
) -> None:
    server, www = file_server
    genuine = release_args(coordinator_home, draft_dir, server, www)
    renamed = ModelRelease(**{**genuine.release.model_dump(), "name": "draft-other"})
    # Even with the coordinator's own signature over the new name, the content says otherwise.
    from coordinator.ops.releases import load_or_create_release_key

    signature = sign_release(load_or_create_release_key(coordinator_home), renamed)
    args = genuine.model_copy(update={"name": "draft-other", "signature": signature})
    outcome = store.install(args)
    assert outcome.state == "refused"
    assert outcome.stage is InstallStage.CHECK
    assert "holds" in outcome.error
    assert store.installed() == {}


def _tar(members: dict[str, bytes], *, link: str | None = None) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        for name, payload in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(payload)
            tar.addfile(info, io.BytesIO(payload))
        if link is not None:
            info = tarfile.TarInfo("manifest.json")
            info.type = tarfile.SYMTYPE
            info.linkname = link
            tar.addfile(info)
    return buffer.getvalue()


@pytest.mark.parametrize(
    ("archive", "reason"),
    [
        (_tar({"../escape": b"x"}), "refused file name"),
        (_tar({"sub/manifest.json": b"{}"}), "refused file name"),
        (_tar({}, link="/etc/passwd"), "not a plain file"),
        (b"definitely not a tar archive" * 40, "not a tar archive"),
    ],
    ids=["dotdot", "subdir", "symlink", "garbage"],
)
def test_signed_archives_with_unsafe_members_are_refused(
    store: ModelStore,
    coordinator_home: Path,
    file_server: tuple[FileServer, Path],
    archive: bytes,
    reason: str,
) -> None:
    import hashlib

    from coordinator.ops.releases import load_or_create_release_key

    server, www = file_server
    sha = hashlib.sha256(archive).hexdigest()
    (www / "evil.tar").write_bytes(archive)
    release = ModelRelease(
        name="draft-evil", format="onnx", sha256=sha, size_bytes=len(archive), version=1
    )
    args = DeployModelArgs(
        deployment_id=1,
        **release.model_dump(),
        url=server.url("evil.tar"),
        signature=sign_release(load_or_create_release_key(coordinator_home), release),
    )
    outcome = store.install(args)
    assert outcome.state == "refused"
    assert reason in outcome.error
    assert not (store.models_dir.parent / "escape").exists()
    assert store.installed() == {}


def test_a_device_without_a_release_key_refuses_every_release(
    tmp_path: Path,
    coordinator_home: Path,
    draft_dir: Path,
    file_server: tuple[FileServer, Path],
) -> None:
    server, www = file_server
    args = release_args(coordinator_home, draft_dir, server, www)
    outcome = ModelStore(tmp_path / "models", None).install(args)
    assert outcome.state == "refused"
    assert "no release key" in outcome.error


def test_release_store_is_content_addressed_and_deterministic(
    coordinator_home: Path, draft_dir: Path, tmp_path: Path
) -> None:
    first = store_release(coordinator_home, draft_dir)
    again = store_release(coordinator_home, shutil.copytree(draft_dir, tmp_path / "copy"))
    assert first.release == again.release
    assert first.path == again.path
    assert sorted(p.name for p in artifacts_dir(coordinator_home).iterdir()) == [first.path.name]


def test_an_older_release_is_refused_unless_signed_as_a_rollback(
    store: ModelStore,
    coordinator_home: Path,
    draft_dir: Path,
    tmp_path: Path,
    file_server: tuple[FileServer, Path],
) -> None:
    server, www = file_server
    first = release_args(coordinator_home, draft_dir, server, www)
    second_dir = copy_release(draft_dir, tmp_path / "v2" / draft_dir.name, note="v2")
    second = release_args(coordinator_home, second_dir, server, www, deployment_id=2)
    assert (first.version, second.version) == (1, 2)
    assert store.install(first).state == "installed"
    assert store.install(second).state == "installed"

    # The genuine, signed release 1 again (a replayed command): refused before any download.
    (www / f"{first.sha256}.tar").rename(www / "hidden.tar")
    replayed = store.install(first.model_copy(update={"deployment_id": 3}))
    assert replayed.state == "refused"
    assert replayed.stage is InstallStage.VERSION
    assert "signed rollback" in replayed.error
    assert store.active(first.name) == second.sha256
    (www / "hidden.tar").rename(www / f"{first.sha256}.tar")

    # Unsigned claims of a rollback do not verify.
    claimed = first.model_copy(update={"rollback_from": 2})
    assert store.install(claimed).stage is InstallStage.SIGNATURE

    # The coordinator's signed rollback from 2 to 1 is taken.
    back = rollback_release(coordinator_home, first.name, 1)
    assert (back.release.version, back.release.rollback_from) == (1, 2)
    rollback = first.model_copy(
        update={"deployment_id": 4, "rollback_from": 2, "signature": back.signature}
    )
    outcome = store.install(rollback)
    assert outcome.state == "installed", outcome.error
    assert store.active(first.name) == first.sha256
    assert store.release_record(first.name) == ReleaseRecord(highest=2, active=1)

    # The rolled-back release 2 cannot come back by replay, nor the rollback once 3 is out.
    assert store.install(second).stage is InstallStage.VERSION
    third_dir = copy_release(draft_dir, tmp_path / "v3" / draft_dir.name, note="v3")
    third = release_args(coordinator_home, third_dir, server, www, deployment_id=5)
    assert third.version == 3
    assert store.install(third).state == "installed"
    stale = store.install(rollback)
    assert stale.stage is InstallStage.VERSION
    assert "release 3 is active" in stale.error
    assert store.active(first.name) == third.sha256


class _HeaderRecorder(http.server.BaseHTTPRequestHandler):
    seen: ClassVar[list[str | None]] = []

    def do_GET(self) -> None:
        type(self).seen.append(self.headers.get("Authorization"))
        self.send_error(404)

    def log_message(self, format: str, *args: object) -> None:
        pass


def test_the_agent_downloads_with_the_token_and_never_sends_its_credential(
    tmp_path: Path, coordinator_home: Path, draft_dir: Path
) -> None:
    settings = load_agent_settings(
        device_id="pi-1",
        credential="the-bus-credential",
        home=tmp_path / "agent",
        release_key_file=_write(tmp_path / "key.pem", release_public_key_pem(coordinator_home)),
    )
    stored = store_release(coordinator_home, draft_dir)
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _HeaderRecorder)
    # The stdlib server blocks in serve_forever; a thread keeps it beside the test.
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        args = DeployModelArgs(
            deployment_id=1,
            **stored.release.model_dump(),
            url=f"http://127.0.0.1:{server.server_address[1]}/a.tar",
            signature=stored.signature,
            download_token="grant-for-this-artifact",
        )
        outcome = ModelStore.from_settings(settings).install(args)
    finally:
        server.shutdown()
        server.server_close()
    assert outcome.stage is InstallStage.DOWNLOAD  # the recorder answers 404
    assert _HeaderRecorder.seen == ["Bearer grant-for-this-artifact"]


def _write(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


def test_a_draft_of_another_vocabulary_is_refused_at_install(
    store: ModelStore,
    coordinator_home: Path,
    draft_dir: Path,
    file_server: tuple[FileServer, Path],
) -> None:
    """A device that drafts for another target (its tokenizer's vocabulary hash) refuses the
    release before the swap; one that drafts for this draft's target installs it."""
    from inference.artifacts import load_manifest, with_vocab

    server, www = file_server
    release = release_args(coordinator_home, draft_dir, server, www)
    store.vocabulary = lambda: "f" * 64
    outcome = store.install(release)
    assert outcome.state == "refused" and outcome.stage is InstallStage.CHECK
    assert "another vocabulary" in outcome.error and "ffffffffffff" in outcome.error
    assert store.active(release.name) is None
    store.vocabulary = lambda: with_vocab(draft_dir, load_manifest(draft_dir)).vocab_sha256
    assert store.install(release).state == "installed"
