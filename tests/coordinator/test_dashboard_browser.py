"""The dashboard in real headless Chromium (Debian's package, driven by Playwright): log in, see
a device come online live, open a finished session, see its tokens' provenance, run the replay.
Every page leaves a screenshot under test-artifacts/screenshots/ for CI to keep."""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import uvicorn
from dashboard_rows import (
    StoredRollouts,
    StoredSession,
    add_fleet,
    add_rollouts,
    add_session,
    recent,
)
from fastapi import FastAPI
from playwright.sync_api import Browser, Page, Playwright, Route, expect, sync_playwright
from sqlalchemy.engine import Engine

from broker.messages import Mode
from broker.mosquitto import free_port
from coordinator.db.engine import make_sessionmaker
from coordinator.db.models import AdminRole, DeviceDeploymentState, SessionStatus
from coordinator.ops.rollout import Deployments
from coordinator.web.api.main import create_app
from coordinator.web.auth import AdminStore
from core.settings import Settings
from device_agent import __version__ as AGENT_VERSION
from inference.artifacts import default_models_dir

REPO_ROOT = Path(__file__).resolve().parents[2]
SCREENSHOTS = REPO_ROOT / "test-artifacts" / "screenshots"
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]
SHARED_MOSQUITTO = "mqtt://127.0.0.1:1883"
SPECFLEET = (sys.executable, "-m", "specfleet")
AGENT = (sys.executable, "-m", "device_agent.cli", "run")
SECRET = "a-test-secret-of-32-characters!!"
VIEWPORT = {"width": 1360, "height": 900}

# A coordinator on the shared Mosquitto: one such module at a time (tests/conftest.py).
pytestmark = [
    pytest.mark.skipif(
        not Path(CHROMIUM).exists(),
        reason="Chromium is not installed: run scripts/install-browser-test-deps.sh",
    ),
    pytest.mark.shared_mosquitto,
]


@pytest.fixture(scope="module")
def playwright() -> Iterator[Playwright]:
    with sync_playwright() as driver:
        yield driver


@pytest.fixture(scope="module")
def browser(playwright: Playwright) -> Iterator[Browser]:
    browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
    yield browser
    browser.close()


@pytest.fixture
def page(browser: Browser) -> Iterator[Page]:
    context = browser.new_context(viewport=VIEWPORT)  # type: ignore[arg-type]
    page = context.new_page()
    page.set_default_timeout(15_000)
    yield page
    context.close()


def screenshot(page: Page, name: str) -> Path:
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    path = SCREENSHOTS / f"{name}.png"
    page.screenshot(path=str(path), full_page=True)
    assert path.stat().st_size > 10_000  # a rendered page, not a blank one
    return path


@contextmanager
def serve(app: FastAPI) -> Iterator[str]:
    """The app under uvicorn on a free loopback port, in a thread of this process."""
    port = free_port()
    config = uvicorn.Config(
        app,
        host="127.0.0.1",
        port=port,
        log_level="warning",
        log_config=None,
        lifespan="off",
        # Event streams stay open; do not wait for the browser to close them.
        timeout_graceful_shutdown=1,
    )
    server = uvicorn.Server(config)
    # A thread, because Playwright's sync API owns this thread and uvicorn needs an event loop.
    thread = threading.Thread(target=server.run, name="dashboard-http", daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)


@dataclass(frozen=True)
class Dashboard:
    url: str
    token: str
    viewer_token: str
    finished: StoredSession


@pytest.fixture
def dashboard(pg_clean_engine: Engine) -> Iterator[Dashboard]:
    sessions = make_sessionmaker(pg_clean_engine)
    add_fleet(sessions, recent(5))
    finished = add_session(sessions, created_at=recent(300))
    add_session(sessions, device_id="jet-1", created_at=recent(240), task_type="code")
    add_session(
        sessions,
        device_id="pi-2",
        created_at=recent(200),
        status=SessionStatus.CANCELLED,
        mode=Mode.CLOUD,
        draft_model="draft-l1",
        pattern=((4, 1, False), (4, 3, False)),
    )
    store = AdminStore(sessions)
    _, token = store.create("alice", AdminRole.ADMIN)
    _, viewer_token = store.create("victor", AdminRole.VIEWER)
    settings = Settings(
        database_url=pg_clean_engine.url.render_as_string(hide_password=False),
        models_dir=default_models_dir(),
        secret_key=SECRET,
    )
    with serve(create_app(settings, pg_clean_engine)) as url:
        yield Dashboard(url, token, viewer_token, finished)


