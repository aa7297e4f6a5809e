"""The chart library the dashboard serves is the uPlot release that scripts/vendor-uplot.sh pins
(from the npm registry, checked against its integrity hash), unedited, with its licence, and the
dashboard serves it from this host."""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

from fastapi.testclient import TestClient
from sqlalchemy.engine import Engine

from coordinator.web.api.main import create_app
from core.settings import Settings

REPO_ROOT = Path(__file__).resolve().parents[2]
VENDOR = REPO_ROOT / "coordinator" / "web" / "dashboard" / "static" / "vendor" / "uplot"
SCRIPT = REPO_ROOT / "scripts" / "vendor-uplot.sh"
FILES = ("uPlot.iife.min.js", "uPlot.min.css", "LICENSE")


def test_the_files_are_the_pinned_release_unedited() -> None:
    pinned = re.search(r"^VERSION=(\S+)$", SCRIPT.read_text(), re.M)
    assert pinned is not None
    banner = (VENDOR / "uPlot.iife.min.js").read_text()[:200]
    assert f"(v{pinned.group(1)})" in banner, banner
    sums: dict[str, str] = {}
    for line in (VENDOR / "SHA256SUMS").read_text().splitlines():
        digest, name = line.split("  ", 1)
        sums[name] = digest
    assert sorted(sums) == sorted(FILES)
    for name in FILES:
        assert hashlib.sha256((VENDOR / name).read_bytes()).hexdigest() == sums[name], name
    assert "MIT License" in (VENDOR / "LICENSE").read_text()


def test_the_dashboard_serves_it(sqlite_engine: Engine) -> None:
    settings = Settings(
        database_url=sqlite_engine.url.render_as_string(hide_password=False),
        secret_key="a-test-secret-of-32-characters!!",
    )
    with TestClient(create_app(settings, sqlite_engine)) as client:
        script = client.get("/static/vendor/uplot/uPlot.iife.min.js")
        style = client.get("/static/vendor/uplot/uPlot.min.css")
    assert script.status_code == 200 and script.content == (VENDOR / FILES[0]).read_bytes()
    assert style.status_code == 200 and style.content == (VENDOR / FILES[1]).read_bytes()
