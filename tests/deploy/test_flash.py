"""`specfleet flash` into a real sshd on loopback (Debian's openssh-server), then upgrades.

The test starts its own sshd on a free port with a throwaway host key and user key; the "device"
is this machine's root account, its install root a temporary directory. systemd is not running
here, so the agent runs under `--no-systemd` (bin/agentctl, nohup).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from deploy_support import Lab, agent_running, flash, isolated, releases

from broker.mosquitto import free_port, wait_for_port

SSHD = Path("/usr/sbin/sshd")

pytestmark = pytest.mark.skipif(
    not SSHD.exists(), reason="no sshd: run scripts/install-flash-test-deps.sh"
)


@dataclass(frozen=True)
class Sshd:
    port: int
    identity: Path
    known_hosts: Path

    def args(self) -> list[str]:
        return [
            "--ssh", "root@127.0.0.1", "--port", str(self.port),
            "--identity", str(self.identity),
            "--ssh-option", f"UserKnownHostsFile={self.known_hosts}",
            "--ssh-option", "StrictHostKeyChecking=yes",
        ]  # fmt: skip


@pytest.fixture
def sshd(tmp_path: Path) -> Iterator[Sshd]:
    directory = tmp_path / "sshd"
    directory.mkdir(mode=0o700)
    for name in ("host_key", "user_key"):
        subprocess.run(
            ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(directory / name)],
            check=True,
        )
    shutil.copy(directory / "user_key.pub", directory / "authorized_keys")
    port = free_port()
    host_key = (directory / "host_key.pub").read_text().split()[:2]
    known_hosts = directory / "known_hosts"
    known_hosts.write_text(f"[127.0.0.1]:{port} {' '.join(host_key)}\n")
    config = directory / "sshd_config"
    config.write_text(
        "\n".join(
            [
                f"Port {port}",
                "ListenAddress 127.0.0.1",
                f"HostKey {directory / 'host_key'}",
                f"AuthorizedKeysFile {directory / 'authorized_keys'}",
                f"PidFile {directory / 'sshd.pid'}",
                "PermitRootLogin prohibit-password",
                "PasswordAuthentication no",
                "KbdInteractiveAuthentication no",
                "UsePAM no",
                # The keys live in a pytest temporary directory, not in a home with sshd's modes.
                "StrictModes no",
            ]
        )
        + "\n"
    )
    os.makedirs("/run/sshd", exist_ok=True)  # sshd's privilege separation directory
    log = (directory / "sshd.log").open("wb")
    process = subprocess.Popen([str(SSHD), "-D", "-e", "-f", str(config)], stdout=log, stderr=log)
    try:
        wait_for_port("127.0.0.1", port)
        yield Sshd(port, directory / "user_key", known_hosts)
    finally:
        process.terminate()
        process.wait(10)
        log.close()


def ssh_args(sshd: Sshd, root: Path, bundle: Path) -> list[str]:
    return [*sshd.args(), "--no-systemd", "--root", str(root), "--bundle", str(bundle)]


def test_flash_over_ssh_brings_the_agent_online_with_its_own_credential(
    lab: Lab, sshd: Sshd, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bundle = lab.provision("pi-ssh")
    credential = (bundle / "credential").read_text().strip()
    root = tmp_path / "device" / "specfleet-agent"
    lab.roots.append(root)

    # The wheelhouse is built here, from this checkout, for the platform the probe found.
    assert flash("pi-ssh", *ssh_args(sshd, root, bundle)) == 0, capsys.readouterr()
    out = capsys.readouterr().out
    assert "first install" in out and "pi-ssh: online" in out
    assert agent_running(root)
    # Online with its own credential, and kept off another device's topics.
    assert isolated(lab, "pi-ssh", credential)
    config = (root / "current" / "agent.toml").read_text()
    assert f'home = "{root}/state"' in config
    assert lab.registry.get("pi-ssh").credential_hash != credential


def test_a_failed_first_install_leaves_nothing_on_the_device(
    lab: Lab,
    sshd: Sshd,
    agent_wheelhouse: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    bundle = lab.provision("pi-fail")
    root = tmp_path / "device" / "specfleet-agent"
    broken = without_numpy(agent_wheelhouse, tmp_path / "broken")
    assert flash("pi-fail", *ssh_args(sshd, root, bundle), "--wheelhouse", str(broken)) == 1
    err = capsys.readouterr().err
    assert "step 'install' failed" in err and "nothing of this flash is left" in err
    assert not (root / "current").exists()
    assert releases(root) == []


def without_numpy(wheelhouse: Path, dest: Path) -> Path:
    """A wheelhouse that misses a dependency: pip fails to install from it."""
    shutil.copytree(wheelhouse, dest)
    for wheel in dest.glob("numpy-*.whl"):
        wheel.unlink()
    return dest


@pytest.mark.slow
def test_upgrade_in_place_keeps_identity_and_failed_upgrades_leave_the_device_as_it_was(
    lab: Lab,
    sshd: Sshd,
    agent_wheelhouse: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    bundle = lab.provision("pi-up")
    credential = (bundle / "credential").read_text().strip()
    root = tmp_path / "device" / "specfleet-agent"
    lab.roots.append(root)
    common = [*ssh_args(sshd, root, bundle), "--wheelhouse", str(agent_wheelhouse)]
    assert flash("pi-up", *common) == 0
    first = os.readlink(root / "current")

    # Upgrade in place: a new release, the same identity and state. The operator no longer
    # keeps the credential: the device's own is carried over.
    (root / "state" / "kept.txt").write_text("state survives upgrades")
    (bundle / "credential").unlink()
    capsys.readouterr()
    assert flash("pi-up", *common) == 0
    assert "upgrading" in capsys.readouterr().out
    second = os.readlink(root / "current")
    assert second != first
    assert releases(root) == sorted([Path(first).name, Path(second).name])
    assert (root / "state" / "kept.txt").exists()
    assert (root / "current" / "bundle" / "credential").read_text().strip() == credential
    assert lab.registry.verify_credential("pi-up", credential)
    assert isolated(lab, "pi-up", credential)

    # A failed install: nothing changes, the running agent keeps running.
    broken = without_numpy(agent_wheelhouse, tmp_path / "broken")
    failing = [*ssh_args(sshd, root, bundle), "--wheelhouse", str(broken)]
    assert flash("pi-up", *failing) == 1
    err = capsys.readouterr().err
    assert "step 'install' failed" in err
    assert os.readlink(root / "current") == second
    assert releases(root) == sorted([Path(first).name, Path(second).name])
    assert agent_running(root)

    # A release that never comes online (a broker it cannot reach) is swapped back out.
    dead = f"mqtt://127.0.0.1:{free_port()}"
    code = flash("pi-up", *common, "--device-broker-url", dead, "--online-timeout", "8")
    assert code == 1
    err = capsys.readouterr().err
    assert "step 'service' failed" in err and "back on its previous release" in err
    assert os.readlink(root / "current") == second
    assert releases(root) == sorted([Path(first).name, Path(second).name])
    assert agent_running(root)
    assert isolated(lab, "pi-up", credential)


def test_dry_run_prints_every_step_and_touches_nothing(
    lab: Lab, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bundle = lab.provision("pi-dry")
    root = tmp_path / "never"
    port = str(free_port())  # nothing listens: a dry run must not connect
    code = flash(
        "pi-dry", "--ssh", "pi@127.0.0.1", "--port", port, "--root", str(root),
        "--bundle", str(bundle), "--dry-run",
    )  # fmt: skip
    assert code == 0
    out = capsys.readouterr().out
    steps = re.findall(r"^\[\d+\] (\w+):", out, re.M)
    assert steps == [
        "probe", "wheelhouse", "upload", "venv", "install", "check", "swap", "service", "prune",
    ]  # fmt: skip
    assert "systemd" in out and "$ " in out
    assert not root.exists()


def test_flash_refuses_a_device_without_a_bundle(
    lab: Lab, capsys: pytest.CaptureFixture[str]
) -> None:
    assert flash("nobody", "--target-dir", "/nonexistent") == 2
    assert "devices provision nobody" in capsys.readouterr().out