def log_in(page: Page, url: str, token: str, start: str = "/fleet") -> None:
    page.goto(url + start)
    expect(page).to_have_url(f"{url}/login?next={start.replace('/', '%2F')}")
    page.fill("#token", token)
    page.click("button[type=submit]")
    expect(page).to_have_url(url + start)


def test_log_in_and_see_the_fleet(page: Page, dashboard: Dashboard) -> None:
    page.goto(dashboard.url + "/fleet")
    expect(page.locator("#token")).to_be_visible()
    screenshot(page, "login")

    page.fill("#token", "sft_wrong")
    page.click("button[type=submit]")
    expect(page.get_by_role("alert")).to_have_text("That token is not valid.")

    page.fill("#token", dashboard.token)
    page.click("button[type=submit]")
    expect(page).to_have_url(dashboard.url + "/fleet")
    expect(page.get_by_test_id("user-name")).to_have_text("alice")
    rows = page.locator("#devices tbody tr[data-device]")
    expect(rows).to_have_count(4)
    pi = page.locator('tr[data-device="pi-1"]')
    expect(pi).to_have_attribute("data-status", "online")
    expect(pi).to_contain_text("14 ms")
    expect(pi).to_contain_text("draft-l1")
    # α and speed come from the finished session's rounds (within the last 15 minutes).
    expect(pi.locator("td").nth(5)).not_to_have_text("–")
    expect(page.locator("#sum-online")).to_have_text("1")
    expect(page.locator("#live-indicator")).to_have_class("live on")
    screenshot(page, "fleet")

    page.select_option("#filter-status", "offline")
    expect(rows).to_have_count(3)
    page.fill("#filter-tag", "field")
    expect(rows).to_have_count(1)
    expect(rows.first).to_have_attribute("data-device", "phone-1")


def test_a_viewer_sees_no_write_controls(page: Page, dashboard: Dashboard) -> None:
    log_in(page, dashboard.url, dashboard.viewer_token)
    expect(page.locator("#devices tbody tr[data-device]")).to_have_count(4)
    expect(page.get_by_role("button", name="Retire")).to_have_count(0)
    page.goto(dashboard.url + "/sessions")
    expect(page.locator("#start-panel")).to_have_count(0)


def _transcript_tokens(page: Page) -> list[tuple[int, str]]:
    pairs: list[list[object]] = page.eval_on_selector_all(
        "#transcript .tok:not(.tok-rejected)",
        "nodes => nodes.map(n => [Number(n.dataset.token), n.dataset.kind])",
    )
    return [(int(str(token)), str(kind)) for token, kind in pairs]


def _background(page: Page, selector: str) -> str:
    value: str = page.eval_on_selector(selector, "n => getComputedStyle(n).backgroundColor")
    return value


def test_open_a_finished_session_and_see_its_tokens_highlighted(
    page: Page, dashboard: Dashboard
) -> None:
    stored = dashboard.finished
    log_in(page, dashboard.url, dashboard.token, "/sessions")
    rows = page.locator("#sessions tbody tr[data-session]")
    expect(rows).to_have_count(3)
    screenshot(page, "sessions")
    rows.filter(has_text="pi-1").locator("a").click()
    expect(page).to_have_url(f"{dashboard.url}/sessions/{stored.id}")
    expect(page.locator("#transcript")).to_have_attribute("data-loaded", "true")
    expect(page.locator("#session-status")).to_have_text("finished")

    tokens = _transcript_tokens(page)
    assert [t for t, _ in tokens] == stored.generated
    assert [kind for _, kind in tokens] == stored.kinds
    colours = {
        kind: _background(page, f"#transcript .tok-{kind}")
        for kind in ("accepted", "corrected", "provisional")
    }
    assert len(set(colours.values())) == 3, colours
    assert "rgba(0, 0, 0, 0)" not in colours.values()
    decoration: str = page.eval_on_selector(
        "#transcript .tok-provisional", "n => getComputedStyle(n).textDecorationStyle"
    )
    assert decoration == "dashed"
    expect(page.locator("#transcript .tok-provisional").first).to_have_attribute(
        "title",
        "round 2 · provisional (drafted offline), accepted · id " + str(stored.generated[7]),
    )

    # Rejected drafts are hidden until asked for, then struck through.
    rejected = page.locator("#transcript .tok-rejected").first
    expect(rejected).to_be_hidden()
    page.check("#show-rejected")
    expect(rejected).to_be_visible()
    assert "line-through" in str(
        page.eval_on_selector(
            "#transcript .tok-rejected", "n => getComputedStyle(n).textDecoration"
        )
    )

    timeline = page.locator("#timeline li")
    expect(timeline).to_have_count(stored.rounds)
    expect(timeline.first.locator(".leg")).to_have_count(5)
    expect(page.locator("#timeline li.policy-change")).to_have_count(1)
    expect(page.locator("#timeline .r-policy").first).to_contain_text("k 4")
    expect(page.locator("#timeline .r-policy").last).to_contain_text("k 6")
    expect(page.locator("#facts")).to_contain_text(f"{len(stored.generated)} / 256")
    screenshot(page, "session")

    # A phone's width: one column, nothing wider than the screen.
    page.set_viewport_size({"width": 390, "height": 844})
    overflow = page.evaluate("document.documentElement.scrollWidth - window.innerWidth")
    assert overflow <= 0, overflow
    screenshot(page, "session-narrow")


