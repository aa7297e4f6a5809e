"""The bus contract: versioned message schemas, and encode/decode with validation at the boundary.

Every payload is a JSON object with `v` (the schema version) and `type`. Receivers of version 1
ignore fields they do not know, so adding an optional field needs no new version; removing or
changing the meaning of one does.
"""

from __future__ import annotations

import base64
import binascii
import math
from enum import Enum
from typing import Annotated, Any, Literal, TypeAlias, TypeVar

import pydantic_core
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    TypeAdapter,
    ValidationError,
    field_validator,
    model_validator,
)

SCHEMA_VERSION = 1
SUPPORTED_VERSIONS = frozenset({SCHEMA_VERSION})

# A provisional tail sent after a long offline spell is one long draft; 2,048 tokens with a
# top-8 sparse q' stays well under this.
MAX_PAYLOAD_BYTES = 256 * 1024
MAX_DRAFT_TOKENS = 2048
MAX_SPARSE_K = 64
MAX_CLOUD_K = 64  # the most tokens a verifier host drafts in one cloud round
MAX_TOKEN_ID = 2**31 - 1
# A verdict's features: the target's hidden state at one position, fp16. 8,192 values is past
# any target a device drafts for (SmolLM2-135M has 576: 1,536 base64 characters).
MAX_FEATURE_DIM = 8192
MAX_FEATURE_CHARS = 4 * -(-2 * MAX_FEATURE_DIM // 3)  # base64 of 2 bytes a value
# The high byte of a little-endian fp16 whose exponent bits are all set: an inf or a NaN.
_NOT_FINITE = bytes(1 if (b & 0x7C) == 0x7C else 0 for b in range(256))

TokenId = Annotated[int, Field(ge=0, le=MAX_TOKEN_ID)]
Milliseconds = Annotated[float, Field(ge=0, allow_inf_nan=False)]
Probability = Annotated[float, Field(ge=0.0, le=1.0, allow_inf_nan=False)]
SessionId = Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.:-]+$")]
Name = Annotated[str, Field(min_length=1, max_length=128)]
# `inference.tokenizer.vocab_sha256`, hex; "" from a sender that predates it.
VocabHash = Annotated[str, Field(max_length=64, pattern=r"^[0-9a-f]*$")]


class BusError(Exception):
    """A payload the bus contract refuses; `reason` is fit for a log line or an error reply."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class PayloadTooLarge(BusError):
    def __init__(self, size: int) -> None:
        super().__init__(f"payload of {size} bytes exceeds the limit of {MAX_PAYLOAD_BYTES}")
        self.size = size


class MalformedPayload(BusError):
    """Not UTF-8 JSON, not an object, or missing `v`/`type`."""


class UnsupportedVersion(BusError):
    def __init__(self, version: object) -> None:
        supported = ", ".join(str(v) for v in sorted(SUPPORTED_VERSIONS))
        shown = _short(repr(version))
        super().__init__(f"unsupported schema version {shown} (supported: {supported})")
        self.version = version


class UnknownMessageType(BusError):
    def __init__(self, message_type: object) -> None:
        super().__init__(f"unknown message type {_short(repr(message_type))}")
        self.message_type = message_type


class SchemaViolation(BusError):
    """A known type whose fields do not validate."""

    def __init__(self, message_type: str, errors: list[str]) -> None:
        super().__init__(f"invalid {message_type}: " + "; ".join(errors))
        self.message_type = message_type
        self.errors = errors


class _Message(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)

    v: Literal[1] = 1


class DeviceState(str, Enum):
    ONLINE = "online"
    OFFLINE = "offline"


class Status(_Message):
    """Presence, retained on `dev/{id}/status`; the Last Will carries state=offline."""

    type: Literal["status"] = "status"
    device_id: Name
    state: DeviceState
    at: float = Field(ge=0, allow_inf_nan=False)  # unix seconds
    agent_version: str = Field(default="", max_length=64)
    kind: str = Field(default="other", max_length=32)
    runtimes: tuple[Name, ...] = Field(default=(), max_length=8)
    drafts: tuple[Name, ...] = Field(default=(), max_length=64)
    keepalive_s: int = Field(default=0, ge=0, le=65535)
    reason: str = Field(default="", max_length=256)


class Telemetry(_Message):
    """Periodic health of a device; `probe_nonce` asks the coordinator to echo, to measure RTT."""

    type: Literal["telemetry"] = "telemetry"
    device_id: Name
    at: float = Field(ge=0, allow_inf_nan=False)
    rtt_ms: Milliseconds | None = None
    cpu_percent: float | None = Field(default=None, ge=0, le=100 * 1024)
    memory_percent: float | None = Field(default=None, ge=0, le=100)
    battery_percent: float | None = Field(default=None, ge=0, le=100)
    thermal_c: float | None = Field(default=None, ge=-100, le=200)
    probe_nonce: str | None = Field(default=None, max_length=64)
    # Power and the device's own limits: past one, the policy keeps drafting off the device.
    charging: bool | None = None
    power_saver: bool | None = None
    thermal_limit_c: float | None = Field(default=None, ge=0, le=200)
    battery_floor_percent: float | None = Field(default=None, ge=0, le=100)
    # Drafts whose runtime process kept crashing here, quarantined until the agent restarts;
    # their sessions draft with the copying hybrid. Left out when there are none.
    quarantined_drafts: tuple[Name, ...] | None = Field(default=None, max_length=16)
    # Memory a new draft load may take now (MemAvailable, or the room left under the agent's
    # cgroup when tighter), and the installed drafts that would not fit it with the agent's
    # margin: the policy does not ask for those. Left out by agents that do not read them.
    memory_available_mb: float | None = Field(default=None, ge=0, le=2**40, allow_inf_nan=False)
    drafts_over_memory: tuple[Name, ...] | None = Field(default=None, max_length=16)


def check_sparse_q(
    tokens: tuple[int, ...],
    q_ids: tuple[tuple[int, ...], ...] | None,
    q_probs: tuple[tuple[float, ...], ...] | None,
) -> None:
    """q' comes as one row of 1..MAX_SPARSE_K ids and probabilities per drafted token."""
    if (q_ids is None) != (q_probs is None):
        raise ValueError("q_ids and q_probs come together")
    if q_ids is None or q_probs is None:
        return
    if len(q_ids) != len(tokens) or len(q_probs) != len(tokens):
        raise ValueError("q_ids and q_probs need one row per drafted token")
    for ids, probs in zip(q_ids, q_probs, strict=True):
        if not 1 <= len(ids) <= MAX_SPARSE_K or len(ids) != len(probs):
            raise ValueError(f"each q' row holds 1..{MAX_SPARSE_K} ids and as many probs")
        if not math.isclose(sum(probs), 1.0, abs_tol=1e-3):
            raise ValueError("each q' row must sum to 1")


