"""The admin API on the real PostgreSQL: authentication, pagination and filters, session detail
with token provenance, models, verifiers, events, statistics, audited writes, and 4xx on bad
input. Starting and cancelling sessions go through the CoordinatorControl protocol; here a
database-backed implementation stands in for the coordinator service (see DatabaseControl)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from datetime import timedelta

import pytest
import sqlalchemy as sa
from dashboard_rows import StoredSession, add_fleet, add_session, chat_tokenizer, recent
from fastapi.testclient import TestClient
from sqlalchemy.engine import Engine
from sqlalchemy.orm import Session, sessionmaker

from broker.messages import Mode
from coordinator.db.engine import make_sessionmaker
from coordinator.db.models import (
    Admin,
    AdminRole,
    ApiToken,
    DecodingSession,
    Event,
    Model,
    ModelRole,
    SessionStatus,
    utcnow,
)
from coordinator.live import ControlError, SessionStartRequest, VerifierLoad
from coordinator.web.api.main import create_app
from coordinator.web.auth import AdminStore
from core.settings import Settings
from inference.artifacts import default_models_dir, list_models

SECRET = "a-test-secret-of-32-characters!!"


@dataclass
class DatabaseControl:
    """The service's side of CoordinatorControl as far as the database goes: a start writes the
    session row and a cancel ends it, as the coordinator does before it talks to the device.
    No device runs these sessions; the end-to-end start is the coordinator service's test."""

    sessions: sessionmaker[Session]
    loads: list[VerifierLoad] = field(default_factory=list)
    started: list[SessionStartRequest] = field(default_factory=list)
    revoked: list[tuple[str, str]] = field(default_factory=list)  # (device id, actor)

    def verifier_loads(self) -> Sequence[VerifierLoad]:
        return self.loads

    async def start_session(self, request: SessionStartRequest) -> uuid.UUID:
        if request.device_id == "phone-1":
            raise ControlError("device 'phone-1' is offline", status=409)
        self.started.append(request)
        prompt_ids = chat_tokenizer().apply_chat_template(request.prompt)
        row = DecodingSession(
            device_id=request.device_id,
            task_type=request.task_type,
            prompt=request.prompt,
            prompt_ids=prompt_ids,
            temperature=request.temperature,
            top_p=request.top_p,
            seed=request.seed or 7,
            max_tokens=request.max_tokens,
            mode=Mode.DISTRIBUTED,
            draft_model=request.draft_model or "lookup",
            k=request.k or 4,
            status=SessionStatus.ACTIVE,
            committed_ids=[],
            committed_len=len(prompt_ids),
        )
        with self.sessions.begin() as db:
            db.add(row)
        return row.id

    async def cancel_session(self, session_id: uuid.UUID, *, reason: str, actor: str) -> None:
        with self.sessions.begin() as db:
            row = db.get(DecodingSession, session_id)
            assert row is not None
            row.status = SessionStatus.CANCELLED
            row.finished_at = utcnow()

    async def revoke_device(self, device_id: str, *, reason: str, actor: str) -> None:
        self.revoked.append((device_id, actor))


@dataclass(frozen=True)
class Fixture:
    client: TestClient
    admin: dict[str, str]  # headers
    viewer: dict[str, str]
    finished: StoredSession
    control: DatabaseControl
    sessions: sessionmaker[Session]


