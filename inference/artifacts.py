"""Models directory layout and per-model manifests; `specfleet models list`."""

from __future__ import annotations

import argparse
import dataclasses
import functools
import hashlib
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np
import numpy.typing as npt

from core.report import format_table

MANIFEST_FILE = "manifest.json"
OUTPUT_IDS_FILE = "output_ids.json"  # vocabulary id of each logit column of a trimmed head
Role = Literal["target", "draft"]
ModelFormat = Literal["onnx", "tflite"]
ROLES: tuple[Role, ...] = ("target", "draft")
FORMATS: tuple[ModelFormat, ...] = ("onnx", "tflite")
DECODER = "decoder"  # a causal LM with a KV cache (the target, the drafts)
KINDS = (DECODER, "feature-head")  # a feature head: inference/feature_head.py


class ArtifactError(Exception):
    """A manifest that is missing, malformed, or disagrees with the files beside it."""


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as stream:
        for chunk in iter(lambda: stream.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


@dataclass(frozen=True)
class ModelManifest:
    """What a model directory holds: `<models_dir>/<name>/manifest.json` beside the files."""

    name: str
    role: Role
    format: ModelFormat
    file: str  # model file, relative to the model directory
    sha256: str
    size_bytes: int
    tokenizer_file: str  # relative to the model directory
    tokenizer_sha256: str
    precision: str  # "fp32", "q4", ...
    config: dict[str, Any]  # LlamaConfig fields of the exported graph
    source_sha256: str  # of what it was built from (the GGUF, or the target for a draft)
    builder_version: str
    extra: dict[str, Any] = field(default_factory=dict)  # builder-specific facts (head size, ...)
    # `inference.tokenizer.vocab_sha256` of the tokenizer beside it: a draft serves a target
    # only when the two agree. "" in manifests written before it: see `with_vocab`.
    vocab_sha256: str = ""
    kind: str = DECODER  # what the graph computes; manifests older than kinds hold decoders

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ArtifactError(f"{self.name}: kind must be one of {KINDS}, got {self.kind!r}")
        if self.role not in ROLES:
            raise ArtifactError(f"{self.name}: role must be one of {ROLES}, got {self.role!r}")
        if self.format not in FORMATS:
            raise ArtifactError(
                f"{self.name}: format must be one of {FORMATS}, got {self.format!r}"
            )
        if self.size_bytes < 0 or len(self.sha256) != 64:
            raise ArtifactError(f"{self.name}: bad size or sha256")

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, document: dict[str, Any]) -> ModelManifest:
        known = set(cls.__dataclass_fields__)
        missing = known - set(document) - {"extra", "kind", "vocab_sha256"}
        if missing:
            raise ArtifactError(f"manifest lacks {sorted(missing)}")
        return cls(**{key: document[key] for key in known if key in document})


def describe_model(
    directory: Path,
    *,
    name: str,
    role: Role,
    model_format: ModelFormat,
    model_file: str,
    tokenizer_file: str,
    precision: str,
    config: dict[str, Any],
    source_sha256: str,
    builder_version: str,
    extra: dict[str, Any] | None = None,
    kind: str = DECODER,
) -> ModelManifest:
    """A manifest for files already written under `directory` (hashes and sizes read from disk)."""
    model_path = directory / model_file
    tokenizer_path = directory / tokenizer_file
    return ModelManifest(
        name=name,
        role=role,
        format=model_format,
        file=model_file,
        sha256=sha256_file(model_path),
        size_bytes=model_path.stat().st_size,
        tokenizer_file=tokenizer_file,
        tokenizer_sha256=sha256_file(tokenizer_path),
        precision=precision,
        config=config,
        source_sha256=source_sha256,
        builder_version=builder_version,
        extra=extra or {},
        kind=kind,
        vocab_sha256=tokenizer_vocab_sha256(tokenizer_path),
    )


def tokenizer_vocab_sha256(path: Path) -> str:
    """The vocabulary identity of a tokenizer.json (see `inference.tokenizer.vocab_sha256`)."""
    try:
        stat = path.stat()
    except OSError as exc:
        raise ArtifactError(f"{path}: not a readable tokenizer ({exc})") from exc
    # SmolLM2's tokenizer is a 2 MB JSON document: the answer is kept while the file stays.
    return _vocab_sha256_of(str(path), stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=64)
def _vocab_sha256_of(path: str, mtime_ns: int, size: int) -> str:
    from inference.tokenizer import document_vocab_sha256

    try:
        return document_vocab_sha256(json.loads(Path(path).read_text()))
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ArtifactError(f"{path}: not a readable tokenizer ({exc!r})") from exc