def feature_bytes(text: str) -> bytes:
    """The fp16 values (little-endian) a `features` field carries, checked: base64 of 1 to
    MAX_FEATURE_DIM finite values. Raises ValueError with the reason."""
    try:
        raw = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise ValueError("features must be base64 (of little-endian fp16 values)") from None
    if len(raw) % 2 or not 2 <= len(raw) <= 2 * MAX_FEATURE_DIM:
        raise ValueError(
            f"features hold {len(raw)} bytes: expected 1..{MAX_FEATURE_DIM} fp16 values"
        )
    if 1 in raw[1::2].translate(_NOT_FINITE):
        raise ValueError("features hold an infinite or NaN value")
    return raw


def encode_features(raw: bytes) -> str:
    """The `features` field for fp16 values (little-endian bytes)."""
    return base64.b64encode(raw).decode("ascii")


Features = Annotated[str, Field(min_length=4, max_length=MAX_FEATURE_CHARS)]


class DraftTimings(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)

    draft_ms: Milliseconds = 0.0
    sent_at: float = Field(default=0.0, ge=0, allow_inf_nan=False)  # unix seconds, device clock
    # The downlink of the verdict of round - 1: its arrival at the device minus its `sent_at`
    # (two clocks, so as exact as they agree). Absent on a first round, or when not known.
    downlink_ms: Milliseconds | None = None


class Draft(_Message):
    """k drafted tokens after the first `base_len` committed tokens of a session.

    `q_ids`/`q_probs` carry q', the draft's distribution cut to its top-K and renormalised, one
    row per drafted position; both are absent for greedy sessions.
    """

    type: Literal["draft"] = "draft"
    session_id: SessionId
    round: int = Field(ge=0)
    base_len: int = Field(ge=0)
    tokens: tuple[TokenId, ...] = Field(max_length=MAX_DRAFT_TOKENS)  # [k]
    q_ids: tuple[tuple[TokenId, ...], ...] | None = None  # [k, K]
    q_probs: tuple[tuple[Probability, ...], ...] | None = None  # [k, K]
    draft_model: Name
    provisional: bool = False  # drafted offline and already shown to the user
    timings: DraftTimings = DraftTimings()
    # Cloud mode: no tokens; the verifier host drafts up to `cloud_k` tokens a round with its own
    # copy of `draft_model` and the coordinator streams a Verdict per round (docs/protocol.md).
    cloud_k: int | None = Field(default=None, ge=1, le=MAX_CLOUD_K)
    # A feature drafter asks for the target's features on this round's verdict. Left out (None)
    # by drafters that do not ask, so their drafts carry no byte of it. Cloud rounds carry none.
    want_features: bool | None = None
    # Why this window comes from another drafter than the one the session or the policy asked
    # for (`draft_model` names the one that drafted it): that one does not fit the memory free
    # on the device, or is not on it yet and is being fetched. Left out otherwise.
    drafter_note: str | None = Field(default=None, max_length=256)

    @model_validator(mode="after")
    def _sparse_q_matches_tokens(self) -> Draft:
        check_sparse_q(self.tokens, self.q_ids, self.q_probs)
        if self.cloud_k is not None and (self.tokens or self.q_ids or self.provisional):
            raise ValueError("a cloud request carries no tokens, no q' and is not provisional")
        return self

    @property
    def cloud(self) -> bool:
        return self.cloud_k is not None

    def misfit(
        self, next_round: int, committed_len: int, greedy: bool, vocab_size: int | None = None
    ) -> str | None:
        """Why this draft does not fit a session at (next_round, committed_len), or None.

        Whoever answers a session's rounds (the coordinator, or the verifier holding its lease)
        refuses such a draft with this reason; `vocab_size`, when known, bounds its token ids."""
        if self.round != next_round or self.base_len != committed_len:
            return (
                f"expected round {next_round} at base_len {committed_len}, got round "
                f"{self.round} at base_len {self.base_len}"
            )
        if self.q_ids is None and not greedy and self.tokens:
            return "a sampled session needs q' (q_ids, q_probs) with its draft"
        if vocab_size is not None:
            highest = max((max(row) for row in self.q_ids or ()), default=-1)
            highest = max(highest, max(self.tokens, default=-1))
            if highest >= vocab_size:
                return (
                    f"draft token id {highest} is outside the target's vocabulary "
                    f"(ids 0..{vocab_size - 1})"
                )
        return None


