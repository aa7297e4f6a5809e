"""`specfleet models ...` and `specfleet generate`: wiring only; each command has its own module."""

from __future__ import annotations

import argparse

from core.cli_help import add_module_command

# (command path, module, help). Each module defines `add_arguments(parser)` and `run(args) -> int`,
# and keeps its top-level imports cheap (no torch, no onnxruntime) so that `--help` stays fast.
MODEL_COMMANDS = (
    ("build-target", "modelbuild.target_build", "build the target (tokenizer, ONNX, manifest)"),
    ("distill", "modelbuild.distill", "distil draft models from the target's own outputs"),
    ("train-head", "modelbuild.head_train", "train a feature-conditioned draft head (EAGLE)"),
    ("list", "inference.artifacts", "list built models with their sha256 and sizes"),
    ("deploy", "coordinator.ops.deploy_command", "roll a draft out to devices in waves (OTA)"),
    (
        "build-ngram",
        "modelbuild.ngram_build",
        "build the n-gram drafter's table from target output",
    ),
)


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    models = subparsers.add_parser("models", help="build, distil and list models")
    model_sub = models.add_subparsers(dest="models_command", metavar="ACTION", required=True)
    for name, module_name, help_text in MODEL_COMMANDS:
        add_module_command(model_sub, name, module_name, help_text)
    add_module_command(
        subparsers, "generate", "modelbuild.generate", "generate text in one process, no bus"
    )
