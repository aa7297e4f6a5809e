"""The agent's neural drafts in supervised child processes: restarts, quarantine, fallback.

`DraftSupervisor` keeps one `IsolatedRuntime` per draft model. A child that crashes (SIGSEGV
in a driver, an OOM kill), hangs past its deadline or cannot load is restarted after a backoff
that doubles with each loss in the window; one lost QUARANTINE_LOSSES times within
QUARANTINE_WINDOW_S is quarantined on this device until the agent restarts, and reported.

`SupervisedProposer` is what a session drafts with: the neural drafter while its child is up,
the copying `hybrid` (lookup and the n-gram table, no native runtime) while it is not. A loss in
the middle of a window costs nothing more than that window's neural part: the same round is
drafted again by the fallback, at once, and the verifier's verdict keeps the output the
target's. Nothing waits for a restart: a round that finds the child still starting drafts with
the fallback, and the neural drafter comes back, with a fresh cache, on the first round after.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import numpy as np

from inference.isolated_runtime import DraftChildSpec, IsolatedRuntime, RuntimeLost
from inference.proposers import Candidates, HybridProposer, Proposer

log = logging.getLogger(__name__)

# Module-level so tests can shorten them. The first restart waits half a second (a crash that
# comes back at once would otherwise spin on spawning); each further loss in the window doubles it.
RESTART_BACKOFF_S = 0.5
RESTART_BACKOFF_MAX_S = 60.0
QUARANTINE_LOSSES = 3
QUARANTINE_WINDOW_S = 300.0
# A session's first neural round waits this long for a child's first load (as an in-process
# load would have blocked); later starts never hold a round up.
FIRST_LOAD_WAIT_S = 60.0

DraftHealthState = Literal["up", "starting", "down", "quarantined"]


@dataclass(frozen=True)
class DraftRuntimeHealth:
    """One draft's child as the agent reports it (local API, telemetry)."""

    name: str
    state: DraftHealthState
    pid: int | None
    starts: int
    losses: int  # in all, since the agent started
    last_loss: str  # the last reason, "" before any
    quarantined: bool


@dataclass
class _Child:
    runtime: IsolatedRuntime
    recent: list[float] = field(default_factory=list)  # monotonic times of losses in the window
    losses: int = 0
    last_loss: str = ""
    next_start: float = 0.0
    quarantine: str | None = None  # the reason, once quarantined

    @property
    def state(self) -> DraftHealthState:
        if self.quarantine is not None:
            return "quarantined"
        if self.runtime.up:
            return "up"
        return "starting" if self.runtime.starting else "down"


