"""A draft in its own process: the same logits as in-process, refusals, crashes, hangs, framing."""

from __future__ import annotations

import os
import signal
import socket
import struct
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from inference import isolated_runtime
from inference.artifacts import default_models_dir
from inference.drafts import DraftRuntimeKind, load_draft
from inference.isolated_runtime import (
    DraftChildSpec,
    IsolatedRuntime,
    RuntimeLost,
    RuntimeRefused,
    decode_forward,
    decode_logits,
    encode_forward,
    encode_logits,
    read_frame,
    write_frame,
)
from inference.proposers import head_token_ids
from modelbuild.distill import ensure_drafts

DRAFTS: list[tuple[str, DraftRuntimeKind]] = [("draft-l1", "onnx"), ("draft-l1-tflite", "tflite")]
PROMPT = list(range(200, 248))


@pytest.fixture(scope="module")
def models_dir(target_dir: Path) -> Path:
    directory = default_models_dir()
    ensure_drafts(directory, target_dir)
    return directory


@pytest.fixture
def isolated(models_dir: Path) -> Iterator[IsolatedRuntime]:
    """The ONNX draft-l1 in a child of its own, loaded."""
    runtime = IsolatedRuntime(DraftChildSpec(models_dir, "draft-l1", "onnx", threads=1))
    runtime.start()
    assert runtime.wait_ready(60.0)
    yield runtime
    runtime.stop()


@pytest.mark.parametrize(("name", "kind"), DRAFTS)
def test_isolated_logits_equal_the_in_process_runtime_s_bit_for_bit(
    models_dir: Path, name: str, kind: DraftRuntimeKind
) -> None:
    local = load_draft(models_dir, name, kind, threads=1)
    isolated = IsolatedRuntime(DraftChildSpec(models_dir, name, kind, threads=1))
    isolated.start()
    try:
        assert isolated.wait_ready(60.0)
        assert isolated.vocab_size == local.vocab_size
        local_ids, isolated_ids = head_token_ids(local), head_token_ids(isolated)
        assert local_ids is not None and isolated_ids is not None
        assert np.array_equal(local_ids, isolated_ids)
        a, b = local.new_cache(), isolated.new_cache()
        # A prefill, decode steps, a rollback and a window after it, as a drafter's rounds go.
        steps: list[tuple[int | None, list[int]]] = [
            (None, PROMPT),
            (None, [17]),
            (None, [18]),
            (30, [5, 6, 7]),
            (None, [9]),
            (0, [1, 2]),
        ]
        for trim, tokens in steps:
            if trim is not None:
                a.trim(trim)
                b.trim(trim)
            expected, got = local.forward(tokens, a), isolated.forward(tokens, b)
            assert got.dtype == np.float32
            assert np.array_equal(expected, got)
            assert a.length == b.length
        # Two caches of different lengths in one pass.
        c, d = local.new_cache(), isolated.new_cache()
        local.forward(PROMPT[:7], c)
        isolated.forward(PROMPT[:7], d)
        expected_rows = local.forward_batch([([3, 4], a), ([8], c)])
        got_rows = isolated.forward_batch([([3, 4], b), ([8], d)])
        for expected, got in zip(expected_rows, got_rows, strict=True):
            assert np.array_equal(expected, got)
    finally:
        isolated.stop()


def test_framing_round_trips() -> None:
    rows = [(3, 0, [1, 2, 3]), (9, 12, [7])]
    words = np.frombuffer(encode_forward(rows, freed=[4, 5]), dtype="<i8")
    assert decode_forward(words) == (rows, [4, 5])
    logits = [np.arange(6, dtype=np.float32).reshape(2, 3), np.ones((1, 3), np.float32)]
    for expected, got in zip(logits, decode_logits(encode_logits(logits), 3), strict=True):
        assert np.array_equal(expected, got)


def test_a_frame_is_read_whole_or_not_by_its_deadline() -> None:
    ours, theirs = socket.socketpair()
    with ours, theirs:
        # More than a socket's buffer holds at once: written as it is read.
        writer = threading.Thread(target=write_frame, args=(theirs.fileno(), b"x" * 3_000_000))
        writer.start()
        assert read_frame(ours.fileno(), time.monotonic() + 10.0) == b"x" * 3_000_000
        writer.join()
        # A writer that stops halfway through a frame (a SIGSTOPped child): the deadline holds.
        theirs.sendall(struct.pack("<Q", 1000) + b"y" * 10)
        started = time.monotonic()
        with pytest.raises(TimeoutError, match="10 of 1000 bytes"):
            read_frame(ours.fileno(), started + 0.2)
        assert time.monotonic() - started < 2.0
        theirs.close()
        with pytest.raises(EOFError):
            read_frame(ours.fileno(), None)