@pytest.fixture
def api(pg_clean_engine: Engine) -> Iterator[Fixture]:
    sessions = make_sessionmaker(pg_clean_engine)
    add_fleet(sessions, recent(5))
    finished = add_session(sessions, created_at=recent(120))
    # More sessions for filters and paging: newest first is the list's order.
    add_session(sessions, device_id="jet-1", created_at=recent(90), task_type="code")
    add_session(sessions, device_id="pi-2", created_at=recent(80), status=SessionStatus.ACTIVE)
    add_session(
        sessions,
        device_id="pi-2",
        created_at=recent(70),
        status=SessionStatus.CANCELLED,
        mode=Mode.CLOUD,
        draft_model="draft-l1",
    )
    store = AdminStore(sessions)
    _, admin_token = store.create("alice", AdminRole.ADMIN)
    _, viewer_token = store.create("victor", AdminRole.VIEWER)
    control = DatabaseControl(
        sessions,
        loads=[
            VerifierLoad("verifier-1", True, 3, 1, 5, 8, "smollm2@abc", utcnow()),
            VerifierLoad("verifier-0", True, 0, 0, 2, 8, "smollm2@abc", utcnow()),
            VerifierLoad("verifier-2", False, 0, 0, 0, 8, "smollm2@abc", None),
        ],
    )
    settings = Settings(
        database_url=pg_clean_engine.url.render_as_string(hide_password=False),
        models_dir=default_models_dir(),
        secret_key=SECRET,
    )
    app = create_app(settings, pg_clean_engine, control=control)
    with TestClient(app) as client:
        yield Fixture(
            client=client,
            admin={"Authorization": f"Bearer {admin_token}"},
            viewer={"Authorization": f"Bearer {viewer_token}"},
            finished=finished,
            control=control,
            sessions=sessions,
        )


READ_URLS = [
    "/api/v1/devices",
    "/api/v1/devices/pi-1",
    "/api/v1/sessions",
    "/api/v1/models",
    "/api/v1/verifiers",
    "/api/v1/events",
    "/api/v1/stats/fleet",
    "/api/v1/stats/acceptance",
    "/api/v1/stats/latency",
    "/api/v1/me",
]


@pytest.mark.parametrize("url", READ_URLS)
def test_every_resource_needs_credentials(api: Fixture, url: str) -> None:
    response = api.client.get(url)
    assert response.status_code == 401
    assert response.headers["WWW-Authenticate"] == "Bearer"
    assert "specfleet admin create" in response.json()["detail"]
    assert api.client.get(url, headers=api.viewer).status_code == 200


@pytest.mark.parametrize(
    ("header", "reason"),
    [
        ("Bearer sft_not-a-real-token", "invalid or revoked token"),
        ("Basic YWxpY2U6c2VjcmV0", "malformed Authorization header"),
        ("Bearer", "malformed Authorization header"),
        ("Bearer    ", "malformed Authorization header"),
        ("Bearer " + "x" * 500, "invalid or revoked token"),
    ],
)
def test_bad_credentials_are_401_with_a_reason(api: Fixture, header: str, reason: str) -> None:
    response = api.client.get("/api/v1/devices", headers={"Authorization": header})
    assert response.status_code == 401
    assert reason in response.json()["detail"]


def test_a_revoked_token_stops_working(api: Fixture) -> None:
    assert api.client.get("/api/v1/me", headers=api.admin).json() == {
        "name": "alice",
        "role": "admin",
    }
    assert AdminStore(api.sessions).revoke_tokens("alice", actor="cli") == 1
    assert api.client.get("/api/v1/me", headers=api.admin).status_code == 401


WRITES = [
    ("put", "/api/v1/devices/pi-2/tags", {"tags": ["lab"]}),
    ("post", "/api/v1/devices/pi-2/retire", {"reason": "broken"}),
    ("post", "/api/v1/sessions", {"device_id": "pi-1", "prompt": "Hi"}),
    ("post", "/api/v1/sessions/{active}/cancel", {}),
]


def _active_id(api: Fixture) -> str:
    page = api.client.get("/api/v1/sessions?status=active", headers=api.viewer).json()
    return str(page["data"][0]["id"])


@pytest.mark.parametrize(("method", "url", "body"), WRITES)
def test_writes_are_admin_only(
    api: Fixture, method: str, url: str, body: dict[str, object]
) -> None:
    url = url.format(active=_active_id(api))
    assert api.client.request(method, url, json=body).status_code == 401
    refused = api.client.request(method, url, json=body, headers=api.viewer)
    assert refused.status_code == 403
    assert refused.json() == {"detail": "'victor' is a viewer: admins only"}
    assert api.client.request(method, url, json=body, headers=api.admin).status_code in (200, 202)