class Mode(str, Enum):
    DISTRIBUTED = "distributed"  # the device drafts
    CLOUD = "cloud"  # the verifier host drafts and streams tokens
    LOCAL = "local"  # the device drafts alone, offline; its output is provisional
    # No drafter at all: the verifier host decodes the session in its batch (k = 0) and streams
    # the tokens, as in cloud mode; what wins on a loaded, compute-bound verifier.
    PLAIN = "plain"


# The modes in which the verifier host runs the session's rounds by itself (a host stream).
HOST_MODES = frozenset({Mode.CLOUD, Mode.PLAIN})


class Policy(BaseModel):
    """What the agent should do next round."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    mode: Mode = Mode.DISTRIBUTED
    draft_model: Name
    k: int = Field(ge=0, le=64)
    # Stop the window early once the draft's own top probability falls below this.
    min_confidence: Probability | None = None


class Verdict(_Message):
    """The target's decision on a draft; the agent commits tokens[base_len:committed_len]."""

    type: Literal["verdict"] = "verdict"
    session_id: SessionId
    round: int = Field(ge=0)
    base_len: int = Field(ge=0)
    n_accepted: int = Field(ge=0)
    next_token: TokenId | None = None  # None only when the session ended on an accepted eos
    committed_len: int = Field(ge=0)
    finished: bool = False
    policy: Policy | None = None
    verifier_id: str = Field(default="", max_length=128)
    # Unix seconds, coordinator clock, as it leaves (the agent reports the downlink from it).
    sent_at: float = Field(default=0.0, ge=0, allow_inf_nan=False)
    # A cloud round: the tokens the verifier host drafted (the agent sent none); the agent commits
    # draft_tokens[:n_accepted] + [next_token].
    draft_tokens: tuple[TokenId, ...] | None = Field(default=None, max_length=MAX_CLOUD_K)
    # Cloud mode: the coordinator runs round + 1 itself; the agent waits for its verdict rather
    # than drafting it.
    continues: bool = False
    # From the verifier holding the session's lease (a direct round): the agent sends its next
    # window on its `direct` topic, which only verifiers read (protocol.md, "Direct rounds").
    direct: bool = False
    # Asked for by the draft (`want_features`): the target's last-layer hidden state, after the
    # final norm, at the position of the second-to-last committed token (whose logits chose
    # next_token), as base64 of little-endian fp16 # [hidden_size]. See `feature_bytes`.
    features: Features | None = None

    @field_validator("features")
    @classmethod
    def _features_are_fp16(cls, text: str | None) -> str | None:
        if text is not None:
            feature_bytes(text)
        return text

    @model_validator(mode="after")
    def _lengths_add_up(self) -> Verdict:
        expected = self.base_len + self.n_accepted + (0 if self.next_token is None else 1)
        if self.committed_len != expected:
            raise ValueError(
                f"committed_len {self.committed_len} != base_len + n_accepted + next_token "
                f"({expected})"
            )
        if self.draft_tokens is not None and self.n_accepted > len(self.draft_tokens):
            raise ValueError(
                f"n_accepted {self.n_accepted} exceeds the {len(self.draft_tokens)} drafted tokens"
            )
        if self.continues and self.finished:
            raise ValueError("a finished session does not continue")
        if self.features is not None and (self.next_token is None or self.finished):
            raise ValueError("features come only with a next token of a session that goes on")
        return self


