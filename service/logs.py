"""One log format for the whole process: kda-serve's loggers and uvicorn's (``uvicorn``,
``uvicorn.error``, ``uvicorn.access``) all go through one handler on stderr, as text
(``2026-12-02 14:09:39,897 INFO kda_serve.app: ...``) or, with ``--log-format json``, as one
JSON object per line::

    {"ts": "2026-12-02T14:09:39.897+00:00", "level": "INFO", "logger": "kda_serve.app",
     "message": "...", "request_id": "..."}

``request_id`` (and ``trace_id``) are there when the record carries them: the request id
filter of `service.http` (passed in ``filters`` by the CLIs) sets them on every record
written while a request runs; text lines show the request id in brackets (``-`` outside
a request). ``exc_info`` holds the traceback of a record logged with one.
"""
from __future__ import annotations

import json
import logging
import sys
from datetime import datetime, timezone
from typing import Optional, Sequence, TextIO

TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s [%(request_id)s]: %(message)s"
UVICORN_LOGGERS = ("uvicorn", "uvicorn.error", "uvicorn.access", "uvicorn.asgi")


class JsonFormatter(logging.Formatter):
    """A record as one line of JSON: ts (ISO 8601, UTC, ms), level, logger, message, and
    request_id / exc_info when present."""

    def format(self, record: logging.LogRecord) -> str:
        line = {
            "ts": datetime.fromtimestamp(record.created, timezone.utc).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        for name in ("request_id", "trace_id"):
            value = record.__dict__.get(name)
            if value is not None and value != "-":
                line[name] = str(value)
        if record.exc_info:
            line["exc_info"] = self.formatException(record.exc_info)
        return json.dumps(line, ensure_ascii=False)


def configure_logging(level: str, fmt: str = "text", stream: Optional[TextIO] = None,
                      filters: Sequence[logging.Filter] = ()) -> None:
    """Send every record at ``level`` or above (debug | info | warning | error) to ``stream``
    (default stderr), formatted as ``fmt`` (text | json), through ``filters`` (the request
    id's); uvicorn's loggers lose their own handlers and propagate here (start uvicorn with
    ``log_config=None`` so it keeps them so)."""
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json"
                         else logging.Formatter(TEXT_FORMAT, defaults={"request_id": "-"}))
    for f in filters:
        handler.addFilter(f)
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())
    for name in UVICORN_LOGGERS:
        logger = logging.getLogger(name)
        for old in list(logger.handlers):
            logger.removeHandler(old)
        logger.propagate = True
