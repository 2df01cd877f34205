"""Log formatting and setup for brokers and workers: plain text or one JSON object a line.

Both formats show the fields a record carries besides the standard ones (``extra=``,
a filter, :func:`task_fields`): JSON as keys of the object, text as ``key=value``
after the message. Every task-related line carries ``task_id`` and ``tenant``.

JSON lines: ``ts`` (ISO-8601 UTC with milliseconds), ``level``, ``logger``,
``message``, ``exception`` (the formatted traceback, when there is one), then the
process-wide fields (e.g. ``broker``) and the record's own fields.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from collections.abc import Mapping
from typing import Any, Final, TextIO

LOG_FORMATS: Final = ("text", "json")
LOG_FORMAT_ENV: Final = "STEWARD_LOG_FORMAT"

# Attributes every LogRecord has: anything else on a record is an extra field.
_STANDARD_ATTRS: Final = frozenset(
    vars(logging.LogRecord("", logging.INFO, "", 0, "", None, None)).keys()
) | {"message", "asctime", "taskName"}
_PLAIN_TYPES: Final = (str, int, float, bool, type(None))


def task_fields(task_id: int, tenant: str, **more: Any) -> dict[str, Any]:
    """``extra=`` for a task-related log line: its task id and tenant (and ``more``)."""
    return {"task_id": task_id, "tenant": tenant, **more}


def extra_fields(record: logging.LogRecord) -> dict[str, Any]:
    """The fields a record carries besides the standard LogRecord attributes."""
    return {
        key: value
        for key, value in record.__dict__.items()
        if key not in _STANDARD_ATTRS and not key.startswith("_")
    }


def iso_utc_ms(epoch_s: float) -> str:
    """``2026-11-22T12:15:52.123Z``."""
    whole = int(epoch_s)
    millis = int((epoch_s - whole) * 1000)
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(whole)) + f".{millis:03d}Z"


class JsonFormatter(logging.Formatter):
    """One JSON object per record, on one line (newlines inside values are escaped)."""

    def __init__(self, static_fields: Mapping[str, Any] | None = None) -> None:
        super().__init__()
        self._static = dict(static_fields or {})

    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, Any] = {
            "ts": iso_utc_ms(record.created),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        elif record.exc_text:
            line["exception"] = record.exc_text
        if record.stack_info:
            line["stack"] = self.formatStack(record.stack_info)
        line.update(self._static)
        for key, value in extra_fields(record).items():
            line.setdefault(key, value if isinstance(value, _PLAIN_TYPES) else str(value))
        return json.dumps(line, ensure_ascii=False, default=str)


class TextFormatter(logging.Formatter):
    """``ts LEVEL [static] logger: message key=value...`` (then the traceback, if any)."""

    def __init__(self, static_fields: Mapping[str, Any] | None = None) -> None:
        prefix = " ".join(str(v) for v in (static_fields or {}).values())
        middle = f" [{prefix}]" if prefix else ""
        super().__init__(f"%(asctime)s %(levelname)s{middle} %(name)s: %(message)s")

    def formatMessage(self, record: logging.LogRecord) -> str:
        text = super().formatMessage(record)
        fields = extra_fields(record)
        if not fields:
            return text
        # task= rather than task_id=: short, and what the examples use.
        shown = " ".join(
            f"{'task' if key == 'task_id' else key}={value}" for key, value in fields.items()
        )
        return f"{text} {shown}"


def make_formatter(
    log_format: str, static_fields: Mapping[str, Any] | None = None
) -> logging.Formatter:
    if log_format == "json":
        return JsonFormatter(static_fields)
    if log_format == "text":
        return TextFormatter(static_fields)
    raise ValueError(f"unknown log format {log_format!r}: use one of {', '.join(LOG_FORMATS)}")


def setup_logging(
    level: str,
    log_format: str,
    *,
    static_fields: Mapping[str, Any] | None = None,
    stream: TextIO | None = None,
) -> None:
    """Send every logger's records to ``stream`` (stderr) in ``log_format``."""
    handler = logging.StreamHandler(stream if stream is not None else sys.stderr)
    handler.setFormatter(make_formatter(log_format, static_fields))
    logging.basicConfig(level=level.upper(), handlers=[handler], force=True)


def log_format_arg(text: str) -> str:
    """argparse type of ``--log-format`` (also checks the environment's default)."""
    if text not in LOG_FORMATS:
        raise argparse.ArgumentTypeError(
            f"log format must be one of {', '.join(LOG_FORMATS)}, not {text!r}"
        )
    return text


def add_log_format_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--log-format",
        type=log_format_arg,
        default=os.environ.get(LOG_FORMAT_ENV, "text"),
        help="text, or json: one JSON object per line (env STEWARD_LOG_FORMAT; "
        "default %(default)s)",
    )
