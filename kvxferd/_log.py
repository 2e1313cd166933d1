"""Structured logs: one line per event, ``event`` first, ids as fields.

Several lines are logged per handoff, on the event loop, so a line must be cheap. An event
goes straight to the handler :func:`configure` installed, formatted once (text or JSON) and
written under the handler's lock: ``logging``'s record, filters and handler calls were two
thirds of a line's cost (about 70 µs a line under a profiler, in a busy daemon). Anything else
(an event with a traceback, another handler installed) goes through ``logging``, whose
records keep the fields unformatted until a handler formats them, without the caller, thread
and process look-ups (turned off by :func:`configure`).

>>> format_fields("transfer.done", {"transfer_id": "t1", "bytes": 4096})
'transfer.done transfer_id=t1 bytes=4096'
"""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import Any

__all__ = ["configure", "log_event"]

logger = logging.getLogger("kvxferd")


def format_fields(event: str, fields: dict[str, Any]) -> str:
    parts = [event]
    for k, v in fields.items():
        text = v if isinstance(v, str) else json.dumps(v) if isinstance(v, dict | list) else str(v)
        if " " in text or not text:
            text = json.dumps(text)
        parts.append(f"{k}={text}")
    return " ".join(parts)


class _JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        return self.line(record.created, record.levelno, getattr(record, "event", record.getMessage()), record)

    def line(self, created: float, level: int, event: str, record: logging.LogRecord | dict[str, Any]) -> str:
        """One line: the event and ``record``'s fields (a record's, with its traceback)."""
        data: dict[str, Any] = {"ts": round(created, 6), "level": _level_name(level), "event": event}
        if isinstance(record, dict):
            data.update(record)
        else:
            data.update(getattr(record, "fields", {}))
            if record.exc_info:
                data["exc"] = self.formatException(record.exc_info)
        return json.dumps(data, default=str)


class _TextFormatter(logging.Formatter):
    def __init__(self) -> None:
        super().__init__()
        self._second = -1
        self._stamp = ""

    def format(self, record: logging.LogRecord) -> str:
        fields = getattr(record, "fields", None)
        event = record.msg if fields is not None else record.getMessage()
        line = self.line(record.created, record.levelno, event, fields or {})
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return line

    def line(self, created: float, level: int, event: str, fields: dict[str, Any]) -> str:
        """One line: time, level, the event and its fields."""
        second = int(created)
        if second != self._second:  # strftime once per second, not once per line
            self._second = second
            self._stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(second))
        message = format_fields(event, fields) if fields else event
        return f"{self._stamp}.{int((created - second) * 1000):03d} {_level_name(level):7s} {message}"


#: Level names as lines print them.
_LEVELS = {level: logging.getLevelName(level).lower() for level in (10, 20, 30, 40, 50)}


def _level_name(level: int) -> str:
    return _LEVELS.get(level) or logging.getLevelName(level).lower()


#: The handler :func:`configure` installed and its formatter (events are written there directly).
_direct: tuple[logging.StreamHandler[Any], _JsonFormatter | _TextFormatter] | None = None


def configure(level: str, json_lines: bool) -> None:
    global _direct
    handler: logging.StreamHandler[Any] = logging.StreamHandler(sys.stderr)
    formatter = _JsonFormatter() if json_lines else _TextFormatter()
    handler.setFormatter(formatter)
    _direct = (handler, formatter)
    logger.handlers[:] = [handler]
    logger.setLevel(level.upper())
    logger.propagate = False
    # No caller (a stack walk), thread or process names in the records: nothing prints them,
    # and skipping them is the logging HOWTO's own advice for code that logs often.
    logging._srcfile = None
    logging.logThreads = False
    logging.logProcesses = False
    logging.logMultiprocessing = False


def log_event(event: str, level: int = logging.INFO, exc_info: bool | BaseException = False, **fields: Any) -> None:
    """Log one event with its fields (e.g. ``transfer_id=...``)."""
    if not logger.isEnabledFor(level):
        return
    direct = _direct
    if direct is None or exc_info or len(logger.handlers) != 1 or logger.handlers[0] is not direct[0]:
        logger.log(level, event, extra={"event": event, "fields": fields}, exc_info=exc_info)
        return
    handler, formatter = direct
    line = formatter.line(time.time(), level, event, fields)
    with handler.lock:  # type: ignore[union-attr]  # made by the handler's constructor
        handler.stream.write(line + "\n")
        handler.stream.flush()
