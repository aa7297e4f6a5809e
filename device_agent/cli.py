"""The `specfleet-agent` command: the device side's entry point."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import sys
from collections.abc import Sequence
from pathlib import Path

from pydantic import ValidationError

from broker.secrets import RefuseSecretInArgv
from core.aio import run_service
from core.cli_help import finish_parsers
from core.completion import add_completion_command
from core.logs import configure_logging
from device_agent import __version__
from device_agent.settings import (
    AgentSettings,
    LocalSettings,
    load_agent_settings,
    load_local_settings,
)

log = logging.getLogger("device_agent")

EXAMPLES = {
    "specfleet-agent": """
        specfleet-agent run --config ~/specfleet-agent/current/agent.toml
        specfleet-agent ask "Why is the sky blue?"
    """,
    "specfleet-agent run": """
        specfleet-agent run --config ~/specfleet-agent/current/agent.toml   # as flashed
        specfleet-agent run --device-id pi-kitchen --credential-file credential \\
            --broker-url mqtt://broker.lan:1883 --kind pi -v
    """,
    "specfleet-agent completion": """
        eval "$(specfleet-agent completion bash)"              # in ~/.bashrc
        specfleet-agent completion bash > /etc/bash_completion.d/specfleet-agent
    """,
    "specfleet-agent ask": """
        specfleet-agent ask "Why is the sky blue?"                  # through the running agent
        specfleet-agent ask "Write a haiku" --draft lookup --k 4 --json
    """,
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="specfleet-agent", description="The specfleet device agent."
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log at DEBUG level")
    parser.add_argument("--version", action="version", version=f"specfleet-agent {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    run = sub.add_parser(
        "run",
        help="connect to the bus and serve until stopped",
        description="Connect to the bus with this device's credential, report presence and "
        "telemetry, draft for the sessions the coordinator starts here and serve the local API; "
        "until SIGTERM or Ctrl-C, reconnecting with backoff.",
    )
    _add_device_arguments(run)
    run.add_argument(
        "--kind", choices=["pi", "jetson", "phone", "other"], help="this device's class"
    )
    run.add_argument("--keepalive", type=int, dest="keepalive_s", help="MQTT keepalive, seconds")
    run.add_argument(
        "--telemetry-interval",
        type=float,
        dest="telemetry_interval_s",
        help="seconds between telemetry reports (RTT probe, CPU, memory, battery, heat)",
    )
    run.add_argument(
        "--thermal-limit",
        type=float,
        dest="thermal_limit_c",
        help="degrees C past which the coordinator keeps drafting off this device (default 80)",
    )
    run.add_argument(
        "--battery-floor",
        type=float,
        dest="battery_floor_percent",
        help="battery percent under which, not charging, drafting leaves this device (default 20)",
    )
    run.add_argument(
        "--power-saver",
        action="store_true",
        default=None,
        help="draft nothing on this device: its sessions' drafting goes to the verifier host",
    )
    run.add_argument(
        "--sys-root", type=Path, help="where to read /sys (battery, heat); default /sys"
    )
    run.add_argument(
        "--proc-root", type=Path, help="where to read /proc (available memory); default /proc"
    )
    run.add_argument(
        "--memory-margin",
        type=float,
        dest="memory_margin_mb",
        help="MB a neural draft must leave free to be loaded (default 64)",
    )
    run.add_argument(
        "--in-process-drafts",
        dest="isolate_drafts",
        action="store_false",
        default=None,
        help="run neural drafts in the agent's own process, not in supervised child processes",
    )
    run.add_argument("--draft", dest="default_draft", help="drafter of sessions that name none")
    run.add_argument(
        "--connect-wait",
        type=float,
        dest="connect_wait_s",
        help="seconds a new local session waits for a reconnecting bus (default 15)",
    )
    run.add_argument(
        "--draft-runtime", choices=["onnx", "tflite"], help="which build a bare draft name means"
    )
    run.add_argument(
        "--fallback-after",
        type=float,
        dest="fallback_after_s",
        help="seconds without an answer before a session generates alone, provisionally "
        "(default 5; 0: never)",
    )
    run.add_argument(
        "--no-proactive",
        dest="proactive",
        action="store_false",
        default=None,
        help="do not draft the next window while a verdict is in flight",
    )
    run.add_argument(
        "--no-local-api",
        dest="local_api",
        action="store_false",
        default=None,
        help="serve no HTTP API on loopback",
    )

    ask = sub.add_parser(
        "ask",
        help="answer one prompt on this device and stream the text",
        description="Run one session through the running agent's local API, or, when none "
        "answers, over a one-shot bus connection made with the same settings.",
    )
    ask.add_argument("prompt", help="the user's message")
    ask.add_argument("--max-tokens", type=int, help="tokens to generate at most")
    ask.add_argument("--temperature", type=float, help="0 (default) for greedy")
    ask.add_argument("--top-p", type=float, help="nucleus sampling: keep this probability mass")
    ask.add_argument("--seed", type=int, help="sampling is reproducible from it")
    ask.add_argument("--draft", help="drafter: lookup, ngram, hybrid, a draft's name, hybrid+NAME")
    ask.add_argument("--k", type=int, help="tokens drafted per round")
    ask.add_argument("--task-type", help="task of the prompt, for the coordinator's policy")
    ask.add_argument(
        "--no-proactive",
        dest="proactive",
        action="store_false",
        default=None,
        help="do not draft ahead while a verdict is in flight",
    )
    ask.add_argument("--json", action="store_true", help="print the session summary as JSON")
    _add_device_arguments(ask)
    add_completion_command(sub, build_parser)
    finish_parsers(parser, EXAMPLES)
    return parser


def _add_device_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", type=Path, help="TOML config file (flat keys, e.g. device_id)")
    parser.add_argument("--device-id", help="this device's id (env SPECFLEET_DEVICE_ID)")
    # No flag takes the secret itself: argv shows in `ps` to every user of the device. The old
    # flag stays only to refuse (else argparse would take it as short for --credential-file).
    parser.add_argument(
        "--credential",
        action=RefuseSecretInArgv,
        instead="--credential-file FILE or SPECFLEET_CREDENTIAL",
    )
    parser.add_argument(
        "--credential-file",
        type=Path,
        help="file holding this device's secret (or env SPECFLEET_CREDENTIAL)",
    )
    parser.add_argument("--broker-url", help="mqtt://host:port or mqtts://host:port")
    parser.add_argument("--ca-file", type=Path, help="CA bundle for an mqtts:// broker")
    parser.add_argument("--models-dir", type=Path, help="draft models and the tokenizer")
    parser.add_argument("--local-api-port", type=int, help="loopback port of the local API")


def _local_overrides(args: argparse.Namespace) -> dict[str, object]:
    return {"models_dir": args.models_dir, "local_api_port": args.local_api_port}


def _settings(args: argparse.Namespace) -> AgentSettings:
    overrides = {
        "device_id": args.device_id,
        "credential_file": args.credential_file,
        "broker_url": args.broker_url,
        "ca_file": args.ca_file,
        **_local_overrides(args),
    }
    if args.command == "run":
        overrides |= {
            "kind": args.kind,
            "keepalive_s": args.keepalive_s,
            "telemetry_interval_s": args.telemetry_interval_s,
            "default_draft": args.default_draft,
            "draft_runtime": args.draft_runtime,
            "proactive": args.proactive,
            "local_api": args.local_api,
            "fallback_after_s": args.fallback_after_s,
            "connect_wait_s": args.connect_wait_s,
            "thermal_limit_c": args.thermal_limit_c,
            "battery_floor_percent": args.battery_floor_percent,
            "power_saver": args.power_saver,
            "sys_root": args.sys_root,
            "proc_root": args.proc_root,
            "memory_margin_mb": args.memory_margin_mb,
            "isolate_drafts": args.isolate_drafts,
        }
    return load_agent_settings(args.config, **overrides)


def _settings_reason(exc: ValidationError) -> str:
    first = exc.errors(include_url=False)[0]
    where = ".".join(str(p) for p in first["loc"])
    return f"{where}: {first['msg']}"


async def _run(settings: AgentSettings) -> None:
    from device_agent.agent import Agent

    agent = Agent(settings)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError):  # not on every platform (Termux is fine)
            loop.add_signal_handler(sig, lambda: asyncio.ensure_future(agent.stop()))
    await agent.run()


def _ask(args: argparse.Namespace) -> int:
    from device_agent.ask import AskError, ask, build_request, default_output

    try:
        request = build_request(
            prompt=args.prompt,
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            top_p=args.top_p,
            seed=args.seed,
            draft=args.draft,
            k=args.k,
            task_type=args.task_type,
            proactive=args.proactive,
        )
        local: LocalSettings = load_local_settings(args.config, **_local_overrides(args))
    except AskError as exc:
        print(f"specfleet-agent ask: {exc.reason}", file=sys.stderr)
        return 2
    except ValidationError as exc:
        print(f"specfleet-agent ask: {_settings_reason(exc)}", file=sys.stderr)
        return 2
    except (OSError, ValueError) as exc:
        print(f"specfleet-agent ask: {exc}", file=sys.stderr)
        return 2
    agent_settings: AgentSettings | None = None
    settings_error = ""
    try:
        agent_settings = _settings(args)
    except ValidationError as exc:
        missing_id = any(
            e["loc"] == ("device_id",) and e["type"] == "missing" for e in exc.errors()
        )
        settings_error = (
            "a device id (--device-id or SPECFLEET_DEVICE_ID)"
            if missing_id
            else f"valid settings ({_settings_reason(exc)})"
        )
    try:
        return asyncio.run(
            ask(local, agent_settings, request, default_output(args.json), settings_error)
        )
    except AskError as exc:
        print(f"specfleet-agent ask: {exc.reason}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        return 130


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # `ask` writes the answer to the terminal: only warnings go beside it unless asked.
    quiet = args.command == "ask" and not args.verbose
    configure_logging(
        logging.DEBUG if args.verbose else logging.WARNING if quiet else logging.INFO,
        args.log_format,
    )
    if args.command == "ask":
        return _ask(args)
    if args.command == "completion":
        result: int = args.func(args)
        return result
    try:
        settings = _settings(args)
    except ValidationError as exc:
        print(f"specfleet-agent: {_settings_reason(exc)}", file=sys.stderr)
        return 2
    except (OSError, ValueError) as exc:
        print(f"specfleet-agent: {exc}", file=sys.stderr)
        return 2
    try:
        run_service(_run(settings))
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
