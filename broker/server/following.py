"""A cluster broker's follower side (docs/DESIGN.md §4): tail the log while another broker
leads; a history gap (the ledgers after our snapshot were deleted) downloads a snapshot
from a peer, then follows again.

A broker that needs a snapshot and finds no source (no peer has a usable one, nothing new in
its own snapshots directory) for ``snapshot_source_wait_s`` gives up: ``fatal`` holds one
message naming what it tried, and the broker exits non-zero (Storm's rule: such a boot
fails rather than retrying forever). So does a log entry of a newer release."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl
import time
from collections.abc import Callable

from broker.replication.common import NewerFormatError
from broker.replication.node import HistoryGapError, Node

logger = logging.getLogger("broker.server.cluster")

#: Pause before retrying a failed step (following, a role change).
RETRY_DELAY_S = 0.5
#: Default of ``--snapshot-source-wait-s``: long enough for a peer to restart.
DEFAULT_SNAPSHOT_SOURCE_WAIT_S = 300.0


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
        snapshot_source_wait_s: float = DEFAULT_SNAPSHOT_SOURCE_WAIT_S,
    ) -> None:
        self._node = node
        self._peer_urls = peer_urls
        self._peer_ssl = peer_ssl
        self._peer_timeout_s = peer_timeout_s
        self._cluster_token = cluster_token
        self._on_end = on_end
        self._source_wait_s = snapshot_source_wait_s
        self._task: asyncio.Task[None] | None = None
        # Since when (monotonic) a snapshot is needed and none was found; the peers asked.
        self._needed_since: float | None = None
        self._peers_asked: dict[str, None] = {}
        self.fatal: str | None = None  # why this broker gave up (it follows no more)
        self.gave_up = asyncio.Event()  # set with ``fatal``: the broker exits non-zero

    async def ensure(self) -> None:
        """Follow unless already following; first handle how the last run ended."""
        task = self._task
        if self.fatal is not None or (task is not None and not task.done()):
            return
        if task is not None:
            self._task = None
            failure = None if task.cancelled() else task.exception()
            if isinstance(failure, NewerFormatError):
                self.give_up(str(failure))
                return
            if isinstance(failure, HistoryGapError):
                await self.find_snapshot(failure)
                if self.fatal is not None:
                    return
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

    def give_up(self, reason: str) -> None:
        """Stop following for good: the broker exits non-zero with ``reason``."""
        if self.fatal is None:
            self.fatal = reason
            logger.error("%s", reason)
        self.gave_up.set()

    async def find_snapshot(self, gap: HistoryGapError) -> None:
        """A newer snapshot from the snapshots directory (an operator may have put one there)
        or a peer; give up once none was found for the configured wait (counted from the
        first of the searches in a row that found nothing, whether following or elected)."""
        why = str(gap)
        if self._needed_since is None:
            self._needed_since = time.monotonic()
            self._peers_asked.clear()
        node = self._node
        try:
            # The local directory first: an operator may have restored a file into it.
            if await node.load_snapshot() or await self._download_snapshot(gap):
                self._needed_since = None
                return
        except NewerFormatError as exc:  # a peer's snapshot of a newer release
            self.give_up(str(exc))
            return
        if time.monotonic() - self._needed_since >= self._source_wait_s:
            asked = ", ".join(self._peers_asked) or "none (no other broker advertised itself)"
            self.give_up(
                f"{why}. No snapshot source for {self._source_wait_s:g} s "
                f"(--snapshot-source-wait-s): peers asked: {asked}; local snapshots in "
                f"{node.snapshots.directory}: none usable at or after position "
                f"{node.position}. Start a broker that has a newer snapshot, or copy a "
                f"snapshot file of cluster {node.config.cluster_id!r} into that directory, "
                "then start this broker again"
            )
            return
        await asyncio.sleep(RETRY_DELAY_S * 4)

    async def _download_snapshot(self, gap: HistoryGapError) -> bool:
        from snapshot.peer import download_latest_snapshot

        node = self._node
        peers = self._peer_urls()
        self._peers_asked.update(dict.fromkeys(peers))
        logger.warning("%s; downloading a snapshot from %s", gap, peers)
        # Past the gap: a peer whose snapshot is as old as this state (a follower stuck at
        # the same gap) would be installed and change nothing, again and again.
        needed = max(node.position, gap.needed_position or node.position)
        info = await download_latest_snapshot(
            peers,
            node.snapshots,
            ssl_context=self._peer_ssl,
            cluster_id=node.config.cluster_id,
            timeout_s=self._peer_timeout_s,
            min_position=needed,
            token=self._cluster_token,
        )
        if info is None:
            logger.error("no peer had a usable snapshot; retrying")
            return False
        return await node.load_snapshot()
