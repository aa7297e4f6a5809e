"""Memory admission: what a new load may take (MemAvailable, a cgroup v2's room), a draft refused
when it does not fit with the margin, and a stand-in that drafts with the copying fallback until
the draft fits, then with the draft itself, on the real drafts."""

from __future__ import annotations

from pathlib import Path

import pytest

from device_agent.admission import (
    MB,
    MemoryAdmission,
    MemoryRefused,
    StandInProposer,
    read_memory,
    resident_bytes,
)
from device_agent.catalog import DrafterCatalog
from device_agent.draft_supervisor import drafted_by
from inference.tokenizer import ChatTokenizer

MARGIN = 64 * MB


def _proc(root: Path, available_kb: int, cgroup: str | None = None) -> Path:
    proc = root / "proc"
    (proc / "self").mkdir(parents=True, exist_ok=True)
    (proc / "meminfo").write_text(
        f"MemTotal:       16000000 kB\nMemFree:          100000 kB\n"
        f"MemAvailable:   {available_kb:>8} kB\nBuffers:           10000 kB\n"
    )
    if cgroup is not None:
        (proc / "self" / "cgroup").write_text(f"0::{cgroup}\n")
    return proc


def _cgroup(sys_root: Path, path: str, limit: str, current: int) -> None:
    directory = sys_root / "fs" / "cgroup" / path.strip("/")
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "memory.max").write_text(f"{limit}\n")
    (directory / "memory.current").write_text(f"{current}\n")


def test_memory_available_comes_from_meminfo(tmp_path: Path) -> None:
    proc = _proc(tmp_path, 512_000)
    reading = read_memory(proc, tmp_path / "sys")
    assert reading.available_bytes == 512_000 * 1024
    assert reading.source == "meminfo"


def test_a_tighter_cgroup_limit_wins_and_its_parents_count(tmp_path: Path) -> None:
    sys_root = tmp_path / "sys"
    proc = _proc(tmp_path, 4_000_000, cgroup="/agents/agent-1")
    _cgroup(sys_root, "/agents/agent-1", "max", 10 * MB)  # no limit of its own
    _cgroup(sys_root, "/agents", str(300 * MB), 200 * MB)  # its parent leaves 100 MB
    reading = read_memory(proc, sys_root)
    assert reading.source == "cgroup"
    assert reading.available_bytes == 100 * MB


def test_no_meminfo_reads_as_unknown_and_admits(tmp_path: Path) -> None:
    reading = read_memory(tmp_path / "nothing", tmp_path / "nothing")
    assert reading.available_bytes is None
    admission = MemoryAdmission(MARGIN, lambda: reading)
    assert admission.refusal("draft-l2", 10**12) is None


def test_the_refusal_names_the_draft_what_it_needs_what_is_free_and_the_margin(
    tmp_path: Path,
) -> None:
    proc = _proc(tmp_path, 40 * 1024)
    admission = MemoryAdmission(MARGIN, lambda: read_memory(proc, tmp_path / "sys"))
    assert admission.refusal("draft-l2", 61 * MB) == (
        "memory: draft-l2 needs 61 MB, 40 MB available (margin 64 MB)"
    )
    _proc(tmp_path, 200 * 1024)
    assert admission.refusal("draft-l2", 200 * MB - MARGIN) is None  # just fits
    assert admission.refusal("draft-l2", 200 * MB - MARGIN + 1) is not None


def _catalog(models_dir: Path, proc: Path, sys_root: Path) -> DrafterCatalog:
    admission = MemoryAdmission(MARGIN, lambda: read_memory(proc, sys_root))
    return DrafterCatalog(models_dir, admission=admission)


def _needs_draft(catalog: DrafterCatalog, name: str) -> None:
    if not catalog.has(name):
        pytest.skip(f"{name} is not built in {catalog.models_dir}")


