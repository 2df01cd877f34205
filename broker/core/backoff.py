"""Retry backoff and priority bounds (docs/DESIGN.md §6, "Priorities and backoff").

Pure: the jitter comes from the task id and the attempt number, never a random source,
so every replica computes the same due time for a retry.
"""

from __future__ import annotations

from typing import Final

#: Bounds of TaskSpec.priority (checked at submit and by apply).
MAX_PRIORITY: Final = 1_000_000
#: Upper bound of retry_backoff_ms and retry_backoff_max_ms: one week.
MAX_BACKOFF_MS: Final = 7 * 24 * 3600 * 1000

_MASK64: Final = (1 << 64) - 1


def _mix(value: int) -> int:
    """splitmix64: a well spread 64-bit value of ``value`` (never Python's hash)."""
    z = (value + 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def retry_delay_ms(task_id: int, retry: int, base_ms: int, cap_ms: int) -> int:
    """The delay before retry ``retry`` (1 for the first): ``base_ms * 2^(retry-1)`` capped
    by ``cap_ms``, times a factor in [0.75, 1.25] chosen from (task id, retry). Integer
    arithmetic only, so the result is the same on every platform."""
    if base_ms <= 0 or retry < 1:
        return 0
    # Shifting past 2^40 only makes a value that the cap (<= one week) cuts anyway.
    delay = min(base_ms << min(retry - 1, 40), max(cap_ms, 0))
    permille = 750 + _mix((task_id << 20) ^ retry) % 501  # 750..1250
    return delay * permille // 1000


def validate_scheduling(priority: int, backoff_ms: int, backoff_max_ms: int) -> str | None:
    """Why these scheduling fields of a task are invalid, or None."""
    if not -MAX_PRIORITY <= priority <= MAX_PRIORITY:
        return f"priority must be between {-MAX_PRIORITY} and {MAX_PRIORITY}"
    if not 0 <= backoff_ms <= MAX_BACKOFF_MS:
        return f"retry_backoff_s must be between 0 and {MAX_BACKOFF_MS // 1000}"
    if not 0 <= backoff_max_ms <= MAX_BACKOFF_MS:
        return f"retry_backoff_max_s must be between 0 and {MAX_BACKOFF_MS // 1000}"
    return None