@dataclass(frozen=True)
class TargetIdentity:
    """What every role must agree on about the target: read from its manifest, never assumed."""

    name: str
    sha256: str
    vocab_sha256: str
    vocab_size: int
    eos_id: int

    @property
    def label(self) -> str:
        """`name@sha256 prefix`, as verifiers announce it."""
        return f"{self.name}@{self.sha256[:12]}"

    @classmethod
    def from_manifest(cls, manifest: ModelManifest) -> TargetIdentity:
        if manifest.role != "target":
            raise ArtifactError(f"{manifest.name} is a {manifest.role}, not a target")
        return cls(
            name=manifest.name,
            sha256=manifest.sha256,
            vocab_sha256=manifest.vocab_sha256,
            vocab_size=int(manifest.config["vocab_size"]),
            eos_id=int(manifest.config["eos_id"]),
        )


def check_same_vocabulary(draft: ModelManifest, target_vocab_sha256: str, target: str) -> None:
    """Refuse a draft whose vocabulary is not the target's (its ids would mean other tokens)."""
    if draft.vocab_sha256 != target_vocab_sha256:
        raise ArtifactError(
            f"{draft.name} was built for another vocabulary (vocab {draft.vocab_sha256[:12]}) "
            f"than {target}'s (vocab {target_vocab_sha256[:12]})"
        )


def write_manifest(directory: Path, manifest: ModelManifest) -> Path:
    """Write the manifest last, through a rename, so that a present manifest means a whole model."""
    path = directory / MANIFEST_FILE
    partial = path.with_suffix(".json.partial")
    partial.write_text(json.dumps(manifest.to_json(), indent=2, sort_keys=True) + "\n")
    partial.replace(path)
    return path


def load_manifest(directory: Path) -> ModelManifest:
    path = directory / MANIFEST_FILE
    try:
        document = json.loads(path.read_text())
    except FileNotFoundError as exc:
        raise ArtifactError(f"no manifest in {directory}") from exc
    except json.JSONDecodeError as exc:
        raise ArtifactError(f"{path}: not JSON ({exc})") from exc
    if not isinstance(document, dict):
        raise ArtifactError(f"{path}: not a JSON object")
    return ModelManifest.from_json(document)


def with_vocab(directory: Path, manifest: ModelManifest) -> ModelManifest:
    """The manifest with its vocabulary hash, read from its tokenizer where it predates the
    field. Apart from `load_manifest`, which stays cheap for listings: a hash costs a parse of
    the tokenizer (0.1-0.3 s for SmolLM2's)."""
    if manifest.vocab_sha256:
        return manifest
    vocab = tokenizer_vocab_sha256(directory / manifest.tokenizer_file)
    return dataclasses.replace(manifest, vocab_sha256=vocab)


def list_models(models_dir: Path) -> list[tuple[Path, ModelManifest]]:
    """Every model directory under `models_dir` with a readable manifest, sorted by name."""
    if not models_dir.is_dir():
        return []
    found = []
    for path in sorted(models_dir.glob(f"*/{MANIFEST_FILE}")):
        found.append((path.parent, load_manifest(path.parent)))
    return sorted(found, key=lambda item: (item[1].role != "target", item[1].name))


def read_output_ids(directory: Path) -> npt.NDArray[np.int64] | None:
    path = directory / OUTPUT_IDS_FILE
    if not path.exists():
        return None
    return np.asarray(json.loads(path.read_text()), dtype=np.int64)


def default_models_dir() -> Path:
    from core.settings import Settings

    return Settings().resolved_models_dir


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print the manifests as JSON")
    parser.add_argument(
        "--models-dir", type=Path, default=None, help="models directory (default: from settings)"
    )


def run(args: argparse.Namespace) -> int:
    from core.errors import CommandError

    models_dir: Path = args.models_dir or default_models_dir()
    if args.models_dir is not None and not models_dir.is_dir():
        raise CommandError(f"models directory {models_dir} does not exist")
    try:
        models = list_models(models_dir)
    except ArtifactError as exc:
        raise CommandError(str(exc)) from exc
    if args.json:
        document = [{**m.to_json(), "path": str(directory)} for directory, m in models]
        print(json.dumps(document, indent=2, sort_keys=True))
        return 0
    if not models:
        print(f"no models in {models_dir}; build the target with `specfleet models build-target`")
        return 0
    rows = [
        (m.name, m.role, m.format, m.precision, f"{m.size_bytes / 1e6:.1f}", m.sha256[:12])
        for _, m in models
    ]
    print(format_table(("name", "role", "format", "precision", "MB", "sha256"), rows))
    return 0
