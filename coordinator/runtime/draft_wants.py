"""Drafters a device lacks that the fleet can deliver, as the adaptive policy rates them.

The policy rates the drafters a device has. A drafter the coordinator can release (built in its
models directory, or released already: `deliverable_drafts`) that the device lacks is rated too,
from what the fleet knows of it: its acceptance on the session's task across every device that
ran it (else its prior: the acceptance its build measured on held-out answers), its cost per
drafted token on devices of the same class (the status message's `kind`; else the prior), and
whether its estimated resident cost fits the memory the device reports free
(`inference.resident`, the device's own admission estimate, plus the device's default margin).
When one promises FETCH_MARGIN times the tokens/s of the best drafter the device has, the policy
asks for it to be fetched (drafts on demand), once per device and drafter: the session keeps
drafting with what the device has, and the drafter is rated with the others once the device's
status lists it. A fetch that failed keeps the drafter out while it backs off (`DraftFetches`),
and it is asked for again only after that.

Pure, like the policy: the catalogue is handed in; only `deliverable_drafts`, which the service
calls, reads files.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from coordinator.ops.releases import (
    RELEASES_DIR,
    ReleaseStoreError,
    current_version,
    released_manifest,
)
from coordinator.runtime.decisions import Candidate
from coordinator.runtime.round_model import PRIOR_ALPHA_WEIGHT, AcceptanceRate, Ewma
from inference.artifacts import (
    DECODER,
    MANIFEST_FILE,
    ArtifactError,
    ModelManifest,
    load_manifest,
)
from inference.resident import MB, resident_bytes

if TYPE_CHECKING:  # the policy imports this module
    from coordinator.runtime.policy import RoundObservation

log = logging.getLogger(__name__)

# A drafter the device lacks must promise this many times the tokens/s of the best one it has
# before it is fetched: a fetch costs the device a download, an install and a smoke draft.
FETCH_MARGIN = 1.2
# The memory a device keeps free beyond a draft's estimate (the agent's --memory-margin default).
DEVICE_MEMORY_MARGIN_MB = 64.0
TIME_DECAY = 0.8  # as the policy's


@dataclass(frozen=True)
class Deliverable:
    """A drafter the coordinator can send a device, and what it costs resident there."""

    name: str
    resident_mb: float
    # What its build measured of it: the share of held-out positions where it predicts the
    # target's next token (the manifest's `valid_top1`), its acceptance before any round.
    prior_alpha: float | None = None
    # The drafter it is a build of (the manifest's `extra.draft`: draft-l1-tflite is draft-l1 for
    # LiteRT): a device that has or is fetching one build is not sent another.
    family: str = ""


def deliverable_drafts(home: Path, models_dir: Path) -> dict[str, Deliverable]:
    """The drafters `DraftFetches` can send: the decoder drafts built in `models_dir` and those
    released here (a release's manifest is its model directory's, when that is still here).
    A draft whose manifest cannot be read is left out, with a log line."""
    found: dict[str, Deliverable] = {}
    names = {p.parent.name for p in models_dir.glob(f"*/{MANIFEST_FILE}")}
    releases = home / RELEASES_DIR
    if releases.is_dir():
        names |= {
            p.stem for p in releases.glob("*.json") if current_version(home, p.stem) is not None
        }
    for name in sorted(names):
        try:
            if (models_dir / name / MANIFEST_FILE).is_file():
                manifest: ModelManifest | None = load_manifest(models_dir / name)
            else:
                manifest = released_manifest(home, name)
        except (ArtifactError, ReleaseStoreError, OSError, ValueError) as exc:
            log.warning("drafts on demand: %s left out: %s", name, exc)
            continue
        if manifest is not None and manifest.role == "draft" and manifest.kind == DECODER:
            prior = manifest.extra.get("valid_top1")
            found[name] = Deliverable(
                name,
                resident_bytes(manifest, isolated=True) / MB,
                float(prior) if isinstance(prior, int | float) and 0 < prior < 1 else None,
                str(manifest.extra.get("draft") or name),
            )
    return found


def over_memory_note(over: Sequence[str], available: float | None) -> str | None:
    """The decision's note on a device's drafts that its free memory leaves out, or None."""
    if not over:
        return None
    free = f"the {available:.0f} MB free" if available is not None else "its free memory"
    return f"memory: {', '.join(over)} do not fit {free} on the device"


@dataclass(frozen=True)
class FetchWish:
    """A drafter the device lacks, rated over the best one it has: fetch it."""

    draft_model: str
    wanted: Candidate
    best_installed: Candidate

    @property
    def reason(self) -> str:
        w, b = self.wanted, self.best_installed
        return (
            f"{w.draft_model} would give {w.expected_tokens:.1f} tok/round, "
            f"{w.tokens_per_s:.1f} tok/s vs {b.draft_model} {b.expected_tokens:.1f}, "
            f"{b.tokens_per_s:.1f}: fetching it for this device"
        )


@dataclass
class DraftWants:
    """What the policy knows of drafters beyond one device, and which it asked to fetch."""

    deliverable: dict[str, Deliverable] = field(default_factory=dict)
    kinds: dict[str, str] = field(default_factory=dict)  # device -> class
    free_mb: dict[str, float] = field(default_factory=dict)  # device -> MB a new load may take
    # (draft, task) -> acceptance over the fleet; (class, draft) -> ms per drafted token
    fleet_alpha: dict[tuple[str, str], AcceptanceRate] = field(default_factory=dict)
    class_ms: dict[tuple[str, str], Ewma] = field(default_factory=dict)
    # draft -> acceptance over the fleet on every task: a task it has not run yet starts here
    fleet_draft_alpha: dict[str, AcceptanceRate] = field(default_factory=dict)
    asked: dict[str, set[str]] = field(default_factory=dict)  # device -> drafts being fetched

    def observe(self, round_: RoundObservation, ms: float | None) -> None:
        """A round drafted on `round_.device_id` (ms: per drafted token there, None for a round
        drafted elsewhere or not at all)."""
        device_id, draft = round_.device_id, round_.draft_model
        k, n_accepted, task = round_.k, round_.n_accepted, round_.task_type
        rate = self.fleet_alpha.setdefault((draft, task), AcceptanceRate())
        rate.update(k, n_accepted)
        self.fleet_draft_alpha.setdefault(draft, AcceptanceRate()).update(k, n_accepted)
        kind = self.kinds.get(device_id)
        if kind is not None and ms is not None:
            cost = self.class_ms.get((kind, draft))
            if cost is None:
                self.class_ms[(kind, draft)] = Ewma(ms)
            else:
                cost.update(ms, TIME_DECAY)

    def alpha(self, draft: str, task: str) -> float | None:
        """The fleet's acceptance of `draft` on `task`, else on any task, else the drafter's
        prior (what its build measured), else None."""
        rate = self.fleet_alpha.get((draft, task)) or self.fleet_draft_alpha.get(draft)
        if rate is not None:
            return rate.alpha
        deliverable = self.deliverable.get(draft)
        return None if deliverable is None else deliverable.prior_alpha

    def unseen_alpha(
        self, rates: dict[tuple[str, str], AcceptanceRate], draft: str, task: str
    ) -> float:
        """The acceptance of `draft` on `task` for a device that has no round of it on the
        task, from its `rates` by (draft, task): what it does with the draft on any task, else
        the fleet's on the task (or the build's), else what its other drafts see on the task."""
        seen = [r for (d, _), r in rates.items() if d == draft]
        if seen:
            pooled = AcceptanceRate(
                accepted=sum(r.accepted for r in seen), tried=sum(r.tried for r in seen)
            )
            return pooled.alpha
        fleet = self.alpha(draft, task)
        if fleet is not None:
            return fleet
        # A draft this device never ran: what its other drafts see on this task, held as lightly
        # as the prior, so that a draft is tried on its merits, not on hope.
        device = [r for (_, t), r in rates.items() if t == task]
        if device:
            accepted = sum(r.accepted for r in device)
            tried = sum(r.tried for r in device)
            return AcceptanceRate(
                accepted=PRIOR_ALPHA_WEIGHT * accepted / tried, tried=PRIOR_ALPHA_WEIGHT
            ).alpha
        return AcceptanceRate().alpha

    def class_cost(self, device_id: str, draft: str) -> float | None:
        kind = self.kinds.get(device_id)
        cost = None if kind is None else self.class_ms.get((kind, draft))
        return None if cost is None else cost.value

    def installed(self, device_id: str, drafts: Iterable[str]) -> None:
        """The device's status: drafts it has are no longer being fetched."""
        asked = self.asked.get(device_id)
        if asked:
            asked.difference_update(d.removeprefix("hybrid+") for d in drafts)

    def failed(self, device_id: str, draft: str) -> None:
        """A fetch failed: asked for again only once its backoff is over."""
        self.asked.get(device_id, set()).discard(draft)

    def lacking(
        self, device_id: str, has: Iterable[str], left_out: Iterable[str]
    ) -> tuple[list[str], list[str]]:
        """(drafters to rate for the device, notes on those left out for its free memory).
        Not those it has, is fetching already, or `left_out` (failed fetches backing off)."""
        skip = {d.removeprefix("hybrid+") for d in (*has, *left_out)}
        skip |= self.asked.get(device_id, set())
        held = {self._family(d) for d in (*has, *self.asked.get(device_id, set()))}
        free = self.free_mb.get(device_id)
        names, notes = [], []
        for name, draft in sorted(self.deliverable.items()):
            if name in skip or (draft.family or name) in held:
                continue
            if free is not None and draft.resident_mb + DEVICE_MEMORY_MARGIN_MB > free:
                notes.append(
                    f"{name} needs {draft.resident_mb:.0f} MB, {free:.0f} MB free: not fetched"
                )
                continue
            names.append(name)
        return names, notes

    def _family(self, draft: str) -> str:
        name = draft.removeprefix("hybrid+")
        deliverable = self.deliverable.get(name)
        return deliverable.family if deliverable is not None and deliverable.family else name

    def wanted(
        self,
        device_id: str,
        has: Iterable[str] | None,
        left_out: Iterable[str],
        installed: Sequence[Candidate],
        rate: Callable[[str], Candidate],
    ) -> tuple[str | None, str | None]:
        """(the drafter to fetch for the device, what the round's reason says of it): the
        lacking one `rate` rates highest (ties: by name), when it promises FETCH_MARGIN times
        the tokens/s of the best of `installed` (the candidates of what it has) and no other is
        being fetched for the device; else None, and
        what is being fetched or left out. `has`: its drafts, None while its status is unheard
        (then nothing is fetched: it may have them all)."""
        if has is None:
            return None, None
        names, notes = self.lacking(device_id, has, left_out)
        best_installed = max(installed, key=lambda c: c.tokens_per_s, default=None)
        wish: FetchWish | None = None
        # One fetch at a time per device: the next is judged against the one being fetched,
        # once installed.
        if best_installed is not None and names and not self.asked.get(device_id):
            rated = sorted((rate(n) for n in names), key=lambda c: (-c.tokens_per_s, c.draft_model))
            if rated[0].tokens_per_s > best_installed.tokens_per_s * FETCH_MARGIN:
                wish = FetchWish(rated[0].draft_model, rated[0], best_installed)
        fetching = self.fetching_note(device_id)
        said = [wish.reason] if wish else [fetching] if fetching else []
        return (wish.draft_model if wish else None), "; ".join([*said, *notes]) or None

    def fetching(self, device_id: str, draft: str) -> None:
        """The fetcher was asked for `draft` for the device: not asked again while it runs."""
        self.asked.setdefault(device_id, set()).add(draft)

    def fetching_note(self, device_id: str) -> str | None:
        asked = self.asked.get(device_id)
        return f"being fetched for this device: {', '.join(sorted(asked))}" if asked else None