def test_run_the_replay(page: Page, dashboard: Dashboard) -> None:
    stored = dashboard.finished
    log_in(page, dashboard.url, dashboard.token, f"/sessions/{stored.id}")
    expect(page.locator("#transcript")).to_have_attribute("data-loaded", "true")
    total = len(stored.generated)
    page.select_option("#replay-speed", "2")
    page.click("#replay-button")
    expect(page.locator("#replay-button")).to_have_text("⏸ Stop")
    # Mid-replay: some rounds are shown, not all, and the current round is marked.
    page.wait_for_function(
        f"""() => {{
            const n = document.querySelectorAll('#transcript .tok:not(.tok-rejected)').length;
            return n > 0 && n < {total};
        }}"""
    )
    expect(page.locator("#timeline li.current")).to_have_count(1)
    expect(page.locator("#replay-progress")).to_contain_text(f"/ {stored.rounds}")
    screenshot(page, "session-replay")
    expect(page.locator("#transcript")).to_have_attribute("data-replay", "done", timeout=30_000)
    expect(page.locator("#replay-progress")).to_have_text(f"replayed {stored.rounds} rounds")
    assert [t for t, _ in _transcript_tokens(page)] == stored.generated
    expect(page.locator("#replay-button")).to_have_text("▶ Replay")


def chart(page: Page, name: str) -> dict[str, Any]:
    """What uPlot drew in #chart-<name>: its series' labels and data, each axis's label and tick
    texts (uPlot's own record of the ticks it drew, `_values`, in the vendored release), and
    the plot's box in CSS pixels."""
    drawn: dict[str, Any] = page.evaluate(
        """(id) => {
            const u = window.SFCharts[id];
            return {
                series: u.series.slice(1).map((s) => s.label),
                data: u.data,
                axes: u.axes.map((a) => ({ label: a.label, ticks: (a._values || []).map(String) })),
                box: { left: u.bbox.left / devicePixelRatio,
                       width: u.bbox.width / devicePixelRatio },
            };
        }""",
        f"chart-{name}",
    )
    return drawn


