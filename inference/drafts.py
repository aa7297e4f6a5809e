"""Distilled neural drafts on disk: find them by name and load them as Runtime objects."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from inference.artifacts import DECODER, ModelManifest, list_models, read_output_ids
from inference.model_config import LlamaConfig
from inference.runtime import Runtime

DraftRuntimeKind = Literal["onnx", "tflite"]
TFLITE_SUFFIX = "-tflite"  # manifest name of a draft's TFLite build: "<draft>-tflite"


class DraftError(Exception):
    """No draft of that name and format, or its files disagree with the manifest."""


@dataclass(frozen=True)
class DraftInfo:
    """One built draft: its family name (`draft-l2`), format and model directory."""

    name: str
    format: DraftRuntimeKind
    directory: Path
    manifest: ModelManifest

    @property
    def model_path(self) -> Path:
        return self.directory / self.manifest.file

    @property
    def size_mb(self) -> float:
        return self.manifest.size_bytes / 1e6


def draft_family(manifest: ModelManifest) -> str:
    """`draft-l2` for both `draft-l2` (ONNX) and `draft-l2-tflite`."""
    family = manifest.extra.get("draft")
    return str(family) if family else manifest.name.removesuffix(TFLITE_SUFFIX)


def list_drafts(models_dir: Path) -> list[DraftInfo]:
    """Every draft under `models_dir`, sorted by name then format."""
    found = [
        DraftInfo(draft_family(manifest), manifest.format, directory, manifest)
        for directory, manifest in list_models(models_dir)
        if manifest.role == "draft" and manifest.kind == DECODER
    ]
    return sorted(found, key=lambda d: (d.name, d.format))


def find_draft(models_dir: Path, name: str, runtime: DraftRuntimeKind = "onnx") -> DraftInfo:
    for draft in list_drafts(models_dir):
        if runtime == draft.format and name in (draft.name, draft.manifest.name):
            return draft
    known = sorted({f"{d.name} ({d.format})" for d in list_drafts(models_dir)})
    raise DraftError(
        f"no {runtime} draft {name!r} in {models_dir}; known: {', '.join(known) or 'none'}"
        " (build them with `specfleet models distill`)"
    )


def load_draft(
    models_dir: Path,
    name: str,
    runtime: DraftRuntimeKind = "onnx",
    *,
    threads: int | None = None,
) -> Runtime:
    """The draft as a Runtime; a trimmed head's columns map to vocabulary ids by `head_ids`."""
    draft = find_draft(models_dir, name, runtime)
    if runtime == "onnx":
        from inference.onnx_runtime import OnnxRuntime

        return OnnxRuntime(draft.model_path, threads=threads, name=draft.manifest.name)
    from inference.litert_runtime import LiteRtRuntime

    return LiteRtRuntime(
        draft.model_path,
        LlamaConfig.from_json(draft.manifest.config),
        head_ids=read_output_ids(draft.directory),
        threads=threads,
        name=draft.manifest.name,
    )