class SamplingSpec(BaseModel):
    """Sampling of a session; temperature 0 is greedy. Randomness derives from (seed, round)."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    temperature: float = Field(default=0.0, ge=0.0, le=10.0, allow_inf_nan=False)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0, allow_inf_nan=False)
    seed: int = Field(default=0, ge=0, le=2**63 - 1)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


class ResumeReason(str, Enum):
    """Why an agent opens a session it has opened before (the coordinator logs it)."""

    RECONNECT = "reconnect"  # the agent's link came back
    RESTART = "restart"  # the agent restarted and resumed the session from its journal
    RETRY = "retry"  # no answer came in time
    RESYNC = "resync"  # a verdict did not fit the agent's state
    FALLBACK = "fallback"  # the agent generated alone and reports it


class Fallback(BaseModel):
    """A spell of local mode: the agent generated alone while the coordinator was out of reach."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    provisional_tokens: int = Field(ge=0, le=MAX_DRAFT_TOKENS)  # generated alone, shown as such
    offline_s: float = Field(ge=0, allow_inf_nan=False)  # from the last answer to this report


class SessionOpen(_Message):
    """Open a session, or resume it: re-sent for a known id, it is answered with its state."""

    type: Literal["session_open"] = "session_open"
    session_id: SessionId
    prompt: str = Field(max_length=64 * 1024)
    prompt_ids: tuple[TokenId, ...] = Field(min_length=1, max_length=8192)  # chat-templated
    task_type: str = Field(default="chat", max_length=32)
    sampling: SamplingSpec = SamplingSpec()
    max_tokens: int = Field(default=128, ge=1, le=8192)
    draft_model: Name
    k: int = Field(default=4, ge=0, le=64)
    resume: ResumeReason | None = None  # set when the agent opens the session again
    fallback: Fallback | None = None  # set when the agent reports a spell of local mode
    # The mode of a session with a fixed window (k > 0); with k = 0 the coordinator chooses.
    mode: Mode = Mode.DISTRIBUTED
    # The modes the agent runs, so a coordinator chooses no other for it: an agent that predates
    # cloud mode sends none, and is never asked for it.
    modes: tuple[Mode, ...] = Field(default=(Mode.DISTRIBUTED,), min_length=1, max_length=4)
    # The vocabulary hash of the tokenizer that wrote `prompt_ids` (and that the drafter
    # shares): the coordinator refuses a session whose vocabulary is not the target's.
    vocab: VocabHash = ""
    # The device lacks `draft_model` (drafts on demand): it drafts with its copying tiers
    # meanwhile, and the coordinator sends it the draft's signed release when it has one.
    draft_missing: bool = False
    # The agent waits for a host stream the coordinator starts at the open (SessionState's
    # `streaming`) rather than asking for it: an agent that predates it sends none, and asks.
    awaits_stream: bool = False

    @model_validator(mode="after")
    def _mode_is_chosen_online(self) -> SessionOpen:
        if self.mode is Mode.LOCAL:
            raise ValueError("a session opens online: distributed or cloud")
        if self.mode is Mode.CLOUD and self.k == 0:
            raise ValueError("cloud mode needs a window (k > 0); k = 0 leaves the mode open too")
        if self.mode not in self.modes:
            raise ValueError(f"mode {self.mode.value} is not among the agent's modes")
        return self


class SessionClose(_Message):
    type: Literal["session_close"] = "session_close"
    session_id: SessionId
    reason: str = Field(default="cancelled", max_length=256)


class SessionState(_Message):
    """The coordinator's truth about a session: what is committed and which round comes next."""

    type: Literal["session_state"] = "session_state"
    session_id: SessionId
    prompt_len: int = Field(ge=1)
    generated_ids: tuple[TokenId, ...] = Field(max_length=8192)  # committed after the prompt
    next_round: int = Field(ge=0)
    status: str = Field(max_length=32)  # active, finished, cancelled, failed
    policy: Policy | None = None
    # The coordinator runs the session's host stream from `next_round` on, started at the open
    # of an agent that `awaits_stream`: the agent asks for no round and waits for its verdicts.
    streaming: bool = False

    @property
    def committed_len(self) -> int:
        return self.prompt_len + len(self.generated_ids)


