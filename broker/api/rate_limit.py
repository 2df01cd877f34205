"""The per-tenant submit rate limit, enforced by the leader before it logs a submission
(docs/DESIGN.md §6, "Submit rate limit").

A token bucket per tenant: ``submit_rate`` tokens a second up to ``submit_burst`` (0: one
second's worth, at least 1); a submission of n tasks takes n tokens or is refused whole
with the time until it would fit. The buckets live in the leader's memory only: a new
leader starts them full, so a failover may let one extra burst through (the limit is a
guard against floods, not an accounting).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable


class SubmitRateLimiter:
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._buckets: dict[str, tuple[float, float]] = {}  # tenant -> (tokens, at)

    @staticmethod
    def capacity(rate: float, burst: int) -> float:
        return float(burst) if burst > 0 else max(1.0, math.ceil(rate))

    def take(self, tenant: str, rate: float, burst: int, count: int) -> float | None:
        """Take ``count`` tokens of ``tenant``'s bucket: None when taken, else the seconds
        until they would be there (``math.inf`` when ``count`` exceeds the burst)."""
        if rate <= 0:
            self._buckets.pop(tenant, None)
            return None
        capacity = self.capacity(rate, burst)
        now = self._clock()
        tokens, at = self._buckets.get(tenant, (capacity, now))
        tokens = min(capacity, tokens + (now - at) * rate)
        if count > capacity:
            self._buckets[tenant] = (tokens, now)
            return math.inf
        if tokens >= count:
            self._buckets[tenant] = (tokens - count, now)
            return None
        self._buckets[tenant] = (tokens, now)
        return (count - tokens) / rate
