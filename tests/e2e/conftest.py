"""The end-to-end tests' report: the fault matrix's recovery times after pytest's summary."""

from __future__ import annotations

import sys

import pytest


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    matrix = sys.modules.get("test_fault_matrix")
    if matrix is None:
        return
    lines = matrix.report_lines()
    if lines:
        terminalreporter.section("fault matrix")
        for line in lines:
            terminalreporter.write_line(line)
