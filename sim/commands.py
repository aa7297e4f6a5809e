"""`specfleet sim ...`: profile, calibrate, validate, run and plan (docs/sim.md)."""

from __future__ import annotations

import argparse
import html
import json
import sys
import time
from pathlib import Path
from typing import Any

from core.errors import CommandError
from core.report import format_table, write_json

DEFAULT_CALIBRATION = Path("bench-results/sim-calibration.json")
ERROR_GOAL = 0.10
DEFAULT_REPLAYS = 8  # seeds averaged by sim validate


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    sim = subparsers.add_parser(
        "sim", help="DSD-Sim: simulate a fleet, calibrated on measured runs (docs/sim.md)"
    )
    sub = sim.add_subparsers(dest="sim_command", metavar="COMMAND", required=True)

    p = sub.add_parser("profile", help="time the target's passes on this host (a verifier kind)")
    p.add_argument("--out", type=Path, required=True, metavar="FILE", help="profile JSON")
    p.add_argument("--threads", type=int, default=1, help="ONNX Runtime threads (default: 1)")
    p.add_argument("--context", type=int, default=64, help="cached positions per row (default 64)")
    p.add_argument("--models-dir", type=Path, default=None, help="default: settings")
    p.add_argument("--target", default=None, help="a built target by name (default: SmolLM2)")
    p.add_argument(
        "--provider", choices=("cpu", "cuda"), default="cpu", help="execution provider (cpu)"
    )
    p.set_defaults(func=_profile)

    c = sub.add_parser("calibrate", help="fit the simulator's parameters from measured runs")
    c.add_argument("--database-url", required=True, action="append", metavar="URL",
                   help="a run's database (repeatable: their rounds are pooled)")  # fmt: skip
    c.add_argument("--profile", type=Path, required=True, metavar="FILE", help="from sim profile")
    c.add_argument("--bench-json", type=Path, action="append", default=[], metavar="FILE",
                   help="bench e2e or bench adaptive JSON (repeatable)")  # fmt: skip
    c.add_argument("--gpu-profile", type=Path, action="append", default=[], metavar="KIND=FILE",
                   help="another verifier kind's profile, as data (repeatable)")  # fmt: skip
    c.add_argument("--broker-hop-ms", type=float, default=None, help="e.g. bench bus p50 / 2")
    c.add_argument("--out", type=Path, default=DEFAULT_CALIBRATION, metavar="FILE",
                   help=f"default {DEFAULT_CALIBRATION}")  # fmt: skip
    c.set_defaults(func=_calibrate)

    v = sub.add_parser(
        "validate", help="replay measured bench e2e and bench adaptive runs; predicted vs measured"
    )
    v.add_argument("--calibration", type=Path, default=DEFAULT_CALIBRATION, metavar="FILE",
                   help=f"from sim calibrate (default {DEFAULT_CALIBRATION})")  # fmt: skip
    v.add_argument("--e2e", type=Path, default=None, metavar="FILE", help="bench e2e JSON")
    v.add_argument("--adaptive", type=Path, default=None, metavar="FILE",
                   help="bench adaptive JSON")  # fmt: skip
    v.add_argument(
        "--measure",
        type=Path,
        default=None,
        metavar="DIR",
        help="measure first, in this invocation: bench e2e (levels 1 4 16 32), sim profile and "
        "bench adaptive into DIR, calibrate on them, then replay both",
    )
    v.add_argument("--seed", type=int, default=0, help="the first replay's seed")
    v.add_argument(
        "--replays", type=int, default=DEFAULT_REPLAYS,
        help=f"replays averaged, seeds --seed, --seed + 1, ... (default {DEFAULT_REPLAYS})",
    )  # fmt: skip
    v.add_argument("--json", type=Path, default=None, metavar="PATH", help="write the report")
    v.set_defaults(func=_validate)

    r = sub.add_parser("run", help="simulate a fleet and workload with a given verifier count")
    _plan_inputs(r)
    r.add_argument("--verifiers", type=int, required=True, help="verifiers of --kind")
    r.add_argument("--kind", default=None, help="verifier kind (default: the fleet's first)")
    r.set_defaults(func=_run)

    q = sub.add_parser("plan", help="verifiers needed to hold a time-between-tokens SLO")
    _plan_inputs(q)
    q.add_argument("--slo", type=Path, required=True, metavar="FILE", help="TOML or JSON")
    q.add_argument("--html", type=Path, default=None, metavar="PATH", help="a self-contained plot")
    q.set_defaults(func=_plan)


