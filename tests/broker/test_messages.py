"""The bus contract: every valid message round-trips, and any bytes are refused, never crash."""

from __future__ import annotations

import json
import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from broker import messages as m

names = st.text(alphabet="abcdefghijklmnopqrstuvwxyz0123456789-_", min_size=1, max_size=20)
session_ids = st.text(alphabet="abcdef0123456789-", min_size=1, max_size=36)
token_ids = st.integers(min_value=0, max_value=m.MAX_TOKEN_ID)
unix_times = st.floats(min_value=0, max_value=4e9, allow_nan=False, allow_infinity=False)
ms = st.floats(min_value=0, max_value=1e6, allow_nan=False, allow_infinity=False)


@st.composite
def drafts(draw: st.DrawFn) -> m.Draft:
    if draw(st.integers(0, 4)) == 0:  # a cloud round request: the verifier host drafts
        return m.Draft(
            session_id=draw(session_ids),
            round=draw(st.integers(min_value=0, max_value=10_000)),
            base_len=draw(st.integers(min_value=0, max_value=100_000)),
            tokens=(),
            draft_model=draw(names),
            cloud_k=draw(st.integers(1, m.MAX_CLOUD_K)),
            timings=m.DraftTimings(sent_at=draw(unix_times)),
        )
    tokens = draw(st.lists(token_ids, max_size=16))
    sparse = draw(st.booleans())
    q_ids = q_probs = None
    if sparse:
        top_k = draw(st.integers(min_value=1, max_value=4))
        q_ids = tuple(
            tuple(draw(st.lists(token_ids, min_size=top_k, max_size=top_k))) for _ in tokens
        )
        q_probs = tuple((1.0 / top_k,) * top_k for _ in tokens)
    return m.Draft(
        session_id=draw(session_ids),
        round=draw(st.integers(min_value=0, max_value=10_000)),
        base_len=draw(st.integers(min_value=0, max_value=100_000)),
        tokens=tuple(tokens),
        q_ids=q_ids,
        q_probs=q_probs,
        draft_model=draw(names),
        provisional=draw(st.booleans()),
        timings=m.DraftTimings(
            draft_ms=draw(ms), sent_at=draw(unix_times), downlink_ms=draw(st.none() | ms)
        ),
        want_features=draw(st.sampled_from([None, True, False])),
    )


# fp16 bit patterns with an exponent short of all ones: every finite half, as bytes.
finite_halves = st.integers(0, 0xFFFF).filter(lambda h: h & 0x7C00 != 0x7C00)
features = st.lists(finite_halves, min_size=1, max_size=64).map(
    lambda halves: m.encode_features(b"".join(h.to_bytes(2, "little") for h in halves))
)


@st.composite
def verdicts(draw: st.DrawFn) -> m.Verdict:
    base_len = draw(st.integers(min_value=0, max_value=100_000))
    n_accepted = draw(st.integers(min_value=0, max_value=64))
    next_token = draw(st.none() | token_ids)
    policy = draw(
        st.none()
        | st.builds(m.Policy, mode=st.sampled_from(m.Mode), draft_model=names, k=st.integers(0, 64))
    )
    cloud = draw(st.booleans()) and n_accepted <= m.MAX_CLOUD_K
    draft_tokens = None
    if cloud:
        extra = draw(st.integers(0, m.MAX_CLOUD_K - n_accepted))
        draft_tokens = tuple(draw(st.lists(token_ids, min_size=n_accepted + extra, max_size=64)))
    finished = draw(st.booleans())
    return m.Verdict(
        session_id=draw(session_ids),
        round=draw(st.integers(min_value=0, max_value=10_000)),
        base_len=base_len,
        n_accepted=n_accepted,
        next_token=next_token,
        committed_len=base_len + n_accepted + (next_token is not None),
        finished=finished,
        policy=policy,
        verifier_id=draw(names),
        draft_tokens=draft_tokens,
        continues=cloud and not finished and draw(st.booleans()),
        features=draw(features) if next_token is not None and not finished else None,
    )