def test_charts_are_drawn_by_uplot_served_from_this_host(page: Page, dashboard: Dashboard) -> None:
    """uPlot, not hand-written SVG: ticks never repeat, counts are whole, every axis says its
    unit, and a series of one point shows (a marker, off the plot's edges)."""
    elsewhere: list[str] = []

    def only_this_host(route: Route) -> None:
        if route.request.url.startswith(dashboard.url):
            route.continue_()
        else:
            elsewhere.append(route.request.url)
            route.abort()

    page.route("**/*", only_this_host)
    log_in(page, dashboard.url, dashboard.token, "/charts")
    page.wait_for_function(
        "() => window.SFCharts && ['chart-acceptance', 'chart-rtt', 'chart-legs']"
        ".every((id) => window.SFCharts[id])"
    )
    assert page.evaluate("() => typeof uPlot.paths.bars") == "function"
    assert not elsewhere

    acceptance = chart(page, "acceptance")
    assert len(acceptance["series"]) == 3
    expect(page.locator("#legend-acceptance")).to_contain_text("lookup · code")
    rtt = chart(page, "rtt")
    assert len(rtt["data"][1]) == 11
    legs = chart(page, "legs")
    assert legs["series"] == ["p95", "p50"] and len(legs["data"][1]) == 5
    expect(page.locator("#chart-verifiers")).to_contain_text("No coordinator service attached")

    for name, drawn in (("acceptance", acceptance), ("rtt", rtt), ("legs", legs)):
        ticks = drawn["axes"][1]["ticks"]
        assert len(ticks) >= 2 and len(set(ticks)) == len(ticks), (name, ticks)  # 0,0,1,1 was
    assert all(tick.isdigit() for tick in rtt["axes"][1]["ticks"]), rtt  # rounds count whole
    assert [axis["label"] for axis in rtt["axes"]] == ["round trip, ms", "rounds"]
    assert rtt["axes"][0]["ticks"][0].startswith("<") and rtt["axes"][0]["ticks"][-1][0] == "≥"
    assert [axis["label"] for axis in legs["axes"]] == ["leg", "ms"]
    assert acceptance["axes"][1]["label"].startswith("α")

    # Each series here is one bucket, so one point: a marker in its colour, inside the plot and
    # off its edges.
    lone = page.evaluate(
        """() => {
            const u = window.SFCharts["chart-acceptance"];
            const ratio = devicePixelRatio;
            return u.series.slice(1).map((s, i) => {
                const row = u.data[i + 1].findIndex((v) => v !== null);
                const x = u.valToPos(u.data[0][row], "x", true);
                const y = u.valToPos(u.data[i + 1][row], "y", true);
                const [r, g, b, a] = u.ctx.getImageData(Math.round(x), Math.round(y), 1, 1).data;
                return { x: x / ratio, alpha: a, rgb: [r, g, b], color: s._stroke ?? s.stroke };
            });
        }"""
    )
    box = acceptance["box"]
    colors = {tuple(bytes.fromhex(point["color"].lstrip("#"))) for point in lone}
    for point in lone:
        # The marker (of this series, or of one drawn over it at the same value).
        assert point["alpha"] == 255 and tuple(point["rgb"]) in colors, (point, colors)
        assert 20 < point["x"] - box["left"] < box["width"] - 20, (point, box)
    screenshot(page, "charts")


def test_models_and_events_pages(page: Page, dashboard: Dashboard) -> None:
    log_in(page, dashboard.url, dashboard.token, "/models")
    target = page.locator("#models tbody tr", has_text="smollm2")
    expect(target.first).to_contain_text("target")
    expect(target.first).to_contain_text("on disk")
    screenshot(page, "models")

    page.goto(dashboard.url + "/events")
    events = page.locator("#events tbody tr[data-event]")
    expect(events.first).to_have_attribute("data-kind", "auth.login")
    expect(page.locator('#events tr[data-kind="device.provisioned"]')).to_have_count(4)
    page.fill("#filter-kind", "device.")
    expect(events).to_have_count(5)
    screenshot(page, "events")


def test_a_write_from_the_page_is_audited(page: Page, dashboard: Dashboard) -> None:
    log_in(page, dashboard.url, dashboard.token)
    page.once("dialog", lambda dialog: dialog.accept("lab, rack-3"))
    page.locator('tr[data-device="pi-2"]').get_by_role("button", name="Tags").click()
    expect(page.locator('tr[data-device="pi-2"]')).to_contain_text("rack-3")
    page.goto(dashboard.url + "/events")
    tagged = page.locator('#events tr[data-kind="device.tagged"]')
    expect(tagged).to_contain_text("user:alice")
    expect(tagged).to_contain_text('"after":["lab","rack-3"]')


# --- rollouts and devices -----------------------------------------------------------------------


@dataclass(frozen=True)
class RolloutDashboard:
    url: str
    token: str
    viewer_token: str
    finished: StoredSession
    rollouts: StoredRollouts
    deployments: Deployments  # to move a rollout on while a page shows it


