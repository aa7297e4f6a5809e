"""The agent's journal of open sessions (SQLite), so that a restarted agent resumes them.

One row per open session: what it is (its spec), the tokens committed so far, the round it is
at, and, in local mode, the provisional tail with its q' rows and the spell it belongs to. The
spec (the prompt, its ids, up to 64 KB of text) is written once; the progress is updated on
every commit and every piece of local generation; the row is deleted when the session ends.
WAL with synchronous=NORMAL makes a write a few tens of microseconds; a write lost to a power
cut costs only a resynchronisation, since the coordinator holds every committed token.
The provisional tail is the one thing only the device holds.
"""

from __future__ import annotations

import json
import logging
import sqlite3
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from broker import messages as m
from device_agent.drafting import LocalSpell, SessionDrafter, SessionSpec

log = logging.getLogger(__name__)

SCHEMA_VERSION = 1

_SCHEMA = """
CREATE TABLE IF NOT EXISTS sessions (
    session_id TEXT PRIMARY KEY,
    spec TEXT NOT NULL,
    proactive INTEGER NOT NULL,
    generated TEXT NOT NULL,
    next_round INTEGER NOT NULL,
    provisional TEXT NOT NULL,
    provisional_q TEXT NOT NULL,
    spell TEXT,
    status TEXT NOT NULL,
    updated_at REAL NOT NULL
)
"""


class JournalError(Exception):
    """The journal file cannot be opened or is not one of ours."""


@dataclass(frozen=True)
class JournalEntry:
    """An open session as the journal last saw it."""

    spec: SessionSpec
    proactive: bool
    generated: list[int]  # committed after the prompt
    next_round: int
    provisional: list[int]  # [n]
    provisional_q: list[tuple[tuple[int, ...], tuple[float, ...]]]  # [n] or empty
    spell: LocalSpell | None
    status: str


def _spec_json(spec: SessionSpec) -> str:
    return json.dumps(
        {
            "session_id": spec.session_id,
            "prompt": spec.prompt,
            "prompt_ids": list(spec.prompt_ids),
            "task_type": spec.task_type,
            "sampling": spec.sampling.model_dump(mode="json"),
            "max_tokens": spec.max_tokens,
            "draft_model": spec.draft_model,
            "k": spec.k,
            "vocab": spec.vocab,
        }
    )


def _spec_from(document: dict[str, Any]) -> SessionSpec:
    return SessionSpec(
        session_id=str(document["session_id"]),
        prompt=str(document["prompt"]),
        prompt_ids=tuple(int(t) for t in document["prompt_ids"]),
        task_type=str(document["task_type"]),
        sampling=m.SamplingSpec.model_validate(document["sampling"]),
        max_tokens=int(document["max_tokens"]),
        draft_model=str(document["draft_model"]),
        k=int(document["k"]),
        vocab=str(document.get("vocab", "")),  # rows journaled before vocabulary hashes have none
    )


class SessionJournal:
    """`record` an open session's progress, `forget` it when it ends, `open_sessions` on start.

    Used from the agent's event loop only; that loop may run in another thread than the one
    that built the agent (an embedding app's loop thread), hence `check_same_thread=False`.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            self._db = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=NORMAL")
            version = int(self._db.execute("PRAGMA user_version").fetchone()[0])
            if version not in (0, SCHEMA_VERSION):
                raise JournalError(f"{path}: journal schema {version}, expected {SCHEMA_VERSION}")
            self._db.execute(_SCHEMA)
            self._db.execute(f"PRAGMA user_version={SCHEMA_VERSION}")
        except (OSError, sqlite3.Error) as exc:
            raise JournalError(f"cannot open the session journal {path}: {exc}") from exc
        # The spec last written in full, by session: while a session's is the same object, a
        # record updates its progress alone.
        self._written: dict[str, SessionSpec] = {}

    def record(self, drafter: SessionDrafter, status: str) -> None:
        """Write a session's current state: its whole row the first time (or for a new spec),
        then its progress only. A verdict's commit rewrote the prompt and its ids every time:
        O(prompt) on the device per round, for what never changes."""
        session_id = drafter.spec.session_id
        spell = drafter.spell
        progress = (
            int(drafter.proactive),
            json.dumps(drafter.generated),
            drafter.round,
            json.dumps(drafter.provisional),
            json.dumps([[list(ids), list(probs)] for ids, probs in drafter.provisional_q]),
            None if spell is None else json.dumps(spell.to_json()),
            status,
            time.time(),
        )
        if self._written.get(session_id) is drafter.spec:
            updated = self._db.execute(
                "UPDATE sessions SET proactive = ?, generated = ?, next_round = ?, "
                "provisional = ?, provisional_q = ?, spell = ?, status = ?, updated_at = ? "
                "WHERE session_id = ?",
                (*progress, session_id),
            )
            if updated.rowcount == 1:
                return
        self._db.execute(
            "INSERT OR REPLACE INTO sessions VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (session_id, _spec_json(drafter.spec), *progress),
        )
        self._written[session_id] = drafter.spec

    def forget(self, session_id: str) -> None:
        self._written.pop(session_id, None)
        self._db.execute("DELETE FROM sessions WHERE session_id = ?", (session_id,))

    def open_sessions(self) -> list[JournalEntry]:
        """Every session the journal holds, oldest first; unreadable rows are logged and dropped."""
        rows = self._db.execute(
            "SELECT session_id, spec, proactive, generated, next_round, provisional, "
            "provisional_q, spell, status FROM sessions ORDER BY updated_at"
        ).fetchall()
        entries = []
        for session_id, spec, proactive, generated, next_round, tail, tail_q, spell, status in rows:
            try:
                spell_doc = None if spell is None else json.loads(spell)
                entries.append(
                    JournalEntry(
                        spec=_spec_from(json.loads(spec)),
                        proactive=bool(proactive),
                        generated=[int(t) for t in json.loads(generated)],
                        next_round=int(next_round),
                        provisional=[int(t) for t in json.loads(tail)],
                        provisional_q=[
                            (tuple(int(i) for i in ids), tuple(float(p) for p in probs))
                            for ids, probs in json.loads(tail_q)
                        ],
                        spell=None
                        if spell_doc is None
                        else LocalSpell(
                            at=int(spell_doc["at"]),
                            round=int(spell_doc["round"]),
                            generated=int(spell_doc["generated"]),
                            kept=int(spell_doc["kept"]),
                            replaced=[int(t) for t in spell_doc["replaced"]],
                            since=float(spell_doc["since"]),
                        ),
                        status=str(status),
                    )
                )
            except (ValueError, KeyError, TypeError) as exc:
                log.error("journal: session %s unreadable (%s); dropped", session_id, exc)
                self.forget(session_id)
        return entries

    def close(self) -> None:
        self._db.close()
