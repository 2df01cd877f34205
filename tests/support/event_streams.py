"""Reading server-sent event streams in tests (GET /api/v1/events)."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable, Iterable
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


# A feed stream (GET /api/v1/events without tasks=) starts "from now": a reader that
# opened late misses what finished before. Nothing tells a client when the broker holds
# its stream, so a probe's event proves it: a quick task whose completion it saw.
PROBE_EVERY_S = 1.0


def open_feed(
    submit_probe: Callable[[], int],
    seen: Callable[[], Iterable[int]],
    timeout_s: float = 30.0,
) -> list[int]:
    """Wait (bounded) until a feed reader's stream is open: submit a probe task every
    :data:`PROBE_EVERY_S` until the reader saw one's event. The probes' ids (the last
    one seen; earlier ones may have finished before the stream opened)."""
    probes: list[int] = []
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        probes.append(submit_probe())
        until = min(deadline, time.monotonic() + PROBE_EVERY_S)
        while time.monotonic() < until:
            if probes[-1] in set(seen()):
                return probes
            time.sleep(0.05)
    raise AssertionError(f"the feed reader saw none of the probes {probes} in {timeout_s} s")


async def open_feed_async(
    submit_probe: Callable[[], Awaitable[int]],
    seen: Callable[[], Iterable[int]],
    timeout_s: float = 30.0,
) -> list[int]:
    """:func:`open_feed` for an asyncio reader."""
    probes: list[int] = []
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while loop.time() < deadline:
        probes.append(await submit_probe())
        until = min(deadline, loop.time() + PROBE_EVERY_S)
        while loop.time() < until:
            if probes[-1] in set(seen()):
                return probes
            await asyncio.sleep(0.05)
    raise AssertionError(f"the feed reader saw none of the probes {probes} in {timeout_s} s")