def _events(api: Fixture, kind: str) -> list[dict[str, object]]:
    body = api.client.get(f"/api/v1/events?kind={kind}", headers=api.viewer).json()
    return list(body["data"])


def test_tagging_and_retiring_are_audited_with_the_actor(api: Fixture) -> None:
    tagged = api.client.put(
        "/api/v1/devices/pi-2/tags", json={"tags": ["lab", "b", "lab"]}, headers=api.admin
    )
    assert tagged.status_code == 200
    assert tagged.json()["tags"] == ["b", "lab"]
    (event,) = _events(api, "device.tagged")
    assert event["actor"] == "user:alice"
    assert event["device_id"] == "pi-2"
    assert event["detail"] == {"before": [], "after": ["b", "lab"]}

    retired = api.client.post(
        "/api/v1/devices/pi-2/retire", json={"reason": "water damage"}, headers=api.admin
    )
    assert retired.json()["status"] == "retired"
    (event,) = _events(api, "device.retired")
    assert (event["actor"], event["detail"]) == ("user:alice", {"reason": "water damage"})
    assert api.control.revoked == [("pi-2", "user:alice")]  # the service cuts it off
    # Retiring again changes nothing and logs nothing; tagging a retired device is refused.
    assert api.client.post("/api/v1/devices/pi-2/retire", json={}, headers=api.admin).is_success
    assert len(_events(api, "device.retired")) == 1
    conflict = api.client.put("/api/v1/devices/pi-2/tags", json={"tags": []}, headers=api.admin)
    assert conflict.status_code == 409
    assert conflict.json()["detail"] == "device 'pi-2' is retired"


@pytest.mark.parametrize(
    ("query", "count", "first_device"),
    [
        ("", 4, "pi-2"),
        ("status=finished", 2, "jet-1"),
        ("status=active", 1, "pi-2"),
        ("device_id=pi-2", 2, "pi-2"),
        ("task_type=code", 1, "jet-1"),
        ("mode=cloud", 1, "pi-2"),
        ("draft_model=draft-l1", 1, "pi-2"),
        ("skip=3&limit=1", 4, "pi-1"),
        ("status=failed", 0, None),
    ],
)
def test_sessions_filter_and_page_newest_first(
    api: Fixture, query: str, count: int, first_device: str | None
) -> None:
    body = api.client.get(f"/api/v1/sessions?{query}", headers=api.viewer).json()
    assert body["count"] == count
    assert (body["data"][0]["device_id"] if body["data"] else None) == first_device
    times = [s["created_at"] for s in body["data"]]
    assert times == sorted(times, reverse=True)


def test_sessions_filter_by_time(api: Fixture) -> None:
    since = (recent(100)).isoformat().replace("+00:00", "Z")
    body = api.client.get("/api/v1/sessions", params={"since": since}, headers=api.viewer).json()
    assert body["count"] == 3
    naive = recent(100).replace(tzinfo=None).isoformat()  # taken as UTC
    body = api.client.get("/api/v1/sessions", params={"until": naive}, headers=api.viewer).json()
    assert body["count"] == 1


def test_a_session_lists_its_round_aggregates(api: Fixture) -> None:
    body = api.client.get("/api/v1/sessions?device_id=pi-1", headers=api.viewer).json()
    (listed,) = body["data"]
    stored = api.finished
    assert listed["rounds"] == stored.rounds
    assert (listed["drafted"], listed["accepted"]) == (stored.drafted, stored.accepted)
    assert listed["alpha"] == pytest.approx(stored.accepted / stored.drafted)
    assert listed["generated_len"] == len(stored.generated)