statuses = st.builds(
    m.Status,
    device_id=names,
    state=st.sampled_from(m.DeviceState),
    at=unix_times,
    kind=st.sampled_from(["pi", "jetson", "phone", "other"]),
    drafts=st.lists(names, max_size=4).map(tuple),
    keepalive_s=st.integers(0, 600),
)
telemetry = st.builds(
    m.Telemetry,
    device_id=names,
    at=unix_times,
    rtt_ms=st.none() | ms,
    cpu_percent=st.none() | st.floats(0, 400),
    memory_percent=st.none() | st.floats(0, 100),
    battery_percent=st.none() | st.floats(0, 100),
    thermal_c=st.none() | st.floats(-20, 120),
    probe_nonce=st.none() | names,
)
json_scalars = st.none() | st.booleans() | st.integers(-1000, 1000) | names
commands = st.builds(
    m.Command,
    command_id=names,
    name=st.sampled_from(m.CommandName),
    args=st.dictionaries(names, json_scalars, max_size=4),
    issued_at=unix_times,
)
acks = st.builds(
    m.CommandAck,
    command_id=names,
    device_id=names,
    ok=st.booleans(),
    result=st.dictionaries(names, json_scalars, max_size=4),
    error=names,
    at=unix_times,
)
errors = st.builds(
    m.ErrorReply,
    refused_type=st.sampled_from(m.Refused),
    session_id=st.none() | session_ids,
    round=st.none() | st.integers(0, 100),
    reason=names,
)
samplings = st.builds(
    m.SamplingSpec,
    temperature=st.floats(0, 2),
    top_p=st.floats(0.05, 1.0),
    seed=st.integers(0, 2**63 - 1),
)
session_opens = st.builds(
    m.SessionOpen,
    session_id=session_ids,
    prompt=st.text(max_size=200),
    prompt_ids=st.lists(token_ids, min_size=1, max_size=32).map(tuple),
    task_type=st.sampled_from(["chat", "code", "math"]),
    sampling=samplings,
    max_tokens=st.integers(1, 512),
    draft_model=names,
    k=st.integers(1, 16),
    mode=st.sampled_from([m.Mode.DISTRIBUTED, m.Mode.CLOUD]),
    modes=st.just((m.Mode.DISTRIBUTED, m.Mode.CLOUD)),
) | st.builds(
    m.SessionOpen,
    session_id=session_ids,
    prompt=st.text(max_size=200),
    prompt_ids=st.lists(token_ids, min_size=1, max_size=32).map(tuple),
    draft_model=names,
    k=st.just(0),
)
session_closes = st.builds(m.SessionClose, session_id=session_ids, reason=names)
session_states = st.builds(
    m.SessionState,
    session_id=session_ids,
    prompt_len=st.integers(1, 100),
    generated_ids=st.lists(token_ids, max_size=32).map(tuple),
    next_round=st.integers(0, 100),
    status=st.sampled_from(["active", "finished"]),
)
verifier_statuses = st.builds(
    m.VerifierStatus,
    verifier_id=names,
    state=st.sampled_from(m.DeviceState),
    at=unix_times,
    queue_depth=st.integers(0, 100),
    sessions_cached=st.integers(0, 100),
    drafts=st.lists(names, max_size=4).map(tuple),
)


@st.composite
def verify_requests(draw: st.DrawFn) -> m.VerifyRequest:
    draft = draw(drafts())
    if draft.cloud:
        return m.VerifyRequest(
            request_id=draw(names),
            session_id=draft.session_id,
            round=draft.round,
            context_ids=tuple(draw(st.lists(token_ids, min_size=1, max_size=32))),
            tokens=(),
            sampling=draw(samplings),
            cloud_draft=draft.draft_model,
            cloud_k=draft.cloud_k,
        )
    return m.VerifyRequest(
        request_id=draw(names),
        session_id=draft.session_id,
        round=draft.round,
        context_ids=tuple(draw(st.lists(token_ids, min_size=1, max_size=32))),
        tokens=draft.tokens,
        q_ids=draft.q_ids,
        q_probs=draft.q_probs,
        sampling=draw(samplings),
        sent_at=draw(unix_times),
    )


