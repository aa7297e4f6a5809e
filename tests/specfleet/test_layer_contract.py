"""The layer contract in pyproject.toml names the coordinator's parts one by one (the verifier may
reach its persistence, coordinator.db, and nothing else of it); a part added later must be named
there too, or the contract would let the verifier import it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

try:
    import tomllib
except ImportError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

REPO_ROOT = Path(__file__).resolve().parents[2]
PERSISTENCE = "coordinator.db"


def _contracts() -> dict[str, dict[str, Any]]:
    config = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    return {contract["name"]: contract for contract in config["contracts"]}


def _coordinator_parts() -> set[str]:
    root = REPO_ROOT / "coordinator"
    parts = {f"coordinator.{p.name}" for p in root.iterdir() if (p / "__init__.py").is_file()}
    parts |= {f"coordinator.{p.stem}" for p in root.glob("*.py") if p.stem != "__init__"}
    return parts


def test_every_part_of_the_coordinator_but_its_persistence_is_forbidden_to_the_verifier() -> None:
    parts = _coordinator_parts()
    assert PERSISTENCE in parts
    checked = []
    for contract in _contracts().values():
        sources = set(contract.get("source_modules", ()))
        if contract["type"] == "forbidden" and sources in ({"verifier"}, {PERSISTENCE}):
            named = {m for m in contract["forbidden_modules"] if m.startswith("coordinator.")}
            assert named == parts - {PERSISTENCE}, sorted((parts - {PERSISTENCE}) ^ named)
            checked.append(contract["name"])
    assert len(checked) == 2, checked  # the verifier's contract and the persistence's


def test_the_contract_lists_no_exceptions_and_every_package() -> None:
    config = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    assert all("ignore_imports" not in contract for contract in config["contracts"])
    packages = {
        p.name for p in REPO_ROOT.iterdir() if (p / "__init__.py").is_file() and p.name != "tests"
    }
    assert set(config["root_packages"]) == packages