def test_session_detail_tells_every_token_where_it_came_from(api: Fixture) -> None:
    stored = api.finished
    body = api.client.get(f"/api/v1/sessions/{stored.id}", headers=api.viewer).json()
    tokens = [t for r in body["rounds"] for t in r["tokens"]]
    assert [t["id"] for t in tokens] == stored.generated
    assert [t["kind"] for t in tokens] == stored.kinds
    assert {"accepted", "corrected", "provisional", "target"} <= set(stored.kinds)
    tokenizer = chat_tokenizer()
    assert body["text"] == tokenizer.decode(stored.generated)
    assert "".join(t["text"] for t in tokens) == body["text"]
    assert body["problems"] == []
    assert body["rounds_count"] == stored.rounds
    assert body["stats"]["kinds"]["provisional"] == stored.kinds.count("provisional")
    first = body["rounds"][0]
    assert first["legs_ms"] == {
        "draft": 3.0,
        "uplink": 5.0,
        "queue": 1.0,
        "verify": 12.0,
        "downlink": 5.0,
    }
    assert first["total_ms"] == 26.0
    assert first["delay_s"] == pytest.approx(0.06)
    # Round 0 drafted 4 and kept 2: the other 2 come back as rejected, with their text.
    assert len(first["rejected"]) == 2
    assert all(t["text"] for t in first["rejected"])
    page = api.client.get(
        f"/api/v1/sessions/{stored.id}/rounds?skip=2&limit=2", headers=api.viewer
    ).json()
    assert page["count"] == stored.rounds
    assert [r["round"] for r in page["data"]] == [2, 3]
    assert page["data"][0]["provisional"] is True


def test_a_session_whose_rounds_disagree_with_its_tokens_reports_it(api: Fixture) -> None:
    with api.sessions.begin() as db:
        row = db.get(DecodingSession, api.finished.id)
        assert row is not None
        row.committed_ids = [*row.committed_ids[:-1], 0]
    body = api.client.get(f"/api/v1/sessions/{api.finished.id}", headers=api.viewer).json()
    (problem,) = body["problems"]
    assert f"first differ at position {len(api.finished.generated) - 1}" in problem


def test_start_and_cancel_go_through_the_control_and_are_audited(api: Fixture) -> None:
    started = api.client.post(
        "/api/v1/sessions",
        json={"device_id": "pi-1", "prompt": "Name three colours.", "max_tokens": 32},
        headers=api.admin,
    )
    assert started.status_code == 202
    session_id = started.json()["id"]
    (request,) = api.control.started
    assert (request.device_id, request.max_tokens, request.actor) == ("pi-1", 32, "user:alice")
    assert request.seed is None and request.k is None
    shown = api.client.get(f"/api/v1/sessions/{session_id}", headers=api.viewer).json()
    assert shown["session"]["status"] == "active"
    (event,) = _events(api, "session.start_requested")
    assert (event["actor"], event["session_id"]) == ("user:alice", session_id)

    cancelled = api.client.post(
        f"/api/v1/sessions/{session_id}/cancel", json={"reason": "test"}, headers=api.admin
    )
    assert cancelled.status_code == 202
    (event,) = _events(api, "session.cancel_requested")
    assert event["detail"] == {"reason": "test"}
    again = api.client.post(f"/api/v1/sessions/{session_id}/cancel", headers=api.admin)
    assert again.status_code == 409
    assert "has already ended (cancelled)" in again.json()["detail"]


@pytest.mark.parametrize(
    ("body", "status", "detail"),
    [
        ({"device_id": "ghost-1", "prompt": "Hi"}, 404, "no device 'ghost-1'"),
        ({"device_id": "phone-1", "prompt": "Hi"}, 409, "device 'phone-1' is offline"),
        ({"device_id": "pi-1", "prompt": ""}, 422, None),
        ({"device_id": "pi-1", "prompt": "Hi", "temperature": -1}, 422, None),
        ({"device_id": "pi-1", "prompt": "Hi", "max_tokens": 0}, 422, None),
        ({"device_id": "pi-1", "prompt": "Hi", "k": 65}, 422, None),
        ({"device_id": "pi-1", "prompt": "Hi", "colour": "red"}, 422, None),
        ({"prompt": "Hi"}, 422, None),
    ],
)
def test_a_bad_start_is_a_4xx_with_a_reason(
    api: Fixture, body: dict[str, object], status: int, detail: str | None
) -> None:
    response = api.client.post("/api/v1/sessions", json=body, headers=api.admin)
    assert response.status_code == status
    assert response.json()["detail"]
    if detail is not None:
        assert response.json()["detail"] == detail
    assert api.control.started == []