@pytest.fixture
def rollout_dashboard(pg_clean_engine: Engine, tmp_path: Path) -> Iterator[RolloutDashboard]:
    """The fleet with two rollouts of draft-l1 (one done, one mid-way) whose releases live in the
    app's home, and pi-1's agent back online reporting its version and runtimes."""
    sessions = make_sessionmaker(pg_clean_engine)
    registry = add_fleet(sessions, recent(5))
    registry.mark_offline("pi-1", recent(4), "keepalive expired")
    registry.mark_online(
        "pi-1", recent(3), detail={"agent_version": AGENT_VERSION, "runtimes": ["onnx", "tflite"]}
    )
    finished = add_session(sessions, created_at=recent(300))
    add_session(sessions, device_id="jet-1", created_at=recent(240), task_type="code")
    rollouts = add_rollouts(sessions, tmp_path, "draft-l1")
    store = AdminStore(sessions)
    _, token = store.create("alice", AdminRole.ADMIN)
    _, viewer_token = store.create("victor", AdminRole.VIEWER)
    settings = Settings(
        database_url=pg_clean_engine.url.render_as_string(hide_password=False),
        models_dir=default_models_dir(),
        secret_key=SECRET,
        home=tmp_path,
    )
    with serve(create_app(settings, pg_clean_engine)) as url:
        yield RolloutDashboard(url, token, viewer_token, finished, rollouts, Deployments(sessions))


def _segments(page: Page, selector: str) -> dict[str, int]:
    pairs: list[list[str]] = page.eval_on_selector_all(
        f"{selector} .seg", "nodes => nodes.map(n => [n.dataset.state, n.dataset.count])"
    )
    return {state: int(count) for state, count in pairs}


def test_deployments_page_shows_waves_device_states_and_aborts(
    page: Page, rollout_dashboard: RolloutDashboard
) -> None:
    board, rollouts = rollout_dashboard, rollout_dashboard.rollouts
    log_in(page, board.url, board.token, "/deployments")
    rows = page.locator("#deployments tbody tr[data-deployment]")
    expect(rows).to_have_count(2)
    rolling = page.locator(f'tr[data-deployment="{rollouts.rolling}"]')
    done = page.locator(f'tr[data-deployment="{rollouts.done}"]')
    expect(rows.first).to_have_attribute("data-deployment", str(rollouts.rolling))  # newest first
    expect(rolling).to_have_attribute("data-state", "rolling")
    expect(rolling).to_contain_text(f"v{rollouts.version} {rollouts.sha256[:12]}")
    expect(rolling).to_contain_text("2 / 4 answered")
    expect(rolling).to_contain_text("2 / 3")  # the second of three waves
    row_bar = f'tr[data-deployment="{rollouts.rolling}"]'
    assert _segments(page, row_bar) == {"installed": 1, "pending": 2, "rolled_back": 1}
    expect(done).to_contain_text("2 / 2 answered")
    assert _segments(page, f'tr[data-deployment="{rollouts.done}"]') == {"installed": 2}
    screenshot(page, "deployments")

    page.select_option("#filter-state", "done")
    expect(rows).to_have_count(1)
    expect(rows.first).to_have_attribute("data-deployment", str(rollouts.done))
    page.select_option("#filter-state", "")
    expect(rows).to_have_count(2)

    rolling.get_by_role("link").first.click()
    expect(page).to_have_url(f"{board.url}/deployments/{rollouts.rolling}")
    expect(page.locator("#waves")).to_have_attribute("data-loaded", "true")
    expect(page.locator("#deployment-state")).to_have_text("rolling")
    waves = page.locator("#waves section.wave")
    expect(waves).to_have_count(3)
    expect(waves.nth(0)).to_have_attribute("data-state", "finished")
    expect(waves.nth(1)).to_have_attribute("data-state", "finished")
    expect(waves.nth(2)).to_have_attribute("data-state", "waiting")
    phone = waves.nth(1).locator('tr[data-device="phone-1"]')
    expect(phone).to_have_attribute("data-state", "rolled_back")
    expect(phone).to_contain_text("smoke: RuntimeError: no memory")
    expect(waves.nth(2).locator("tr[data-device]")).to_have_count(2)
    expect(waves.nth(2)).to_contain_text("not sent yet")
    expect(page.locator("#facts")).to_contain_text("phone-1, pi-2, lab")
    expect(page.locator("#facts")).to_contain_text("60% failed")
    expect(page.locator("#state-legend")).to_contain_text("1 rolled back")
    screenshot(page, "deployment")

    # The runner starts the last wave and pi-1 answers: the page follows without a reload.
    page.evaluate("window.__notReloaded = true")
    board.deployments.start_wave(rollouts.rolling, 2, ["pi-1", "pi-2"])
    board.deployments.record_device(
        rollouts.rolling,
        "pi-1",
        DeviceDeploymentState.INSTALLED,
        "installed",
        model_name="draft-l1",
    )
    expect(waves.nth(2).locator('tr[data-device="pi-1"]')).to_have_attribute(
        "data-state", "installed"
    )
    expect(waves.nth(2).locator('tr[data-device="pi-2"]')).to_have_attribute("data-state", "sent")
    expect(waves.nth(2)).to_have_attribute("data-state", "running")
    assert page.evaluate("window.__notReloaded") is True

    page.once("dialog", lambda dialog: dialog.accept("smoke failures on phones"))
    page.get_by_role("button", name="Abort rollout").click()
    expect(page.locator("#deployment-state")).to_have_text("cancelled")
    expect(page.get_by_role("button", name="Abort rollout")).to_be_hidden()
    screenshot(page, "deployment-aborted")

    page.goto(board.url + "/events")
    aborted = page.locator('#events tr[data-kind="deployment.abort_requested"]')
    expect(aborted).to_contain_text("user:alice")
    expect(aborted).to_contain_text("smoke failures on phones")


