"""`specfleet models build-target`: GGUF to tokenizer files, a target ONNX and a manifest."""

from __future__ import annotations

import argparse
import fcntl
import shutil
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from inference.artifacts import (
    ArtifactError,
    ModelManifest,
    default_models_dir,
    describe_model,
    load_manifest,
    write_manifest,
)

if TYPE_CHECKING:
    from inference.onnx_runtime import OnnxRuntime
    from inference.tokenizer import ChatTokenizer

TargetPrecision = Literal["q4", "fp32"]
PRECISIONS: tuple[TargetPrecision, ...] = ("q4", "fp32")
# Measured on a 2-core x86 CPU: q4 (MatMulNBits, fp32 compute) is faster than fp32 only for a
# single row; for verification windows (k + 1 rows) and batches fp32 is faster, and those are
# what a verifier runs. q4 is the smaller file (195 MB against 538 MB).
DEFAULT_PRECISION: TargetPrecision = "fp32"
# Bump whenever the graph or the files change, so that cached builds are redone.
BUILDER_VERSION = "2"
MODEL_FILE = "model.onnx"
TARGET_NAME = "smollm2-135m-instruct"


def target_name(precision: TargetPrecision) -> str:
    return f"{TARGET_NAME}-{precision}"


@dataclass(frozen=True)
class BuildResult:
    directory: Path
    manifest: ModelManifest
    rebuilt: bool
    seconds: float


@contextmanager
def _build_lock(models_dir: Path, name: str) -> Iterator[None]:
    """One builder per target at a time, across processes (tests and commands may race)."""
    models_dir.mkdir(parents=True, exist_ok=True)
    with (models_dir / f".{name}.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _up_to_date(directory: Path, source_sha256: str, precision: TargetPrecision) -> bool:
    try:
        manifest = load_manifest(directory)
    except ArtifactError:
        return False
    model = directory / manifest.file
    return (
        manifest.source_sha256 == source_sha256
        and manifest.builder_version == BUILDER_VERSION
        and manifest.precision == precision
        and model.is_file()
        and model.stat().st_size == manifest.size_bytes
        and (directory / manifest.tokenizer_file).is_file()
    )


def build_target(
    models_dir: Path,
    precision: TargetPrecision = DEFAULT_PRECISION,
    *,
    force: bool = False,
    progress: bool = True,
) -> BuildResult:
    """Build the target into `models_dir/<name>/`, or reuse the build when nothing changed."""
    from inference.gguf_source import file_sha256, find_gguf

    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    started = time.perf_counter()
    name = target_name(precision)
    directory = models_dir / name
    gguf_path = find_gguf()
    source_sha256 = file_sha256(gguf_path)
    with _build_lock(models_dir, name):
        if not force and _up_to_date(directory, source_sha256, precision):
            manifest = load_manifest(directory)
            return BuildResult(directory, manifest, False, time.perf_counter() - started)
        manifest = _build(gguf_path, source_sha256, directory, name, precision, progress)
    return BuildResult(directory, manifest, True, time.perf_counter() - started)


def _build(
    gguf_path: Path,
    source_sha256: str,
    directory: Path,
    name: str,
    precision: TargetPrecision,
    progress: bool,
) -> ModelManifest:
    import onnx
    from tqdm import tqdm

    from inference.gguf_source import GgufModel, QuantizedMatrix
    from inference.onnx_graph import DecoderSpec, build_decoder
    from inference.tokenizer import TOKENIZER_FILE, ChatTokenizer

    partial = directory.with_name(f".{name}.partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    stages = tqdm(total=5, desc=f"build {name}", unit="stage", disable=not progress)

    stages.set_postfix_str("tokenizer")
    source = GgufModel(gguf_path)
    ChatTokenizer.from_gguf(source).save(partial)
    stages.update()

    stages.set_postfix_str("weights")
    weights = source.weights()
    quantized: dict[str, QuantizedMatrix] = {}
    if precision == "q4":
        for weight_name in weights:
            if weight_name.endswith("_proj.weight"):
                matrix = source.quantized(weight_name)
                if matrix is not None and matrix.kind == "q4_1":
                    quantized[weight_name] = matrix
    stages.update()

    stages.set_postfix_str("graph")
    # The final hidden state rides along (one small extra output) for feature-conditioned drafts.
    spec = DecoderSpec(output_hidden=True)
    model = build_decoder(source.config, weights, spec, quantized=quantized, name=name)
    del weights
    stages.update()

    stages.set_postfix_str("save")
    onnx.save_model(model, str(partial / MODEL_FILE))
    del model
    stages.update()

    stages.set_postfix_str("manifest")
    manifest = describe_model(
        partial,
        name=name,
        role="target",
        model_format="onnx",
        model_file=MODEL_FILE,
        tokenizer_file=TOKENIZER_FILE,
        precision=precision,
        config=source.config.to_json(),
        source_sha256=source_sha256,
        builder_version=BUILDER_VERSION,
        extra={"source_file": gguf_path.name, "quantized_matrices": len(quantized)},
    )
    write_manifest(partial, manifest)
    shutil.rmtree(directory, ignore_errors=True)
    partial.rename(directory)
    stages.update()
    stages.close()
    return manifest


def ensure_target(
    models_dir: Path | None = None, precision: TargetPrecision = DEFAULT_PRECISION
) -> Path:
    """The target's model directory, built first if it is missing or stale."""
    return build_target(models_dir or default_models_dir(), precision, progress=False).directory


def load_target(
    models_dir: Path | None = None,
    *,
    precision: TargetPrecision = DEFAULT_PRECISION,
    threads: int | None = None,
    allow_spinning: bool = False,
    consistent_decode: bool = True,
) -> tuple[OnnxRuntime, ChatTokenizer]:
    """The target runtime and its tokenizer, building the target on first use.

    The options are OnnxRuntime's: `consistent_decode=False` makes one-token steps ~20% faster,
    but their logits then differ from a verification window's in the last bits.
    """
    from inference.onnx_runtime import OnnxRuntime
    from inference.tokenizer import ChatTokenizer

    directory = ensure_target(models_dir, precision)
    manifest = load_manifest(directory)
    runtime = OnnxRuntime(
        directory / manifest.file,
        threads=threads,
        allow_spinning=allow_spinning,
        consistent_decode=consistent_decode,
        name=manifest.name,
    )
    return runtime, ChatTokenizer.load(directory)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--models-dir", type=Path, default=None, help="models directory (default: from settings)"
    )
    parser.add_argument(
        "--precision",
        choices=PRECISIONS,
        default=DEFAULT_PRECISION,
        help=f"fp32 weights, or the GGUF's own 4-bit blocks (default: {DEFAULT_PRECISION})",
    )
    parser.add_argument("--force", action="store_true", help="rebuild even when up to date")


def run(args: argparse.Namespace) -> int:
    from inference.gguf_source import GgufError
    from specfleet.cli import CommandError

    models_dir: Path = args.models_dir or default_models_dir()
    try:
        result = build_target(models_dir, args.precision, force=args.force)
    except (GgufError, ArtifactError, OSError) as exc:
        raise CommandError(str(exc)) from exc
    m = result.manifest
    verb = "built" if result.rebuilt else "up to date:"
    print(
        f"{verb} {m.name} ({m.precision}, {m.size_bytes / 1e6:.1f} MB, sha256 {m.sha256[:12]}) "
        f"in {result.directory} [{result.seconds:.1f} s]"
    )
    return 0