@st.composite
def cloud_results(draw: st.DrawFn) -> m.VerifyResult:
    tokens = tuple(draw(st.lists(token_ids, max_size=16)))
    sparse = draw(st.booleans())
    return m.VerifyResult(
        request_id=draw(names),
        session_id=draw(session_ids),
        round=draw(st.integers(0, 100)),
        base_len=draw(st.integers(0, 1000)),
        n_accepted=draw(st.integers(0, len(tokens))),
        next_token=draw(token_ids),
        verifier_id=draw(names),
        draft_tokens=tokens,
        q_ids=tuple((t,) for t in tokens) if sparse else None,
        q_probs=tuple((1.0,) for _ in tokens) if sparse else None,
        draft_ms=draw(ms),
    )


verify_results = st.builds(
    m.VerifyResult,
    request_id=names,
    session_id=session_ids,
    round=st.integers(0, 100),
    base_len=st.integers(0, 1000),
    n_accepted=st.integers(0, 16),
    next_token=st.none() | token_ids,
    verifier_id=names,
    queue_ms=ms,
    verify_ms=ms,
    batch_size=st.integers(1, 16),
    error=st.just("") | names,
)
batched_results = st.builds(
    m.VerifyResults, results=st.lists(verify_results, min_size=1, max_size=8).map(tuple)
)
any_message = st.one_of(
    drafts(),
    verdicts(),
    statuses,
    telemetry,
    commands,
    acks,
    errors,
    session_opens,
    session_closes,
    session_states,
    verifier_statuses,
    verify_requests(),
    verify_results,
    cloud_results(),
    batched_results,
)


@given(any_message)
@settings(max_examples=300)
def test_every_valid_message_round_trips(message: m.Message) -> None:
    assert m.decode(m.encode(message)) == message


def test_a_pass_of_results_holds_one_to_max_batched_results_each_checked_as_alone() -> None:
    """A VerifyResults is refused empty, past MAX_BATCHED_RESULTS, or with one result that
    alone would be refused (its reason names where); 64 plain rounds stay small."""
    result = {"type": "verify_result", "v": 1, "request_id": "r", "session_id": "s"}
    result |= {"round": 3, "base_len": 40, "next_token": 7, "verifier_id": "v"}
    full = {"v": 1, "type": "verify_results", "results": [result] * m.MAX_BATCHED_RESULTS}
    payload = json.dumps(full).encode()
    decoded = m.decode(payload)
    assert isinstance(decoded, m.VerifyResults)
    assert len(decoded.results) == m.MAX_BATCHED_RESULTS
    assert len(m.encode(decoded)) < m.MAX_PAYLOAD_BYTES // 16
    for results, reason in (
        ([], "at least 1"),
        ([result] * (m.MAX_BATCHED_RESULTS + 1), "at most"),
        ([result, {**result, "n_accepted": 2, "draft_tokens": [1]}], "results.1"),
    ):
        document = {"v": 1, "type": "verify_results", "results": results}
        with pytest.raises(m.SchemaViolation) as caught:
            m.decode(json.dumps(document).encode())
        assert reason in caught.value.reason


@given(st.binary(max_size=2048))
@settings(max_examples=500)
def test_arbitrary_bytes_are_refused_with_a_reason_never_a_crash(payload: bytes) -> None:
    try:
        m.decode(payload)
    except m.BusError as exc:
        assert exc.reason
    # Anything that decodes is a valid message by construction; nothing else may escape.


json_values = st.recursive(
    json_scalars | st.floats(allow_nan=False),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(names, children, max_size=4),
    max_leaves=20,
)


