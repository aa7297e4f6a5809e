"""`specfleet models deploy`: roll a draft model out to devices in waves, over the bus."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from core.errors import CommandError

if TYPE_CHECKING:
    from broker.model_release import DeployModelArgs, ModelRelease
    from coordinator.ops.rollout import Deployments, DeviceOutcome, RolloutSummary
    from core.settings import Settings

PREFLIGHT_TIMEOUT_S = 5.0
# A device's download token outlives its whole attempt by this much (clock skew, a slow start).
DOWNLOAD_TOKEN_SLACK_S = 60.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from coordinator.ops.rollout import (
        DEFAULT_ABORT_AT_PERCENT,
        DEFAULT_DEVICE_TIMEOUT_S,
        DEFAULT_WAVE_PERCENT,
    )

    parser.add_argument("model", metavar="MODEL", help="a model name in the models directory")
    parser.add_argument(
        "--to",
        nargs="+",
        required=True,
        metavar="TAG|DEVICE",
        help="device ids or tags (a name that is not a device is a tag)",
    )
    parser.add_argument(
        "--wave",
        type=float,
        default=DEFAULT_WAVE_PERCENT,
        metavar="N",
        help=f"each wave's share of the devices, in percent (default {DEFAULT_WAVE_PERCENT:g})",
    )
    parser.add_argument(
        "--abort-at",
        type=float,
        default=DEFAULT_ABORT_AT_PERCENT,
        metavar="F",
        help="stop before the next wave once this percentage of the devices tried so far failed "
        f"(default {DEFAULT_ABORT_AT_PERCENT:g})",
    )
    parser.add_argument(
        "--rollback-to",
        type=int,
        metavar="VERSION",
        help="send the stored release VERSION of MODEL back out, signed as a rollback from the "
        "current release (devices refuse an older release otherwise)",
    )
    parser.add_argument("--models-dir", type=Path, help="models directory (default: settings)")
    parser.add_argument(
        "--artifact-url",
        metavar="URL",
        help="the API base devices download from, e.g. https://fleet.example/api/v1 "
        "(default: http://<http_host>:<http_port>/api/v1 from the settings)",
    )
    parser.add_argument("--broker-url", help="the broker (default: the settings' broker_url)")
    parser.add_argument(
        "--device-timeout",
        type=float,
        default=DEFAULT_DEVICE_TIMEOUT_S,
        metavar="S",
        help=f"how long one device may take (default {DEFAULT_DEVICE_TIMEOUT_S:g}s)",
    )
    parser.add_argument("--json", action="store_true", help="print the summary as JSON")
    parser.add_argument(
        "--database-url",
        metavar="URL",
        help="sqlite:///PATH or postgresql://... (default: the settings' database_url)",
    )


def _settings(args: argparse.Namespace) -> Settings:
    from pydantic import ValidationError

    from core.settings import Settings

    try:
        settings = Settings()
    except ValidationError as exc:
        raise CommandError(f"invalid settings: {exc.errors()[0]['msg']}") from exc
    updates: dict[str, object] = {}
    if args.database_url:
        updates["database_url"] = args.database_url
    if args.broker_url:
        updates["broker_url"] = args.broker_url
    return settings.model_copy(update=updates)


def preflight(url: str) -> None:
    """Fail early when devices could not download: the API must answer (401 without login)."""
    request = urllib.request.Request(url, method="HEAD")
    try:
        with urllib.request.urlopen(request, timeout=PREFLIGHT_TIMEOUT_S):
            return
    except urllib.error.HTTPError as exc:
        if exc.code in (401, 403):
            return
        raise CommandError(f"the coordinator's API answered HTTP {exc.code} for {url}") from None
    except (urllib.error.URLError, OSError) as exc:
        raise CommandError(
            f"the coordinator's API is not reachable at {url} ({exc}); start it "
            "(`specfleet up`) or pass --artifact-url"
        ) from None


def _version(release: ModelRelease) -> str:
    if release.rollback_from is None:
        return f"release {release.version}"
    return f"release {release.version} (rollback from {release.rollback_from})"


def _print_outcome(outcome: DeviceOutcome) -> None:
    print(
        f"wave {outcome.wave}  {outcome.device_id:<24} {outcome.state.value:<12} {outcome.detail}"
    )
    sys.stdout.flush()


def run(args: argparse.Namespace) -> int:
    import sqlalchemy.exc

    from broker.model_release import DeployModelArgs
    from coordinator.db import migrate
    from coordinator.db.engine import NoSuchDatabase, make_engine, make_sessionmaker
    from coordinator.ops.releases import (
        ReleaseStoreError,
        issue_download_token,
        load_or_create_release_key,
        rollback_release,
        store_release,
    )
    from coordinator.ops.rollout import Deployments, RolloutError, plan_waves

    if not 0 < args.abort_at <= 100:
        raise CommandError(f"--abort-at {args.abort_at}: use a percentage in (0, 100]")
    if args.device_timeout <= 0:
        raise CommandError("--device-timeout must be positive")
    settings = _settings(args)
    models_dir: Path = args.models_dir or settings.resolved_models_dir
    model_dir = models_dir / args.model
    if args.rollback_to is None and not model_dir.is_dir():
        raise CommandError(f"no model {args.model!r} in {models_dir}")
    base = args.artifact_url or f"http://{settings.http_host}:{settings.http_port}/api/v1"
    try:
        if args.rollback_to is not None:
            stored = rollback_release(settings.home, args.model, args.rollback_to)
        else:
            stored = store_release(settings.home, model_dir)
    except ReleaseStoreError as exc:
        raise CommandError(str(exc)) from exc
    if stored.manifest.role != "draft":
        raise CommandError(f"{args.model} is a {stored.manifest.role}; only drafts go to devices")
    url = f"{base.rstrip('/')}/artifacts/{stored.release.sha256}"
    preflight(url)

    try:
        engine = make_engine(settings.database_url, create=False)
    except NoSuchDatabase as exc:
        raise CommandError(str(exc)) from exc
    try:
        migrate.require_head(engine)
        deployments = Deployments(make_sessionmaker(engine))
        targets = deployments.resolve_targets(args.to)
        waves = plan_waves(targets, args.wave)
        location = stored.path if args.rollback_to is not None else model_dir
        model_id = deployments.register_model(stored, str(location))
        deployment_id = deployments.create(
            model_id=model_id,
            artifact_sha256=stored.release.sha256,
            targets=args.to,
            waves=waves,
            wave_percent=args.wave,
            abort_at_percent=args.abort_at,
            actor="cli",
        )
        release_args = DeployModelArgs(
            deployment_id=deployment_id,
            **stored.release.model_dump(),
            url=url,
            signature=stored.signature,
        )
        print(
            f"deployment {deployment_id}: {stored.release.name} {_version(stored.release)} "
            f"({stored.release.sha256[:12]}, {stored.release.size_bytes / 1e6:.1f} MB) to "
            f"{len(targets)} device(s) in {len(waves)} wave(s), abort at {args.abort_at:g}%"
        )
        release_key = load_or_create_release_key(settings.home)

        def download_token(device_id: str) -> str:
            ttl_s = args.device_timeout + DOWNLOAD_TOKEN_SLACK_S
            return issue_download_token(release_key, stored.release.sha256, device_id, ttl_s)

        summary = asyncio.run(
            _rollout_over_bus(
                settings, deployments, deployment_id, waves, release_args, args, download_token
            )
        )
    except (RolloutError, migrate.SchemaOutOfDateError) as exc:
        raise CommandError(str(exc)) from exc
    except sqlalchemy.exc.OperationalError as exc:
        raise CommandError(f"database error: {exc.orig}") from exc
    finally:
        engine.dispose()
    _report(summary, as_json=args.json)
    return 0 if summary.state.value == "done" else 1


async def _rollout_over_bus(
    settings: Settings,
    deployments: Deployments,
    deployment_id: int,
    waves: list[list[str]],
    release_args: DeployModelArgs,
    args: argparse.Namespace,
    download_token: Callable[[str], str],
) -> RolloutSummary:
    import secrets

    from broker import messages as m
    from broker.client import BrokerAddress, BusConnectionError, ConnectOptions, connect
    from broker.topics import DeviceChannel, device_subscription
    from coordinator.db.models import DeploymentState
    from coordinator.ops.rollout import AckWaiter, run_rollout
    from core.aio import task_group

    options = ConnectOptions(
        client_id=f"deploy-{secrets.token_hex(6)}",
        username=settings.broker_username,
        password=settings.broker_password,
        protocol=settings.mqtt_protocol,
    )
    try:
        async with connect(BrokerAddress.from_url(settings.broker_url), options) as client:
            await client.subscribe(device_subscription(DeviceChannel.ACK))
            waiter = AckWaiter(client.publish)

            async def receive() -> None:
                async for incoming in client.messages():
                    try:
                        ack = m.decode_as(incoming.payload, m.CommandAck)
                    except m.BusError:
                        continue  # not ours to judge; the coordinator service logs it
                    waiter.on_ack(ack)

            async with task_group() as tasks:
                receiver = tasks.create_task(receive(), name="deploy-acks")
                summary = await run_rollout(
                    deployments,
                    deployment_id,
                    waves,
                    release_args,
                    waiter.send,
                    abort_at_percent=args.abort_at,
                    device_timeout_s=args.device_timeout,
                    on_outcome=_print_outcome,
                    download_token=download_token,
                )
                receiver.cancel()
            return summary
    except BusConnectionError as exc:
        await asyncio.to_thread(
            deployments.finish,
            deployment_id,
            DeploymentState.FAILED,
            {"reason": f"the rollout lost the bus: {exc}"},
        )
        raise CommandError(f"bus: {exc}") from exc


def _report(summary: RolloutSummary, *, as_json: bool) -> None:
    from coordinator.db.models import DeviceDeploymentState

    counts = {state.value: summary.count(state) for state in DeviceDeploymentState}
    if as_json:
        document = {
            "deployment_id": summary.deployment_id,
            "state": summary.state.value,
            "waves": summary.waves,
            "waves_run": summary.waves_run,
            "devices": [
                {
                    "device_id": o.device_id,
                    "wave": o.wave,
                    "state": o.state.value,
                    "detail": o.detail,
                }
                for o in summary.outcomes
            ],
            "counts": counts,
        }
        print(json.dumps(document, indent=2, sort_keys=True))
        return
    nonzero = ", ".join(f"{n} {state}" for state, n in counts.items() if n)
    print(
        f"deployment {summary.deployment_id} {summary.state.value}: "
        f"{summary.waves_run} of {summary.waves} wave(s) run; {nonzero or 'no devices'}"
    )
