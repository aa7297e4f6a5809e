"""Benchmark output: an aligned table on stdout and a JSON document on disk."""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def add_json_argument(parser: argparse.ArgumentParser, default_path: Path) -> None:
    """`--json [PATH]`: every benchmark writes its results there (default_path when bare)."""
    parser.add_argument(
        "--json",
        type=Path,
        nargs="?",
        const=default_path,
        default=None,
        metavar="PATH",
        help=f"write the results as JSON (default path {default_path})",
    )


def int_list(text: str, option: str, least: int = 1) -> list[int]:
    """A benchmark's comma-separated integers (`--k 1,2,4`); CommandError naming the option."""
    from core.errors import CommandError

    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError as exc:
        raise CommandError(f"{option} must be comma-separated integers, got {text!r}") from exc
    if not values or min(values) < least:
        raise CommandError(f"{option} values must be >= {least}, got {text!r}")
    return values


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) by linear interpolation; NaN for no values."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    if len(ordered) == 1:
        return ordered[0]
    pos = (len(ordered) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else float("nan")


def format_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    def cell(value: Any) -> str:
        if isinstance(value, float):
            return f"{value:.3f}" if abs(value) < 1000 else f"{value:.0f}"
        return str(value)

    text_rows = [[cell(v) for v in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in text_rows)) for i, h in enumerate(headers)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True))]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in text_rows]
    return "\n".join(lines)


def write_json(path: Path, document: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(document, indent=2, sort_keys=True) + "\n")