def _plan_inputs(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--calibration", type=Path, default=DEFAULT_CALIBRATION, metavar="FILE",
                        help=f"from sim calibrate (default {DEFAULT_CALIBRATION})")  # fmt: skip
    parser.add_argument("--fleet", type=Path, required=True, metavar="FILE", help="TOML or JSON")
    parser.add_argument("--workload", type=Path, required=True, metavar="FILE",
                        help="TOML or JSON")  # fmt: skip
    parser.add_argument("--seed", type=int, default=0, help="the simulation's seed")
    parser.add_argument("--json", type=Path, default=None, metavar="PATH", help="write the report")


def _load(path: Path, model: Any) -> Any:
    from sim.inputs import SimInputError, load

    try:
        return load(path, model)
    except SimInputError as exc:
        raise CommandError(str(exc)) from None


def _profile(args: argparse.Namespace) -> int:
    from inference.artifacts import ArtifactError
    from inference.onnx_runtime import ProviderError
    from sim.calibrate import measure_profile

    if args.threads < 1 or args.context < 1:
        raise CommandError("--threads and --context must be >= 1")
    try:
        profile = measure_profile(
            args.models_dir,
            threads=args.threads,
            context=args.context,
            kind=args.provider,
            target=args.target,
            provider=args.provider,
        )
    except (FileNotFoundError, ArtifactError, ProviderError) as exc:
        raise CommandError(f"no target to profile: {exc}") from None
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(profile.model_dump_json(indent=1) + "\n")
    print(_cost_table(profile.passes))
    print(f"wrote {args.out}: {len(profile.passes)} pass shapes ({profile.source})")
    return 0


def _cost_table(passes: list[tuple[int, int, float]]) -> str:
    """ms per pass, rows down and positions per row across (T = k + 1)."""
    cost = {(rows, positions): ms for rows, positions, ms in passes}
    columns = sorted({positions for _, positions in cost})
    table = [
        (str(rows), *(f"{cost[rows, t]:.1f}" if (rows, t) in cost else "-" for t in columns))
        for rows in sorted({rows for rows, _ in cost})
    ]
    return format_table(("B", *(f"T={t}" for t in columns)), table)


def _calibrate(args: argparse.Namespace) -> int:
    from sim.calibrate import calibrate, write
    from sim.inputs import Calibration, VerifierProfile

    profile = _load(args.profile, VerifierProfile)
    documents = []
    for path in args.bench_json:
        try:
            documents.append(json.loads(path.read_text()))
        except (OSError, json.JSONDecodeError) as exc:
            raise CommandError(f"cannot read {path}: {exc}") from None
    try:
        calibration = calibrate(
            args.database_url, profile, documents, broker_hop_ms=args.broker_hop_ms
        )
    except ValueError as exc:
        raise CommandError(str(exc)) from None
    except Exception as exc:  # a database that cannot be read: one line, not a traceback
        if type(exc).__module__.startswith("sqlalchemy"):
            raise CommandError(f"cannot read the database: {str(exc).splitlines()[0]}") from None
        raise
    kinds = dict(calibration.verifiers)
    for item in args.gpu_profile:
        kind, _, path = str(item).partition("=")
        if not path:
            raise CommandError(f"--gpu-profile {item}: expected KIND=FILE")
        kinds[kind] = _load(Path(path), VerifierProfile)
    calibration = Calibration.model_validate({**calibration.model_dump(), "verifiers": kinds})
    write(calibration, args.out)
    drafters = ", ".join(f"{d} ({sum(t.rounds for k, t in v.items() if k == '*')} rounds)"
                         for d, v in calibration.acceptance.items())  # fmt: skip
    print(f"wrote {args.out}: verifier kinds {', '.join(kinds)}; drafters {drafters}")
    for line in calibration.unfit:
        print(f"  not fitted: {line}")
    return 0


def _calibration(path: Path) -> Any:
    from sim.inputs import Calibration

    return _load(path, Calibration)