@given(
    st.sampled_from(sorted(m.MESSAGE_TYPES)),
    st.dictionaries(
        st.sampled_from(
            [
                "session_id",
                "round",
                "tokens",
                "base_len",
                "device_id",
                "state",
                "at",
                "next_token",
                "n_accepted",
                "committed_len",
                "draft_model",
                "q_ids",
                "q_probs",
                "name",
                "ok",
            ]
        ),
        json_values,
        max_size=8,
    ),
)
@settings(max_examples=500)
def test_json_objects_of_known_types_validate_or_are_refused(
    message_type: str, fields: dict[str, object]
) -> None:
    payload = json.dumps({"v": 1, "type": message_type, **fields}).encode()
    try:
        message = m.decode(payload)
    except m.BusError as exc:
        assert exc.reason
    else:
        assert message.type == message_type  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("payload", "error", "reason_part"),
    [
        (b"\xff\xfe", m.MalformedPayload, "not UTF-8 JSON"),
        (b"[1, 2]", m.MalformedPayload, "expected a JSON object"),
        (b'{"type": "draft"}', m.MalformedPayload, "missing"),
        (b'{"v": 2, "type": "draft"}', m.UnsupportedVersion, "unsupported schema version 2"),
        (b'{"v": true, "type": "draft"}', m.UnsupportedVersion, "unsupported schema version"),
        (b'{"v": 1, "type": "gossip"}', m.UnknownMessageType, "unknown message type 'gossip'"),
        (b'{"v": 1, "type": "draft", "session_id": "s"}', m.SchemaViolation, "round"),
        (b"x" * (m.MAX_PAYLOAD_BYTES + 1), m.PayloadTooLarge, "exceeds the limit"),
    ],
)
def test_refusals_say_why(payload: bytes, error: type[m.BusError], reason_part: str) -> None:
    with pytest.raises(error) as caught:
        m.decode(payload)
    assert reason_part in caught.value.reason


@pytest.mark.parametrize(
    ("fields", "reason_part"),
    [
        ({"q_ids": [[1]], "q_probs": None}, "come together"),
        ({"q_ids": [[1], [2]], "q_probs": [[1.0], [1.0]]}, "one row per drafted token"),
        ({"q_ids": [[1, 2]], "q_probs": [[0.2, 0.2]]}, "sum to 1"),
        ({"tokens": [-1]}, "greater than or equal to 0"),
        ({"round": -1}, "greater than or equal to 0"),
    ],
)
def test_draft_shapes_are_checked(fields: dict[str, object], reason_part: str) -> None:
    document = {
        "v": 1,
        "type": "draft",
        "session_id": "s",
        "round": 0,
        "base_len": 3,
        "tokens": [5],
        "draft_model": "lookup",
        **fields,
    }
    with pytest.raises(m.SchemaViolation) as caught:
        m.decode(json.dumps(document).encode())
    assert reason_part in caught.value.reason