def test_a_draft_that_does_not_fit_is_refused_and_one_that_fits_loads(
    models_dir: Path, tmp_path: Path
) -> None:
    proc = _proc(tmp_path, 100 * 1024)  # 100 MB free
    catalog = _catalog(models_dir, proc, tmp_path / "sys")
    _needs_draft(catalog, "draft-l2")
    needs = catalog.memory_needed("draft-l2")
    # The estimate covers what ONNX Runtime holds for it (161 MB measured after the load).
    assert needs > 150 * MB
    with pytest.raises(MemoryRefused, match=r"^memory: draft-l2 needs \d+ MB, 100 MB available"):
        catalog.acquire("draft-l2")
    assert catalog.over_memory() == sorted(catalog.over_memory())
    assert "draft-l2" in catalog.over_memory()
    # The copying drafters need nothing.
    assert catalog.memory_needed("hybrid") == 0
    catalog.acquire("hybrid")
    _proc(tmp_path, (needs + MARGIN) // 1024 + 1024)
    assert catalog.memory_refusal("draft-l2") is None
    assert "draft-l2" not in catalog.over_memory()
    catalog.acquire("draft-l2")


def test_a_stand_in_drafts_with_the_fallback_until_the_draft_fits_then_with_it(
    models_dir: Path, tmp_path: Path, tokenizer: ChatTokenizer
) -> None:
    proc = _proc(tmp_path, 100 * 1024)
    catalog = _catalog(models_dir, proc, tmp_path / "sys")
    _needs_draft(catalog, "draft-l2")
    import device_agent.admission as admission

    admission.STAND_IN_LOOK_EVERY_S = 0.0
    stand_in = catalog.stand_in("draft-l2")
    assert isinstance(stand_in, StandInProposer)
    context = tokenizer.apply_chat_template("Write a Python function that adds two numbers.")
    stand_in.get_candidates(context, 4)
    assert drafted_by(stand_in, "draft-l2") == "hybrid"
    assert stand_in.note is not None and stand_in.note.startswith("memory: draft-l2 needs ")
    _proc(tmp_path, (catalog.memory_needed("draft-l2") + MARGIN) // 1024 + 1024)
    proposal = stand_in.get_candidates(context, 4)
    assert drafted_by(stand_in, "draft-l2") == "draft-l2"
    assert stand_in.note is None
    assert proposal.n == 4  # a neural draft fills its window
    # At the session's end each part goes back under its own name, for the next session.
    catalog.release("draft-l2", 0.0, stand_in)
    assert catalog.acquire("draft-l2") is stand_in.neural


def test_resident_cost_counts_weights_cache_and_a_child_process(models_dir: Path) -> None:
    catalog = DrafterCatalog(models_dir)
    _needs_draft(catalog, "draft-l1")
    built = catalog._model("draft-l1")
    assert built is not None
    in_process = resident_bytes(built.manifest, isolated=False)
    assert resident_bytes(built.manifest, isolated=True) > in_process
    assert in_process > built.manifest.size_bytes * 2


def test_a_switch_to_a_draft_that_does_not_fit_keeps_the_current_drafter_with_the_reason(
    models_dir: Path, tmp_path: Path, tokenizer: ChatTokenizer
) -> None:
    from concurrent.futures import ThreadPoolExecutor

    from broker import messages as m
    from device_agent.sessions import SessionBook
    from device_agent.settings import LocalSettings

    async def nowhere(channel: object, message: m.Message) -> bool:
        return False

    proc = _proc(tmp_path, 100 * 1024)
    catalog = _catalog(models_dir, proc, tmp_path / "sys")
    _needs_draft(catalog, "draft-l2")
    with ThreadPoolExecutor(1) as executor:
        book = SessionBook(LocalSettings(), catalog, nowhere, executor)
        current = catalog.acquire("lookup")
        switched = book._acquire("draft-l2", 0.0, current)
        assert isinstance(switched, StandInProposer) and switched.fallback is current
        context = tokenizer.apply_chat_template("Say hello twice: hello hello")
        switched.get_candidates(context, 4)
        assert drafted_by(switched, "draft-l2") == "lookup"
        assert switched.note is not None and switched.note.startswith("memory: draft-l2 needs")
        # A draft this device lacks gets a stand-in too (sessions and switches ask for one only
        # where releases can be installed here: drafts on demand).
        assert (
            book._acquire("draft-l9", 0.0, current).note
            == "draft-l9 is not on this device (fetching it)"
        )