def _validate(args: argparse.Namespace) -> int:
    from sim.inputs import SimInputError
    from sim.validate import mean_of, replay_adaptive, replay_e2e

    if args.replays < 1:
        raise CommandError("--replays must be >= 1")
    if args.measure is not None:
        if args.e2e is not None or args.adaptive is not None:
            raise CommandError("--measure writes its own runs: give it without --e2e/--adaptive")
        args.e2e, args.adaptive, args.calibration = _measure(args.measure)
    if args.e2e is None and args.adaptive is None:
        raise CommandError("give --e2e FILE, --adaptive FILE (or both), or --measure DIR")
    calibration = _calibration(args.calibration)
    started = time.perf_counter()
    comparisons = []
    for path, replay in ((args.e2e, replay_e2e), (args.adaptive, replay_adaptive)):
        if path is None:
            continue
        try:
            document = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise CommandError(f"cannot read {path}: {exc}") from None
        try:
            comparisons += mean_of(
                [replay(calibration, document, seed=args.seed + i) for i in range(args.replays)]
            )
        except SimInputError as exc:
            raise CommandError(f"{path.name}: {exc}") from None
    wall = time.perf_counter() - started
    rows = [
        [
            c.benchmark,
            c.label,
            c.measured_tokens_per_s,
            c.simulated_tokens_per_s,
            f"{c.error:+.1%}",
            f"{c.simulated_range[0]:.1f} - {c.simulated_range[1]:.1f}" if c.simulated_range else "",
            f"{c.measured_wait_ms[0]:.1f} / {c.measured_wait_ms[1]:.1f}",
            f"{c.simulated_wait_ms[0]:.1f} / {c.simulated_wait_ms[1]:.1f}",
        ]
        for c in comparisons
    ]
    headers = ["bench", "configuration", "measured tok/s", "simulated tok/s", "error",
               f"simulated range ({args.replays} replays)", "measured wait p50/p99 ms",
               "simulated wait p50/p99 ms"]  # fmt: skip
    print(format_table(headers, rows))
    worst = max(abs(c.error) for c in comparisons) if comparisons else float("nan")
    within = sum(abs(c.error) <= ERROR_GOAL for c in comparisons)
    print(
        f"\n{within}/{len(comparisons)} within {ERROR_GOAL:.0%}; worst {worst:.1%}; "
        f"{args.replays} replays in {wall:.2f} s"
    )
    if args.json is not None:
        write_json(args.json, {
            "benchmark": "sim-validate",
            "sources": [str(p) for p in (args.e2e, args.adaptive) if p is not None],
            "calibration": str(args.calibration),
            "comparisons": [c.document() for c in comparisons],
            "within_goal": within,
            "worst_error": worst,
            "goal": ERROR_GOAL,
            "replays": args.replays,
            "seeds": [args.seed + i for i in range(args.replays)],
        })  # fmt: skip
        print(f"wrote {args.json}")
    return 0


def _measure(directory: Path) -> tuple[Path, Path, Path]:
    """The measured runs and the calibration, all made now: bench e2e (with its database),
    the target's passes profiled, bench adaptive (its database stays in its workdir); then
    calibrated on both databases and e2e's JSON. Each step is a child `specfleet` process, so
    that a run is measured as its own command measures it."""
    import subprocess

    directory.mkdir(parents=True, exist_ok=True)
    e2e, adaptive = directory / "e2e.json", directory / "adaptive.json"
    profile, calibration = directory / "cpu-profile.json", directory / "calibration.json"
    database = directory / "e2e.db"
    for stale in (database, e2e, adaptive):
        stale.unlink(missing_ok=True)
    e2e_url = f"sqlite:///{database}"
    steps = [
        ["bench", "e2e", "--sessions", "1", "4", "16", "32", "--database-url", e2e_url,
         "--json", str(e2e)],
        ["sim", "profile", "--out", str(profile)],
        ["bench", "adaptive", "--json", str(adaptive)],
    ]  # fmt: skip
    for step in steps:
        print(f"measuring: specfleet {' '.join(step)}", file=sys.stderr, flush=True)
        done = subprocess.run([sys.executable, "-m", "specfleet", *step], check=False)
        if done.returncode != 0:
            raise CommandError(f"specfleet {' '.join(step[:2])} failed (exit {done.returncode})")
    try:
        workdir = Path(json.loads(adaptive.read_text())["settings"]["workdir"])
    except (OSError, KeyError, json.JSONDecodeError) as exc:
        raise CommandError(f"cannot read {adaptive}: {exc}") from None
    urls = [e2e_url, f"sqlite:///{workdir / 'home' / 'specfleet.db'}"]
    step = ["sim", "calibrate", "--profile", str(profile), "--bench-json", str(e2e),
            "--bench-json", str(adaptive), "--out", str(calibration)]  # fmt: skip
    for url in urls:
        step += ["--database-url", url]
    print(f"calibrating: specfleet {' '.join(step)}", file=sys.stderr, flush=True)
    if subprocess.run([sys.executable, "-m", "specfleet", *step], check=False).returncode:
        raise CommandError("specfleet sim calibrate failed")
    return e2e, adaptive, calibration


