"""`specfleet replay`: a stored session played again, or verified against the target."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from core.errors import CommandError
from specfleet.commands.common import _add_database_url, _engine, _print_json

# Heavy imports (SQLAlchemy, Alembic) happen inside the handlers, so `specfleet --help` stays fast.
if TYPE_CHECKING:
    from coordinator.replay import SessionRecord, TokenDecoder

    Subparsers = argparse._SubParsersAction[argparse.ArgumentParser]


def register(subparsers: Subparsers) -> None:
    help_text = "rebuild a session round by round from the database and re-stream it"
    parser = subparsers.add_parser("replay", help=help_text, description=help_text)
    parser.set_defaults(func=_replay)
    parser.add_argument("session_id", metavar="SESSION_ID", help="a session id, or its prefix")
    parser.add_argument(
        "--speed",
        type=float,
        default=1.0,
        help="replay speed: 2 is twice as fast as recorded, 0 does not wait (default: 1)",
    )
    parser.add_argument(
        "--json", action="store_true", help="one JSON object per round, without waiting"
    )
    parser.add_argument(
        "--verify",
        action="store_true",
        help="re-run the target on the recorded drafts and check every stored verdict",
    )
    parser.add_argument(
        "--color",
        choices=("auto", "always", "never"),
        default="auto",
        help="colour tokens by provenance (default: when writing to a terminal)",
    )
    parser.add_argument(
        "--show-rejected", action="store_true", help="also show rejected drafts, struck through"
    )
    parser.add_argument(
        "--precision",
        choices=("fp32", "q4"),
        default="fp32",
        help="the target build to verify with: the one the verifiers ran (default: fp32)",
    )
    parser.add_argument(
        "--models-dir", type=Path, default=None, help="models directory (default: from settings)"
    )
    _add_database_url(parser)


def _replay(args: argparse.Namespace) -> int:
    from coordinator import replay
    from coordinator.db.engine import make_sessionmaker

    if not args.speed >= 0:
        raise CommandError(f"--speed {args.speed}: must be 0 or more")
    with _engine(args) as engine:
        sessions = make_sessionmaker(engine)
        try:
            session_id = replay.find_session(sessions, args.session_id)
            record = replay.load_session(sessions, session_id)
        except replay.ReplayError as exc:
            raise CommandError(str(exc)) from exc
    models_dir = args.models_dir or _settings_models_dir()
    decoder = replay.target_tokenizer(models_dir)
    if args.verify:
        return _replay_verify(args, record, models_dir, decoder)
    result = replay.rebuild(record, decoder)
    if args.json:
        for line in replay.json_lines(result):
            print(line, flush=True)
        for problem in result.problems:
            print(f"specfleet replay: {problem}", file=sys.stderr)
        return 1 if result.problems else 0
    color = args.color == "always" or (args.color == "auto" and sys.stdout.isatty())
    replay.play_terminal(
        result, sys.stdout, speed=args.speed, color=color, show_rejected=args.show_rejected
    )
    return 1 if result.problems else 0


def _settings_models_dir() -> Path:
    from pydantic import ValidationError

    from core.settings import Settings

    try:
        return Settings().resolved_models_dir
    except ValidationError as exc:
        raise CommandError(f"invalid settings: {exc.errors()[0]['msg']}") from exc


def _replay_verify(
    args: argparse.Namespace,
    record: SessionRecord,
    models_dir: Path,
    decoder: TokenDecoder | None,
) -> int:
    from tqdm import tqdm

    from coordinator import replay
    from inference.artifacts import ArtifactError
    from modelbuild.gguf_source import GgufError
    from modelbuild.target_build import load_target

    try:
        target, tokenizer = load_target(models_dir, precision=args.precision)
    except (ArtifactError, GgufError, OSError) as exc:
        raise CommandError(f"cannot load the target: {exc}") from exc
    with tqdm(
        total=len(record.rounds), desc="verifying", unit="round", file=sys.stderr, leave=False
    ) as bar:
        report = replay.verify_session(
            record, target, decoder=decoder or tokenizer, on_round=lambda _: bar.update()
        )
    if args.json:
        _print_json(
            {
                "session_id": str(report.session_id),
                "target": target.name,
                "rounds": report.rounds,
                "verified": report.verified,
                "ok": report.ok,
                "mismatches": [
                    {"round": m.round_index, "what": m.what, "detail": m.detail}
                    for m in report.mismatches
                ],
            }
        )
    else:
        for mismatch in report.mismatches:
            print(f"MISMATCH {mismatch.detail}")
        verdict = "every stored verdict reproduced" if report.ok else "NOT reproduced"
        print(
            f"session {record.id}: {report.verified}/{report.rounds} rounds verified against "
            f"{target.name}: {verdict}"
        )
    return 0 if report.ok else 1
