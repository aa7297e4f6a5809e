"""Sessions rebuilt round by round from the database: text with token provenance, terminal and
JSON replay, and `--verify`, which re-runs the target on the recorded drafts.

records (the stored rounds), rebuild (text and provenance), output (terminal and JSON)
and verify (the target run again on the recorded drafts)."""

from __future__ import annotations

from coordinator.replay.output import (
    ANSI,
    ANSI_DIM,
    ANSI_REJECTED,
    ANSI_RESET,
    MAX_REPLAY_GAP_S,
    json_lines,
    play_terminal,
    round_delays,
    round_document,
    summary_line,
)
from coordinator.replay.rebuild import (
    DETERMINISTIC_DRAFTERS,
    Rebuild,
    ReplayStep,
    ReplayToken,
    TokenDecoder,
    rebuild,
    target_tokenizer,
    token_pieces,
)
from coordinator.replay.records import (
    ReplayError,
    RoundRecord,
    SessionNotFoundError,
    SessionRecord,
    TokenKind,
    find_session,
    load_session,
)
from coordinator.replay.verify import Mismatch, VerifyReport, verify_session

__all__ = [
    "ANSI",
    "ANSI_DIM",
    "ANSI_REJECTED",
    "ANSI_RESET",
    "DETERMINISTIC_DRAFTERS",
    "MAX_REPLAY_GAP_S",
    "Mismatch",
    "Rebuild",
    "ReplayError",
    "ReplayStep",
    "ReplayToken",
    "RoundRecord",
    "SessionNotFoundError",
    "SessionRecord",
    "TokenDecoder",
    "TokenKind",
    "VerifyReport",
    "find_session",
    "json_lines",
    "load_session",
    "play_terminal",
    "rebuild",
    "round_delays",
    "round_document",
    "summary_line",
    "target_tokenizer",
    "token_pieces",
    "verify_session",
]