@pytest.mark.parametrize(
    ("message_type", "fields", "reason_part"),
    [
        ("draft", {"tokens": [5], "cloud_k": 4}, "carries no tokens"),
        ("draft", {"tokens": [], "cloud_k": 0}, "greater than or equal to 1"),
        ("draft", {"tokens": [], "cloud_k": 4, "provisional": True}, "not provisional"),
        ("session_open", {"mode": "local"}, "opens online"),
        ("session_open", {"mode": "satellite"}, "mode"),
        ("session_open", {"mode": "cloud", "k": 0}, "needs a window"),
        ("session_open", {"mode": "cloud"}, "not among the agent's modes"),
        ("session_open", {"modes": []}, "at least 1"),
        ("verdict", {"draft_tokens": [7], "n_accepted": 2, "committed_len": 6}, "exceeds"),
        ("verdict", {"continues": True, "finished": True}, "does not continue"),
        ("verify_request", {"cloud_k": 4}, "come together"),
        ("verify_request", {"cloud_k": 4, "cloud_draft": "hybrid", "tokens": [3]}, "no tokens"),
        ("verify_result", {"q_ids": [[1]], "q_probs": [[1.0]]}, "only with draft_tokens"),
        ("verify_result", {"draft_tokens": [1], "n_accepted": 2}, "exceeds"),
    ],
)
def test_cloud_round_shapes_are_checked(
    message_type: str, fields: dict[str, object], reason_part: str
) -> None:
    base: dict[str, dict[str, object]] = {
        "draft": {"session_id": "s", "round": 0, "base_len": 3, "draft_model": "hybrid"},
        "session_open": {
            "session_id": "s",
            "prompt": "hi",
            "prompt_ids": [1, 2],
            "draft_model": "hybrid",
        },
        "verdict": {
            "session_id": "s",
            "round": 0,
            "base_len": 3,
            "n_accepted": 0,
            "next_token": 9,
            "committed_len": 4,
        },
        "verify_request": {
            "request_id": "r",
            "session_id": "s",
            "round": 0,
            "context_ids": [1, 2],
            "tokens": [],
        },
        "verify_result": {
            "request_id": "r",
            "session_id": "s",
            "round": 0,
            "base_len": 2,
            "verifier_id": "v",
        },
    }
    document = {"v": 1, "type": message_type, **base[message_type], **fields}
    with pytest.raises(m.SchemaViolation) as caught:
        m.decode(json.dumps(document).encode())
    assert reason_part in caught.value.reason


def test_a_draft_from_an_agent_without_cloud_mode_still_validates() -> None:
    """Fields added for cloud mode are optional: older payloads decode as distributed rounds."""
    document = {
        "v": 1,
        "type": "draft",
        "session_id": "s",
        "round": 0,
        "base_len": 3,
        "tokens": [5],
        "draft_model": "lookup",
    }
    draft = m.decode_as(json.dumps(document).encode(), m.Draft)
    assert not draft.cloud and draft.cloud_k is None
    opened = m.decode_as(
        json.dumps(
            {
                "v": 1,
                "type": "session_open",
                "session_id": "s",
                "prompt": "hi",
                "prompt_ids": [1],
                "draft_model": "lookup",
            }
        ).encode(),
        m.SessionOpen,
    )
    assert opened.mode is m.Mode.DISTRIBUTED
    assert opened.modes == (m.Mode.DISTRIBUTED,)  # never asked for cloud mode


def test_verdict_lengths_must_add_up() -> None:
    document = {
        "v": 1,
        "type": "verdict",
        "session_id": "s",
        "round": 0,
        "base_len": 3,
        "n_accepted": 2,
        "next_token": 9,
        "committed_len": 5,
    }
    with pytest.raises(m.SchemaViolation, match="committed_len 5"):
        m.decode(json.dumps(document).encode())


def test_round_timings_added_later_are_optional() -> None:
    """A verdict's departure and a draft's report of the downlink before it: payloads without
    them decode as before; with them they round-trip; a negative downlink is refused."""
    verdict = {
        "v": 1,
        "type": "verdict",
        "session_id": "s",
        "round": 1,
        "base_len": 3,
        "n_accepted": 1,
        "next_token": 9,
        "committed_len": 5,
    }
    assert m.decode_as(json.dumps(verdict).encode(), m.Verdict).sent_at == 0.0
    stamped = m.decode_as(json.dumps({**verdict, "sent_at": 1.5e9}).encode(), m.Verdict)
    assert m.decode(m.encode(stamped)) == stamped and stamped.sent_at == 1.5e9
    draft = {
        "v": 1,
        "type": "draft",
        "session_id": "s",
        "round": 2,
        "base_len": 5,
        "tokens": [5],
        "draft_model": "lookup",
        "timings": {"draft_ms": 0.2, "sent_at": 1.5e9},
    }
    assert m.decode_as(json.dumps(draft).encode(), m.Draft).timings.downlink_ms is None
    draft["timings"] = {"sent_at": 1.5e9, "downlink_ms": 0.4}
    assert m.decode_as(json.dumps(draft).encode(), m.Draft).timings.downlink_ms == 0.4
    draft["timings"] = {"downlink_ms": -1.0}
    with pytest.raises(m.SchemaViolation, match="downlink_ms"):
        m.decode(json.dumps(draft).encode())


