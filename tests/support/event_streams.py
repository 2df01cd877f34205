"""Reading server-sent event streams in tests (GET /api/v1/events)."""

from __future__ import annotations

import json
from typing import Any

EVENTS = "/api/v1/events"


def parse_events(text: str) -> list[dict[str, Any]]:
    """The events of a server-sent event stream: {"event", "id"?, "data"} each, and the
    comment lines as {"comment": ...}."""
    events: list[dict[str, Any]] = []
    for block in text.split("\n\n"):
        if not block:
            continue
        event: dict[str, Any] = {}
        for line in block.split("\n"):
            name, _, value = line.partition(": ")
            if name == "":
                event["comment"] = value
            else:
                event[name] = json.loads(value) if name == "data" else value
        events.append(event)
    return events
