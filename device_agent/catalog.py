"""The drafters this device can run, by name, with built drafters kept for the next session.

Names follow `inference.drafters`: `lookup`, `ngram`, `hybrid`, a draft's manifest name
(`draft-l1` for its ONNX build, `draft-l1-tflite` for its TFLite build) and `hybrid+NAME`. A bare
family name means the build in the runtime the settings prefer, when the device holds both.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from device_agent.admission import MemoryAdmission, MemoryRefused, StandInProposer, resident_bytes
from inference.artifacts import ArtifactError, check_same_vocabulary, load_manifest, with_vocab
from inference.drafters import (
    BUILTIN_DRAFTERS,
    DEFAULT_NGRAM_TABLE,
    HYBRID,
    HYBRID_PREFIX,
    LOOKUP,
    DrafterError,
    default_k,
    make_proposer,
)
from inference.tokenizer import CHAT_FORMAT_FILE, TOKENIZER_FILE, ChatTokenizer

if TYPE_CHECKING:
    from device_agent.draft_supervisor import DraftRuntimeHealth, DraftSupervisor
    from inference.drafts import DraftInfo, DraftRuntimeKind
    from inference.feature_head import HeadInfo
    from inference.proposers import Proposer


class CatalogError(Exception):
    """No tokenizer on the device, or a drafter it cannot run."""


def find_tokenizer_dir(models_dir: Path, target: str | None = None) -> Path | None:
    """The first model directory under `models_dir` that carries the tokenizer files; with a
    `target`, that target's directory or a draft built for it."""
    if not models_dir.is_dir():
        return None
    for directory in sorted(p for p in models_dir.iterdir() if p.is_dir()):
        has_files = (directory / TOKENIZER_FILE).is_file() and (
            directory / CHAT_FORMAT_FILE
        ).is_file()
        if has_files and (target is None or target in (directory.name, _built_for(directory))):
            return directory
    return None


def _built_for(directory: Path) -> str | None:
    """The target a draft's manifest says it was built for."""
    try:
        return str(load_manifest(directory).extra.get("target"))
    except ArtifactError:
        return None