def test_a_viewer_cannot_abort_a_rollout(page: Page, rollout_dashboard: RolloutDashboard) -> None:
    board, rolling = rollout_dashboard, rollout_dashboard.rollouts.rolling
    log_in(page, board.url, board.viewer_token, f"/deployments/{rolling}")
    expect(page.locator("#waves")).to_have_attribute("data-loaded", "true")
    expect(page.get_by_role("button", name="Abort rollout")).to_have_count(0)
    answer = page.request.post(
        f"{board.url}/api/v1/deployments/{rolling}/abort",
        headers={"Authorization": f"Bearer {board.viewer_token}"},
        data={"reason": "no"},
    )
    assert answer.status == 403, answer.text()
    # An admin's abort of a finished rollout is refused with the reason.
    done = page.request.post(
        f"{board.url}/api/v1/deployments/{board.rollouts.done}/abort",
        headers={"Authorization": f"Bearer {board.token}"},
        data={},
    )
    assert done.status == 409
    assert "is done: nothing to abort" in done.json()["detail"]


def test_device_page_from_the_fleet(page: Page, rollout_dashboard: RolloutDashboard) -> None:
    board, rollouts = rollout_dashboard, rollout_dashboard.rollouts
    log_in(page, board.url, board.token)
    page.locator('tr[data-device="pi-1"]').get_by_role("link", name="pi-1").click()
    expect(page).to_have_url(f"{board.url}/devices/pi-1")
    expect(page.locator("#facts")).to_have_attribute("data-loaded", "true")
    expect(page.locator("#device-status")).to_have_text("online")
    facts = page.locator("#facts")
    expect(facts).to_contain_text(f"Agent version{AGENT_VERSION}")
    expect(facts).to_contain_text("onnx, tflite")
    expect(facts.locator(".chip")).to_have_text(["field", "lab"])
    expect(page.locator("#telemetry")).to_contain_text("14 ms")
    expect(page.locator("#telemetry")).to_contain_text("35%")
    expect(page.locator("#telemetry")).to_contain_text("Memory free612 MB")
    expect(page.locator("#telemetry")).to_contain_text("Drafts over memorydraft-l2")

    draft = page.locator('#drafts tr[data-draft="draft-l1"]')
    expect(draft).to_have_attribute("data-source", "rollout")
    expect(draft).to_contain_text(f"v{rollouts.version}")
    expect(draft.locator("code")).to_have_text(rollouts.sha256[:12])
    expect(draft.locator("code")).to_have_attribute("title", rollouts.sha256)
    expect(draft).to_contain_text(f"deployment #{rollouts.done}")
    lookup = page.locator('#drafts tr[data-draft="lookup"]')
    expect(lookup).to_have_attribute("data-source", "device")

    part = page.locator("#device-deployments tbody tr[data-deployment]")
    expect(part).to_have_count(2)
    expect(part.first).to_have_attribute("data-deployment", str(rollouts.rolling))
    expect(part.first).to_have_attribute("data-state", "pending")
    expect(part.last).to_have_attribute("data-state", "installed")

    sessions = page.locator("#device-sessions tbody tr[data-session]")
    expect(sessions).to_have_count(1)
    expect(sessions.first).to_have_attribute("data-session", str(board.finished.id))
    expect(sessions.first).to_contain_text(str(len(board.finished.generated)))
    expect(page.locator('nav a[aria-current="page"]')).to_have_text("Fleet")
    screenshot(page, "device")

    sessions.first.get_by_role("link").click()
    expect(page).to_have_url(f"{board.url}/sessions/{board.finished.id}")
    page.get_by_role("link", name="pi-1").click()
    expect(page).to_have_url(f"{board.url}/devices/pi-1")

    page.goto(board.url + "/devices/no-such-device")
    expect(page.locator("#facts .error")).to_have_text("no device 'no-such-device'")


