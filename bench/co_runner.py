"""What work on the other CPUs costs the target's passes on its own.

`bench e2e` gives the target a core to itself and puts the broker, the coordinator and the agents
on the other (`bench.cpus`), yet on this 2-vCPU host the verifier's plain passes at 16 sessions
came out 1-5% slower than plain serving's same passes, whose other core sat idle: the cores share
more than their time (caches, memory bandwidth, or one physical core under two vCPUs). This
measures it: the target's decode passes of `--rows` rows on one CPU, alone and beside a process
spinning on another CPU, in turns (each load's passes against the passes alone of the same
turn, as a ratio: the host's own drift moves both). The loads: `alu` (a bare Python loop),
`objects` (Python building and dropping small objects, as the coordinator and the agents do a
round) and `memory` (copying a 64 MiB array, the most a neighbour can take of the memory).
"""

from __future__ import annotations

import argparse
import os
import random
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from signal import SIGKILL
from typing import Any

from bench import cpus
from bench.target_passes import PROMPT_TOKENS, TOKEN_IDS
from core.report import add_json_argument, format_table, median, write_json

DEFAULT_JSON = Path("bench-results/co-runner.json")
# Each load: (its set-up, one step of its loop). It spins until it is killed (`start_load`).
LOADS = {
    "alu": ("", "pass"),
    "objects": (
        "import random",
        "rows = [{'id': random.random(), 'ids': [i] * 8} for i in range(20000)]",
    ),
    "memory": ("import numpy as np\na = np.ones(64 * 2**20 // 8)", "b = a.copy()"),
}


def load_program(name: str) -> str:
    """Load `name` as a Python program."""
    setup, step = LOADS[name]
    return f"{setup}\nwhile True:\n    {step}\n"


def start_load(name: str, cpu: int) -> subprocess.Popen[bytes]:
    """Load `name` spinning on `cpu`, killed when this process ends however it ends (a benchmark
    killed outright leaves no load behind: `popen_tied`)."""
    from broker.mosquitto import popen_tied

    with open(os.devnull, "wb") as devnull:
        load = popen_tied([sys.executable, "-c", load_program(name)], log=devnull, sig=SIGKILL)
    cpus.pin_tree(load.pid, {cpu})
    return load


WARM_S = 0.5  # a load runs this long before the passes beside it are timed


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_json_argument(parser, DEFAULT_JSON)
    parser.add_argument("--rows", type=int, default=16, help="rows a pass (default 16)")
    parser.add_argument("--passes", type=int, default=15, help="passes a load a turn (15)")
    parser.add_argument("--turns", type=int, default=2, help="turns of every load (default 2)")
    parser.add_argument(
        "--loads",
        default=",".join(LOADS),
        help=f"comma-separated loads beside the target ({','.join(LOADS)})",
    )
    parser.add_argument("--threads", type=int, default=1, help="runtime threads (default 1)")
    parser.add_argument(
        "--models-dir", type=Path, default=None, help="models directory (default: from settings)"
    )


def _loads(text: str) -> list[str]:
    from core.errors import CommandError

    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in names if name not in LOADS]
    if not names or unknown:
        raise CommandError(f"--loads must name some of {', '.join(LOADS)}; got {text!r}")
    return names


def run(args: argparse.Namespace) -> int:
    from core.errors import CommandError
    from modelbuild.target_build import load_target

    loads = _loads(args.loads)
    if args.rows < 1 or args.passes < 2 or args.turns < 1:
        raise CommandError("--rows must be at least 1, --passes at least 2, --turns at least 1")
    allowed = cpus.available()
    placement = cpus.split(allowed)
    if placement is None:
        raise CommandError(
            f"needs two CPUs, one for the target and one beside; has {sorted(allowed)}"
        )
    (target_cpu,), others = placement
    other_cpu = min(others)
    os.sched_setaffinity(0, {target_cpu})
    try:
        by_turn = _turns(
            args, loads, other_cpu, load_target(args.models_dir, threads=args.threads)[0]
        )
    finally:
        os.sched_setaffinity(0, allowed)  # a caller in-process keeps its CPUs
    results: list[dict[str, Any]] = []
    for name in ["none", *loads]:
        ratios = [turn[name] / turn["none"] for turn in by_turn]
        results.append(
            {
                "load": name,
                "pass_ms": [turn[name] for turn in by_turn],
                "ratio": ratios,
                "ratio_median": median(ratios),
            }
        )
    print(
        f"the target on CPU {target_cpu} ({args.rows} rows, plain decoding), the load on CPU "
        f"{other_cpu}; median pass of {args.passes} a load a turn"
    )
    headers = ["beside", "pass ms by turn", "/ alone, by turn", "/ alone, median"]
    table = [
        [
            r["load"],
            ", ".join(f"{ms:.1f}" for ms in r["pass_ms"]),
            ", ".join(f"{x:.3f}" for x in r["ratio"]),
            r["ratio_median"],
        ]
        for r in results
    ]
    print(format_table(headers, table))
    if args.json is not None:
        write_json(
            args.json,
            {
                "benchmark": "co-runner",
                "rows": args.rows,
                "passes": args.passes,
                "turns": args.turns,
                "target_cpu": target_cpu,
                "load_cpu": other_cpu,
                "results": results,
            },
        )
        print(f"wrote {args.json}")
    return 0


def _turns(
    args: argparse.Namespace, loads: list[str], other_cpu: int, runtime: Any
) -> list[dict[str, float]]:
    """Per turn, the median pass alone ("none") and beside each load."""
    from tqdm import tqdm

    rng = random.Random(0)
    caches = []
    for _ in range(args.rows):
        cache = runtime.new_cache()
        length = rng.randrange(*PROMPT_TOKENS)
        runtime.forward([rng.randrange(*TOKEN_IDS) for _ in range(length)], cache)
        caches.append(cache)

    lengths = [cache.length for cache in caches]

    def passes() -> float:
        times = []
        for index in range(args.passes + 1):
            requests = [([rng.randrange(*TOKEN_IDS)], cache) for cache in caches]
            t0 = time.perf_counter()
            runtime.forward_batch(requests)
            if index:  # the first after a change of neighbour is left out
                times.append((time.perf_counter() - t0) * 1e3)
        for cache, length in zip(caches, lengths, strict=True):
            cache.trim(length)  # every load's passes on the same contexts
        return median(times)

    by_turn: list[dict[str, float]] = []
    with tqdm(total=args.turns * (len(loads) + 1), desc="co-runner", unit="load",
              file=sys.stderr) as bar:  # fmt: skip
        for _ in range(args.turns):
            turn = {"none": passes()}
            bar.update()
            for name in loads:
                turn[name] = _beside(name, other_cpu, passes)
                bar.update()
            by_turn.append(turn)
    return by_turn


def _beside(name: str, cpu: int, passes: Callable[[], float]) -> float:
    """`passes()` timed while load `name` spins on `cpu`; the load is ended whatever happens."""
    load = start_load(name, cpu)
    try:
        time.sleep(WARM_S)
        if load.poll() is not None:
            from core.errors import CommandError

            raise CommandError(f"the {name} load ended at once (exit {load.returncode})")
        return passes()
    finally:
        load.kill()
        load.wait()