class DrafterCatalog:
    """Hands each session a drafter of its own and takes it back when the session ends.

    A drafter holds per-sequence state (a neural draft's KV cache), so two sessions never share
    one; a returned drafter is rolled back to empty and reused, which spares the next session
    the runtime's load (0.03-0.2 s for the small drafts, measured here). Every method may be
    called from the event loop or from the agent's drafting thread, hence the lock.

    With `isolate`, every neural draft runs in a supervised child process of its own
    (`device_agent.draft_supervisor`): its sessions draft with the copying hybrid while it is
    down, and `stop` ends the children.

    With `admission`, a neural drafter is loaded only when its estimated resident cost fits the
    memory available now, with a margin (`device_agent.admission`); `acquire` raises
    MemoryRefused otherwise, and `stand_in` gives a session the copying fallback meanwhile.
    """

    def __init__(
        self,
        models_dir: Path,
        *,
        tokenizer_dir: Path | None = None,
        target: str | None = None,
        runtime: DraftRuntimeKind = "onnx",
        threads: int | None = None,
        ngram_path: Path = DEFAULT_NGRAM_TABLE,
        isolate: bool = False,
        admission: MemoryAdmission | None = None,
    ) -> None:
        self.models_dir = models_dir
        self.tokenizer_dir = tokenizer_dir
        self.target = target
        self.runtime = runtime
        self.threads = threads
        self.ngram_path = ngram_path
        self._lock = threading.Lock()
        self._idle: dict[tuple[str, float], list[Proposer]] = {}
        self._tokenizer: ChatTokenizer | None = None
        self._drafts: list[DraftInfo] | None = None
        self._heads: list[HeadInfo] | None = None
        self.admission = admission
        # Why the last fetch of a model failed here (drafts on demand), or None; the agent
        # sets it from its model store.
        self.fetch_failure: Callable[[str], str | None] = lambda name: None
        self.supervisor: DraftSupervisor | None = None
        if isolate:
            from device_agent.draft_supervisor import DraftSupervisor

            self.supervisor = DraftSupervisor(models_dir, threads=threads)

    def _list_drafts(self) -> list[DraftInfo]:
        with self._lock:
            if self._drafts is None:
                from inference.drafts import list_drafts

                self._drafts = list_drafts(self.models_dir)
            return self._drafts

    def _list_heads(self) -> list[HeadInfo]:
        with self._lock:
            if self._heads is None:
                from inference.feature_head import list_heads

                self._heads = list_heads(self.models_dir)
            return self._heads

    def _built(self) -> list[DraftInfo | HeadInfo]:
        """The drafts and feature heads on this device."""
        return [*self._list_drafts(), *self._list_heads()]

    def names(self) -> list[str]:
        """Every drafter name `acquire` accepts here (neural ones only when their files exist)."""
        table = self.ngram_path.is_file()
        builtins = [name for name in BUILTIN_DRAFTERS if name == LOOKUP or table]
        models = sorted({d.manifest.name for d in self._built()})
        return [*builtins, *models, *(HYBRID_PREFIX + name for name in models)]

    def has(self, name: str) -> bool:
        return name in self.names()

    def default_k(self, name: str) -> int:
        return default_k(name)

    def is_neural(self, name: str) -> bool:
        """Whether drafting with `name` runs a model (and so belongs on the drafting thread)."""
        return name not in BUILTIN_DRAFTERS

    def resolve(self, name: str) -> str:
        """The manifest name behind a drafter name: a family name picks the preferred runtime."""
        if name.startswith(HYBRID_PREFIX):
            return HYBRID_PREFIX + self.resolve(name[len(HYBRID_PREFIX) :])
        family = [d for d in self._built() if d.name == name]
        preferred = [d for d in family if d.format == self.runtime]
        chosen = preferred or family
        return chosen[0].manifest.name if chosen else name

    def tokenizer(self) -> ChatTokenizer:
        with self._lock:
            if self._tokenizer is None:
                directory = self.tokenizer_dir or find_tokenizer_dir(self.models_dir, self.target)
                if directory is None or not (directory / TOKENIZER_FILE).is_file():
                    where = self.tokenizer_dir or self.models_dir
                    target = f" for target {self.target!r}" if self.target else ""
                    raise CatalogError(
                        f"no {TOKENIZER_FILE} and {CHAT_FORMAT_FILE}{target} in {where}: set "
                        "tokenizer_dir or models_dir to a directory with the target's tokenizer"
                    )
                self._tokenizer = ChatTokenizer.load(directory)
            return self._tokenizer

    def vocabulary(self) -> str | None:
        """The vocabulary hash of this device's tokenizer (its target's); None without one."""
        try:
            return self.tokenizer().vocab_sha256
        except CatalogError:
            return None

    def check_vocabulary(self, name: str) -> None:
        """Refuse a neural drafter built for another target than this device's tokenizer's."""
        resolved = self.resolve(name).removeprefix(HYBRID_PREFIX)
        for draft in self._list_drafts():
            if draft.manifest.name == resolved:
                expected = self.tokenizer().vocab_sha256
                try:
                    manifest = with_vocab(draft.directory, draft.manifest)
                    check_same_vocabulary(manifest, expected, "this device's target")
                except ArtifactError as exc:
                    raise CatalogError(f"drafter {name!r} refused: {exc}") from None

    def acquire(self, name: str, temperature: float = 0.0) -> Proposer:
        """A drafter for one session; a neural one samples at `temperature` from its top-K q'."""
        if not self.has(name):
            raise CatalogError(
                f"unknown drafter {name!r}; this device has: {', '.join(self.names())}"
            )
        self.check_vocabulary(name)
        key = (self.resolve(name), temperature)
        with self._lock:
            idle = self._idle.get(key)
            if idle:
                return idle.pop()
        refusal = self.memory_refusal(name)
        if refusal is not None:
            raise MemoryRefused(refusal)
        try:
            if self.supervisor is not None and self._is_draft(key[0]):
                return self._supervised(key[0], temperature, self.supervisor)
            return make_proposer(
                key[0],
                self.models_dir,
                temperature=temperature,
                ngram_path=self.ngram_path,
                threads=self.threads,
            )
        except (DrafterError, ImportError, OSError, ValueError) as exc:
            raise CatalogError(f"cannot load drafter {name!r}: {exc}") from exc

    def _model(self, name: str) -> DraftInfo | HeadInfo | None:
        """The built draft or head a drafter name runs; None for the copying drafters."""
        model = self.resolve(name).removeprefix(HYBRID_PREFIX)
        return next((d for d in self._built() if d.manifest.name == model), None)

    def memory_needed(self, name: str) -> int:
        """Bytes that loading drafter `name` for one more session would take (0: copying)."""
        built = self._model(name)
        if built is None:
            return 0
        isolated = self.supervisor is not None and self._is_draft(built.manifest.name)
        if isolated and self._child_loaded(built.manifest.name):
            return resident_bytes(built.manifest, False) - resident_bytes(built.manifest, False, 0)
        return resident_bytes(built.manifest, isolated)

    def _child_loaded(self, model: str) -> bool:
        """Whether a draft child holds `model` already (its sessions share it)."""
        health = self.supervisor.health() if self.supervisor is not None else []
        return any(h.name == model and h.state in ("up", "starting") for h in health)

    def memory_refusal(self, name: str) -> str | None:
        """Why drafter `name` cannot be loaded now for want of memory; None when it fits."""
        if self.admission is None:
            return None
        needs = self.memory_needed(name)
        return None if needs == 0 else self.admission.refusal(name, needs)

    def over_memory(self) -> list[str]:
        """The neural drafters on this device that would not fit the memory available now."""
        if self.admission is None:
            return []
        reading = self.admission.read()
        if reading.available_bytes is None:
            return []
        room = reading.available_bytes - self.admission.margin_bytes
        models = sorted({d.manifest.name for d in self._built()})
        return [name for name in models if self.memory_needed(name) > room]

    def fallback(self, temperature: float = 0.0) -> Proposer:
        """A drafter that needs no native runtime and nearly no memory: the copying hybrid,
        or lookup without an n-gram table."""
        name = HYBRID if self.ngram_path.is_file() else LOOKUP
        with self._lock:
            idle = self._idle.get((name, temperature))
            if idle:
                return idle.pop()
        return make_proposer(
            name, self.models_dir, temperature=temperature, ngram_path=self.ngram_path
        )

    def stand_in(
        self,
        name: str,
        temperature: float = 0.0,
        fallback: Proposer | None = None,
        fetching: bool = False,
    ) -> StandInProposer:
        """A drafter for `name` that drafts with `fallback` (default: the copying one) until
        `name` is on this device and fits its memory, then with `name` itself."""

        def available() -> bool:
            return self.has(name) and self.memory_refusal(name) is None

        def why() -> str:
            if not self.has(name):
                failed = self.fetch_failure(name.removeprefix(HYBRID_PREFIX))
                if failed is not None:
                    return f"{name} is not on this device: its fetch failed ({failed})"
                return f"{name} is not on this device" + (" (fetching it)" if fetching else "")
            return self.memory_refusal(name) or f"{name} is loading"

        return StandInProposer(
            name,
            lambda: self.acquire(name, temperature),
            fallback if fallback is not None else self.fallback(temperature),
            available,
            why,
            errors=(CatalogError,),
        )

    def _is_draft(self, resolved: str) -> bool:
        """Whether a drafter runs a draft model (feature heads stay in this process)."""
        model = resolved.removeprefix(HYBRID_PREFIX)
        return any(d.manifest.name == model for d in self._list_drafts())

    def _supervised(
        self, resolved: str, temperature: float, supervisor: DraftSupervisor
    ) -> Proposer:
        from device_agent.draft_supervisor import SupervisedProposer

        model = resolved.removeprefix(HYBRID_PREFIX)
        supervisor.wait_first_load(model)

        def neural() -> Proposer:
            return make_proposer(
                resolved,
                self.models_dir,
                temperature=temperature,
                ngram_path=self.ngram_path,
                load_runtime=supervisor.runtime,
            )

        # The fallback needs no native runtime: the copying hybrid, or lookup without a table.
        fallback = make_proposer(
            HYBRID if self.ngram_path.is_file() else LOOKUP,
            self.models_dir,
            temperature=temperature,
            ngram_path=self.ngram_path,
        )
        return SupervisedProposer(
            resolved,
            neural,
            fallback,
            lambda: supervisor.available(model),
        )

    def runtime_health(self) -> list[DraftRuntimeHealth]:
        """The draft children and their state; empty when drafts run in this process."""
        return [] if self.supervisor is None else self.supervisor.health()

    def stop(self) -> None:
        """End the draft children, if any."""
        if self.supervisor is not None:
            self.supervisor.stop()

    def forget(self, name: str) -> None:
        """A model's files changed (an OTA install or rollback): list drafts and load it afresh.

        Sessions drafting with the old version keep it until they end; new ones get the new one.
        Isolated, the old version's child stops: its sessions draft with the fallback until the
        new one's child is up.
        """
        with self._lock:
            self._drafts = None
            self._heads = None
            for key in [k for k in self._idle if k[0] in (name, HYBRID_PREFIX + name)]:
                del self._idle[key]
        if self.supervisor is not None:
            self.supervisor.forget(name)

    def release(self, name: str, temperature: float, proposer: Proposer) -> None:
        """Take a drafter back once its session no longer drafts with it."""
        if isinstance(proposer, StandInProposer):  # each part goes back under its own name
            for part in proposer.parts():
                self.release(part.name, temperature, part)
            return
        proposer.rollback(0)
        key = (self.resolve(name), temperature)
        with self._lock:
            self._idle.setdefault(key, []).append(proposer)
