"""The coordinator is split by concern into modules a reader can hold in mind: none of its
Python modules may grow past MAX_LINES lines."""

from __future__ import annotations

from pathlib import Path

import coordinator

MAX_LINES = 500


def test_no_coordinator_module_is_over_the_limit() -> None:
    root = Path(coordinator.__file__).resolve().parent
    modules = sorted(root.rglob("*.py"))
    assert len(modules) > 20, f"only {len(modules)} modules found under {root}"
    sizes = {path.relative_to(root.parent): len(path.read_text().splitlines()) for path in modules}
    too_long = {str(path): n for path, n in sizes.items() if n > MAX_LINES}
    assert not too_long, f"coordinator modules over {MAX_LINES} lines: {too_long}"
