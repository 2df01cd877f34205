"""A cluster broker's follower side (docs/DESIGN.md §4): tail the log while another broker
leads; a history gap (the ledgers after our snapshot were deleted) downloads a snapshot
from a peer, then follows again."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl
from collections.abc import Callable

from broker.replication.node import HistoryGapError, Node

logger = logging.getLogger("broker.server.cluster")

#: Pause before retrying a failed step (following, a role change).
RETRY_DELAY_S = 0.5


class LogFollower:
    """One task running ``Node.follow`` while the broker follows; ``on_end`` is called when
    it ends (however it ends), so the role manager looks again."""

    def __init__(
        self,
        node: Node,
        *,
        peer_urls: Callable[[], list[str]],
        peer_ssl: ssl.SSLContext | None,
        peer_timeout_s: float,
        cluster_token: str | None,
        on_end: Callable[[], None],
    ) -> None:
        self._node = node
        self._peer_urls = peer_urls
        self._peer_ssl = peer_ssl
        self._peer_timeout_s = peer_timeout_s
        self._cluster_token = cluster_token
        self._on_end = on_end
        self._task: asyncio.Task[None] | None = None

    async def ensure(self) -> None:
        """Follow unless already following; first handle how the last run ended."""
        task = self._task
        if task is not None and not task.done():
            return
        if task is not None:
            self._task = None
            failure = None if task.cancelled() else task.exception()
            if isinstance(failure, HistoryGapError):
                await self._download_snapshot(str(failure))
            elif failure is not None:
                logger.warning("following the log failed (%s); retrying", failure)
                await asyncio.sleep(RETRY_DELAY_S)
        self._task = asyncio.create_task(self._follow(), name="steward-follow")

    async def _follow(self) -> None:
        try:
            await self._node.follow()
        finally:
            self._on_end()

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task

    async def _download_snapshot(self, why: str) -> None:
        from snapshot.peer import download_latest_snapshot

        node = self._node
        peers = self._peer_urls()
        logger.warning("%s; downloading a snapshot from %s", why, peers)
        info = await download_latest_snapshot(
            peers,
            node.snapshots,
            ssl_context=self._peer_ssl,
            cluster_id=node.config.cluster_id,
            timeout_s=self._peer_timeout_s,
            min_position=node.position,
            token=self._cluster_token,
        )
        if info is None:
            logger.error("no peer had a usable snapshot; retrying")
            await asyncio.sleep(RETRY_DELAY_S * 4)
            return
        await node.load_snapshot()
