"""The web dashboard every broker serves at ``/``: static files (``index.html``, ``app.js``,
``style.css``, ``icon.svg``; vanilla JS, no build step, nothing fetched from elsewhere) and
the recent task throughput its charts show.

The page holds no data: it reads the JSON API with ``fetch`` (with the API token the user
typed, when one is set), so serving the files needs no authentication.
"""

from __future__ import annotations

import functools
from importlib import resources
from typing import Final

from broker.api import api_models as m
from broker.core import Applied, TaskRef, TaskState
from broker.core import entries as e
from broker.replication.node import Node

# Only these files are served; anything else under /dashboard/ is a 404.
ASSET_TYPES: Final[dict[str, bytes]] = {
    "index.html": b"text/html; charset=utf-8",
    "app.js": b"text/javascript; charset=utf-8",
    "style.css": b"text/css; charset=utf-8",
    "icon.svg": b"image/svg+xml",
}
# The page loads only its own files and talks only to this broker.
SECURITY_HEADERS: Final[tuple[tuple[bytes, bytes], ...]] = (
    (b"cache-control", b"no-cache"),
    (b"x-content-type-options", b"nosniff"),
    (b"x-frame-options", b"DENY"),
    (
        b"content-security-policy",
        b"default-src 'self'; img-src 'self' data:; style-src 'self'; script-src 'self'; "
        b"connect-src 'self'; frame-ancestors 'none'",
    ),
)


@functools.cache
def read_asset(name: str) -> bytes | None:
    """The bytes of one dashboard file (cached), or None when it is not one of them."""
    if name not in ASSET_TYPES:
        return None
    return resources.files(__package__).joinpath(name).read_bytes()


class ThroughputRecorder:
    """Counts of tasks submitted, finished, failed and cancelled per time bucket over the
    last ``buckets * bucket_ms``, kept by every broker from the entries it applies.

    Buckets follow the entries' own (leader-stamped) times, so every broker that applied
    the same entries shows the same counts; entries replayed at boot that are older than
    the window are not counted. Local to the broker: not part of the replicated state.
    """

    KINDS: Final = ("submitted", "finished", "failed", "cancelled")

    def __init__(self, node: Node, *, bucket_ms: int = 5_000, buckets: int = 60) -> None:
        self.node = node
        self.bucket_ms = bucket_ms
        self.buckets = buckets
        # bucket start (epoch ms) -> counts in KINDS order
        self._counts: dict[int, list[int]] = {}
        node.listeners.append(self.on_applied)

    def _window_start_ms(self, now_ms: int) -> int:
        return (now_ms // self.bucket_ms - self.buckets + 1) * self.bucket_ms

    def on_applied(self, entry: e.Entry, applied: Applied) -> None:
        result = applied.result
        became_final = applied.final_ids
        submitted = 0
        # A replayed submission (a ReplayedResults: same idempotency key) created nothing.
        if isinstance(entry, e.SubmitTasks) and type(result) is list:
            submitted = sum(1 for r in result if isinstance(r, TaskRef))
        if not submitted and not became_final:
            return
        start_ms = entry.time_ms // self.bucket_ms * self.bucket_ms
        now_ms = max(self.node.clock_ms(), entry.time_ms)
        if start_ms < self._window_start_ms(now_ms):
            return
        counts = self._counts.get(start_ms)
        if counts is None:
            counts = self._counts[start_ms] = [0, 0, 0, 0]
            self._prune(now_ms)
        counts[0] += submitted
        tasks = self.node.state.tasks
        for task_id in became_final:
            task = tasks.get(task_id)
            if task is None:
                continue
            if task.state == TaskState.FINISHED:
                counts[1] += 1
            elif task.state == TaskState.ERROR:
                counts[2] += 1
            elif task.state == TaskState.CANCELLED:
                counts[3] += 1

    def _prune(self, now_ms: int) -> None:
        oldest = self._window_start_ms(now_ms)
        for start_ms in [s for s in self._counts if s < oldest]:
            del self._counts[start_ms]

    def series(self) -> tuple[int, dict[str, list[int]]]:
        """(end of the newest bucket in epoch ms, counts per kind, oldest bucket first)."""
        now_ms = self.node.clock_ms()
        first = self._window_start_ms(now_ms)
        starts = [first + i * self.bucket_ms for i in range(self.buckets)]
        empty = [0, 0, 0, 0]
        rows = [self._counts.get(s, empty) for s in starts]
        series = {kind: [row[i] for row in rows] for i, kind in enumerate(self.KINDS)}
        return starts[-1] + self.bucket_ms, series


# --- broker statuses --------------------------------------------------------------------------

RUNNING_SHOWN: Final = 50  # running task ids listed per worker


def broker_statuses(
    rows: list[m.BrokerSummary], leader_id: str | None, own_id: str, own_writable: bool
) -> list[m.BrokerStatus]:
    """The dashboard's broker table, from the cluster view's summaries (the rows of
    ``GET /api/v1/cluster``, broker/server/peer_view.py): nothing here asks a peer again."""
    leader = next((row.position for row in rows if row.id == leader_id and row.reachable), None)
    return [
        m.BrokerStatus(
            id=row.id,
            url=row.url,
            role=row.role,
            is_leader=row.is_leader,
            reachable=row.reachable,
            writable=own_writable if row.id == own_id else None,
            position=row.position,
            lag_entries=row.lag_entries,
            behind_ledgers=(
                row.lag_entries is None
                and row.position is not None
                and leader is not None
                and row.position.ledger_id < leader.ledger_id
            ),
            uptime_secs=row.uptime_secs,
            error=row.unknown_reason,
            last_seen_secs_ago=row.last_seen_secs_ago,
            member=row.member,
        )
        for row in rows
    ]
