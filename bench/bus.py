"""`specfleet bench bus`: QoS 1 round trip of a draft, agent -> coordinator -> agent.

The agent side publishes a real Draft (k=8 with a top-8 sparse q'); the coordinator side decodes
it, builds the Verdict and publishes it back. Each broker is measured with TCP_NODELAY on and off
on the clients, in the same run, so the ratio between them is what to read on a noisy machine.
With `--features N` each configuration runs again with a feature drafter's round: the draft asks
for features and the verdict carries N fp16 values (576 for SmolLM2-135M's hidden state).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from broker import messages as m
from broker.client import BrokerAddress, ConnectOptions, Protocol, connect
from broker.mosquitto import MosquittoError, PrivateMosquitto
from broker.topics import DeviceChannel, device_topic
from core.report import add_json_argument, format_table, median, percentile, write_json
from inference.features import features_to_wire

K = 8
TOP_K = 8
DEVICE_ID = "bench-dev"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--count", type=int, default=2000, help="round trips per configuration")
    parser.add_argument("--warmup", type=int, default=100, help="round trips not counted")
    parser.add_argument(
        "--broker",
        action="append",
        default=[],
        metavar="URL",
        help="also measure this broker (repeatable); e.g. the system Mosquitto",
    )
    parser.add_argument(
        "--no-private-mosquitto",
        action="store_true",
        help="skip the private Mosquitto started with the production setting set_tcp_nodelay",
    )
    parser.add_argument("--embedded", action="store_true", help="also measure the embedded amqtt")
    parser.add_argument(
        "--features",
        type=int,
        default=0,
        metavar="N",
        help="also measure rounds whose verdict carries N fp16 features (the target's: 576)",
    )
    add_json_argument(parser, Path("bench-results/bus.json"))


def sample_draft(round_index: int, want_features: bool = False) -> m.Draft:
    probs = (0.65, 0.15, 0.08, 0.05, 0.03, 0.02, 0.01, 0.01)
    return m.Draft(
        session_id="3f2b8c1e-bench-0000-0000-000000000000",
        round=round_index,
        base_len=120 + round_index * K,
        tokens=tuple(range(1000, 1000 + K)),
        q_ids=tuple(tuple(range(2000 + i * TOP_K, 2000 + (i + 1) * TOP_K)) for i in range(K)),
        q_probs=tuple(probs for _ in range(K)),
        draft_model="draft-l2",
        timings=m.DraftTimings(draft_ms=3.2, sent_at=time.time()),
        want_features=True if want_features else None,
    )


def sample_features(size: int) -> str:
    """A hidden state's worth of fp16 values, as a verdict carries them."""
    values = np.random.default_rng(0).standard_normal(size).astype(np.float32)
    return features_to_wire(values * 4.0)


@dataclass(frozen=True)
class Result:
    broker: str
    tcp_nodelay: bool
    rtts_ms: list[float]
    payload_bytes: int
    verdict_bytes: int = 0
    features: int = 0  # fp16 values on each verdict

    def row(self) -> dict[str, Any]:
        return {
            "broker": self.broker,
            "tcp_nodelay": self.tcp_nodelay,
            "features": self.features,
            "count": len(self.rtts_ms),
            "payload_bytes": self.payload_bytes,
            "verdict_bytes": self.verdict_bytes,
            "p50_ms": median(self.rtts_ms),
            "p99_ms": percentile(self.rtts_ms, 99),
            "mean_ms": sum(self.rtts_ms) / len(self.rtts_ms),
        }


async def measure(
    label: str,
    url: str,
    tcp_nodelay: bool,
    count: int,
    warmup: int,
    username: str | None = None,
    password: str | None = None,
    features: int = 0,
    protocol: Protocol = "auto",
) -> Result:
    address = BrokerAddress.from_url(url)
    draft_topic = device_topic(DEVICE_ID, DeviceChannel.DRAFT)
    verdict_topic = device_topic(DEVICE_ID, DeviceChannel.VERDICT)
    agent_opts = ConnectOptions(
        client_id="bench-agent",
        username=username,
        password=password,
        tcp_nodelay=tcp_nodelay,
        protocol=protocol,
    )
    coord_opts = dataclasses.replace(agent_opts, client_id="bench-coordinator")
    async with connect(address, agent_opts) as agent, connect(address, coord_opts) as coord:
        await coord.subscribe(draft_topic)
        await agent.subscribe(verdict_topic)
        hidden = sample_features(features) if features else None

        async def coordinator() -> None:
            async for incoming in coord.messages():
                draft = m.decode_as(incoming.payload, m.Draft)
                verdict = m.Verdict(
                    session_id=draft.session_id,
                    round=draft.round,
                    base_len=draft.base_len,
                    n_accepted=5,
                    next_token=42,
                    committed_len=draft.base_len + 6,
                    policy=m.Policy(draft_model=draft.draft_model, k=K),
                    features=hidden if draft.want_features else None,
                )
                await coord.publish(verdict_topic, m.encode(verdict))

        server = asyncio.create_task(coordinator(), name="bench-coordinator")
        verdicts = agent.messages()
        rtts: list[float] = []
        payload_bytes = verdict_bytes = 0
        try:
            # One bar per configuration, kept when done: the run's progress reads down the list.
            for i in tqdm(
                range(warmup + count),
                desc=f"{label}, TCP_NODELAY {'on' if tcp_nodelay else 'off'}, features {features}",
                unit="round",
            ):
                payload = m.encode(sample_draft(i, want_features=features > 0))
                payload_bytes = len(payload)
                start = time.perf_counter()
                await agent.publish(draft_topic, payload)
                answer = (await anext(verdicts)).payload
                m.decode_as(answer, m.Verdict)
                if i >= warmup:
                    rtts.append((time.perf_counter() - start) * 1000.0)
                verdict_bytes = len(answer)
        finally:
            server.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await server
    return Result(label, tcp_nodelay, rtts, payload_bytes, verdict_bytes, features)


