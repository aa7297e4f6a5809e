"""The end-to-end tests' report: the fault matrix's recovery times after pytest's summary."""

from __future__ import annotations

import sys

import pytest

TITLE = "fault matrix"
WORKER_SUMMARY = "summary_sections"  # the key of workeroutput that tests/conftest.py prints


def _matrix_lines() -> list[str]:
    matrix = sys.modules.get("test_fault_matrix")
    return matrix.report_lines() if matrix is not None else []


def pytest_sessionfinish(session: pytest.Session) -> None:
    """On an xdist worker: hand the report to the controller (tests/conftest.py prints it)."""
    workeroutput = getattr(session.config, "workeroutput", None)
    if workeroutput is None:
        return
    lines = _matrix_lines()
    if lines:
        workeroutput.setdefault(WORKER_SUMMARY, {})[TITLE] = lines


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if hasattr(terminalreporter.config, "workeroutput"):
        return  # a worker's terminal is not shown; its report went to the controller
    lines = _matrix_lines()
    if lines:
        terminalreporter.section(TITLE)
        for line in lines:
            terminalreporter.write_line(line)
