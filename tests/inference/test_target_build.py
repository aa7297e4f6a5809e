"""`specfleet models build-target` and `specfleet models list` on the real target."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import pytest

from core.errors import CommandError
from inference import artifacts
from inference.artifacts import (
    ArtifactError,
    ModelManifest,
    load_manifest,
    sha256_file,
    write_manifest,
)
from modelbuild import target_build
from modelbuild.target_build import DEFAULT_PRECISION
from specfleet.commands.models import MODEL_COMMANDS

COMMANDS = {"build-target": target_build, "list": artifacts}


def main(argv: list[str]) -> int:
    """`specfleet models <command> ...` through the command modules, as specfleet.cli runs them."""
    assert argv[0] == "models"
    module = COMMANDS[argv[1]]
    parser = argparse.ArgumentParser(prog=f"specfleet models {argv[1]}")
    module.add_arguments(parser)
    try:
        status: int = module.run(parser.parse_args(argv[2:]))
    except CommandError as exc:
        print(exc, file=sys.stderr)
        return 2
    return status


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_commands_are_wired(command: str) -> None:
    wired = {name: module for name, module, _ in MODEL_COMMANDS}
    assert wired[command] == COMMANDS[command].__name__


def test_second_build_is_cached(target_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model = target_dir / load_manifest(target_dir).file
    before = model.stat().st_mtime_ns
    argv = ["models", "build-target", "--models-dir", str(target_dir.parent)]
    assert main([*argv, "--precision", DEFAULT_PRECISION]) == 0
    assert "up to date" in capsys.readouterr().out
    assert model.stat().st_mtime_ns == before


def test_models_list_json_shows_hash_and_size(
    target_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["models", "list", "--json", "--models-dir", str(target_dir.parent)]) == 0
    listed = {entry["name"]: entry for entry in json.loads(capsys.readouterr().out)}
    entry = listed[target_dir.name]
    model = target_dir / entry["file"]
    assert entry["role"] == "target" and entry["format"] == "onnx"
    assert entry["size_bytes"] == model.stat().st_size
    assert entry["sha256"] == sha256_file(model)
    assert entry["tokenizer_sha256"] == sha256_file(target_dir / "tokenizer.json")


def test_models_list_table(target_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["models", "list", "--models-dir", str(target_dir.parent)]) == 0
    assert target_dir.name in capsys.readouterr().out


def test_models_list_of_missing_dir_fails(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["models", "list", "--models-dir", str(tmp_path / "absent")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_stale_manifest_triggers_rebuild_check(target_dir: Path, tmp_path: Path) -> None:
    """A manifest whose builder version differs is not up to date (checked without rebuilding)."""
    from modelbuild.target_build import _up_to_date

    manifest = load_manifest(target_dir)
    assert _up_to_date(target_dir, manifest.source_sha256, DEFAULT_PRECISION)
    assert not _up_to_date(target_dir, "0" * 64, DEFAULT_PRECISION)
    copy = tmp_path / "copy"
    copy.mkdir()
    stale = ModelManifest(**{**manifest.to_json(), "builder_version": "0", "file": "missing"})
    write_manifest(copy, stale)
    assert not _up_to_date(copy, manifest.source_sha256, DEFAULT_PRECISION)


@pytest.mark.parametrize(
    ("field", "value"), [("role", "verifier"), ("format", "gguf"), ("sha256", "abc")]
)
def test_manifest_refuses_bad_fields(target_dir: Path, field: str, value: str) -> None:
    document = {**load_manifest(target_dir).to_json(), field: value}
    with pytest.raises(ArtifactError):
        ModelManifest.from_json(document)


def test_manifest_missing_is_reported(tmp_path: Path) -> None:
    with pytest.raises(ArtifactError, match="no manifest"):
        load_manifest(tmp_path)
