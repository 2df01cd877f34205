"""Code retention (docs/DESIGN.md §7), a leader duty: the acting leader deletes artifacts
no task has needed for ``retention_ms`` by logging ``DeleteCode(unused_for_ms=retention_ms)``.

The candidates come from the replicated state (an artifact's ``created_ms`` and
``last_used_ms``, and the live tasks using it); ``apply`` checks the same condition again,
so a task submitted between the check and the entry keeps its artifact. Once applied,
every broker removes the file (``CodeStore.on_applied``) and workers drop it from their
caches. A new leader's loop starts from the state: nothing is lost with a leader.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from functools import partial
from typing import Final

from broker.core import Rejected
from broker.core import entries as e
from broker.replication.node import BrokerUnavailableError, Node, Stamp

__all__ = ["CodeRetention", "retention_interval_s"]

logger = logging.getLogger(__name__)

_MAX_INTERVAL_S: Final = 60.0
_MIN_INTERVAL_S: Final = 0.2


def retention_interval_s(retention_ms: int) -> float:
    """How often to look: a quarter of the retention, between 0.2 s and a minute (an
    artifact outlives its retention by at most this much)."""
    return min(_MAX_INTERVAL_S, max(_MIN_INTERVAL_S, retention_ms / 4000))


class CodeRetention:
    """Run on the acting leader only; ``retention_ms`` 0 keeps artifacts forever."""

    def __init__(self, node: Node, retention_ms: int, *, interval_s: float | None = None) -> None:
        if retention_ms < 0:
            raise ValueError("retention_ms must be >= 0 (0: keep forever)")
        self._node = node
        self._retention_ms = retention_ms
        self._interval_s = interval_s or retention_interval_s(retention_ms)
        self._task: asyncio.Task[None] | None = None
        self.deleted = 0

    async def start(self) -> None:
        if self._retention_ms and self._task is None:
            self._task = asyncio.create_task(self._run(), name="code-retention")

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self._interval_s)
            try:
                await self.sweep()
            except BrokerUnavailableError as exc:
                logger.info("code retention: no longer writable: %s", exc)
            except Exception:
                logger.exception("code retention failed")

    async def sweep(self) -> int:
        """Delete every artifact due now; returns how many were deleted."""
        if not self._node.writable:
            return 0
        retention_ms = self._retention_ms
        deleted = 0
        state, now_ms = self._node.state, self._node.clock_ms()
        for sha256 in state.unneeded_artifacts(retention_ms, now_ms):
            result = await self._node.propose(partial(_delete_entry, sha256, retention_ms))
            if isinstance(result, Rejected):
                logger.info("code retention kept %s: %s", sha256[:12], result.message)
                continue
            deleted += 1
            logger.info(
                "code artifact %s deleted: no task needed it for %.3g h",
                sha256[:12],
                retention_ms / 3_600_000,
            )
        self.deleted += deleted
        return deleted


def _delete_entry(sha256: str, retention_ms: int, stamp: Stamp) -> e.DeleteCode:
    return e.DeleteCode(time_ms=stamp.now_ms, sha256=sha256, unused_for_ms=retention_ms)
