"""Drafts on demand: a device that lacks the draft a session asked for is sent its signed release.

A session that opens on a device lacking its draft says so (`SessionOpen.draft_missing`). The
coordinator then sends that device a `deploy_model` command for the draft's current release,
as a rollout does for one device: the release statement signed with the release key, a download
token for this device, the artifact served by the API (`ops.releases.release_on_demand`; a
draft with no release yet but built in the coordinator's models directory is released first).
The device installs it in the background (signature, size, sha256, files, vocabulary, a smoke
draft) while the session drafts with its copying tiers, and the session switches to the draft
at its first window after the install.

One fetch per (device, draft) at a time. A fetch that fails (refused by the device, rolled back,
no answer, no release here) leaves the device as it was; the same draft is not sent to that
device again for FETCH_BACKOFF_S, doubled with each further failure up to FETCH_BACKOFF_MAX_S,
and meanwhile the policy leaves it out of the device's candidates.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from broker import messages as m
from broker.client import BusConnectionError
from broker.model_release import DeployModelArgs
from coordinator.ops.releases import (
    ReleaseStoreError,
    issue_download_token,
    load_or_create_release_key,
    release_on_demand,
)
from coordinator.runtime.fleet import CommandFailed

log = logging.getLogger(__name__)

# Module-level so tests can shorten them.
FETCH_BACKOFF_S = 60.0
FETCH_BACKOFF_MAX_S = 3600.0
# Downloading tens of megabytes and a smoke draft on a Pi over a slow link takes minutes.
FETCH_TIMEOUT_S = 600.0
DOWNLOAD_TOKEN_SLACK_S = 60.0
HYBRID_PREFIX = "hybrid+"  # inference.drafters.HYBRID_PREFIX

SendCommand = Callable[[str, m.CommandName, dict[str, Any], float], Awaitable[m.CommandAck]]


class FetchObserver(Protocol):
    def set_fetch_failure(self, device_id: str, draft: str, reason: str | None) -> None: ...


@dataclass
class _Failures:
    count: int
    until: float  # monotonic
    reason: str


@dataclass(frozen=True)
class FetchOutcome:
    device_id: str
    draft: str
    ok: bool
    detail: str


class DraftFetches:
    """The drafts being fetched for devices, and the ones that failed lately (backing off)."""

    def __init__(
        self,
        home: Path,
        models_dir: Path,
        artifact_url: str,
        send: SendCommand,
        observer: FetchObserver | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.home = home
        self.models_dir = models_dir
        self.artifact_url = artifact_url.rstrip("/")
        self.send = send
        self.observer = observer
        self.clock = clock
        self._in_flight: dict[tuple[str, str], asyncio.Task[None]] = {}
        self._failed: dict[tuple[str, str], _Failures] = {}
        self.outcomes: list[FetchOutcome] = []  # the latest, newest last

    def want(self, device_id: str, draft: str) -> str:
        """A session on `device_id` asked for `draft`, which it lacks: fetch it unless a fetch
        runs or the last one failed lately. Returns what was done, for the log."""
        model = draft.removeprefix(HYBRID_PREFIX)
        key = (device_id, model)
        if key in self._in_flight:
            return f"{model} is being fetched for {device_id}"
        failed = self._failed.get(key)
        if failed is not None and self.clock() < failed.until:
            return (
                f"not fetching {model} for {device_id} again for "
                f"{failed.until - self.clock():.0f}s: {failed.reason}"
            )
        task = asyncio.create_task(self._fetch(device_id, model), name=f"fetch-{model}")
        self._in_flight[key] = task
        task.add_done_callback(lambda _: self._in_flight.pop(key, None))
        return f"fetching {model} for {device_id}"

    def backing_off(self, device_id: str, draft: str) -> str | None:
        """Why `draft` is not fetched for `device_id` now, or None."""
        failed = self._failed.get((device_id, draft.removeprefix(HYBRID_PREFIX)))
        return failed.reason if failed is not None and self.clock() < failed.until else None

    async def _fetch(self, device_id: str, model: str) -> None:
        try:
            stored = await asyncio.to_thread(release_on_demand, self.home, self.models_dir, model)
            if stored is None:
                raise ReleaseStoreError(f"the coordinator has no release of {model}")
            release = stored.release
            key = await asyncio.to_thread(load_or_create_release_key, self.home)
            ttl_s = FETCH_TIMEOUT_S + DOWNLOAD_TOKEN_SLACK_S
            args = DeployModelArgs(
                deployment_id=0,
                **release.model_dump(),
                url=f"{self.artifact_url}/artifacts/{release.sha256}",
                signature=stored.signature,
                download_token=issue_download_token(key, release.sha256, device_id, ttl_s),
            )
            log.info(
                "drafts on demand: sending %s %d (%s, %.1f MB) to %s",
                model,
                release.version,
                release.sha256[:12],
                release.size_bytes / 1e6,
                device_id,
            )
            ack = await self.send(
                device_id, m.CommandName.DEPLOY_MODEL, args.to_args(), FETCH_TIMEOUT_S
            )
        except (ReleaseStoreError, CommandFailed) as exc:  # refused, rolled back, no answer
            self._failure(device_id, model, str(exc))
        except (asyncio.TimeoutError, ConnectionError, BusConnectionError) as exc:
            self._failure(device_id, model, f"no answer: {exc or type(exc).__name__}")
        except Exception as exc:  # a send that failed for any other reason: back off too
            log.exception("drafts on demand: fetching %s for %s", model, device_id)
            self._failure(device_id, model, f"{type(exc).__name__}: {exc}")
        else:
            if ack.ok:
                self._success(device_id, model, str(ack.result.get("state", "installed")))
            else:
                self._failure(device_id, model, ack.error or "refused")

    def _success(self, device_id: str, model: str, state: str) -> None:
        self._failed.pop((device_id, model), None)
        if self.observer is not None:
            self.observer.set_fetch_failure(device_id, model, None)
        log.info("drafts on demand: %s %s on %s", model, state, device_id)
        self._record(FetchOutcome(device_id, model, True, state))

    def _failure(self, device_id: str, model: str, reason: str) -> None:
        key = (device_id, model)
        count = self._failed[key].count + 1 if key in self._failed else 1
        backoff = min(FETCH_BACKOFF_MAX_S, FETCH_BACKOFF_S * 2 ** (count - 1))
        self._failed[key] = _Failures(count, self.clock() + backoff, reason)
        if self.observer is not None:
            self.observer.set_fetch_failure(device_id, model, reason)
            # The policy may consider the draft again once the backoff is over (the count of
            # failures stays, so that the next failure backs off longer).
            asyncio.get_running_loop().call_later(backoff, self._backoff_over, key, count)
        log.warning(
            "drafts on demand: %s for %s failed (%s); not asked again for %.0fs",
            model,
            device_id,
            reason,
            backoff,
        )
        self._record(FetchOutcome(device_id, model, False, reason))

    def _backoff_over(self, key: tuple[str, str], count: int) -> None:
        failed = self._failed.get(key)
        if failed is not None and failed.count == count and self.observer is not None:
            self.observer.set_fetch_failure(*key, None)

    def _record(self, outcome: FetchOutcome) -> None:
        self.outcomes = [*self.outcomes[-63:], outcome]

    async def aclose(self) -> None:
        tasks = list(self._in_flight.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