def _inputs(args: argparse.Namespace) -> tuple[Any, Any, Any]:
    from sim.inputs import FleetSpec, WorkloadSpec

    return (
        _calibration(args.calibration),
        _load(args.fleet, FleetSpec),
        _load(args.workload, WorkloadSpec),
    )


def _run_rows(results: list[Any]) -> list[list[Any]]:
    return [
        [
            r.verifier_kind,
            r.verifiers,
            r.offered_tokens_per_s,
            r.tokens_per_s,
            f"{r.tbt_ms[0]:.1f} / {r.tbt_ms[1]:.1f}",
            f"{r.session_s[0]:.2f} / {r.session_s[1]:.2f}",
            ", ".join(f"{k} {v:.0%}" for k, v in r.utilisation.items()),
            r.bottleneck,
        ]
        for r in results
    ]


def _limited_line(result: Any) -> str | None:
    """What the devices' batteries and heat did in a run, where its fleet has them."""
    counts = result.devices_limited
    if not counts:
        return None
    drained = counts.get("battery drafting percent")
    return (
        f"{result.verifiers} {result.verifier_kind}: of {counts['reporting']:.0f} devices "
        f"reporting a battery or heat, spared the drafting at the end: "
        f"{counts['battery low']:.0f} battery low, {counts['too hot']:.0f} too hot; "
        f"{counts['throttled']:.0f} throttled by heat"
        + (
            ""
            if drained is None
            else f"; a working device's drafting took {drained:.2g}% of its battery"
        )
        + "; rounds "
        + ", ".join(f"{mode} {n}" for mode, n in sorted(result.rounds_by_mode.items()))
    )


RUN_HEADERS = ["kind", "verifiers", "offered tok/s", "served tok/s", "TBT p50/p95 ms",
               "session p50/p95 s", "utilisation", "bottleneck"]  # fmt: skip


def _run(args: argparse.Namespace) -> int:
    from sim.inputs import SimInputError
    from sim.plan import simulate

    calibration, fleet, workload = _inputs(args)
    kind = args.kind or fleet.verifiers[0].kind
    if args.verifiers < 1:
        raise CommandError("--verifiers must be >= 1")
    from tqdm import tqdm

    started, cpu_started = time.perf_counter(), time.process_time()
    total = round(workload.duration_s)
    with tqdm(total=total, desc="fleet time", unit="s", file=sys.stderr) as bar:

        def progress(fleet_s: float) -> None:
            bar.update(min(total, round(fleet_s)) - bar.n)

        try:
            result = simulate(
                calibration, fleet, workload, kind, args.verifiers, args.seed, progress
            )
        except SimInputError as exc:
            raise CommandError(str(exc)) from None
    wall, cpu = time.perf_counter() - started, time.process_time() - cpu_started
    print(format_table(RUN_HEADERS, _run_rows([result])))
    limited = _limited_line(result)
    if limited is not None:
        print(limited)
    devices = sum(d.count for d in fleet.devices)
    rounds = sum(result.rounds_by_mode.values())
    print(
        f"\n{devices} devices, {result.sessions_started} sessions ({result.open_sessions:.0f} "
        f"open at a time), {workload.duration_s:.0f} s of fleet time, {rounds} rounds, "
        f"{result.wall_events} events in {wall:.1f} s wall, {cpu:.1f} s CPU (one core)"
    )
    if args.json is not None:
        write_json(args.json, {
            "benchmark": "sim-run",
            "devices": devices,
            "fleet_s": workload.duration_s,
            "result": result.document(),
            "rounds": rounds,
            "wall_s": wall,
            "cpu_s": cpu,
        })  # fmt: skip
    return 0