def test_a_refused_call_leaves_the_child_up(isolated: IsolatedRuntime) -> None:
    cache = isolated.new_cache()
    with pytest.raises(RuntimeRefused):
        isolated.forward([10**9], cache)  # far past the vocabulary
    assert isolated.up
    assert isolated.forward([1, 2], isolated.new_cache()).shape == (2, isolated.vocab_size)


@pytest.mark.parametrize(
    ("sig", "named"), [(signal.SIGKILL, "SIGKILL"), (signal.SIGSEGV, "SIGSEGV")]
)
def test_a_killed_child_raises_runtime_lost_once_and_its_caches_stay_lost(
    isolated: IsolatedRuntime, sig: signal.Signals, named: str
) -> None:
    losses: list[RuntimeLost] = []
    isolated.on_lost = losses.append
    cache = isolated.new_cache()
    isolated.forward(PROMPT, cache)
    assert isolated.pid is not None
    os.kill(isolated.pid, sig)
    with pytest.raises(RuntimeLost, match=named) as lost:
        isolated.forward([1], cache)
    assert lost.value.kind == "crash"
    assert [loss.reason for loss in losses] == [lost.value.reason]
    assert not isolated.up
    with pytest.raises(RuntimeLost):  # down until started again; not counted twice
        isolated.forward([1], isolated.new_cache())
    assert len(losses) == 1
    isolated.start()
    assert isolated.wait_ready(60.0)
    with pytest.raises(RuntimeLost, match="lost"):
        isolated.forward([1], cache)  # a cache of the child that died
    assert isolated.forward([1, 2], isolated.new_cache()).shape == (2, isolated.vocab_size)


def test_a_hang_past_the_deadline_kills_the_child(
    isolated: IsolatedRuntime, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(isolated_runtime, "CALL_DEADLINE_S", 0.5)
    pid = isolated.pid
    assert pid is not None
    os.kill(pid, signal.SIGSTOP)  # alive, holding its pipe, answering nothing
    with pytest.raises(RuntimeLost, match="hung") as lost:
        isolated.forward([1, 2], isolated.new_cache())
    assert lost.value.kind == "hang"
    assert not isolated.up
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)  # killed and reaped


def test_a_draft_that_cannot_load_is_a_start_loss(models_dir: Path) -> None:
    losses: list[RuntimeLost] = []
    runtime = IsolatedRuntime(
        DraftChildSpec(models_dir, "no-such-draft", "onnx"), on_lost=losses.append
    )
    runtime.start()
    with pytest.raises(RuntimeLost, match="could not load") as lost:
        runtime.wait_ready(60.0)
    assert lost.value.kind == "start"
    assert len(losses) == 1 and not runtime.up


MEMORY_CGROUPS = Path("/sys/fs/cgroup/memory")


@pytest.fixture
def memory_cgroup() -> Iterator[Path]:
    """A cgroup v1 memory group of our own (root, as on this host), removed afterwards."""
    group = MEMORY_CGROUPS / f"specfleet-test-{os.getpid()}"
    try:
        group.mkdir()
    except OSError as exc:
        pytest.skip(f"no writable cgroup v1 memory controller here: {exc}")
    yield group
    for pid in (group / "cgroup.procs").read_text().split():  # a survivor goes back to the root
        (MEMORY_CGROUPS / "cgroup.procs").write_text(pid)
    group.rmdir()


def test_an_out_of_memory_kill_is_a_crash_like_any_other(
    isolated: IsolatedRuntime, memory_cgroup: Path
) -> None:
    # What the child allocates from now on may not pass 40 MB; one pass over 2,048 positions
    # needs far more (attention scores, logits), so the kernel's OOM killer ends the child.
    (memory_cgroup / "memory.limit_in_bytes").write_text(str(40 * 2**20))
    assert isolated.pid is not None
    (memory_cgroup / "cgroup.procs").write_text(str(isolated.pid))
    losses: list[RuntimeLost] = []
    isolated.on_lost = losses.append
    with pytest.raises(RuntimeLost, match="SIGKILL") as lost:
        isolated.forward([7] * 2048, isolated.new_cache())
    assert lost.value.kind == "crash" and "out-of-memory" in lost.value.reason
    oom = dict(
        line.split() for line in (memory_cgroup / "memory.oom_control").read_text().splitlines()
    )
    assert int(oom["oom_kill"]) >= 1  # the kernel's OOM killer did it, not someone else
    assert len(losses) == 1
