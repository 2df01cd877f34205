"""Task progress (``ctx.progress(fraction, message)``) kept by the leader, in memory.

Not state: a report never enters the replicated log, so it costs no log append and no
fsync (a task may report many times a second), and it is lost on a failover or restart
until the task reports again (docs/DESIGN.md §6, "Task progress"). Bounded: one entry per
task, the least recently reported dropped past ``max_tasks``; per task at most one
report per ``min_interval_s`` is taken (a worker sends at most one a second; this bounds
one that does not). Not thread safe: the broker's event loop owns it.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final

DEFAULT_MAX_TASKS: Final = 100_000
DEFAULT_MIN_INTERVAL_S: Final = 0.25


@dataclass(frozen=True, slots=True)
class TaskProgress:
    attempt: int
    fraction: float
    message: str
    updated_ms: int  # the leader's wall clock when it took the report


class ProgressStore:
    def __init__(
        self,
        max_tasks: int = DEFAULT_MAX_TASKS,
        min_interval_s: float = DEFAULT_MIN_INTERVAL_S,
        clock: Callable[[], float] = time.monotonic,
        wall_ms: Callable[[], int] = lambda: time.time_ns() // 1_000_000,
    ) -> None:
        if max_tasks < 1 or min_interval_s < 0:
            raise ValueError("progress bounds must be positive")
        self.max_tasks = max_tasks
        self.min_interval_s = min_interval_s
        self._clock = clock
        self._wall_ms = wall_ms
        self._kept: OrderedDict[int, tuple[TaskProgress, float]] = OrderedDict()
        self.refused = 0  # reports dropped by the rate limit (for tests and debugging)

    def __len__(self) -> int:
        return len(self._kept)

    def put(self, task_id: int, attempt: int, fraction: float, message: str) -> bool:
        """Take a report; False when the task's rate limit or an older attempt drops it."""
        now = self._clock()
        kept = self._kept.get(task_id)
        if kept is not None:
            previous, taken_at = kept
            # A newer attempt's first report always counts; an older attempt's never does.
            if attempt < previous.attempt or (
                attempt == previous.attempt and now - taken_at < self.min_interval_s
            ):
                self.refused += 1
                return False
        self._kept[task_id] = (TaskProgress(attempt, fraction, message, self._wall_ms()), now)
        self._kept.move_to_end(task_id)
        while len(self._kept) > self.max_tasks:
            self._kept.popitem(last=False)
        return True

    def get(self, task_id: int) -> TaskProgress | None:
        kept = self._kept.get(task_id)
        return kept[0] if kept is not None else None

    def forget(self, task_id: int) -> None:
        self._kept.pop(task_id, None)
