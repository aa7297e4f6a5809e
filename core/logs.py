"""How both binaries log: lines for people (the default), or one JSON object a line for a log
collector (`--log-format json`: journald, Loki, CloudWatch, `kubectl logs | jq`)."""

from __future__ import annotations

import json
import logging
from datetime import datetime, timezone

LOG_FORMATS = ("text", "json")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
# The attributes every LogRecord has; anything else on a record came from `extra=` and is kept.
_RECORD_FIELDS = frozenset(vars(logging.makeLogRecord({}))) | {"message", "asctime"}


class JsonFormatter(logging.Formatter):
    """One JSON object per record: time (UTC, ISO 8601), level, logger, message, the process,
    the exception's traceback as text when there is one, and any `extra=` fields."""

    def format(self, record: logging.LogRecord) -> str:
        document: dict[str, object] = {
            "time": datetime.fromtimestamp(record.created, timezone.utc).isoformat(
                timespec="milliseconds"
            ),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
            "pid": record.process,
        }
        if record.exc_info:
            document["exception"] = self.formatException(record.exc_info)
        for key, value in vars(record).items():
            if key not in _RECORD_FIELDS and key not in document:
                document[key] = value
        # default=str: an extra field that JSON cannot hold (a Path, an enum) is still logged.
        return json.dumps(document, default=str, ensure_ascii=False)


def configure_logging(level: int, log_format: str) -> None:
    """A stderr handler in the chosen format on the root logger, as logging.basicConfig does (and,
    as it does, nothing where the root logger has handlers already: an embedding test's)."""
    handler = logging.StreamHandler()
    if log_format == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter(TEXT_FORMAT))
    logging.basicConfig(level=level, handlers=[handler])
