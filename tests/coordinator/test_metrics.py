"""`/metrics` in the Prometheus text format: counters from observed rounds, gauges from the real
database and from the live service's verifier load."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import pytest
from dashboard_rows import add_fleet, add_session, recent
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy.engine import Engine

from coordinator.db.engine import make_sessionmaker
from coordinator.db.models import Round, SessionStatus
from coordinator.live import VerifierLoad
from coordinator.runtime.metrics import CoordinatorMetrics, RoundLegs
from coordinator.web.api.main import create_app
from coordinator.web.auth import AdminStore
from core.settings import Settings


def _samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    found = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            found[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return found


@dataclass
class Loads:
    """The verifier-load side of CoordinatorControl (the only part /metrics reads)."""

    loads: list[VerifierLoad] = field(default_factory=list)

    def verifier_loads(self) -> Sequence[VerifierLoad]:
        return self.loads


def test_rounds_count_as_vllm_names_them_with_mean_acceptance_length() -> None:
    metrics = CoordinatorMetrics()
    legs = RoundLegs(draft_ms=2.0, uplink_ms=0.4, queue_ms=0.1, verify_ms=9.0, downlink_ms=0.3)
    metrics.observe_round(draft_model="draft-l1", k=4, n_accepted=3, committed=4, legs=legs)
    metrics.observe_round(draft_model="draft-l1", k=4, n_accepted=1, committed=2, legs=legs)
    metrics.observe_round(draft_model="lookup", k=2, n_accepted=0, committed=1, legs=RoundLegs())
    metrics.observe_round(draft_model=None, k=0, n_accepted=0, committed=1, legs=legs)
    s = _samples(metrics.render().decode())
    model = (("draft_model", "draft-l1"),)
    assert s[("specfleet:spec_decode_num_drafts_total", model)] == 2
    assert s[("specfleet:spec_decode_num_draft_tokens_total", model)] == 8
    assert s[("specfleet:spec_decode_num_accepted_tokens_total", model)] == 4
    assert s[("specfleet:spec_decode_mean_acceptance_length", model)] == pytest.approx(3.0)
    lookup = (("draft_model", "lookup"),)
    assert s[("specfleet:spec_decode_mean_acceptance_length", lookup)] == pytest.approx(1.0)
    per_pos = "specfleet:spec_decode_num_accepted_tokens_per_pos_total"
    assert s[(per_pos, (("draft_model", "draft-l1"), ("position", "0")))] == 2
    assert s[(per_pos, (("draft_model", "draft-l1"), ("position", "2")))] == 1
    # A target-only step counts no draft, but its committed token and its latency.
    assert ("specfleet:spec_decode_num_drafts_total", (("draft_model", "none"),)) not in s
    assert s[("specfleet:committed_tokens_total", (("draft_model", "none"),))] == 1
    verify = "specfleet:round_leg_latency_seconds_count"
    assert s[(verify, (("leg", "verify"),))] == 3
    assert s[("specfleet:round_leg_latency_seconds_sum", (("leg", "verify"),))] == pytest.approx(
        0.027
    )
    # 9 ms falls in the 10 ms bucket, not the 5 ms one.
    bucket = "specfleet:round_leg_latency_seconds_bucket"
    assert s[(bucket, (("le", "0.005"), ("leg", "verify")))] == 0
    assert s[(bucket, (("le", "0.01"), ("leg", "verify")))] == 3
    assert s[("specfleet:round_latency_seconds_count", ())] == 3


def test_observe_round_refuses_impossible_counts() -> None:
    with pytest.raises(ValueError, match="n_accepted 5 outside"):
        CoordinatorMetrics().observe_round(
            draft_model="d", k=4, n_accepted=5, committed=6, legs=RoundLegs()
        )


def test_observe_row_reads_a_persisted_round() -> None:
    metrics = CoordinatorMetrics()
    row = Round(
        round_index=0,
        base_len=10,
        draft_tokens=[1, 2, 3],
        draft_model="ngram",
        k=3,
        n_accepted=2,
        next_token=9,
        committed_len=13,
        t_verify_ms=4.0,
    )
    metrics.observe_row(row)
    s = _samples(metrics.render().decode())
    assert s[("specfleet:committed_tokens_total", (("draft_model", "ngram"),))] == 3
    assert s[("specfleet:round_leg_latency_seconds_count", (("leg", "verify"),))] == 1
    assert ("specfleet:round_leg_latency_seconds_count", (("leg", "draft"),)) not in s


def test_metrics_endpoint_counts_sessions_devices_and_verifier_queues(
    pg_clean_engine: Engine,
) -> None:
    sessions = make_sessionmaker(pg_clean_engine)
    add_fleet(sessions, recent(5))
    add_session(sessions, created_at=recent(60))
    add_session(sessions, device_id="pi-2", created_at=recent(50), status=SessionStatus.ACTIVE)
    add_session(sessions, device_id="jet-1", created_at=recent(40), status=SessionStatus.ACTIVE)
    control = Loads(
        [
            VerifierLoad("verifier-0", True, 4, 2, 3, 8, "t", None),
            VerifierLoad("verifier-1", False, 0, 0, 0, 8, "t", None),
        ]
    )
    settings = Settings(
        database_url=pg_clean_engine.url.render_as_string(hide_password=False),
        secret_key="a-test-secret-of-32-characters!!",
    )
    app = create_app(settings, pg_clean_engine, control=control)  # type: ignore[arg-type]
    app.state.metrics.observe_round(
        draft_model="lookup", k=4, n_accepted=4, committed=5, legs=RoundLegs(verify_ms=3.0)
    )
    with TestClient(app) as client:
        response = client.get("/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    s = _samples(response.text)
    assert s[("specfleet:sessions", (("state", "active"),))] == 2
    assert s[("specfleet:sessions", (("state", "finished"),))] == 1
    assert s[("specfleet:sessions", (("state", "failed"),))] == 0
    assert s[("specfleet:devices_online", ())] == 1
    assert s[("specfleet:devices", (("status", "offline"),))] == 3
    assert s[("specfleet:verifier_queue_depth", (("verifier", "verifier-0"),))] == 4
    assert s[("specfleet:verifier_in_flight", (("verifier", "verifier-0"),))] == 2
    assert s[("specfleet:verifiers_online", ())] == 1
    assert s[("specfleet:spec_decode_num_accepted_tokens_total", (("draft_model", "lookup"),))] == 4


def test_metrics_need_a_token_in_production(pg_clean_engine: Engine) -> None:
    settings = Settings(
        database_url=pg_clean_engine.url.render_as_string(hide_password=False),
        environment="production",
        secret_key="a-production-secret-of-32-chars!",
    )
    _, token = AdminStore(make_sessionmaker(pg_clean_engine)).create("prometheus", "viewer")
    with TestClient(create_app(settings, pg_clean_engine)) as client:
        assert client.get("/metrics").status_code == 401
        scraped = client.get("/metrics", headers={"Authorization": f"Bearer {token}"})
    assert scraped.status_code == 200
    assert "specfleet:sessions" in scraped.text
    # No service attached: the verifier gauges are there, with no verifier in them.
    assert _samples(scraped.text)[("specfleet:verifiers_online", ())] == 0