def _plan(args: argparse.Namespace) -> int:
    from sim.inputs import SimInputError, SloSpec
    from sim.plan import plan

    calibration, fleet, workload = _inputs(args)
    slo = _load(args.slo, SloSpec)
    try:
        answers = plan(calibration, fleet, workload, slo, args.seed)
    except SimInputError as exc:
        raise CommandError(str(exc)) from None
    print(format_table(RUN_HEADERS, _run_rows(answers)))
    for answer in answers:
        verdict = "holds" if answer.holds(slo) else "does NOT hold (max_verifiers reached)"
        print(
            f"{answer.verifiers} {answer.verifier_kind} verifier(s): TBT p95 "
            f"{answer.tbt_ms[1]:.1f} ms against {slo.tbt_p95_ms:.0f} ms, {verdict}; "
            f"bottleneck: {answer.bottleneck}"
        )
        limited = _limited_line(answer)
        if limited is not None:
            print(limited)
    if args.json is not None:
        write_json(args.json, {
            "benchmark": "sim-plan",
            "slo": slo.model_dump(),
            "answers": [a.document() for a in answers],
        })  # fmt: skip
        print(f"wrote {args.json}")
    if args.html is not None:
        args.html.parent.mkdir(parents=True, exist_ok=True)
        args.html.write_text(plan_html(answers, slo))
        print(f"wrote {args.html}")
    return 0


def plan_html(answers: list[Any], slo: Any) -> str:
    """A self-contained page: each kind's answer as bars of TBT p95 against the SLO."""
    width, bar_h, gap = 640, 28, 12
    top = max([slo.tbt_p95_ms, *(a.tbt_ms[1] for a in answers if a.tbt_ms[1] == a.tbt_ms[1])])
    scale = (width - 220) / (top * 1.2)
    bars = []
    for i, a in enumerate(answers):
        y = 30 + i * (bar_h + gap)
        w = max(1.0, a.tbt_ms[1] * scale) if a.tbt_ms[1] == a.tbt_ms[1] else 1.0
        label = html.escape(f"{a.verifiers} x {a.verifier_kind}")
        bars.append(
            f'<text x="0" y="{y + 19}">{label}</text>'
            f'<rect x="200" y="{y}" width="{w:.1f}" height="{bar_h}" fill="#4a7"/>'
            f'<text x="{205 + w:.1f}" y="{y + 19}">{a.tbt_ms[1]:.1f} ms</text>'
        )
    slo_x = 200 + slo.tbt_p95_ms * scale
    height = 40 + len(answers) * (bar_h + gap)
    svg = (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'font-family="sans-serif" font-size="13">{"".join(bars)}'
        f'<line x1="{slo_x:.1f}" x2="{slo_x:.1f}" y1="20" y2="{height}" stroke="#c33" '
        f'stroke-dasharray="4"/><text x="{slo_x + 4:.1f}" y="14" fill="#c33">SLO '
        f"{slo.tbt_p95_ms:.0f} ms</text></svg>"
    )
    rows = "".join(
        "<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in row) + "</tr>"
        for row in _run_rows(answers)
    )
    head = "".join(f"<th>{html.escape(h)}</th>" for h in RUN_HEADERS)
    return (
        "<!doctype html><meta charset=utf-8><title>specfleet capacity plan</title>"
        "<style>body{font-family:sans-serif;margin:2em}td,th{padding:4px 8px;"
        "border-bottom:1px solid #ddd;text-align:right}</style>"
        f"<h1>Capacity plan</h1><p>Verifiers needed per kind for a time between tokens p95 of "
        f"{slo.tbt_p95_ms:.0f} ms.</p>{svg}<table><tr>{head}</tr>{rows}</table>\n"
    )


if __name__ == "__main__":  # pragma: no cover
    sys.exit("run as: specfleet sim ...")
