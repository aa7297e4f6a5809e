"""The verifier worker on a private Mosquitto with the real target in its inference child."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path

import numpy as np
import pytest
from verifier_helpers import (
    REPO_ROOT,
    BusListener,
    draft_from,
    greedy_reference,
    make_request,
    prompt_ids,
    target_pair,
)

from broker.client import BrokerAddress, ConnectOptions, connect
from broker.messages import DeviceState, VerifierStatus, VerifyRequest, decode_as, encode
from broker.mosquitto import PrivateMosquitto
from broker.topics import VerifierChannel, verifier_topic
from core.aio import task_group, timeout
from inference.artifacts import default_models_dir
from inference.features import features_from_wire
from modelbuild.target_build import load_target_identity
from verifier.child import ChildConfig
from verifier.worker import STEPS_PER_CALL, VerifierWorker, WorkerConfig

K = 4
SCENARIO_WATCHDOG_S = 100.0
LONG_WINDOW_MS = 120_000.0  # longer than a result is waited for
Body = Callable[[VerifierWorker, BusListener], Awaitable[None]]


def run_with_worker(
    mosquitto: PrivateMosquitto,
    body: Body,
    batch_window_ms: float = 2.0,
    database_url: str | None = None,
    subscriptions: tuple[str, ...] = (),
    steps_per_call: int = STEPS_PER_CALL,
) -> None:
    """Start a worker (and its child) on the broker, run `body` against it, then stop it."""
    verifier_id = f"t-{uuid.uuid4().hex[:10]}"
    address = BrokerAddress.from_url(mosquitto.url)
    config = WorkerConfig(
        verifier_id,
        child=ChildConfig(models_dir=default_models_dir(), threads=1),
        heartbeat_s=0.2,
        batch_window_ms=batch_window_ms,
        steps_per_call=steps_per_call,
    )
    worker = VerifierWorker(config, address, database_url=database_url)

    async def scenario() -> None:
        async with connect(address, ConnectOptions(client_id=f"coord-{verifier_id}")) as client:
            await client.subscribe(worker.result_topic)
            await client.subscribe(worker.status_topic)
            for topic in subscriptions:
                await client.subscribe(topic)
            listener = BusListener(client)
            async with task_group() as tasks:
                listening = tasks.create_task(listener.listen(), name="test-listener")
                serving = tasks.create_task(worker.run(), name="test-worker")
                await listener.status(lambda s: s.state == DeviceState.ONLINE)
                await body(worker, listener)
                assert not serving.done()  # the worker never stopped serving
                serving.cancel()
                listening.cancel()

    async def watched() -> None:
        # A stuck scenario says where it is stuck before pytest-timeout kills it.
        watchdog = asyncio.get_running_loop().call_later(SCENARIO_WATCHDOG_S, dump_state, worker)
        try:
            await scenario()
        finally:
            watchdog.cancel()

    asyncio.run(watched())


def dump_state(worker: VerifierWorker) -> None:
    print(
        f"worker {worker.config.verifier_id}: in flight {worker.in_flight}, queue "
        f"{worker.queue_depth}, child {worker.child.pid} alive={worker.child.alive}, "
        f"{worker.counters}"
    )
    for task in asyncio.all_tasks():
        task.print_stack()


def greedy_case(session: str, prompt: int, start: int, wrong_at: int | None) -> VerifyRequest:
    reference = greedy_reference(prompt, 12)
    context = prompt_ids(prompt) + reference[:start]
    return make_request(session, start, context, draft_from(reference, start, K, wrong_at))


def expected(prompt: int, start: int, wrong_at: int | None) -> tuple[int, int]:
    n = K if wrong_at is None else wrong_at
    return n, greedy_reference(prompt, 12)[start + n]


async def publish(worker: VerifierWorker, listener: BusListener, payload: bytes) -> None:
    await listener.client.publish(worker.work_topic, payload)


def test_requests_over_the_bus_get_the_targets_verdicts(mosquitto: PrivateMosquitto) -> None:
    cases = [(0, 0, None), (1, 3, 0), (2, 5, 2)]

    async def body(worker: VerifierWorker, listener: BusListener) -> None:
        requests = [greedy_case(f"bus-{i}", *case) for i, case in enumerate(cases)]
        for request in requests:
            await publish(worker, listener, encode(request))
        for request, case in zip(requests, cases, strict=True):
            result = await listener.result(request.request_id)
            assert not result.error
            assert (result.n_accepted, result.next_token) == expected(*case)
            assert (result.session_id, result.round) == (request.session_id, request.round)
            assert result.base_len == len(request.context_ids)
            assert result.verifier_id == worker.config.verifier_id
            assert result.verify_ms > 0 and result.queue_ms >= 0
        await listener.status(lambda s: s.sessions_cached == len(cases))

    run_with_worker(mosquitto, body)


def test_a_cloud_round_over_the_bus_comes_back_with_the_hosts_draft(
    mosquitto: PrivateMosquitto,
) -> None:
    async def body(worker: VerifierWorker, listener: BusListener) -> None:
        status = await listener.status(lambda s: s.state == DeviceState.ONLINE)
        assert "hybrid" in status.drafts  # announced, so the coordinator may choose cloud mode
        assert status.vocab_size == 49152  # the target's: prompts past it are refused at open
        # The target's identity from its manifest: the coordinator's EOS and vocabulary check.
        identity = load_target_identity(default_models_dir())
        assert (status.eos_id, status.vocab) == (identity.eos_id, identity.vocab_sha256)
        assert status.target == identity.label
        request = VerifyRequest(
            request_id="cloud-1",
            session_id="cloud-bus",
            round=0,
            context_ids=prompt_ids(4),
            tokens=(),
            cloud_draft="hybrid",
            cloud_k=K,
        )
        await publish(worker, listener, encode(request))
        result = await listener.result(request.request_id)
        assert not result.error
        assert result.draft_tokens is not None and len(result.draft_tokens) <= K
        reference = greedy_reference(4, 12)
        committed = [*result.draft_tokens[: result.n_accepted], result.next_token]
        assert committed == list(reference[: len(committed)])
        assert result.verify_ms > 0 and result.draft_ms >= 0
        assert result.batch_prefilled > 0  # a session new to this verifier: its prompt
        again = request.model_copy(
            update={
                "request_id": "cloud-2",
                "round": 1,
                "context_ids": (*request.context_ids, *committed),
            }
        )
        await publish(worker, listener, encode(again))
        second = await listener.result(again.request_id)
        assert not second.error and second.batch_prefilled == 0  # its cache held the context

    run_with_worker(mosquitto, body)


def test_malformed_payloads_are_refused_and_the_worker_keeps_serving(
    mosquitto: PrivateMosquitto,
) -> None:
    async def body(worker: VerifierWorker, listener: BusListener) -> None:
        good = greedy_case("after-refusals", 3, 1, 3)
        bad_q = json.loads(encode(good))
        bad_q["q_ids"] = [[t] for t in bad_q["tokens"]]
        bad_q["q_probs"] = [[0.5] for _ in bad_q["tokens"]]  # rows that do not sum to 1
        bad_q["request_id"] = "bad-q"
        status = VerifierStatus(verifier_id="x", state=DeviceState.ONLINE, at=time.time())
        for payload in [
            b"\xff not json",
            b"[1, 2, 3]",
            b'{"v": 1, "type": "verify_request"}',
            b'{"v": 99, "type": "verify_request", "request_id": "r"}',
            encode(status),
            json.dumps(bad_q).encode(),
        ]:
            await publish(worker, listener, payload)
        await publish(worker, listener, encode(good))

        refusal = await listener.result("bad-q")
        assert refusal.error.startswith("refused:") and "sum to 1" in refusal.error
        assert refusal.session_id == good.session_id
        result = await listener.result(good.request_id)
        assert not result.error
        assert (result.n_accepted, result.next_token) == expected(3, 1, 3)
        assert worker.counters.refused == 6
        assert set(listener.results) == {"bad-q", good.request_id}

    run_with_worker(mosquitto, body)


def test_killed_child_fails_its_batch_and_a_new_child_serves_the_next(
    mosquitto: PrivateMosquitto,
) -> None:
    async def body(worker: VerifierWorker, listener: BusListener) -> None:
        first_pid = worker.child.pid
        assert first_pid is not None
        # Two requests queued behind a busy child go to it as one batch.
        await keep_child_busy(worker, listener)
        # A long context keeps the child busy prefilling, so the kill lands mid-batch.
        long_context = (prompt_ids(0) * 40)[:900]
        slow = make_request("victim", 0, long_context, [13, 14, 15])
        other = greedy_case("bystander", 1, 3, 0)
        await publish(worker, listener, encode(slow))
        await publish(worker, listener, encode(other))
        async with timeout(30):
            while worker.in_flight < 2:
                await asyncio.sleep(0.005)
        os.kill(first_pid, signal.SIGKILL)

        for request in (slow, other):
            failed = await listener.result(request.request_id)
            assert "lost its inference process" in failed.error
            assert "killed by SIGKILL" in failed.error
        # The coordinator resends; the new child has no cache and re-prefills from context_ids.
        resent = greedy_case("bystander", 1, 3, 0)
        await publish(worker, listener, encode(resent))
        result = await listener.result(resent.request_id, timeout_s=90)
        assert not result.error
        assert (result.n_accepted, result.next_token) == expected(1, 3, 0)
        assert worker.counters.child_restarts == 1
        assert worker.child.pid not in (None, first_pid)

    run_with_worker(mosquitto, body)


async def keep_child_busy(worker: VerifierWorker, listener: BusListener) -> VerifyRequest:
    """A request that keeps the child prefilling for a while; returns once it is in flight."""
    blocker = make_request(f"blocker-{uuid.uuid4().hex[:6]}", 0, (prompt_ids(2) * 40)[:900], [13])
    await publish(worker, listener, encode(blocker))
    async with timeout(30):
        while worker.in_flight < 1:
            await asyncio.sleep(0.002)
    return blocker


def test_results_of_a_batch_go_out_together_each_delivered_exactly_once(
    mosquitto: PrivateMosquitto,
) -> None:
    async def body(worker: VerifierWorker, listener: BusListener) -> None:
        blocker = await keep_child_busy(worker, listener)
        requests = [greedy_case(f"together-{i}", i % 4, i % 3, None) for i in range(8)]
        for request in requests:
            await publish(worker, listener, encode(request))
        for request in requests:
            result = await listener.result(request.request_id)
            # Each is a new session, so each is scored in its own prefill (batch_size 1); they
            # still went to the target in one call (two passes counted below).
            assert not result.error and result.batch_size == 1
        await listener.result(blocker.request_id)
        await listener.status(lambda s: s.sessions_cached == len(requests) + 1)
        # Published side by side, acknowledged one by one: none twice, none lost.
        assert all(listener.deliveries[r.request_id] == 1 for r in [blocker, *requests])
        assert worker.counters.served == len(requests) + 1
        # The heartbeat counts the target's passes (the blocker's, then the batch's) and the
        # seconds it computed in them, as the child timed them.
        status = await listener.status(lambda s: s.passes == 2)
        computed = sum(timing.compute_ms for timing in worker.counters.timings) / 1e3
        assert status.busy_s == pytest.approx(computed) and status.busy_s > 0
        assert status.idle_s >= 0

    run_with_worker(mosquitto, body)


def test_a_lone_session_is_not_held_back_by_the_batch_window(
    mosquitto: PrivateMosquitto,
) -> None:
    """No other session is due back, so the batch closes at once, however long the window."""

    async def body(worker: VerifierWorker, listener: BusListener) -> None:
        for start in (0, 1, 2):
            request = greedy_case("alone", 5, start, None)
            await publish(worker, listener, encode(request))
            result = await listener.result(request.request_id, timeout_s=60)
            # Were the window waited, this result would come long after the test gave up.
            assert not result.error and result.batch_size == 1

    run_with_worker(mosquitto, body, batch_window_ms=LONG_WINDOW_MS)


def spawned_children(pid: int) -> list[int]:
    """Children of `pid` started by multiprocessing's spawn (the resource tracker is not one)."""
    children = [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    return [c for c in children if b"spawn_main" in Path(f"/proc/{c}/cmdline").read_bytes()]


def has_exited(pid: int) -> bool:
    """Gone, or a zombie waiting for whoever adopted it to reap it."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except FileNotFoundError:
        return True
    return fields[0] in ("Z", "X")


def test_heartbeat_carries_load_retained_and_the_will_fires_on_sigkill(
    mosquitto: PrivateMosquitto, tmp_path: Path
) -> None:
    verifier_id = f"w-{uuid.uuid4().hex[:10]}"
    command = [
        sys.executable, "-m", "specfleet", "verifier", "--id", verifier_id,
        "--broker-url", mosquitto.url, "--heartbeat-s", "0.2", "--threads", "1",
        "--max-batch", "4", "--models-dir", str(default_models_dir()),
    ]  # fmt: skip
    log_path = tmp_path / "verifier.log"
    with log_path.open("wb") as log:
        process = subprocess.Popen(command, cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT)
    address = BrokerAddress.from_url(mosquitto.url)
    status_topic = verifier_topic(verifier_id, VerifierChannel.STATUS)

    async def retained_status() -> tuple[VerifierStatus, bool]:
        async with connect(address, ConnectOptions(client_id=f"late-{uuid.uuid4().hex}")) as late:
            await late.subscribe(status_topic)
            async for incoming in late.messages():
                return decode_as(incoming.payload, VerifierStatus), incoming.retain
        raise AssertionError("no status")

    async def scenario() -> None:
        async with connect(address, ConnectOptions(client_id=f"coord-{verifier_id}")) as client:
            await client.subscribe(verifier_topic(verifier_id, VerifierChannel.RESULT))
            await client.subscribe(status_topic)
            listener = BusListener(client)
            async with task_group() as tasks:
                listening = tasks.create_task(listener.listen(), name="test-listener")
                await listener.status(lambda s: s.state == DeviceState.ONLINE, timeout_s=120)
                work_topic = verifier_topic(verifier_id, VerifierChannel.WORK)
                requests = [make_request("long", 0, (prompt_ids(0) * 40)[:900], [13, 14])]
                requests += [greedy_case(f"s{i}", i, 0, None) for i in range(3)]
                for request in requests:
                    await client.publish(work_topic, encode(request))
                busy = await listener.status(lambda s: s.in_flight + s.queue_depth > 0)
                assert busy.state == DeviceState.ONLINE and busy.max_batch == 4
                for request in requests:
                    assert not (await listener.result(request.request_id)).error
                await listener.status(lambda s: s.sessions_cached == len(requests))

                status, retained = await retained_status()
                assert retained and status.state == DeviceState.ONLINE
                assert status.heartbeat_s == 0.2 and status.target.startswith("smollm2")

                (child,) = spawned_children(process.pid)
                process.send_signal(signal.SIGKILL)
                process.wait(10)
                will = await listener.status(lambda s: s.state == DeviceState.OFFLINE, 15)
                assert will.verifier_id == verifier_id
                status, retained = await retained_status()
                assert retained and status.state == DeviceState.OFFLINE
                # The orphaned child reads EOF on its pipe and exits instead of holding the model.
                async with timeout(15):
                    while not has_exited(child):
                        await asyncio.sleep(0.05)
                listening.cancel()

    try:
        asyncio.run(scenario())
    except BaseException:
        print(log_path.read_text()[-4000:])
        raise
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def test_results_carry_features_only_where_asked(mosquitto: PrivateMosquitto) -> None:
    """The coordinator's path: a request that asks gets, on its result, the target's hidden
    state at the position that chose its next token (a target-alone pass's, within fp16); one
    that does not ask gets no feature byte."""
    runtime, _ = target_pair()
    cases = [(0, 0, None), (1, 3, 0), (2, 5, 2)]

    async def body(worker: VerifierWorker, listener: BusListener) -> None:
        requests = [
            greedy_case(f"feat-{i}", *case).model_copy(update={"want_features": i != 1 or None})
            for i, case in enumerate(cases)
        ]
        for request in requests:
            await publish(worker, listener, encode(request))
        for request, case in zip(requests, cases, strict=True):
            result = await listener.result(request.request_id)
            assert not result.error and (result.n_accepted, result.next_token) == expected(*case)
            if not request.want_features:
                assert result.features is None
                continue
            assert result.features is not None
            accepted = list(request.tokens[: result.n_accepted])
            sequence = [*request.context_ids, *accepted]
            ((_, hidden),) = runtime.forward_batch_hidden([(sequence, runtime.new_cache())])
            np.testing.assert_allclose(
                features_from_wire(result.features), hidden[-1], rtol=2e-3, atol=2e-3
            )

    run_with_worker(mosquitto, body)