def test_without_a_service_start_is_503_and_verifiers_are_not_live(
    api: Fixture, pg_clean_engine: Engine
) -> None:
    app = api.client.app
    app.state.control = None  # type: ignore[attr-defined]
    response = api.client.post(
        "/api/v1/sessions", json={"device_id": "pi-1", "prompt": "Hi"}, headers=api.admin
    )
    assert response.status_code == 503
    assert "specfleet up" in response.json()["detail"]
    body = api.client.get("/api/v1/verifiers", headers=api.viewer).json()
    assert body == {"data": [], "count": 0, "live": False}


def test_verifiers_show_live_load(api: Fixture) -> None:
    body = api.client.get("/api/v1/verifiers", headers=api.viewer).json()
    assert body["live"] is True
    assert body["count"] == 3
    assert [v["verifier_id"] for v in body["data"]] == ["verifier-0", "verifier-1", "verifier-2"]
    assert body["data"][1]["queue_depth"] == 3
    online = api.client.get("/api/v1/verifiers?online=false", headers=api.viewer).json()
    assert [v["verifier_id"] for v in online["data"]] == ["verifier-2"]


def test_models_join_the_registry_and_the_models_directory(api: Fixture) -> None:
    on_disk = {m.name: m for _, m in list_models(default_models_dir())}
    target = next(m for m in on_disk.values() if m.role == "target")
    with api.sessions.begin() as db:
        db.add(
            Model(
                name=target.name,
                role=ModelRole.TARGET,
                format="onnx",
                sha256="0" * 64,
                size_bytes=1,
                tokenizer_sha256=target.tokenizer_sha256,
                location="https://models.example/target.onnx",
            )
        )
        db.add(
            Model(
                name="draft-remote",
                role=ModelRole.DRAFT,
                format="tflite",
                sha256="f" * 64,
                size_bytes=12_345,
                tokenizer_sha256=target.tokenizer_sha256,
                location="https://models.example/draft.tflite",
            )
        )
    body = api.client.get("/api/v1/models?limit=1000", headers=api.viewer).json()
    by_name = {m["name"]: m for m in body["data"]}
    assert body["count"] == len(set(on_disk) | {"draft-remote"})
    assert by_name[target.name]["registered"] and by_name[target.name]["on_disk"]
    assert by_name[target.name]["sha256_mismatch"] is True
    assert by_name["draft-remote"] == {
        "name": "draft-remote",
        "role": "draft",
        "format": "tflite",
        "sha256": "f" * 64,
        "size_bytes": 12_345,
        "tokenizer_sha256": target.tokenizer_sha256,
        "location": "https://models.example/draft.tflite",
        "precision": None,
        "registered": True,
        "on_disk": False,
        "sha256_mismatch": False,
        "created_at": by_name["draft-remote"]["created_at"],
    }
    for name, manifest in on_disk.items():
        if name != target.name:
            assert by_name[name]["sha256"] == manifest.sha256
            assert by_name[name]["size_bytes"] == manifest.size_bytes
    drafts = api.client.get("/api/v1/models?role=draft&source=registry", headers=api.viewer)
    assert [m["name"] for m in drafts.json()["data"]] == ["draft-remote"]
    one = api.client.get("/api/v1/models/draft-remote", headers=api.viewer)
    assert one.json()["size_bytes"] == 12_345