class VerifierStatus(_Message):
    """A verifier's heartbeat, retained; its Last Will says offline."""

    type: Literal["verifier_status"] = "verifier_status"
    verifier_id: Name
    state: DeviceState
    at: float = Field(ge=0, allow_inf_nan=False)
    queue_depth: int = Field(default=0, ge=0)
    in_flight: int = Field(default=0, ge=0)
    sessions_cached: int = Field(default=0, ge=0)
    max_batch: int = Field(default=1, ge=1)
    heartbeat_s: float = Field(default=1.0, gt=0, allow_inf_nan=False)
    target: str = Field(default="", max_length=128)  # target model name@sha256 prefix
    drafts: tuple[Name, ...] = Field(default=(), max_length=64)  # drafters for cloud rounds
    # Direct rounds: whether it takes session leases (it has the database), and the sessions it
    # holds now, so a coordinator that restarts knows whose drafts are not its to answer.
    leases: bool = False
    leased: tuple[SessionId, ...] = Field(default=(), max_length=4096)
    # The target's vocabulary: a session whose prompt holds a larger id is refused at open.
    vocab_size: int | None = Field(default=None, ge=1, le=MAX_TOKEN_ID)
    # The target's EOS and vocabulary hash, from its manifest: the coordinator's stop rule, and
    # the vocabulary a session's drafter must share (refused at open otherwise).
    eos_id: TokenId | None = None
    vocab: VocabHash = ""
    # Since the verifier started: its passes, the target's seconds in them and idle between
    # them, and the rows and positions (padding included) of the passes without a prefill.
    passes: int = Field(default=0, ge=0)
    busy_s: float = Field(default=0.0, ge=0, allow_inf_nan=False)
    idle_s: float = Field(default=0.0, ge=0, allow_inf_nan=False)
    rows: int = Field(default=0, ge=0)
    positions: int = Field(default=0, ge=0)
    # Its own cost model, profiled when it started and refined by every pass: a pass of B rows
    # of T positions takes pass_cost[0] + pass_cost[1] B + pass_cost[2] B T ms; and what its
    # drafters have cost a drafted token on this host (ms), those it has timed. The policy
    # prices rounds with them rather than with a fit of its own (None, {}: nothing reported).
    pass_cost: tuple[Milliseconds, Milliseconds, Milliseconds] | None = None
    draft_ms: dict[Name, Milliseconds] = Field(default_factory=dict, max_length=64)
    # It takes StreamRedraft: a running stream's drafter changes without ending the stream.
    redraft: bool = False


MAX_STREAM_ROUNDS = 256
# Results a VerifyResults holds at most. Only results without q' or features go in one (a
# verifier's choice), so that 64 stay far below MAX_PAYLOAD_BYTES: ~2.6 KB each at most, a
# window of 64 tokens and a pass choice of 65 windows' goodputs; ~0.3 KB for a plain round.
MAX_BATCHED_RESULTS = 64


class StreamSpec(BaseModel):
    """A host stream: the verifier runs up to `rounds` rounds of the session by itself, one per
    batched pass, choosing each pass's window (0..cloud_k) for the goodput of its whole batch,
    and returns one VerifyResult per round. It applies the stop rules to know when to stop; the
    coordinator applies them again, as the truth, before it persists a round."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    rounds: int = Field(ge=1, le=MAX_STREAM_ROUNDS)
    max_new: int = Field(ge=1)  # tokens the session may still generate
    eos_id: TokenId
    task_type: Name = "chat"
    # The coordinator's acceptance estimate for (device, drafter, task): a prior for a host that
    # has not yet seen this drafter on this task.
    alpha: Probability | None = None
    # False: the session's window is fixed (opened with k > 0), every round drafts cloud_k.
    adaptive: bool = True
    # The coordinator takes this stream's rounds in a VerifyResults with the other batched
    # streams' rounds of the same pass (a verifier that predates it sends them one by one).
    batched: bool = False


class PassChoice(BaseModel):
    """The window a host pass chose for its streams, and why (recorded on the round)."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    k: int = Field(ge=0, le=MAX_CLOUD_K)
    rows: int = Field(ge=1)  # windows in the pass
    # Predicted committed tokens/s of the whole pass for each window considered, by k.
    goodput: dict[str, Annotated[float, Field(ge=0, allow_inf_nan=False)]] = Field(
        default_factory=dict, max_length=MAX_CLOUD_K + 1
    )
    cost_ms: Milliseconds = 0.0  # the predicted pass time at the chosen k
    reason: str = Field(default="", max_length=256)


