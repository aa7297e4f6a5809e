"""`specfleet bench ...`: wiring only; each benchmark lives in its own module."""

from __future__ import annotations

import argparse

from core.cli_help import add_module_command

# (name, module, help). Each module defines `add_arguments(parser)` and `run(args) -> int`.
BENCHMARKS = (
    ("bus", "bench.bus", "round trip of a draft-sized message through the broker"),
    ("models", "bench.models", "draft and target costs, acceptance and speculative speedup"),
    (
        "replay",
        "bench.replay",
        "tokens per target pass of drafters, replayed along the target's greedy answers",
    ),
    (
        "e2e",
        "bench.e2e",
        "specfleet (fixed drafter, adaptive) vs plain serving: tokens/s, throughput, overhead",
    ),
    (
        "adaptive",
        "bench.adaptive",
        "adaptive policy vs fixed configurations on a changing network (lan, 4g, ...)",
    ),
    (
        "soak",
        "bench.soak",
        "many short sessions for minutes: coordinator RSS growth after warm-up, and errors",
    ),
    (
        "fleet",
        "bench.fleet",
        "thousands of MQTT agents and a replay verifier against the control plane (a load "
        "tool: no model, recorded answers)",
    ),
    (
        "target-passes",
        "bench.target_passes",
        "batched target passes with rows kept in the last pass against stacking every pass",
    ),
    (
        "co-runner",
        "bench.co_runner",
        "the target's passes on its CPU alone and beside a load on another (what neighbours cost)",
    ),
    (
        "host-drafting",
        "bench.host_drafting",
        "a pass's cloud drafts drafted together (one feature-head call a step) against one by one",
    ),
    (
        "round-floor",
        "bench.round_floor",
        "a direct round's hops alone (bus, pipe, commit) on this host: the overhead's floor",
    ),
    (
        "draft-boundary",
        "bench.draft_boundary",
        "a drafting round's cost with the draft in a child process against in-process",
    ),
)


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    bench = subparsers.add_parser("bench", help="run a benchmark; prints a table, writes JSON")
    bench_sub = bench.add_subparsers(dest="bench_command", metavar="BENCHMARK", required=True)
    for name, module_name, help_text in BENCHMARKS:
        add_module_command(bench_sub, name, module_name, help_text)
