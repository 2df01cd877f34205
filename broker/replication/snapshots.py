"""Local snapshots of the node's state (docs/DESIGN.md §5): load the newest at boot, take
one periodically (every role) and at a clean stop; after one, the leader applies retention."""

from __future__ import annotations

import asyncio
import hashlib
from typing import TYPE_CHECKING

from broker.core import StateMachine
from broker.core.snapshot_body import SnapshotBodyVersionError
from broker.replication.common import NewerFormatError, logger
from snapshot.format import NewerSnapshotVersionError

if TYPE_CHECKING:
    from broker.replication.node import Node


def _decode(body: bytes) -> StateMachine:
    try:
        return StateMachine.from_snapshot(body)
    except SnapshotBodyVersionError as exc:
        if exc.newer:
            # The store names the file when it re-raises this.
            raise NewerSnapshotVersionError("", str(exc)) from exc
        raise


class Snapshots:
    def __init__(self, node: Node) -> None:
        self._node = node
        self.entries_at_snapshot = 0
        self.position: tuple[int, int] = (-1, -1)  # of the last snapshot loaded or taken
        self._lock = asyncio.Lock()

    async def load(self) -> bool:
        """Replace the state with the newest usable local snapshot (False: none)."""
        node = self._node
        # A snapshot whose verified body this build cannot decode is skipped too; one of a
        # newer release stops the broker (docs/OPERATIONS.md, "Rolling upgrade").
        try:
            loaded = await asyncio.to_thread(
                node.snapshots.load_newest_decoded, _decode, refuse_newer=True
            )
        except NewerSnapshotVersionError as exc:
            raise NewerFormatError(
                f"{exc}; or move that file out of {node.snapshots.directory} to start from "
                "an older snapshot and the log (if the log still holds what follows it)"
            ) from None
        if loaded is None:
            return False
        header, state = loaded
        if (header.ledger_id, header.entry_id) <= node.position:
            return False  # not newer than what we have
        node.state = state
        node.position = (header.ledger_id, header.entry_id)
        self.position = node.position
        self.entries_at_snapshot = node.state.entries_applied
        logger.info("loaded snapshot at position %s", node.position)
        return True

    async def loop(self) -> None:
        node = self._node
        while True:
            await asyncio.sleep(node.config.snapshot_interval_s)
            new_entries = node.state.entries_applied - self.entries_at_snapshot
            if new_entries >= node.config.snapshot_min_entries:
                try:
                    await self.take()
                except Exception:
                    logger.exception("periodic snapshot failed")

    async def take(self) -> None:
        node = self._node
        async with self._lock:
            # Encoding runs on the loop so the state cannot change under it; the
            # compression, hashing and fsync run in a thread.
            started = node.clock.monotonic_s()
            body = node.state.encode_snapshot()
            ledger_id, entry_id = node.position
            entries_applied = node.state.entries_applied
            created_ms = node.clock.now_ms()

            def write() -> int | None:
                info = node.snapshots.write(
                    cluster_id=node.config.cluster_id,
                    ledger_id=ledger_id,
                    entry_id=entry_id,
                    created_ms=created_ms,
                    digest=hashlib.sha256(body).hexdigest(),
                    body=body,
                )
                try:
                    return info.path.stat().st_size
                except FileNotFoundError:
                    return None  # pruned at once (older than the kept ones)

            size_bytes = await asyncio.to_thread(write)
            node.metrics.snapshot_duration.observe(node.clock.monotonic_s() - started)
            node.metrics.snapshot_body.set(len(body))
            if size_bytes is not None:
                node.metrics.snapshot_size.set(size_bytes)
            self.entries_at_snapshot = entries_applied
            self.position = (ledger_id, entry_id)
            node.stats.snapshots_taken += 1
            node.stats.last_snapshot_ms = node.clock.now_ms()
            leader = node.leader
            if leader is not None and not node.closing and node.writable:
                await leader.retain_after_snapshot()