class VerifyRequest(_Message):
    """Score a draft against the target. `context_ids` is the whole committed sequence (prompt
    included), so a verifier that lost its cache rebuilds it without asking anyone."""

    type: Literal["verify_request"] = "verify_request"
    request_id: str = Field(min_length=1, max_length=64)
    session_id: SessionId
    round: int = Field(ge=0)
    context_ids: tuple[TokenId, ...] = Field(min_length=1, max_length=16384)
    tokens: tuple[TokenId, ...] = Field(max_length=MAX_DRAFT_TOKENS)  # [k]
    q_ids: tuple[tuple[TokenId, ...], ...] | None = None  # [k, K]
    q_probs: tuple[tuple[Probability, ...], ...] | None = None  # [k, K]
    sampling: SamplingSpec = SamplingSpec()
    sent_at: float = Field(default=0.0, ge=0, allow_inf_nan=False)
    # A cloud round: the verifier drafts up to `cloud_k` tokens with `cloud_draft` itself, then
    # verifies them in the same pass; `tokens` and q' are then empty.
    cloud_draft: Name | None = None
    cloud_k: int | None = Field(default=None, ge=1, le=MAX_CLOUD_K)
    # How far a long match in the context may run past cloud_k when the round is its pass's
    # only row, where a position costs the target little (`HybridProposer.drafting`): set by a
    # verifier for its own streams' rounds, never on the bus.
    cloud_reach: int | None = Field(default=None, ge=1, le=MAX_CLOUD_K)
    # A host stream from `round` on (cloud_k is then the cap of each pass's window; without
    # cloud_draft the stream is plain decoding).
    stream: StreamSpec | None = None
    # Return the target's features at the verdict's position (see Verdict.features); a device's
    # feature drafter asked. Left out when not asked; cloud rounds and streams carry none.
    want_features: bool | None = None

    @model_validator(mode="after")
    def _sparse_q_matches_tokens(self) -> VerifyRequest:
        check_sparse_q(self.tokens, self.q_ids, self.q_probs)
        if (self.cloud_draft is None) != (self.cloud_k is None):
            raise ValueError("cloud_draft and cloud_k come together")
        if self.cloud_reach is not None and self.cloud_k is None:
            raise ValueError("cloud_reach goes with cloud_k")
        if (self.cloud_k is not None or self.stream is not None) and (self.tokens or self.q_ids):
            raise ValueError("a cloud round or stream request carries no tokens and no q'")
        return self


class SessionLease(_Message):
    """Coordinator -> verifier: own this session's device-drafted rounds from `next_round` on.

    The verifier subscribes to the device's draft topic, verifies its drafts in its batches,
    persists each round and publishes the verdict to the device itself: one bus round trip and
    one commit a round. Sent again with the same `lease_id` to change the policy the verdicts
    carry, or with `send_state` to have the verifier tell the device where the session stands.
    """

    type: Literal["session_lease"] = "session_lease"
    lease_id: str = Field(min_length=1, max_length=64)
    session_id: SessionId
    device_id: Name
    prompt_len: int = Field(ge=1)
    context_ids: tuple[TokenId, ...] = Field(min_length=1, max_length=16384)  # committed
    next_round: int = Field(ge=0)
    sampling: SamplingSpec = SamplingSpec()
    max_tokens: int = Field(ge=1, le=8192)
    eos_id: TokenId
    policy: Policy
    # The policy column of the rounds stored from now on: the decision in force, with its inputs.
    policy_record: dict[str, Any] | None = None
    send_state: bool = False


class LeaseEnd(_Message):
    """Coordinator -> verifier: give the session back (closed, host mode, moved)."""

    type: Literal["lease_end"] = "lease_end"
    lease_id: str = Field(min_length=1, max_length=64)
    session_id: SessionId


class LeaseAck(_Message):
    """Verifier -> coordinator: a lease taken (or refused, with the reason) or given back; the
    session's state as the verifier left it."""

    type: Literal["lease_ack"] = "lease_ack"
    lease_id: str = Field(min_length=1, max_length=64)
    session_id: SessionId
    verifier_id: Name
    held: bool  # False: refused, or given back
    next_round: int = Field(ge=0)
    committed_len: int = Field(ge=0)
    reason: str = Field(default="", max_length=256)


class RoundDone(_Message):
    """Verifier -> coordinator, after the verdict left: a direct round, for the policy, the
    dashboard and the coordinator's view of the session (the database already holds it)."""

    type: Literal["round_done"] = "round_done"
    lease_id: str = Field(min_length=1, max_length=64)
    session_id: SessionId
    round: int = Field(ge=0)
    base_len: int = Field(ge=0)
    committed: tuple[TokenId, ...] = Field(min_length=1, max_length=MAX_DRAFT_TOKENS + 1)
    drafted: int = Field(ge=0)
    n_accepted: int = Field(ge=0)
    finished: bool = False
    draft_model: Name
    provisional: bool = False
    verifier_id: Name
    t_draft_ms: Milliseconds = 0.0
    t_uplink_ms: Milliseconds | None = None
    t_queue_ms: Milliseconds = 0.0
    t_verify_ms: Milliseconds = 0.0
    batch_prefilled: int = Field(default=0, ge=0)
    batch_size: int = Field(default=1, ge=1)  # windows in the pass that verified it
    overhead_ms: Milliseconds | None = None  # the device's turn beyond compute (see policy)
    # The verifier's own legs of the round (absent from a verifier that does not time them):
    # the pipe to its inference process and back beyond the pass, persisting (the group commit,
    # its queue included), encoding the verdict, and the whole time from the draft's arrival to
    # the verdict queued for the bus, of which the legs above and queue + verify are parts.
    t_pipe_ms: Milliseconds | None = None
    t_persist_ms: Milliseconds | None = None
    t_encode_ms: Milliseconds | None = None
    t_held_ms: Milliseconds | None = None


class StreamStop(_Message):
    """The coordinator no longer wants a host stream's rounds (closed, moved, mode changed)."""

    type: Literal["stream_stop"] = "stream_stop"
    request_id: str = Field(min_length=1, max_length=64)
    session_id: SessionId