def test_events_filter_and_page(api: Fixture) -> None:
    everything = api.client.get("/api/v1/events?limit=1000", headers=api.viewer).json()
    # 4 provisioned, 1 online, 2 admins created by the fixture.
    assert everything["count"] == 7
    ids = [e["id"] for e in everything["data"]]
    assert ids == sorted(ids, reverse=True)
    devices = api.client.get("/api/v1/events?kind=device.", headers=api.viewer).json()
    assert devices["count"] == 5
    assert {e["kind"] for e in devices["data"]} == {"device.provisioned", "device.online"}
    by_device = api.client.get("/api/v1/events?device_id=pi-1", headers=api.viewer).json()
    assert by_device["count"] == 2
    page = api.client.get("/api/v1/events?skip=2&limit=2", headers=api.viewer).json()
    assert [e["id"] for e in page["data"]] == ids[2:4]
    cli = api.client.get("/api/v1/events?actor=cli", headers=api.viewer).json()
    assert {e["kind"] for e in cli["data"]} == {"admin.created"}


def test_fleet_stats_give_alpha_and_speed_per_device(api: Fixture) -> None:
    body = api.client.get("/api/v1/stats/fleet", headers=api.viewer).json()
    by_device = {d["device_id"]: d for d in body["data"]}
    assert set(by_device) == {"jet-1", "phone-1", "pi-1", "pi-2"}
    pi = by_device["pi-1"]
    stored = api.finished
    assert (pi["rounds"], pi["drafted"], pi["accepted"]) == (
        stored.rounds,
        stored.drafted,
        stored.accepted,
    )
    assert pi["alpha"] == pytest.approx(stored.accepted / stored.drafted)
    assert pi["committed"] == len(stored.generated)
    assert pi["tokens_per_s"] == pytest.approx(len(stored.generated) / (stored.round_ms / 1e3))
    assert by_device["phone-1"]["alpha"] is None
    narrow = api.client.get("/api/v1/stats/fleet?window_s=30", headers=api.viewer).json()
    assert all(d["rounds"] == 0 for d in narrow["data"])


def test_acceptance_and_latency_charts(api: Fixture) -> None:
    body = api.client.get("/api/v1/stats/acceptance?bucket_s=3600", headers=api.viewer).json()
    series = {(s["draft_model"], s["task_type"]): s for s in body["data"]}
    assert set(series) == {("lookup", "qa"), ("lookup", "code"), ("draft-l1", "qa")}
    points = series[("lookup", "code")]["points"]
    assert sum(p["drafted"] for p in points) > 0
    assert all(0.0 <= p["alpha"] <= 1.0 for p in points)
    latency = api.client.get("/api/v1/stats/latency", headers=api.viewer).json()
    edges, counts = latency["rtt_ms"]["edges"], latency["rtt_ms"]["counts"]
    assert edges[-1] is None
    # Every round's uplink + downlink is 10 ms: all fall in [10, 20).
    assert counts[edges.index(10.0)] == sum(counts) > 0
    legs = {leg["leg"]: leg for leg in latency["legs"]}
    assert legs["verify"]["p50_ms"] == 12.0
    assert legs["draft"]["count"] < legs["verify"]["count"]  # plain target steps draft nothing


@pytest.mark.parametrize(
    "url",
    [
        "/api/v1/sessions?status=sleeping",
        "/api/v1/sessions?mode=teleport",
        "/api/v1/sessions?limit=0",
        "/api/v1/sessions?limit=5000",
        "/api/v1/sessions?skip=-3",
        "/api/v1/sessions?since=yesterday",
        "/api/v1/sessions?device_id=-bad",
        "/api/v1/sessions/not-a-uuid",
        "/api/v1/sessions/not-a-uuid/rounds",
        # A fixed id: each of pytest-xdist's workers must collect the same test names.
        f"/api/v1/sessions/{uuid.UUID(int=1)}/rounds?limit=-1",
        "/api/v1/events?kind=DROP%20TABLE",
        "/api/v1/events?session_id=42",
        "/api/v1/events?since=2026-13-45",
        "/api/v1/models?role=oracle",
        "/api/v1/models?source=cloud",
        "/api/v1/models/bad%20name",
        "/api/v1/verifiers?online=maybe",
        "/api/v1/stats/fleet?window_s=0",
        "/api/v1/stats/acceptance?bucket_s=ten",
        "/api/v1/stats/latency?window_s=99999999",
        "/api/v1/devices?tag=",
    ],
)
def test_malformed_parameters_are_422_never_500(api: Fixture, url: str) -> None:
    response = api.client.get(url, headers=api.viewer)
    assert response.status_code == 422, response.text
    assert response.json()["detail"]


