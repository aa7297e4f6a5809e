"""The steps of one flash, run in order; a failure before the swap leaves the device as it
was, and one after it swaps the previous release back."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from coordinator.ops.flash.release import (
    KEEP_RELEASES,
    MIN_PYTHON,
    STEP_TIMEOUT_S,
    UNIT_NAME,
    DeviceFacts,
    FlashOptions,
    Step,
    _q,
    parse_probe,
    probe_script,
    release_archive,
    release_stamp,
    service_files,
)
from coordinator.ops.flash.transport import FlashError, run_on_device

if TYPE_CHECKING:
    from core.settings import Settings


class Flash:
    """Plans and runs the steps of one flash; `steps()` is what --dry-run prints."""

    def __init__(
        self, options: FlashOptions, settings: Settings, log: Callable[[str], None] = print
    ) -> None:
        self.options = options
        self.settings = settings
        self.log = log
        self.facts: DeviceFacts | None = None
        self.stamp = release_stamp()
        self.wheels: list[Path] = []
        self.swapped = False
        self.previous: str | None = None

    # --- facts -------------------------------------------------------------------------------

    @property
    def root(self) -> str:
        if self.facts is not None:
            return self.facts.root
        root = self.options.root
        return root if root.startswith("/") else f"~/{root}"

    @property
    def release_dir(self) -> str:
        return f"{self.root}/releases/{self.stamp}"

    def _run(self, script: str, stdin: bytes | None = None) -> str:
        return run_on_device(self.options.transport, script, stdin=stdin, timeout_s=STEP_TIMEOUT_S)

    # --- the steps ---------------------------------------------------------------------------

    def steps(self) -> list[Step]:
        o = self.options
        q = _q
        rel, root = self.release_dir, self.root
        pip = f"{q(rel)}/venv/bin/python {q(rel)}/wheels/pip-*.whl/pip"
        service = (
            "install the systemd unit, enable and restart it"
            if o.systemd
            else "restart the agent with nohup (bin/agentctl; no systemd)"
        )
        steps = [
            Step(
                "probe",
                f"look at the device ({o.transport.description}): Python, CPU, systemd, "
                "an existing install",
                self.probe,
                probe_script(o.python, o.root),
            ),
            Step(
                "wheelhouse",
                "build the specfleet wheel and gather its dependencies for the device's platform"
                if o.wheelhouse is None
                else f"use the wheelhouse {o.wheelhouse}",
                self.wheelhouse,
            ),
            Step(
                "upload",
                f"copy wheels, bundle, config and service files into {rel}",
                self.upload,
                f"mkdir -p {q(rel)} && tar -x -C {q(rel)}",
            ),
            Step(
                "venv",
                f"create a virtual environment with {o.python} (pip runs from its wheel)",
                self.venv,
                f"{q(o.python)} -m venv --without-pip {q(rel)}/venv",
            ),
            Step(
                "install",
                f"install {self._requirement()} from the uploaded wheels only",
                self.install,
                f"{pip} install --no-index --find-links {q(rel)}/wheels '{self._requirement()}'",
            ),
            Step(
                "check",
                "load the agent's config with the new install",
                self.check,
                f"{q(rel)}/venv/bin/python -c 'from device_agent.settings import ...'",
            ),
            Step(
                "swap",
                f"point {root}/current at the new release (one rename)",
                self.swap,
                f"ln -s releases/{self.stamp} {q(root)}/current.new && rename it over current",
            ),
        ]
        if o.start:
            steps.append(Step("service", service, self.service))
            if o.wait_online:
                steps[-1].description += f"; wait up to {o.online_timeout_s:g}s for 'online'"
        steps.append(Step("prune", f"keep the newest {KEEP_RELEASES} releases", self.prune))
        return steps

    def _requirement(self) -> str:
        """What pip installs on the device: the agent's own wheel with its runtime's extra
        (`specfleet-agent[onnx]`), or `specfleet[agent]` from a given wheelhouse that holds the
        whole project's wheel instead."""
        from coordinator.ops.packaging import AGENT_EXTRAS, AGENT_WHEEL_EXTRAS

        runtime = self.options.runtime
        given = self.options.wheelhouse
        if given is not None and not any(given.glob("specfleet_agent-*.whl")):
            return f"specfleet[{AGENT_EXTRAS[runtime]}]"
        return f"specfleet-agent[{AGENT_WHEEL_EXTRAS[runtime]}]"

    def probe(self) -> None:
        platform, facts = parse_probe(
            self._run(probe_script(self.options.python, self.options.root))
        )
        python = tuple(int(x) for x in platform.python.split("."))
        if python < MIN_PYTHON:
            raise RuntimeError(f"Python {platform.python} on the device; the agent needs 3.10+")
        if facts.get("venv") != "yes":
            raise RuntimeError(
                f"{self.options.python} has no venv module (Debian: apt install python3-venv)"
            )
        systemd = facts.get("systemd") == "yes"
        if self.options.systemd and self.options.start and not systemd:
            raise RuntimeError("systemd is not running on the device: use --no-systemd")
        self.facts = DeviceFacts(
            platform=platform,
            home=facts["home"],
            root=facts["root"],
            systemd=systemd,
            uid=int(facts["uid"]),
            current=facts.get("current") or None,
            has_credential=facts.get("credential") == "yes",
        )
        from coordinator.ops.provisioning import CREDENTIAL_FILE

        if not (self.options.bundle / CREDENTIAL_FILE).is_file() and not self.facts.has_credential:
            raise RuntimeError(
                "neither the bundle nor the device holds a credential: "
                f"run `specfleet devices provision {self.options.device_id} --rotate`"
            )
        self.log(
            f"  device: Python {platform.python} on {platform.machine} ({platform.libc} "
            f"{platform.libc_version}), systemd {'yes' if systemd else 'no'}, "
            f"{'upgrading ' + self.facts.current if self.facts.current else 'first install'}"
        )

    def wheelhouse(self) -> None:
        from coordinator.ops import packaging

        if self.options.wheelhouse is not None:
            self.wheels = sorted(self.options.wheelhouse.glob("*.whl"))
            # The agent's own wheel (specfleet_agent-*), or the whole project's (specfleet-*).
            for needed in (("specfleet_agent-", "specfleet-"), ("pip-",)):
                if not any(w.name.startswith(needed) for w in self.wheels):
                    names = " or ".join(f"{n}*.whl" for n in needed)
                    raise RuntimeError(f"no {names} in {self.options.wheelhouse}")
            return
        assert self.facts is not None
        cache = self.options.cache_dir or self.settings.home / "wheelhouse"
        dest = cache / f"{self.facts.platform.tag}-{self.options.runtime}"
        wheel = packaging.build_agent_wheel(cache / "built")
        self.wheels = packaging.build_wheelhouse(
            wheel, self.options.runtime, self.facts.platform, dest
        )
        self.log(f"  {len(self.wheels)} wheels in {dest}")

    def upload(self) -> None:
        assert self.facts is not None
        archive = release_archive(
            self.options,
            release_dir=self.release_dir,
            root=self.root,
            user=self._user(),
            wheels=self.wheels,
        )
        rel = _q(self.release_dir)
        script = [f"set -e; mkdir -p {rel}; chmod 700 {rel}; tar -x -C {rel}"]
        from coordinator.ops.provisioning import CREDENTIAL_FILE

        if not (self.options.bundle / CREDENTIAL_FILE).is_file():
            # Keep the identity the device already has.
            script.append(f"cp -p {_q(self.root)}/current/bundle/{CREDENTIAL_FILE} {rel}/bundle/")
        self._run("; ".join(script), stdin=archive)
        self.log(f"  {len(archive) / 1e6:.1f} MB into {self.release_dir}")

    def _user(self) -> str:
        target = getattr(self.options.transport, "target", "")
        if "@" in target:
            return str(target.split("@", 1)[0])
        import getpass

        return getpass.getuser()

    def venv(self) -> None:
        self._run(f"{_q(self.options.python)} -m venv --without-pip {_q(self.release_dir)}/venv")

    def install(self) -> None:
        rel = _q(self.release_dir)
        # Byte-compiling every library at install costs more than compiling what is imported.
        self._run(
            f'set -e; pip=$(ls {rel}/wheels/pip-*.whl | head -n 1); [ -n "$pip" ]; '
            f'{rel}/venv/bin/python "$pip/pip" install --quiet --disable-pip-version-check '
            f"--no-compile --no-index --find-links {rel}/wheels '{self._requirement()}'"
        )

    def check(self) -> None:
        rel = self.release_dir
        code = (
            "import sys; from pathlib import Path; "
            "from device_agent.settings import load_agent_settings; "
            "import device_agent.agent; "
            "s = load_agent_settings(Path(sys.argv[1])); "
            "assert s.device_id == sys.argv[2], s.device_id; "
            "assert s.credential, 'no credential'; print(s.device_id)"
        )
        self._run(
            f"{_q(rel)}/venv/bin/python -c {_q(code)} {_q(rel)}/agent.toml "
            f"{_q(self.options.device_id)}"
        )

    def _point_current(self, release: str | None) -> None:
        root = _q(self.root)
        if release is None:
            self._run(f"rm -f {root}/current")
            return
        swap = "import os, sys; os.replace(sys.argv[1], sys.argv[2])"  # atomic, unlike ln -sf
        self._run(
            f"set -e; rm -f {root}/current.new; ln -s releases/{_q(release)} {root}/current.new; "
            f"{_q(self.options.python)} -c {_q(swap)} {root}/current.new {root}/current"
        )

    def swap(self) -> None:
        assert self.facts is not None
        self.previous = self.facts.current
        self._point_current(self.stamp)
        self.swapped = True

    def _restart_script(self) -> str:
        root = _q(self.root)
        if not self.options.systemd:
            return f"{root}/current/bin/agentctl restart"
        assert self.facts is not None
        sudo = "" if self.facts.uid == 0 else "sudo -n "
        unit = f"/etc/systemd/system/{UNIT_NAME}"
        return (
            f"set -e; {sudo}install -m 0644 {root}/current/{UNIT_NAME} {unit}; "
            f"{sudo}systemctl daemon-reload; {sudo}systemctl enable --quiet {UNIT_NAME}; "
            f"{sudo}systemctl restart {UNIT_NAME}"
        )

    def service(self) -> None:
        if not self.options.wait_online:
            self._run(self._restart_script())
            return
        started = time.monotonic()
        asyncio.run(self._restart_and_wait())
        self.log(f"  online after {time.monotonic() - started:.1f}s")

    async def _restart_and_wait(self) -> None:
        from broker import messages as m
        from broker.client import BrokerAddress, ConnectOptions, connect
        from broker.topics import DeviceChannel, device_topic
        from core.aio import timeout

        options = ConnectOptions(
            client_id=f"flash-{self.options.device_id}-{os.getpid()}"[:64],
            username=self.settings.broker_username,
            password=self.settings.broker_password,
            protocol=self.settings.mqtt_protocol,
        )
        address = BrokerAddress.from_url(self.settings.broker_url)
        async with connect(address, options) as client:
            # Subscribed before the restart: a live (not retained) "online" is the new agent's.
            await client.subscribe(device_topic(self.options.device_id, DeviceChannel.STATUS))
            await asyncio.to_thread(self._run, self._restart_script())
            try:
                async with timeout(self.options.online_timeout_s):
                    async for incoming in client.messages():
                        if incoming.retain:
                            continue
                        try:
                            status = m.decode_as(incoming.payload, m.Status)
                        except m.BusError:
                            continue
                        if status.state is m.DeviceState.ONLINE:
                            return
            except TimeoutError:
                raise RuntimeError(
                    f"the agent did not report online within {self.options.online_timeout_s:g}s"
                    f" (see {self.root}/state/agent.log or journalctl -u {UNIT_NAME})"
                ) from None

    def prune(self) -> None:
        root = _q(self.root)
        self._run(
            f"cd {root}/releases && ls -1 | grep -v '^\\.' | sort -r | tail -n +{KEEP_RELEASES + 1}"
            " | while read -r old; do "
            f'[ "releases/$old" = "$(readlink {root}/current)" ] || rm -rf -- "$old"; done'
        )

    # --- running -----------------------------------------------------------------------------

    def _undo(self) -> str:
        """Put the device back as it was; returns a description of where it is now."""
        rel = _q(self.release_dir)
        try:
            if self.swapped:
                self._point_current(self.previous)
                if self.previous is not None and self.options.start:
                    self._run(self._restart_script())
                elif self.options.start and not self.options.systemd:
                    self._run(f"{rel}/bin/agentctl stop")
                elif self.options.start:
                    sudo = "" if self.facts is None or self.facts.uid == 0 else "sudo -n "
                    self._run(f"{sudo}systemctl disable --now --quiet {UNIT_NAME}")
                self.swapped = False
            self._run(f"rm -rf {rel}")
        except RuntimeError as exc:
            return f"the undo failed too ({exc}); inspect {self.root} on the device"
        if self.previous:
            return f"the device is back on its previous release {self.previous}"
        return "nothing of this flash is left on the device"

    def run(self) -> None:
        for number, step in enumerate(self.steps(), start=1):
            self.log(f"[{number}] {step.name}: {step.description}")
            started = time.monotonic()
            try:
                step.action()
                self.log(f"    done in {time.monotonic() - started:.1f}s")
            except (RuntimeError, OSError, ValueError) as exc:
                restored = (
                    "nothing was changed on the device"
                    if step.name in ("probe", "wheelhouse")
                    else self._undo()
                )
                raise FlashError(step.name, str(exc), restored) from exc
            except Exception as exc:  # packaging and provisioning errors have their own types
                restored = (
                    "nothing was changed on the device" if self.facts is None else self._undo()
                )
                raise FlashError(step.name, f"{type(exc).__name__}: {exc}", restored) from exc

    def dry_run(self) -> None:
        for number, step in enumerate(self.steps(), start=1):
            self.log(f"[{number}] {step.name}: {step.description}")
            if step.script is not None:
                for line in step.script.splitlines():
                    self.log(f"      $ {line}")
        # Rendered now, so that a dry run finds a template missing from the install as a
        # real run would.
        for name, text, _ in service_files(self.root, self._user()):
            self.log(f"    {name}: {len(text.splitlines())} lines, rendered from its template")