# --- live: `specfleet up` on the real Mosquitto and PostgreSQL, a real device agent ------------


def _env(home: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPECFLEET_")}
    env.update(
        SPECFLEET_HOME=str(home),
        SPECFLEET_ENVIRONMENT="production",
        SPECFLEET_SECRET_KEY=secrets.token_urlsafe(24),
        **extra,
    )
    return env


def _specfleet(*args: str, env: dict[str, str]) -> str:
    done = subprocess.run(
        [*SPECFLEET, *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


@pytest.fixture
def running_coordinator(
    tmp_path: Path, create_pg_database: Callable[[], str]
) -> Iterator[tuple[str, dict[str, str]]]:
    """`specfleet up` (coordinator service, HTTP API and dashboard) on the shared Mosquitto."""
    http_port = free_port()
    env = _env(
        tmp_path,
        SPECFLEET_DATABASE_URL=create_pg_database(),
        SPECFLEET_COORDINATOR_ID=f"coordinator-browser-{secrets.token_hex(4)}",
    )
    _specfleet("db", "upgrade", env=env)
    process = subprocess.Popen(
        [*SPECFLEET, "up", "--broker", SHARED_MOSQUITTO, "--http-port", str(http_port)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    assert process.stdout is not None
    lines = []
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        line = process.stdout.readline()
        lines.append(line)
        if line.startswith("coordinator  connected") or process.poll() is not None:
            break
    assert process.poll() is None, "".join(lines)
    try:
        yield f"http://127.0.0.1:{http_port}", env
    finally:
        process.send_signal(signal.SIGINT)
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            process.kill()


def test_see_a_device_come_online_live(
    running_coordinator: tuple[str, dict[str, str]], page: Page
) -> None:
    # (The page is set up after the coordinator, so it closes its event stream first.)
    url, env = running_coordinator
    admin = json.loads(_specfleet("admin", "create", "ops", "--json", env=env))
    log_in(page, url, admin["token"])
    expect(page.locator("#live-indicator")).to_have_class("live on")
    page.evaluate("window.__notReloaded = true")

    device_id = f"pi-live-{secrets.token_hex(3)}"
    added = json.loads(_specfleet("devices", "add", device_id, "--kind", "pi", "--json", env=env))
    row = page.locator(f'tr[data-device="{device_id}"]')
    expect(row).to_have_attribute("data-status", "offline")

    agent = subprocess.Popen(
        [
            *AGENT,
            *("--device-id", device_id),
            *("--broker-url", SHARED_MOSQUITTO, "--keepalive", "2", "--telemetry-interval", "0.5"),
        ],
        env=env | {"SPECFLEET_CREDENTIAL": added["credential"]},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        expect(row).to_have_attribute("data-status", "online", timeout=20_000)
        expect(row.locator(".status-dot.online")).to_have_count(1)
        assert page.evaluate("window.__notReloaded") is True  # it changed in place
        screenshot(page, "fleet-live")
    finally:
        agent.send_signal(signal.SIGKILL)
        agent.wait(timeout=5)
    # The Last Will arrives: the row goes offline again without a reload.
    expect(row).to_have_attribute("data-status", "offline", timeout=20_000)


def test_the_api_docs_render_with_no_network_beyond_this_host(
    page: Page, dashboard: Dashboard
) -> None:
    """Swagger UI comes from this host: with every other host refused, the page still renders
    the API's operations (FastAPI's default page loads Swagger UI from a CDN, and is blank on
    a fleet's private network)."""
    elsewhere: list[str] = []

    def refuse_other_hosts(route: Route) -> None:
        if route.request.url.startswith(dashboard.url):
            route.continue_()
        else:
            elsewhere.append(route.request.url)
            route.abort()

    page.route("**/*", refuse_other_hosts)
    page.goto(dashboard.url + "/api/v1/docs")
    expect(page.locator(".swagger-ui .info .title")).to_contain_text("specfleet coordinator")
    expect(page.locator(".opblock-summary-path", has_text="/api/v1/devices").first).to_be_visible()
    screenshot(page, "api-docs")
    assert elsewhere == []
