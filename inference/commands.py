"""`specfleet models ...` and `specfleet generate`: wiring only; each command has its own module."""

from __future__ import annotations

import argparse
import importlib
from typing import Any

# (command path, module, help). Each module defines `add_arguments(parser)` and `run(args) -> int`,
# and keeps its top-level imports cheap (no torch, no onnxruntime) so that `--help` stays fast.
MODEL_COMMANDS = (
    ("build-target", "inference.target_build", "build the target (tokenizer, ONNX, manifest)"),
    ("distill", "inference.distill", "distil draft models from the target's own outputs"),
    ("list", "inference.artifacts", "list built models with their sha256 and sizes"),
    ("deploy", "coordinator.deploy_command", "roll a draft out to devices in waves (OTA)"),
    ("build-ngram", "inference.ngram_build", "build the n-gram drafter's table from target output"),
)


def _add(subparsers: Any, name: str, module_name: str, help_text: str) -> None:
    module = importlib.import_module(module_name)
    parser = subparsers.add_parser(name, help=help_text, description=help_text)
    module.add_arguments(parser)
    parser.set_defaults(func=module.run)


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    models = subparsers.add_parser("models", help="build, distil and list models")
    model_sub = models.add_subparsers(dest="models_command", metavar="ACTION", required=True)
    for name, module_name, help_text in MODEL_COMMANDS:
        _add(model_sub, name, module_name, help_text)
    _add(subparsers, "generate", "inference.generate", "generate text in one process, no bus")