async def run_all(args: argparse.Namespace) -> list[Result]:
    results: list[Result] = []
    targets: list[tuple[str, str]] = [(f"external {url}", url) for url in args.broker]
    private: PrivateMosquitto | None = None
    if not args.no_private_mosquitto:
        try:
            private = PrivateMosquitto(tcp_nodelay=True)
            private.start()
            targets.insert(0, ("mosquitto (set_tcp_nodelay true)", private.url))
        except MosquittoError as exc:
            print(f"skipping the private Mosquitto: {exc}")
            private = None
    sizes = (0, args.features) if args.features else (0,)
    try:
        for label, url in targets:
            for nodelay in (True, False):
                for size in sizes:
                    results.append(
                        await measure(label, url, nodelay, args.count, args.warmup, features=size)
                    )
        if args.embedded:
            results += await _measure_embedded(args)
    finally:
        if private is not None:
            private.stop()
    return results


async def _measure_embedded(args: argparse.Namespace) -> list[Result]:
    import tempfile

    from broker.embedded import EmbeddedBroker
    from broker.mosquitto import free_port
    from broker.passwords import hash_credential, new_credential

    secret = new_credential()
    with tempfile.TemporaryDirectory() as tmp:
        passwords = Path(tmp) / "passwords"
        passwords.write_text(f"bench:{hash_credential(secret)}\n")
        broker = EmbeddedBroker(port=free_port(), password_file=passwords, service_users=("bench",))
        async with broker:
            return [
                await measure(
                    "embedded amqtt",
                    broker.url,
                    nodelay,
                    args.count,
                    args.warmup,
                    username="bench",
                    password=secret,
                    # As the quickstart's clients speak to it: amqtt has no MQTT 5, and the
                    # probe's CONNECT it cannot parse hangs until the broker stops.
                    protocol="3.1.1",
                )
                for nodelay in (True, False)
            ]


def run(args: argparse.Namespace) -> int:
    from core.errors import CommandError

    if args.count < 1 or args.warmup < 0:
        raise CommandError("--count must be >= 1 and --warmup >= 0")
    if not 0 <= args.features <= m.MAX_FEATURE_DIM:
        raise CommandError(f"--features must be in 0..{m.MAX_FEATURE_DIM}")
    results = asyncio.run(run_all(args))
    if not results:
        raise CommandError("no broker to measure")
    rows = [r.row() for r in results]
    # Baseline per broker and round kind: the same with TCP_NODELAY off.
    baseline = {(r["broker"], r["features"]): r["p50_ms"] for r in rows if not r["tcp_nodelay"]}
    for r in rows:
        r["p50_vs_nodelay_off"] = r["p50_ms"] / baseline[(r["broker"], r["features"])]
    plain_verdict = {(r["broker"], r["tcp_nodelay"]): r for r in rows if not r["features"]}
    for r in rows:
        plain = plain_verdict[(r["broker"], r["tcp_nodelay"])]
        r["round_bytes_added"] = (
            r["payload_bytes"]
            + r["verdict_bytes"]
            - plain["payload_bytes"]
            - plain["verdict_bytes"]
        )
    print(
        format_table(
            [
                "broker",
                "TCP_NODELAY",
                "features",
                "n",
                "draft B",
                "verdict B",
                "+B/round",
                "p50 ms",
                "p99 ms",
                "mean ms",
                "p50 / off",
            ],
            [
                [
                    r["broker"],
                    "on" if r["tcp_nodelay"] else "off",
                    r["features"],
                    r["count"],
                    r["payload_bytes"],
                    r["verdict_bytes"],
                    r["round_bytes_added"],
                    r["p50_ms"],
                    r["p99_ms"],
                    r["mean_ms"],
                    r["p50_vs_nodelay_off"],
                ]
                for r in rows
            ],
        )
    )
    goal = [
        r
        for r in rows
        if r["tcp_nodelay"] and r["broker"].startswith("mosquitto") and not r["features"]
    ]
    if goal:
        verdict = "met" if goal[0]["p50_ms"] <= 1.0 else "NOT met"
        print(
            f"goal p50 <= 1 ms with TCP_NODELAY on Mosquitto: {verdict} "
            f"({goal[0]['p50_ms']:.3f} ms)"
        )
    if args.json is not None:
        write_json(args.json, {"benchmark": "bus", "qos": 1, "results": rows})
        print(f"wrote {args.json}")
    return 0