class DraftSupervisor:
    """The draft children of one agent, by draft manifest name."""

    def __init__(
        self,
        models_dir: Path,
        *,
        threads: int | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.models_dir = models_dir
        self.threads = threads
        self.clock = clock
        self._children: dict[str, _Child] = {}
        self._lock = threading.Lock()

    def runtime(self, name: str) -> IsolatedRuntime:
        """The runtime of draft `name`, its child started on first use (not waited for)."""
        with self._lock:
            return self._child(name).runtime

    def _child(self, name: str) -> _Child:
        """The draft's child, created and started on first use; called with the lock held."""
        child = self._children.get(name)
        if child is None:
            child = self._children[name] = _Child(IsolatedRuntime(self._spec(name)))
            child.runtime.on_lost = lambda lost, n=name: self._lost(n, lost)
            self._start(name, child)
        return child

    def _spec(self, name: str) -> DraftChildSpec:
        from inference.drafts import list_drafts

        for draft in list_drafts(self.models_dir):
            if draft.manifest.name == name:
                return DraftChildSpec(self.models_dir, name, draft.format, self.threads)
        raise ValueError(f"no draft {name!r} in {self.models_dir}")

    def _start(self, name: str, child: _Child) -> None:
        try:
            child.runtime.start()
        except OSError as exc:  # no process could be spawned (out of memory, of pids)
            self._lost(name, RuntimeLost(f"draft {name}: cannot spawn its runtime: {exc}", "start"))

    def wait_first_load(self, name: str, timeout_s: float = FIRST_LOAD_WAIT_S) -> bool:
        """Wait for the child's first load (as an in-process load would have blocked); a restart
        is never waited for. False when it is not up: failed (a loss), too slow, restarting."""
        runtime = self.runtime(name)
        try:
            return runtime.wait_ready(timeout_s if runtime.generation == 1 else 0.0)
        except RuntimeLost:
            return False

    def available(self, name: str) -> bool:
        """Whether draft `name` can draft now; starts a child that is due for a restart, and
        takes the ready message of one that is starting. Never blocks."""
        with self._lock:
            try:
                # A draft forgotten after an OTA change gets a child with its new files.
                child = self._child(name)
            except ValueError:  # its files are gone
                return False
            if child.quarantine is not None:
                return False
            if not child.runtime.up and not child.runtime.starting:
                if self.clock() < child.next_start:
                    return False
                log.info("draft %s: restarting its runtime process", name)
                self._start(name, child)
        try:
            return child.runtime.poll_ready()
        except RuntimeLost:
            return False

    def _lost(self, name: str, lost: RuntimeLost) -> None:
        # Called by the runtime (with its own lock held) or by `_start`; ours may be held too.
        child = self._children[name]
        now = self.clock()
        child.losses += 1
        child.last_loss = lost.reason
        child.recent = [t for t in child.recent if now - t < QUARANTINE_WINDOW_S] + [now]
        if len(child.recent) >= QUARANTINE_LOSSES:
            child.quarantine = (
                f"{len(child.recent)} losses within {QUARANTINE_WINDOW_S:.0f}s, the last: "
                f"{lost.reason}"
            )
            log.error("draft %s quarantined on this device: %s", name, child.quarantine)
            return
        backoff = min(RESTART_BACKOFF_MAX_S, RESTART_BACKOFF_S * 2 ** (len(child.recent) - 1))
        child.next_start = now + backoff
        log.warning("draft %s: %s; restart in %.1fs", name, lost.kind, backoff)

    def quarantined(self) -> dict[str, str]:
        """The quarantined drafts and why."""
        with self._lock:
            return {
                name: child.quarantine
                for name, child in self._children.items()
                if child.quarantine is not None
            }

    def health(self) -> list[DraftRuntimeHealth]:
        with self._lock:
            return [
                DraftRuntimeHealth(
                    name,
                    child.state,
                    child.runtime.pid if child.runtime.up else None,
                    child.runtime.generation,
                    child.losses,
                    child.last_loss,
                    child.quarantine is not None,
                )
                for name, child in sorted(self._children.items())
            ]

    def forget(self, name: str) -> None:
        """The draft's files changed: stop its child, so that the next start loads them (its
        sessions draft with the fallback for a round or two meanwhile). Not a loss."""
        with self._lock:
            child = self._children.pop(name, None)
        if child is not None:
            child.runtime.stop()

    def stop(self) -> None:
        with self._lock:
            children, self._children = list(self._children.values()), {}
        for child in children:
            child.runtime.stop()


class SupervisedProposer(HybridProposer):
    """A session's neural drafter that survives its runtime: the neural one while its child is
    up, the copying fallback while it is not.

    It is a HybridProposer of one tier at a time, so the policy's min_confidence and the other
    walks over a hybrid's parts reach whichever drafter is drafting.
    """

    def __init__(
        self,
        name: str,
        make_neural: Callable[[], Proposer],
        fallback: Proposer,
        available: Callable[[], bool],
    ) -> None:
        super().__init__([fallback], name=name)
        self.make_neural = make_neural
        self.fallback = fallback
        self.available = available
        self.neural: Proposer | None = None
        self.fallback_rounds = 0  # windows the fallback drafted (a round lost counts too)

    @property
    def drafting_with(self) -> str:
        """The drafter behind the last window: this one's name, or the fallback's."""
        return self.name if self.proposers[0] is not self.fallback else self.fallback.name

    def get_candidates(
        self, context_ids: Sequence[int], k: int, rng: np.random.Generator | None = None
    ) -> Candidates:
        if not self.available():
            self.neural = None  # its caches went with the child
        elif self.neural is None:
            try:
                self.neural = self.make_neural()
            except RuntimeLost as exc:
                log.warning("%s: drafting with %s: %s", self.name, self.fallback.name, exc)
        self.proposers = [self.neural or self.fallback]
        if self.neural is not None:
            try:
                return super().get_candidates(context_ids, k, rng)
            except RuntimeLost as exc:
                # The window in flight is all a loss costs: the fallback drafts it again now.
                log.warning(
                    "%s: runtime lost mid-window (%s); drafting with %s until it is back",
                    self.name,
                    exc.reason,
                    self.fallback.name,
                )
                self.neural = None
                self.proposers = [self.fallback]
        self.fallback_rounds += 1
        return super().get_candidates(context_ids, k, rng)

    def rollback(self, committed_len: int) -> None:
        # A neural drafter's rollback only trims its cache's length in the agent: it never
        # reaches the child, so it cannot fail on a lost one.
        for proposer in (self.neural, self.fallback):
            if proposer is not None:
                proposer.rollback(committed_len)


def drafted_by(proposer: Proposer, name: str) -> str:
    """The drafter behind a proposer's last window, for the round's record: a supervised
    drafter's fallback says so, so that its rounds are not counted as the neural draft's."""
    return proposer.drafting_with if isinstance(proposer, SupervisedProposer) else name
