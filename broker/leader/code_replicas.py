"""The code replica monitor, a leader duty (docs/DESIGN.md §7).

Uploads to a cluster with ``min_code_replicas`` > 1 are logged not ready
(``AddCode(ready=False)``), and tasks using such an artifact wait outside the scheduler's
queues. Every broker's :class:`~broker.ha.code_replication.CodeReplicator` fetches the
artifact and registers its copy as an ephemeral znode under
``/steward/<cluster>/code/<sha256>/``; this monitor, on the acting leader only, watches
those children for every not-ready artifact and proposes ``CodeReady`` as soon as there
are ``min_code_replicas`` of them, or once ``max_replication_wait_ms`` has passed since the
``AddCode`` (the artifact's ``created_ms``, the replicated clock, so a new leader keeps the
same deadline; -1: never, only the replicas make it ready).

Started when a term opens for writes and stopped at step-down (:mod:`broker.leader`); a
new leader's monitor picks up every artifact still not ready from the state. kazoo's
watch and state callbacks only hand work to the loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any, Final

from kazoo.exceptions import KazooException  # type: ignore[import-untyped]
from kazoo.protocol.states import KazooState  # type: ignore[import-untyped]

from broker.core import Applied, Artifact, Rejected
from broker.core import entries as e
from broker.ha.code_replication import (
    DEFAULT_OPERATION_TIMEOUT_S,
    WAIT_FOREVER,
    call_on_loop,
    code_dir,
)
from broker.replication.node import BrokerUnavailableError, Node
from log.zk_list import KazooTimeoutError, kazoo_result

__all__ = ["CodeReplicaMonitor"]

logger = logging.getLogger(__name__)

ZK_ERRORS: Final = (KazooException, KazooTimeoutError)


class CodeReplicaMonitor:
    """On the acting leader: readies not-ready artifacts once replicated (or waited out).

    Start it when this broker becomes the acting leader and stop it when that ends; a
    new leader's monitor picks up every artifact still not ready from the state.
    """

    def __init__(
        self,
        node: Node,
        zk_client: Any,
        cluster: str,
        min_code_replicas: int,
        max_replication_wait_ms: int,
        *,
        operation_timeout_s: float = DEFAULT_OPERATION_TIMEOUT_S,
        retry_interval_s: float = 1.0,
    ) -> None:
        if min_code_replicas < 1:
            raise ValueError("min_code_replicas must be >= 1")
        if max_replication_wait_ms < WAIT_FOREVER:
            raise ValueError("max_replication_wait_ms must be >= 0, or -1 (wait forever)")
        self._node = node
        self._zk = zk_client
        self._dir = code_dir(cluster)
        self._min_code_replicas = min_code_replicas
        self._max_wait_ms = max_replication_wait_ms
        self._timeout_s = operation_timeout_s
        self._retry_interval_s = retry_interval_s
        self._loop: asyncio.AbstractEventLoop | None = None
        self._worker: asyncio.Task[None] | None = None
        self._dirty: set[str] = set()
        self._kick = asyncio.Event()
        self._deadlines: dict[str, asyncio.TimerHandle | None] = {}
        self._started = False
        self._stopping = False

    async def start(self) -> None:
        if self._started:
            raise RuntimeError("CodeReplicaMonitor already started")
        self._started = True
        self._loop = asyncio.get_running_loop()
        self._node.listeners.append(self._on_applied)
        self._zk.add_listener(self._on_kazoo_state)
        self._worker = self._loop.create_task(self._run(), name="code-replication-monitor")
        for artifact in list(self._node.state.artifacts.values()):
            if not artifact.ready:
                self._track(artifact)

    async def stop(self) -> None:
        if not self._started or self._stopping:
            return
        self._stopping = True
        with contextlib.suppress(ValueError):
            self._node.listeners.remove(self._on_applied)
        self._zk.remove_listener(self._on_kazoo_state)
        for handle in self._deadlines.values():
            if handle is not None:
                handle.cancel()
        self._deadlines.clear()
        if self._worker is not None:
            self._worker.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._worker

    # -- events (all on the loop) -----------------------------------------------------------

    def _on_applied(self, entry: e.Entry, applied: Applied) -> None:
        result = applied.result
        if isinstance(entry, e.AddCode) and isinstance(result, Artifact) and not result.ready:
            self._track(result)
        elif isinstance(entry, e.CodeReady | e.AddCode) and isinstance(result, Artifact):
            self._forget(result.sha256)

    def _track(self, artifact: Artifact) -> None:
        sha256 = artifact.sha256
        if self._loop is None or self._stopping:
            return
        if sha256 not in self._deadlines:
            due_ms = artifact.created_ms + self._max_wait_ms
            delay_s = max(0.0, (due_ms - self._node.clock_ms()) / 1000)
            # Waiting forever: no timer, only replica watches mark it (None: tracked).
            self._deadlines[sha256] = (
                None
                if self._max_wait_ms == WAIT_FOREVER
                else self._loop.call_later(delay_s, self._mark, sha256)
            )
        self._mark(sha256)

    def _forget(self, sha256: str) -> None:
        handle = self._deadlines.pop(sha256, None)
        if handle is not None:
            handle.cancel()
        self._dirty.discard(sha256)

    def _mark(self, sha256: str) -> None:
        if sha256 in self._deadlines:
            self._dirty.add(sha256)
            self._kick.set()

    def _mark_all(self) -> None:
        for sha256 in self._deadlines:
            self._dirty.add(sha256)
        self._kick.set()

    def _on_children(self, event: Any) -> None:
        # A kazoo watch (its thread). Path None: the connection dropped; the CONNECTED
        # state change re-reads everything (and so re-arms the watches).
        path = getattr(event, "path", None)
        if path:
            sha256 = path.rsplit("/", 1)[-1]
            call_on_loop(self._loop, lambda: self._mark(sha256))

    def _on_kazoo_state(self, state: Any) -> None:
        if state == KazooState.CONNECTED:
            call_on_loop(self._loop, self._mark_all)

    # -- the worker ---------------------------------------------------------------------------

    async def _run(self) -> None:
        while True:
            await self._kick.wait()
            self._kick.clear()
            while self._dirty:
                sha256 = min(self._dirty)
                self._dirty.discard(sha256)
                try:
                    done = await self._check(sha256)
                except (*ZK_ERRORS, BrokerUnavailableError) as exc:
                    logger.info("code artifact %s: readiness check failed: %r", sha256, exc)
                    self._retry_later(sha256)
                    continue
                except Exception:
                    logger.exception("code artifact %s: readiness check failed", sha256)
                    self._retry_later(sha256)
                    continue
                if done:
                    self._forget(sha256)

    def _retry_later(self, sha256: str) -> None:
        assert self._loop is not None
        self._loop.call_later(self._retry_interval_s, self._mark, sha256)

    async def _check(self, sha256: str) -> bool:
        """Propose CodeReady when due; True when nothing more is to be done for it."""
        artifact = self._node.state.artifacts.get(sha256)
        if artifact is None or artifact.ready:
            return True
        waited_out = (
            self._max_wait_ms != WAIT_FOREVER
            and self._node.clock_ms() >= artifact.created_ms + self._max_wait_ms
        )
        count = 0
        if not waited_out:
            count = await self._replicas(sha256)
            if count < self._min_code_replicas:
                if self._max_wait_ms == WAIT_FOREVER:
                    return False  # the replica watch marks it again
                # The watch marks it again when a replica comes; and the wait's end is
                # checked again (the deadline timer runs on the loop's clock, which may
                # fire a little before the wall clock says the wait is over).
                remaining_s = (
                    artifact.created_ms + self._max_wait_ms - self._node.clock_ms()
                ) / 1000
                assert self._loop is not None
                self._loop.call_later(max(0.01, remaining_s + 0.005), self._mark, sha256)
                return False
        result = await self._node.propose(
            lambda stamp: e.CodeReady(time_ms=stamp.now_ms, sha256=sha256)
        )
        if isinstance(result, Rejected):
            logger.warning("code artifact %s: CodeReady rejected: %s", sha256, result.message)
        elif waited_out:
            logger.warning(
                "code artifact %s ready without %d replicas: max_replication_wait of %d ms passed",
                sha256,
                self._min_code_replicas,
                self._max_wait_ms,
            )
        else:
            logger.info("code artifact %s ready with %d replicas", sha256, count)
        return True

    async def _replicas(self, sha256: str) -> int:
        """Replica count, leaving a watch on the artifact's children."""
        path = f"{self._dir}/{sha256}"
        # The parent is persistent; create it so the children watch can be set even
        # before the first replica (the leader's own) is registered.
        await kazoo_result(self._zk.ensure_path_async(path), self._timeout_s)
        children = await kazoo_result(
            self._zk.get_children_async(path, self._on_children), self._timeout_s
        )
        return len(children)