class StreamRedraft(_Message):
    """The coordinator's policy chose another host drafter (or none: plain decoding) for a
    session whose stream runs: the verifier drafts the stream's rounds with it from its next
    pass on, and the stream goes on. Ending the stream and opening the next cost the round the
    verifier had run ahead (computed again) and a hop: each session that switched finished a
    pass behind the others, a pass more for its wave. Sent only to a verifier whose status says
    `redraft`."""

    type: Literal["stream_redraft"] = "stream_redraft"
    request_id: str = Field(min_length=1, max_length=64)  # the stream's opening request
    session_id: SessionId
    cloud_draft: Name | None = None  # None: plain decoding (no window)
    cloud_k: int | None = Field(default=None, ge=1, le=MAX_CLOUD_K)
    alpha: Probability | None = None  # the coordinator's acceptance estimate for the drafter

    @model_validator(mode="after")
    def _drafter_and_window(self) -> StreamRedraft:
        if (self.cloud_draft is None) != (self.cloud_k is None):
            raise ValueError("cloud_draft and cloud_k come together (neither: plain decoding)")
        return self


class VerifyResult(_Message):
    type: Literal["verify_result"] = "verify_result"
    request_id: str = Field(min_length=1, max_length=64)
    session_id: SessionId
    round: int = Field(ge=0)
    base_len: int = Field(ge=0)
    n_accepted: int = Field(default=0, ge=0)
    next_token: TokenId | None = None
    verifier_id: Name
    queue_ms: Milliseconds = 0.0
    verify_ms: Milliseconds = 0.0
    batch_size: int = Field(default=1, ge=1)
    # Positions the pass that verified this request also prefilled (a session new to the
    # verifier, or one that lost its cache): verify_ms is then not the windows' alone.
    batch_prefilled: int = Field(default=0, ge=0)
    error: str = Field(default="", max_length=1024)  # set when the round could not be verified
    # A cloud round: what the verifier drafted, q' when sampling, and what drafting took.
    draft_tokens: tuple[TokenId, ...] | None = Field(default=None, max_length=MAX_CLOUD_K)
    q_ids: tuple[tuple[TokenId, ...], ...] | None = None  # [k, K]
    q_probs: tuple[tuple[Probability, ...], ...] | None = None  # [k, K]
    draft_ms: Milliseconds = 0.0
    # A host stream's round: the pass's choice of window, and whether the stream ends with it.
    pass_choice: PassChoice | None = None
    stream_ends: bool = False
    # A host stream's round, from a verifier that redrafts streams: the drafter the stream had
    # for this round (None: plain decoding), which a StreamRedraft may have changed since the
    # stream opened (the coordinator reads it once it has sent one).
    stream_draft: Name | None = None
    # Asked for by the request (`want_features`): as Verdict.features, at the position whose
    # logits chose next_token.
    features: Features | None = None

    @field_validator("features")
    @classmethod
    def _features_are_fp16(cls, text: str | None) -> str | None:
        if text is not None:
            feature_bytes(text)
        return text

    @model_validator(mode="after")
    def _cloud_draft_adds_up(self) -> VerifyResult:
        if self.q_ids is not None and self.draft_tokens is None:
            raise ValueError("q' comes only with draft_tokens")
        if self.draft_tokens is not None:
            check_sparse_q(self.draft_tokens, self.q_ids, self.q_probs)
            if self.n_accepted > len(self.draft_tokens):
                raise ValueError("n_accepted exceeds the drafted tokens")
        if self.features is not None and self.next_token is None:
            raise ValueError("features come only with a next token")
        return self


class VerifyResults(_Message):
    """The rounds of one pass for host streams opened with `StreamSpec.batched`, in one message
    instead of one each (a pass of 32 streams sent 32, each read, acknowledged and dispatched
    apart by the coordinator). The coordinator takes each as if it had come alone."""

    type: Literal["verify_results"] = "verify_results"
    results: tuple[VerifyResult, ...] = Field(min_length=1, max_length=MAX_BATCHED_RESULTS)


class CommandName(str, Enum):
    PING = "ping"
    ECHO = "echo"  # the answer to a telemetry probe
    DEPLOY_MODEL = "deploy_model"  # args: broker.model_release.DeployModelArgs
    START_SESSION = "start_session"  # args: session_id, prompt, task_type, max_tokens, sampling
    CANCEL_SESSION = "cancel_session"  # args: session_id


class Command(_Message):
    type: Literal["command"] = "command"
    command_id: str = Field(min_length=1, max_length=64)
    name: CommandName
    args: dict[str, Any] = Field(default_factory=dict)
    issued_at: float = Field(default=0.0, ge=0, allow_inf_nan=False)

    @field_validator("args")
    @classmethod
    def _args_are_small(cls, args: dict[str, Any]) -> dict[str, Any]:
        if len(args) > 32:
            raise ValueError("at most 32 command arguments")
        return args


