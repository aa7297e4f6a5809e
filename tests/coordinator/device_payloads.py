"""Malformed and hostile payloads for every channel a device may publish on, for the fuzz tests.

One catalogue of bad values and mutations feeds both hypothesis (in-process decoding) and a
seeded generator (payloads sent over the real broker to a running coordinator).
"""

from __future__ import annotations

import json
import random
import uuid
from collections.abc import Callable
from typing import Any

from hypothesis import strategies as st

from broker import messages as m
from broker.topics import UPLINK_CHANNELS, DeviceChannel

DEVICE = "fuzz-dev"
SESSION = "6f1c2d3e-0000-4000-8000-00000000f022"

# Values that have broken decoders before: containers where scalars belong, numbers past every
# bound, floats where ints belong, strings where numbers belong.
BAD_VALUES: list[Any] = [
    [],
    [1],
    [[[]]],
    {},
    {"a": 1},
    {"v": 1, "type": "draft"},
    None,
    True,
    False,
    0,
    -1,
    1.0,
    1.5,
    -0.0,
    2**31,
    2**63,
    2**64 + 1,
    10**30,
    -(10**30),
    1e308,
    -1e308,
    "",
    "1",
    "x" * 300,
    "\u0000",
    "💥",
    "../../etc",
    "specfleet/v1/dev/+/draft",
]


def valid_documents() -> dict[DeviceChannel, list[dict[str, Any]]]:
    """Valid JSON documents of every message a device may send, by channel."""
    open_ = m.SessionOpen(
        session_id=SESSION,
        prompt="hi",
        prompt_ids=(1, 2, 3),
        draft_model="lookup",
        sampling=m.SamplingSpec(temperature=0.7, seed=3),
    )
    draft = m.Draft(
        session_id=SESSION,
        round=0,
        base_len=3,
        tokens=(5, 6),
        q_ids=((5, 7), (6,)),
        q_probs=((0.5, 0.5), (1.0,)),
        draft_model="lookup",
        timings=m.DraftTimings(draft_ms=1.0, sent_at=1.0),
    )
    messages: dict[DeviceChannel, list[m.Message]] = {
        DeviceChannel.STATUS: [
            m.Status(device_id=DEVICE, state=m.DeviceState.ONLINE, at=1.0, drafts=("lookup",))
        ],
        DeviceChannel.TELEMETRY: [
            m.Telemetry(device_id=DEVICE, at=1.0, rtt_ms=3.0, cpu_percent=5.0, probe_nonce="n")
        ],
        DeviceChannel.ACK: [m.CommandAck(command_id="c1", device_id=DEVICE, ok=True)],
        DeviceChannel.SESSION: [open_, m.SessionClose(session_id=SESSION)],
        DeviceChannel.DRAFT: [draft, draft.model_copy(update={"tokens": (), "cloud_k": 4})],
        # A leased session's next window (read by verifiers, which refuse a malformed one).
        DeviceChannel.DIRECT: [draft],
    }
    assert set(messages) == set(UPLINK_CHANNELS), "a device channel has no fuzz cases"
    return {
        channel: [json.loads(m.encode(message)) for message in listed]
        for channel, listed in messages.items()
    }


DOCUMENTS = valid_documents()
OTHER_TYPES = [*sorted(m.MESSAGE_TYPES), "", "gossip"]


def _paths(document: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Every key path of a document (object keys and list indexes), nested ones included."""
    found: list[tuple[Any, ...]] = []
    if isinstance(document, dict):
        items: list[tuple[Any, Any]] = list(document.items())
    elif isinstance(document, list):
        items = list(enumerate(document))
    else:
        return found
    for key, value in items:
        found.append((*prefix, key))
        found.extend(_paths(value, (*prefix, key)))
    return found


def _set(document: Any, path: tuple[Any, ...], value: Any) -> None:
    for key in path[:-1]:
        document = document[key]
    document[path[-1]] = value


def _delete(document: Any, path: tuple[Any, ...]) -> None:
    for key in path[:-1]:
        document = document[key]
    if isinstance(document, dict):
        del document[path[-1]]
    else:
        document.pop(path[-1])


def mutate(document: dict[str, Any], pick: Callable[[list[Any]], Any], bad: Any) -> bytes:
    """One hostile payload from a valid document: `pick` chooses among options (hypothesis or a
    seeded generator), `bad` is the value to plant."""
    doc = json.loads(json.dumps(document))  # a deep copy
    kind = pick(["set", "set", "set", "delete", "type", "extra", "raw"])
    if kind == "set":
        _set(doc, pick([("v",), ("type",), *_paths(doc)]), bad)
    elif kind == "delete":
        _delete(doc, pick(_paths(doc)))
    elif kind == "type":
        doc["type"] = pick(OTHER_TYPES)
    elif kind == "extra":
        doc[pick(["extra", "v2", "__proto__", "x" * 100])] = bad
    else:
        return pick(
            [
                b"",
                b"\x00\xff\xfe",
                b"not json",
                json.dumps(doc).encode()[: pick([1, 5, 20])],
                b"[" * 10_000 + b"]" * 10_000,
                b'{"v": 1, "type": "draft", "tokens": ' + b"[" * 5000 + b"]" * 5000 + b"}",
                json.dumps([doc]).encode(),
                json.dumps(bad).encode(),
                b"x" * (m.MAX_PAYLOAD_BYTES + 1),
            ]
        )
    return json.dumps(doc, allow_nan=True).encode()


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=40),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=10), children, max_size=4)
    ),
    max_leaves=12,
)


@st.composite
def device_payloads(draw: st.DrawFn) -> tuple[DeviceChannel, bytes]:
    """A channel and a hostile payload for it."""
    channel = draw(st.sampled_from(UPLINK_CHANNELS))
    document = draw(st.sampled_from(DOCUMENTS[channel]))
    bad = draw(st.sampled_from(BAD_VALUES) | json_values)
    return channel, mutate(document, lambda options: draw(st.sampled_from(options)), bad)


def seeded_payloads(count: int, seed: int) -> list[tuple[DeviceChannel, bytes]]:
    """`count` hostile payloads spread over every device channel, the same for the same seed."""
    rng = random.Random(seed)
    cases = []
    for i in range(count):
        channel = UPLINK_CHANNELS[i % len(UPLINK_CHANNELS)]
        document = rng.choice(DOCUMENTS[channel])
        if channel is DeviceChannel.SESSION and rng.random() < 0.2:
            document = {**document, "session_id": str(uuid.UUID(int=rng.getrandbits(128)))}
        cases.append((channel, mutate(document, rng.choice, rng.choice(BAD_VALUES))))
    return cases
