"""`specfleet verifier`: run one verifier worker (the target plus its session caches) on the bus."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import re
import signal
import socket
from pathlib import Path
from typing import TYPE_CHECKING

from broker.secrets import RefuseSecretInArgv
from core.aio import run_service

if TYPE_CHECKING:
    from core.settings import Settings
    from verifier.worker import VerifierWorker

log = logging.getLogger(__name__)

PRECISIONS = ("fp32", "q4")  # modelbuild.target_build.PRECISIONS, without importing the builder
PROVIDERS = ("cpu", "cuda")  # inference.onnx_runtime.PROVIDERS, without importing onnxruntime


def default_verifier_id() -> str:
    """`<host>-<pid>`, cut to what a topic level allows."""
    host = re.sub(r"[^A-Za-z0-9_.-]", "-", socket.gethostname()).strip("-.") or "verifier"
    return f"{host[:50]}-{os.getpid()}"


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _non_negative_float(text: str) -> float:
    value = float(text)
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from verifier import child, core, worker

    parser.add_argument(
        "--id",
        dest="verifier_id",
        default=None,
        help="verifier id, a topic level (default: <host>-<pid>)",
    )
    parser.add_argument("--broker-url", default=None, help="mqtt://host:port (default: settings)")
    parser.add_argument("--username", default=None, help="broker username (default: settings)")
    # No flag takes the password itself: argv shows in `ps` to every user of the machine. The
    # old flag stays only to refuse (else argparse would take it as short for --password-file).
    parser.add_argument(
        "--password",
        action=RefuseSecretInArgv,
        instead="--password-file FILE or SPECFLEET_BROKER_PASSWORD",
    )
    parser.add_argument(
        "--password-file",
        type=Path,
        default=None,
        help="file holding the broker password (default: SPECFLEET_BROKER_PASSWORD)",
    )
    parser.add_argument(
        "--max-batch",
        type=_positive_int,
        default=worker.MAX_BATCH,
        help=f"requests per target pass at most (default: {worker.MAX_BATCH})",
    )
    parser.add_argument(
        "--batch-window-ms",
        type=_non_negative_float,
        default=worker.BATCH_WINDOW_MS,
        help="after a batch's first request, wait at most this long for more, and only while "
        f"another session is due back within it (default: {worker.BATCH_WINDOW_MS})",
    )
    parser.add_argument(
        "--steps-per-call",
        type=_positive_int,
        default=worker.STEPS_PER_CALL,
        help="passes of nothing but plain stream rounds that the inference process runs on by "
        "itself, until other work arrives; 1: every pass goes through the worker (default: "
        f"{worker.STEPS_PER_CALL})",
    )
    parser.add_argument(
        "--heartbeat-s",
        type=float,
        default=worker.HEARTBEAT_S,
        help=f"status heartbeat period (default: {worker.HEARTBEAT_S})",
    )
    parser.add_argument(
        "--max-sessions",
        type=_positive_int,
        default=core.MAX_SESSIONS,
        help=f"KV caches kept, least recent evicted (default: {core.MAX_SESSIONS})",
    )
    parser.add_argument(
        "--max-cache-mb",
        type=_positive_int,
        default=child.MAX_CACHE_MB,
        help=f"memory for KV caches (default: {child.MAX_CACHE_MB})",
    )
    parser.add_argument(
        "--no-cloud-drafts",
        action="store_true",
        help="draft no cloud rounds here (load no drafter): sessions draft on their devices "
        "or run plain",
    )
    parser.add_argument(
        "--threads",
        type=_positive_int,
        default=None,
        help="ONNX Runtime intra-op threads (default: the cores this process may use)",
    )
    parser.add_argument(
        "--precision",
        choices=PRECISIONS,
        default=child.PRECISION,
        help=f"target build to load (default: {child.PRECISION})",
    )
    parser.add_argument(
        "--target",
        default=None,
        help="the built target to load, by name (`specfleet models list`; default: the "
        "settings' target, else SmolLM2 at --precision)",
    )
    parser.add_argument(
        "--provider",
        choices=PROVIDERS,
        default="cpu",
        help="ONNX Runtime execution provider; the pass cost table is timed on it at start "
        "(default: cpu)",
    )
    parser.add_argument(
        "--models-dir", type=Path, default=None, help="models directory (default: from settings)"
    )
    parser.add_argument(
        "--pass-trace",
        type=Path,
        default=None,
        metavar="FILE",
        help="append one JSON line per forward pass to FILE (its rows by session and round, "
        "positions, prefilled rows and positions, ms, and the host's monotonic clock at its "
        "start): where the target's time goes (default: settings' verifier_pass_trace, else "
        "none)",
    )
    parser.add_argument(
        "--database-url",
        default=None,
        metavar="URL",
        help="the fleet's database: with it the verifier takes session leases and answers "
        "their devices' drafts itself (direct rounds: one bus round trip and one commit a "
        "round); without it every round goes through the coordinator",
    )


def _check_pass_trace(path: Path | None) -> None:
    """Refuse, before any process starts, a pass trace that cannot be appended to."""
    from core.errors import CommandError

    if path is None:
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("a", encoding="utf-8"):
            pass
    except OSError as exc:
        raise CommandError(f"--pass-trace {path}: {exc.strerror or exc}") from None


def _check_target(args: argparse.Namespace, settings: Settings) -> None:
    """Refuse, before any process starts, a provider this machine lacks or an unbuilt target."""
    from core.errors import CommandError
    from inference.artifacts import ArtifactError
    from inference.onnx_runtime import ProviderError, check_provider
    from modelbuild.target_build import load_target_identity

    try:
        check_provider(args.provider)
    except ProviderError as exc:
        raise CommandError(str(exc)) from exc
    name = args.target or settings.target
    if name is not None:
        try:
            load_target_identity(args.models_dir or settings.resolved_models_dir, name)
        except ArtifactError as exc:
            raise CommandError(str(exc)) from exc


def _password(path: Path | None) -> str | None:
    from core.errors import CommandError

    if path is None:
        return None
    try:
        return path.read_text().strip() or None
    except OSError as exc:
        raise CommandError(f"--password-file: {exc}") from exc


def run(args: argparse.Namespace) -> int:
    from broker.client import BrokerAddress
    from core.errors import CommandError
    from core.settings import Settings
    from verifier.child import ChildConfig
    from verifier.worker import VerifierError, VerifierWorker, WorkerConfig

    settings = Settings()
    if not args.heartbeat_s > 0:
        raise CommandError(f"--heartbeat-s must be > 0, got {args.heartbeat_s}")
    _check_target(args, settings)
    _check_pass_trace(args.pass_trace or settings.verifier_pass_trace)
    try:
        address = BrokerAddress.from_url(args.broker_url or settings.broker_url)
        config = WorkerConfig(
            verifier_id=args.verifier_id or default_verifier_id(),
            max_batch=args.max_batch,
            batch_window_ms=args.batch_window_ms,
            steps_per_call=args.steps_per_call,
            heartbeat_s=args.heartbeat_s,
            child=ChildConfig(
                models_dir=args.models_dir or settings.resolved_models_dir,
                precision=args.precision,
                target=args.target or settings.target,
                provider=args.provider,
                threads=args.threads or len(os.sched_getaffinity(0)),
                max_sessions=args.max_sessions,
                max_cache_mb=args.max_cache_mb,
                cloud_drafts=not args.no_cloud_drafts,
                pass_trace=args.pass_trace or settings.verifier_pass_trace,
            ),
        )
    except ValueError as exc:
        raise CommandError(str(exc)) from exc
    if args.models_dir is not None and not args.models_dir.is_dir():
        raise CommandError(f"models directory {args.models_dir} does not exist")

    try:
        worker = VerifierWorker(
            config,
            address,
            username=args.username or settings.broker_username,
            password=_password(args.password_file) or settings.broker_password,
            protocol=settings.mqtt_protocol,
            database_url=args.database_url,
        )
    except (ValueError, ImportError) as exc:  # sqlalchemy's ArgumentError is a ValueError
        raise CommandError(f"--database-url: {exc}") from exc
    log.info(
        "verifier %s: broker %s, max batch %d, window %.1f ms, %d steps a call",
        config.verifier_id,
        address.url,
        config.max_batch,
        config.batch_window_ms,
        config.steps_per_call,
    )
    try:
        run_service(_serve(worker))
    except VerifierError as exc:
        raise CommandError(str(exc)) from exc
    return 0


async def _serve(worker: VerifierWorker) -> None:
    main = asyncio.current_task()
    assert main is not None
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, main.cancel)
    try:
        await worker.run()
    except asyncio.CancelledError:
        log.info("verifier %s stopped", worker.config.verifier_id)


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    help_text = "run a verifier worker: the target model, batching drafts from the bus"
    parser = subparsers.add_parser("verifier", help=help_text, description=help_text)
    add_arguments(parser)
    parser.set_defaults(func=run)