class CommandAck(_Message):
    type: Literal["command_ack"] = "command_ack"
    command_id: str = Field(min_length=1, max_length=64)
    device_id: Name
    ok: bool
    result: dict[str, Any] = Field(default_factory=dict)
    error: str = Field(default="", max_length=1024)
    at: float = Field(default=0.0, ge=0, allow_inf_nan=False)


class Refused(str, Enum):
    """What an ErrorReply refuses: a message by its type (a session opened or closed, a draft),
    or, where a message could not be read or came over its quota, the channel it came on. The
    values are the strings the contract has always carried."""

    SESSION_OPEN = "session_open"
    SESSION_CLOSE = "session_close"
    DRAFT = "draft"  # a draft, or a message on the draft channel
    SESSION = "session"  # a message on the session channel that could not be read
    STATUS = "status"
    TELEMETRY = "telemetry"
    ACK = "ack"

    def __str__(self) -> str:
        return str(self.value)


class ErrorReply(_Message):
    """Sent back where a refused message has somewhere to reply (the device's verdict topic)."""

    type: Literal["error"] = "error"
    refused_type: Refused
    session_id: str | None = Field(default=None, max_length=64)
    round: int | None = None
    reason: str = Field(max_length=1024)


M = TypeVar("M", bound="_Message")

Message: TypeAlias = (
    Status
    | Telemetry
    | Draft
    | Verdict
    | Command
    | CommandAck
    | ErrorReply
    | SessionOpen
    | SessionClose
    | SessionState
    | VerifierStatus
    | VerifyRequest
    | VerifyResult
    | VerifyResults
    | StreamStop
    | StreamRedraft
    | SessionLease
    | LeaseEnd
    | LeaseAck
    | RoundDone
)

MESSAGE_TYPES: dict[str, type[_Message]] = {
    cls.model_fields["type"].default: cls
    for cls in (
        Status,
        Telemetry,
        Draft,
        Verdict,
        Command,
        CommandAck,
        ErrorReply,
        SessionOpen,
        SessionClose,
        SessionState,
        VerifierStatus,
        VerifyRequest,
        VerifyResult,
        VerifyResults,
        StreamStop,
        StreamRedraft,
        SessionLease,
        LeaseEnd,
        LeaseAck,
        RoundDone,
    )
}
_ADAPTERS: dict[str, TypeAdapter[Any]] = {
    name: TypeAdapter(cls) for name, cls in MESSAGE_TYPES.items()
}


def encode(message: Message) -> bytes:
    """Compact JSON; optional fields left at None are omitted."""
    payload = message.model_dump_json(exclude_none=True).encode()
    if len(payload) > MAX_PAYLOAD_BYTES:
        raise PayloadTooLarge(len(payload))
    return payload


def decode(payload: bytes) -> Message:
    """Validate a payload from the bus; raise a `BusError` subclass with the reason on refusal."""
    if len(payload) > MAX_PAYLOAD_BYTES:
        raise PayloadTooLarge(len(payload))
    try:
        # pydantic's parser reads what json.loads reads, in well under half its time.
        document = pydantic_core.from_json(payload)
    except (ValueError, RecursionError) as exc:
        raise MalformedPayload(f"not UTF-8 JSON: {exc}") from None
    if not isinstance(document, dict):
        raise MalformedPayload(f"expected a JSON object, got {type(document).__name__}")
    if "v" not in document or "type" not in document:
        raise MalformedPayload("missing 'v' or 'type'")
    version = document["v"]
    # Only an int can be a version: a list or an object is unhashable, and a float 1.0 is not 1.
    if type(version) is not int or version not in SUPPORTED_VERSIONS:
        raise UnsupportedVersion(version)
    message_type = document["type"]
    if not isinstance(message_type, str) or message_type not in _ADAPTERS:
        raise UnknownMessageType(message_type)
    try:
        message: Message = _ADAPTERS[message_type].validate_python(document)
    except ValidationError as exc:
        errors = [
            f"{'.'.join(_short(p) for p in err['loc']) or '<root>'}: {err['msg']}"
            for err in exc.errors(include_url=False)[:5]
        ]
        raise SchemaViolation(message_type, errors) from None
    except (TypeError, ValueError, ArithmeticError, RecursionError) as exc:
        # A validator that met a value it did not foresee: still a refusal, with its reason.
        raise SchemaViolation(message_type, [f"{type(exc).__name__}: {_short(exc)}"]) from None
    return message


def _short(value: object, limit: int = 64) -> str:
    """A value as it may appear in a reason (refusals carry at most 1,024 characters)."""
    text = str(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def decode_as(payload: bytes, expected: type[M]) -> M:
    """Decode and require one message type (e.g. a draft topic carries only drafts)."""
    message = decode(payload)
    if not isinstance(message, expected):
        raise BusError(f"expected {expected.model_fields['type'].default}, got {message.type}")
    return message
