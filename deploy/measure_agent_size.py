"""Measure the agent's installed size with each draft runtime, installed as `specfleet flash` does.

    .venv/bin/python deploy/measure_agent_size.py [--out bench-results/agent-size.json]
        [--local-only]

Two wheels, measured in the same run: the agent's own (`specfleet-agent`, the device packages
only: deploy/agent-wheel/) and the whole project's (`specfleet`, every package, with its `agent`
extras), as the baseline. For each wheel and runtime: gather the wheelhouse for this machine's
platform, create a fresh venv without pip and install `specfleet-agent[<runtime>]` (or
`specfleet[<extra>]`) from the wheelhouse alone with `--no-compile`, as flash does; then sum the
files of every installed distribution.

Devices of other platforms (a Raspberry Pi, a Jetson) cannot be installed here; for them the
wheelhouse is gathered for their platform tags and the files inside the wheels are summed, which
is what pip unpacks (it leaves out only the few bytes of RECORD rewriting and entry scripts).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from coordinator.ops.packaging import (  # noqa: E402
    AGENT_EXTRAS,
    DevicePlatform,
    PackagingError,
    Runtime,
    agent_requirement,
    build_agent_wheel,
    build_wheel,
    build_wheelhouse,
)
from core.report import format_table  # noqa: E402

SIZES = (
    "import importlib.metadata as m, json, os, sys; "
    "sizes = {}; "
    "[sizes.__setitem__(d.metadata['Name'].lower(), sum(os.path.getsize(f.locate()) "
    "for f in (d.files or []) if os.path.isfile(f.locate()))) for d in m.distributions()]; "
    "print(json.dumps(sizes))"
)


# (label, python, machine, glibc): Raspberry Pi OS 12 (bookworm) and JetPack 6 (Ubuntu 22.04).
FOREIGN = (
    ("raspberry-pi-os-12", "3.11", "aarch64", "2.36"),
    ("jetpack-6", "3.10", "aarch64", "2.35"),
)


def unpacked(wheels: list[Path]) -> int:
    total = 0
    for wheel in wheels:
        with zipfile.ZipFile(wheel) as archive:
            total += sum(info.file_size for info in archive.infolist())
    return total


def estimate(
    wheel: Path, runtime: Runtime, work: Path, label: str, platform: DevicePlatform
) -> dict[str, object]:
    wheels = build_wheelhouse(
        wheel, runtime, platform, work / f"wheels-{wheel.stem}-{label}-{runtime}"
    )
    wheels = [w for w in wheels if not w.name.startswith("pip-")]
    return {
        "runtime": runtime,
        "install": agent_requirement(wheel, runtime),
        "platform": f"{label} ({platform.tag})",
        "installed_bytes": unpacked(wheels),
        "wheelhouse_bytes": sum(w.stat().st_size for w in wheels),
        "method": "sum of the files inside the wheels",
        "distributions": {w.name.split("-")[0].lower(): unpacked([w]) for w in wheels},
    }


def du(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file() and not p.is_symlink())


def measure(wheel: Path, runtime: Runtime, work: Path, base_python: str) -> dict[str, object]:
    platform = DevicePlatform.local()
    wheelhouse = work / f"wheels-{wheel.stem}-{runtime}"
    wheels = build_wheelhouse(wheel, runtime, platform, wheelhouse)
    venv = work / f"venv-{wheel.stem}-{runtime}"
    subprocess.run([base_python, "-m", "venv", "--without-pip", str(venv)], check=True)
    empty = du(venv)
    pip = next(w for w in wheels if w.name.startswith("pip-"))
    subprocess.run(
        [
            str(venv / "bin" / "python"), f"{pip}/pip", "install", "--quiet", "--no-compile",
            "--no-index", "--find-links", str(wheelhouse), agent_requirement(wheel, runtime),
        ],
        check=True,
    )  # fmt: skip
    sizes = json.loads(
        subprocess.run(
            [str(venv / "bin" / "python"), "-c", SIZES],
            capture_output=True,
            text=True,
            check=True,
            cwd=venv,  # not a checkout: its specfleet.egg-info would count as installed
        ).stdout
    )
    return {
        "runtime": runtime,
        "install": agent_requirement(wheel, runtime),
        "platform": platform.tag,
        "installed_bytes": du(venv) - empty,
        "wheelhouse_bytes": sum(w.stat().st_size for w in wheels if not w.name.startswith("pip-")),
        "method": "installed into a fresh venv here",
        "distributions": dict(sorted(sizes.items(), key=lambda kv: -int(kv[1]))),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "bench-results" / "agent-size.json")
    parser.add_argument(
        "--python",
        default=str(Path(getattr(sys, "_base_executable", sys.executable)).resolve()),
        help="the interpreter for the fresh venvs (default: the one behind this venv)",
    )
    parser.add_argument(
        "--local-only", action="store_true", help="this machine's platform only (no estimates)"
    )
    args = parser.parse_args()
    results = []
    with tempfile.TemporaryDirectory(prefix="specfleet-size-") as tmp:
        work = Path(tmp)
        wheels = (build_agent_wheel(work / "built"), build_wheel(work / "built"))
        for wheel in wheels:
            for runtime in AGENT_EXTRAS:
                print(f"measuring {agent_requirement(wheel, runtime)} ...", flush=True)
                results.append(measure(wheel, runtime, work, args.python))
        foreign = () if args.local_only else FOREIGN
        for label, python, machine, glibc in foreign:
            for runtime in AGENT_EXTRAS:
                print(f"estimating {agent_requirement(wheels[0], runtime)} on {label} ...")
                device = DevicePlatform(python, machine, "glibc", glibc)
                try:
                    results.append(estimate(wheels[0], runtime, work, label, device))
                except PackagingError as exc:  # e.g. no wheel of a runtime for that platform
                    print(f"  {label} {runtime}: {exc}", flush=True)
                    results.append(
                        {"runtime": runtime, "platform": label, "error": str(exc)[-300:]}
                    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    rows: list[tuple[str, ...]] = []
    for result in results:
        if "error" in result:
            rows.append(("-", str(result["platform"]), "-", "-", "no wheels"))
            continue
        distributions: dict[str, int] = result["distributions"]  # type: ignore[assignment]
        largest = sorted(distributions.items(), key=lambda kv: -kv[1])[:4]
        rows.append(
            (
                str(result["install"]),
                str(result["platform"]),
                f"{int(str(result['installed_bytes'])) / 1e6:.0f}",
                f"{int(str(result['wheelhouse_bytes'])) / 1e6:.0f}",
                ", ".join(f"{name} {size / 1e6:.0f}" for name, size in largest),
            )
        )
    print(format_table(("install", "platform", "installed MB", "wheels MB", "largest (MB)"), rows))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
