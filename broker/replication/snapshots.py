"""Local snapshots of the node's state (docs/DESIGN.md §5): load the newest at boot (installed
through the applier), take one periodically (every role) and at a clean stop; after one, the
node's ``after_take`` runs (the leader applies retention)."""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Awaitable, Callable

from broker.core import StateMachine
from broker.core.snapshot_body import SnapshotBodyVersionError
from broker.replication.common import NewerFormatError, logger
from broker.replication.context import RoleContext
from snapshot.format import NewerSnapshotVersionError


def _decode(body: bytes) -> StateMachine:
    try:
        return StateMachine.from_snapshot(body)
    except SnapshotBodyVersionError as exc:
        if exc.newer:
            # The store names the file when it re-raises this.
            raise NewerSnapshotVersionError("", str(exc)) from exc
        raise


class Snapshots:
    def __init__(self, context: RoleContext, after_take: Callable[[], Awaitable[None]]) -> None:
        self._context = context
        self._after_take = after_take  # run under the lock once a snapshot is written
        self.entries_at_snapshot = 0
        self.snapshot_position: tuple[int, int] = (-1, -1)  # of the last snapshot loaded or taken
        self._lock = asyncio.Lock()

    async def load(self) -> bool:
        """Replace the state with the newest usable local snapshot (False: none)."""
        context = self._context
        store = context.snapshots
        applier = context.applier
        # A snapshot whose verified body this build cannot decode is skipped too; one of a
        # newer release stops the broker (docs/OPERATIONS.md, "Rolling upgrade").
        try:
            loaded = await asyncio.to_thread(store.load_newest_decoded, _decode, refuse_newer=True)
        except NewerSnapshotVersionError as exc:
            raise NewerFormatError(
                f"{exc}; or move that file out of {store.directory} to start from "
                "an older snapshot and the log (if the log still holds what follows it)"
            ) from None
        if loaded is None:
            return False
        header, state = loaded
        position = (header.ledger_id, header.entry_id)
        if position <= applier.position:
            return False  # not newer than what we have
        applier.install(state, position)
        self.snapshot_position = position
        self.entries_at_snapshot = state.entries_applied
        logger.info("loaded snapshot at position %s", position)
        return True

    async def loop(self) -> None:
        context = self._context
        while True:
            await asyncio.sleep(context.config.snapshot_interval_s)
            new_entries = context.applier.state.entries_applied - self.entries_at_snapshot
            if new_entries >= context.config.snapshot_min_entries:
                try:
                    await self.take()
                except Exception:
                    logger.exception("periodic snapshot failed")

    async def take(self) -> None:
        context = self._context
        clock = context.clock
        async with self._lock:
            # Encoding runs on the loop so the state cannot change under it; the
            # compression, hashing and fsync run in a thread.
            started = clock.monotonic_s()
            state = context.applier.state
            body = state.encode_snapshot()
            ledger_id, entry_id = context.applier.position
            entries_applied = state.entries_applied
            created_ms = clock.now_ms()

            def write() -> int | None:
                info = context.snapshots.write(
                    cluster_id=context.config.cluster_id,
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
            metrics = context.metrics
            metrics.snapshot_duration.observe(clock.monotonic_s() - started)
            metrics.snapshot_body.set(len(body))
            if size_bytes is not None:
                metrics.snapshot_size.set(size_bytes)
            self.entries_at_snapshot = entries_applied
            self.snapshot_position = (ledger_id, entry_id)
            context.stats.snapshots_taken += 1
            context.stats.last_snapshot_ms = clock.now_ms()
            await self._after_take()