@pytest.mark.parametrize(
    ("url", "detail"),
    [
        ("/api/v1/devices/ghost-7", "no device 'ghost-7'"),
        (
            "/api/v1/sessions/00000000-0000-4000-8000-000000000000",
            "no session 00000000-0000-4000-8000-000000000000",
        ),
        (
            "/api/v1/sessions/00000000-0000-4000-8000-000000000000/rounds",
            "no session 00000000-0000-4000-8000-000000000000",
        ),
        ("/api/v1/models/draft-nowhere", "no model 'draft-nowhere'"),
    ],
)
def test_unknown_ids_are_404_with_a_reason(api: Fixture, url: str, detail: str) -> None:
    response = api.client.get(url, headers=api.viewer)
    assert response.status_code == 404
    assert response.json() == {"detail": detail}


@pytest.mark.parametrize(
    ("method", "url"),
    [
        ("put", "/api/v1/devices/ghost-7/tags"),
        ("post", "/api/v1/devices/ghost-7/retire"),
        ("post", "/api/v1/sessions/00000000-0000-4000-8000-000000000000/cancel"),
    ],
)
def test_writes_to_unknown_ids_are_404(api: Fixture, method: str, url: str) -> None:
    body = {"tags": []} if url.endswith("tags") else {}
    response = api.client.request(method, url, json=body, headers=api.admin)
    assert response.status_code == 404
    assert response.json()["detail"].startswith("no ")


@pytest.mark.parametrize(
    "body",
    [{"tags": ["has space"]}, {"tags": ["x" * 65]}, {"tags": "lab"}, {"tag": ["lab"]}, {}],
)
def test_bad_tags_are_422(api: Fixture, body: dict[str, object]) -> None:
    response = api.client.put("/api/v1/devices/pi-1/tags", json=body, headers=api.admin)
    assert response.status_code == 422
    assert response.json()["detail"]


def test_tokens_are_stored_hashed_and_use_is_recorded(api: Fixture) -> None:
    token = api.admin["Authorization"].removeprefix("Bearer ")
    with api.sessions() as db:
        rows = db.scalars(sa.select(ApiToken)).all()
        assert all(token not in (r.token_sha256, r.prefix) for r in rows)
        assert all(len(r.token_sha256) == 64 for r in rows)
        assert db.scalar(sa.select(sa.func.count()).select_from(Event)) == 7
    api.client.get("/api/v1/me", headers=api.admin)
    with api.sessions() as db:
        used = db.scalar(
            sa.select(ApiToken.last_used_at)
            .join(Admin, Admin.id == ApiToken.admin_id)
            .where(Admin.name == "alice")
        )
    assert used is not None and utcnow() - used < timedelta(minutes=1)


def test_the_openapi_document_lists_every_resource(api: Fixture) -> None:
    paths = api.client.get("/api/v1/openapi.json").json()["paths"]
    for path in (
        "/api/v1/devices",
        "/api/v1/devices/{device_id}/tags",
        "/api/v1/devices/{device_id}/retire",
        "/api/v1/sessions",
        "/api/v1/sessions/{session_id}",
        "/api/v1/sessions/{session_id}/rounds",
        "/api/v1/sessions/{session_id}/cancel",
        "/api/v1/models",
        "/api/v1/verifiers",
        "/api/v1/events",
        "/api/v1/stats/fleet",
    ):
        assert path in paths