def test_unknown_fields_are_ignored_for_forward_compatibility() -> None:
    status = m.Status(device_id="pi-1", state=m.DeviceState.ONLINE, at=1.0)
    document = json.loads(m.encode(status))
    document["added_in_a_later_minor_release"] = [1, 2, 3]
    assert m.decode(json.dumps(document).encode()) == status


def test_decode_as_refuses_the_wrong_type() -> None:
    status = m.encode(m.Status(device_id="pi-1", state=m.DeviceState.ONLINE, at=1.0))
    with pytest.raises(m.BusError, match="expected draft, got status"):
        m.decode_as(status, m.Draft)


def _fp16(*values: float) -> str:
    return m.encode_features(struct.pack(f"<{len(values)}e", *values))


def _verdict_with(features: object, **fields: object) -> bytes:
    document = {
        "v": 1,
        "type": "verdict",
        "session_id": "s",
        "round": 1,
        "base_len": 3,
        "n_accepted": 1,
        "next_token": 9,
        "committed_len": 5,
        "features": features,
        **fields,
    }
    return json.dumps(document).encode()


def test_features_ride_as_fp16_and_round_trip() -> None:
    verdict = m.decode_as(_verdict_with(_fp16(0.5, -2.0, 65504.0)), m.Verdict)
    assert verdict.features is not None
    assert struct.unpack("<3e", m.feature_bytes(verdict.features)) == (0.5, -2.0, 65504.0)
    assert m.decode(m.encode(verdict)) == verdict
    # A verdict that was not asked for them says nothing of them.
    plain = verdict.model_copy(update={"features": None})
    assert b"features" not in m.encode(plain)


@pytest.mark.parametrize(
    ("features", "fields", "reason_part"),
    [
        ("not base64!", {}, "features must be base64"),
        (m.encode_features(b"\x00\x3c\x00"), {}, "3 bytes"),
        (_fp16(1.0, float("inf")), {}, "infinite or NaN"),
        (_fp16(float("nan")), {}, "infinite or NaN"),
        (_fp16(*[0.0] * (m.MAX_FEATURE_DIM + 1)), {}, "expected 1..8192 fp16"),
        (_fp16(*[0.0] * (2 * m.MAX_FEATURE_DIM)), {}, "at most 21848 characters"),
        (12, {}, "features: Input should be a valid string"),
        (_fp16(1.0), {"finished": True}, "session that goes on"),
        (
            _fp16(1.0),
            {"next_token": None, "n_accepted": 2, "committed_len": 5},
            "only with a next token",
        ),
    ],
)
def test_malformed_features_are_refused_with_a_reason(
    features: object, fields: dict[str, object], reason_part: str
) -> None:
    with pytest.raises(m.SchemaViolation, match=reason_part):
        m.decode(_verdict_with(features, **fields))


def test_a_result_carries_features_only_with_its_next_token() -> None:
    result = {
        "v": 1,
        "type": "verify_result",
        "request_id": "r",
        "session_id": "s",
        "round": 0,
        "base_len": 3,
        "verifier_id": "v",
        "error": "target pass failed",
        "features": _fp16(1.0, 2.0),
    }
    with pytest.raises(m.SchemaViolation, match="only with a next token"):
        m.decode(json.dumps(result).encode())
    result.update(next_token=4, error="")
    decoded = m.decode_as(json.dumps(result).encode(), m.VerifyResult)
    assert decoded.features == _fp16(1.0, 2.0)


def test_drafts_that_do_not_ask_for_features_carry_no_byte_of_it() -> None:
    draft = m.Draft(session_id="s", round=0, base_len=3, tokens=(4,), draft_model="hybrid")
    assert b"want_features" not in m.encode(draft)
    asking = draft.model_copy(update={"want_features": True})
    assert m.decode_as(m.encode(asking), m.Draft).want_features is True
