"""The replication core's one clock (docs/DESIGN.md §2): every time read goes through it."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable


def wall_clock_ms() -> int:
    return int(time.time() * 1000)


class NodeClock:
    """Wall time from the injected ``now_ms`` (entries' time, ledger ages, snapshot stamps,
    follower lag, uptime); intervals (append latency, idle detection, list polls, snapshot
    duration) from the event loop's monotonic clock, the one ``asyncio.sleep`` runs on."""

    __slots__ = ("now_ms",)

    def __init__(self, now_ms: Callable[[], int] = wall_clock_ms) -> None:
        self.now_ms = now_ms

    @staticmethod
    def monotonic_s() -> float:
        return asyncio.get_running_loop().time()
