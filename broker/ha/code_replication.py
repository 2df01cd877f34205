"""Code artifact replication between brokers (docs/DESIGN.md §7, Storm's code distributor).

The leader stores an upload, then logs ``AddCode``; with ``min_code_replicas`` > 1 it logs
it with ``ready=False``, and tasks that use the artifact stay waiting, outside the
scheduler's queues, until a ``CodeReady`` entry (broker/core/state.py). Two parts make that
happen, both on the broker's event loop:

- :class:`CodeReplicator`, on every broker: when an applied ``AddCode`` names an
  artifact missing here (or whose stored copy no longer hashes to its name, checked once
  per process), fetches it at once from peers (``GET <peer>/api/v1/code/<sha>``),
  checks its sha256, stores it, and registers the replica in ZooKeeper as the ephemeral
  znode ``/steward/<cluster>/code/<sha256>/<broker_id>``. A periodic sync (every
  ``sync_interval_s``) is only the safety net for missed entries and failed fetches.
  Replicas are registered again after the ZooKeeper session is lost (its ephemerals
  vanish with it).
- :class:`~broker.leader.code_replicas.CodeReplicaMonitor`, a leader duty: watches the
  replica znodes this module's replicators register and readies an artifact once there
  are ``min_code_replicas`` of them (or its wait is over).

Wiring in a cluster broker (the caller owns the started ``KazooClient``)::

    replicator = CodeReplicator(
        code_store, zk, cluster, broker_id,
        peer_urls=lambda: [url of every other live broker],
        known_artifacts=lambda: node.state.artifacts.keys(),
    )
    node.listeners.append(replicator.on_applied)   # leader and followers alike
    await replicator.start()
    ...
    # docs/DESIGN.md §4 step 3, before acting as leader:
    still_missing = await replicator.fetch_missing(codes of non-final tasks, timeout_s)
    ...
    await replicator.stop()

and the HTTP API with ``ApiConfig(min_code_replicas=m)`` so uploads are logged not ready.

kazoo calls go through its async API with a timeout (``log.zk_list.kazoo_result``);
kazoo's watch and state callbacks only hand work to the loop (``call_soon_threadsafe``).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import os
import ssl
from collections.abc import Callable, Iterable
from typing import Any, Final

import httpx
from kazoo.exceptions import (  # type: ignore[import-untyped]
    KazooException,
    NodeExistsError,
    NoNodeError,
    NotEmptyError,
)
from kazoo.protocol.states import KazooState  # type: ignore[import-untyped]

from broker.artifacts.code_store import SHA256_RE, CodeStore, code_deleted
from broker.core import Applied, Artifact
from broker.core import entries as e
from broker.security.auth import bearer_headers
from log.zk_list import KazooTimeoutError, cluster_path, kazoo_result

__all__ = [
    "DEFAULT_OPERATION_TIMEOUT_S",
    "WAIT_FOREVER",
    "CodeReplicator",
    "call_on_loop",
    "code_dir",
    "replica_path",
]

logger = logging.getLogger(__name__)

DEFAULT_OPERATION_TIMEOUT_S: Final = 5.0
#: ``max_replication_wait_ms`` that never gives up: tasks wait for ``min_code_replicas`` copies.
WAIT_FOREVER: Final = -1
DEFAULT_FETCH_TIMEOUT_S: Final = 60.0
#: Uploads are capped at 64 MiB (ApiConfig.max_code_bytes); refuse a peer sending more.
DEFAULT_MAX_ARTIFACT_BYTES: Final = 256 * 1024 * 1024
# A fetch whose peers all failed is retried this often (delays double from the first);
# after that the periodic sync takes over.
_FETCH_ATTEMPTS: Final = 5
_FIRST_RETRY_DELAY_S: Final = 0.1
_ZK_ERRORS: Final = (KazooException, KazooTimeoutError)


def code_dir(cluster: str) -> str:
    """``/steward/<cluster>/code``: one persistent child per artifact."""
    return f"{cluster_path(cluster)}/code"


def replica_path(cluster: str, sha256: str, broker_id: str) -> str:
    """The ephemeral znode saying ``broker_id`` holds artifact ``sha256``."""
    return f"{code_dir(cluster)}/{sha256}/{broker_id}"


def call_on_loop(loop: asyncio.AbstractEventLoop | None, func: Callable[..., None]) -> None:
    """From a kazoo thread: hand ``func`` to the loop; never block, never raise."""
    if loop is None or loop.is_closed():
        return
    with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
        loop.call_soon_threadsafe(func)


class CodeReplicator:
    """Keeps this broker's code store complete and its replicas registered in ZooKeeper.

    ``peer_urls`` returns the base URLs of the other brokers (not this one), tried in
    order; ``known_artifacts`` (optional) returns every sha256 the state knows, which the
    periodic sync fetches when missing. ``zk_client`` is a started ``KazooClient`` owned
    by the caller (neither started nor stopped here).
    """

    def __init__(
        self,
        code_store: CodeStore,
        zk_client: Any,
        cluster: str,
        broker_id: str,
        peer_urls: Callable[[], list[str]],
        *,
        sync_interval_s: float = 30.0,
        known_artifacts: Callable[[], Iterable[str]] | None = None,
        ssl_context: ssl.SSLContext | None = None,
        operation_timeout_s: float = DEFAULT_OPERATION_TIMEOUT_S,
        fetch_timeout_s: float = DEFAULT_FETCH_TIMEOUT_S,
        max_artifact_bytes: int = DEFAULT_MAX_ARTIFACT_BYTES,
        peer_token: str | None = None,
    ) -> None:
        if not broker_id or "/" in broker_id or broker_id in (".", ".."):
            raise ValueError(f"broker_id {broker_id!r} cannot name a znode")
        if sync_interval_s <= 0:
            raise ValueError("sync_interval_s must be positive")
        self._store = code_store
        self._zk = zk_client
        self._dir = code_dir(cluster)
        self._broker_id = broker_id
        self._peer_urls = peer_urls
        self._known = known_artifacts
        # Verifies https:// peers (None: httpx's default, certifi).
        self._ssl_context = ssl_context
        self._sync_interval_s = sync_interval_s
        self._timeout_s = operation_timeout_s
        self._fetch_timeout_s = fetch_timeout_s
        self._max_bytes = max_artifact_bytes
        # Sent to peers (brokers with authentication on serve artifacts to peers only).
        self._headers = bearer_headers(peer_token)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._http: httpx.AsyncClient | None = None
        self._started = False
        self._stopping = False
        # Artifacts whose replica znode exists in session ``_session_id``.
        self._registered: set[str] = set()
        self._session_id: int | None = None
        self._work: dict[str, asyncio.Task[None]] = {}  # sha256 -> fetch and/or register
        self._pending: set[str] = set()  # asked for before start()
        self._background: list[asyncio.Task[None]] = []
        self._resync = asyncio.Event()

    # -- lifecycle ----------------------------------------------------------------------

    async def start(self) -> None:
        """Register every artifact in the store, start the safety-net sync."""
        if self._started:
            raise RuntimeError("CodeReplicator already started")
        self._started = True
        self._loop = asyncio.get_running_loop()
        verify: ssl.SSLContext | bool = self._ssl_context or True
        self._http = httpx.AsyncClient(
            timeout=httpx.Timeout(self._fetch_timeout_s), headers=self._headers, verify=verify
        )
        self._zk.add_listener(self._on_kazoo_state)
        for sha256 in await asyncio.to_thread(self._stored):
            self.ensure(sha256)
        for sha256 in sorted(self._pending):
            self.ensure(sha256)
        self._pending.clear()
        self._background = [
            asyncio.create_task(self._sync_loop(), name=f"code-sync-{self._broker_id}")
        ]

    async def stop(self) -> None:
        """Stop fetching and syncing. Registered replicas stay (the files stay too);
        they vanish with the caller's ZooKeeper session."""
        if not self._started or self._stopping:
            return
        self._stopping = True
        self._zk.remove_listener(self._on_kazoo_state)
        tasks = [*self._background, *self._work.values()]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._background = []
        self._work.clear()
        if self._http is not None:
            await self._http.aclose()
            self._http = None

    # -- public API ----------------------------------------------------------------------

    def on_applied(self, entry: e.Entry, *_args: object) -> None:
        """Node apply listener (the node passes the ``Applied`` result next).

        For an ``AddCode``: fetch the artifact now if it is missing, then register the
        replica; for a ``DeleteCode`` that deleted it, :meth:`forget` it. Never blocks: the
        work runs in a background task.
        """
        if isinstance(entry, e.AddCode):
            self.ensure(entry.sha256)
        elif isinstance(entry, e.DeleteCode) and _args and isinstance(_args[0], Applied):
            result = _args[0].result
            if isinstance(result, Artifact) and code_deleted(entry, result.owners):
                self.forget(entry.sha256)

    def forget(self, sha256: str) -> None:
        """A deleted artifact: stop fetching it and unregister this broker's replica (the
        store removes the file itself: CodeStore.on_applied)."""
        work = self._work.pop(sha256, None)
        if work is not None:
            work.cancel()
        self._pending.discard(sha256)
        if sha256 in self._registered:
            self._registered.discard(sha256)
            if self._loop is not None and not self._stopping:
                task = self._loop.create_task(
                    self._unregister(sha256), name=f"code-rm-{sha256[:12]}"
                )
                self._background.append(task)
                task.add_done_callback(self._background_done)

    def _background_done(self, task: asyncio.Task[None]) -> None:
        with contextlib.suppress(ValueError):
            self._background.remove(task)

    async def _unregister(self, sha256: str) -> None:
        """Remove this broker's replica znode, and the artifact's node once it is empty."""
        artifact_path = f"{self._dir}/{sha256}"
        try:
            with contextlib.suppress(NoNodeError):
                await kazoo_result(
                    self._zk.delete_async(f"{artifact_path}/{self._broker_id}"), self._timeout_s
                )
            with contextlib.suppress(NoNodeError, NotEmptyError):
                await kazoo_result(self._zk.delete_async(artifact_path), self._timeout_s)
        except _ZK_ERRORS as exc:
            # Ephemeral: it goes with the session at the latest; nothing counts it meanwhile.
            logger.info("code artifact %s: replica not unregistered: %r", sha256, exc)

    def ensure(self, sha256: str) -> None:
        """Make sure the artifact gets here and is registered (in the background)."""
        if not SHA256_RE.fullmatch(sha256) or self._stopping:
            return
        if self._loop is None:
            self._pending.add(sha256)
            return
        if sha256 in self._work:
            return  # already being handled
        if (
            sha256 in self._registered
            and self._session_id == self._current_session()
            and self._store.has(sha256)  # a registered copy can still be lost on disk
        ):
            return
        task = self._loop.create_task(self._ensure(sha256), name=f"code-{sha256[:12]}")
        self._work[sha256] = task
        task.add_done_callback(lambda _: self._work.pop(sha256, None))

    def missing(self, required: Iterable[str]) -> set[str]:
        """Of these artifacts, those not in the local store."""
        return {sha256 for sha256 in required if not self._store.has(sha256)}

    async def fetch_missing(self, required: Iterable[str], timeout_s: float) -> set[str]:
        """Fetch what is missing of ``required``, waiting up to ``timeout_s``; returns what
        is still missing (e.g. for docs/DESIGN.md §4 step 3: a leader must hold them all)."""
        required = set(required)
        wanted = self.missing(required)
        for sha256 in sorted(wanted):
            self.ensure(sha256)
        tasks = [self._work[sha] for sha in wanted if sha in self._work]
        if tasks:
            await asyncio.wait(tasks, timeout=timeout_s)
        return self.missing(required)

    async def replica_count(self, sha256: str) -> int:
        """How many brokers have registered a replica of the artifact (a ZooKeeper read)."""
        try:
            children = await kazoo_result(
                self._zk.get_children_async(f"{self._dir}/{sha256}"), self._timeout_s
            )
        except NoNodeError:
            return 0
        return len(children)

    @property
    def registered(self) -> frozenset[str]:
        """Artifacts whose replica this replicator registered in the current session."""
        if self._session_id != self._current_session():
            return frozenset()
        return frozenset(self._registered)

    # -- work ----------------------------------------------------------------------------

    async def _ensure(self, sha256: str) -> None:
        try:
            # Hashed on first use by this process: a copy damaged or changed while the
            # broker was down is removed and fetched again, never registered.
            if not await asyncio.to_thread(self._store.verify, sha256):
                delay_s = _FIRST_RETRY_DELAY_S
                for attempt in range(_FETCH_ATTEMPTS):
                    if await self._fetch(sha256):
                        break
                    if attempt + 1 < _FETCH_ATTEMPTS:
                        await asyncio.sleep(delay_s)
                        delay_s *= 2
                else:
                    logger.warning(
                        "code artifact %s: no peer could provide it; the periodic sync "
                        "will try again",
                        sha256,
                    )
                    return
            await self._register(sha256)
        except asyncio.CancelledError:
            raise
        except Exception:
            logger.exception("code artifact %s: replication failed", sha256)

    async def _fetch(self, sha256: str) -> bool:
        """Try every peer once; True when the artifact is now stored here."""
        http = self._http
        if http is None:
            return False
        for peer_url in self._peer_urls():
            url = f"{peer_url.rstrip('/')}/api/v1/code/{sha256}"
            try:
                data = await self._download(http, url)
            except (httpx.HTTPError, _PeerError) as exc:
                logger.info("code artifact %s: not from %s: %s", sha256, peer_url, exc)
                continue
            if data is None:
                continue  # the peer does not have it (yet)
            actual = hashlib.sha256(data).hexdigest()
            if actual != sha256:
                logger.warning(
                    "code artifact %s: %s sent bytes hashing to %s; ignored",
                    sha256,
                    peer_url,
                    actual,
                )
                continue
            await asyncio.to_thread(self._store.put, data)
            logger.info("code artifact %s fetched from %s (%d bytes)", sha256, peer_url, len(data))
            return True
        return False

    async def _download(self, http: httpx.AsyncClient, url: str) -> bytes | None:
        async with asyncio.timeout(self._fetch_timeout_s), http.stream("GET", url) as response:
            if response.status_code == 404:
                return None
            if response.status_code != 200:
                raise _PeerError(f"HTTP {response.status_code}")
            chunks: list[bytes] = []
            size_bytes = 0
            async for chunk in response.aiter_bytes():
                size_bytes += len(chunk)
                if size_bytes > self._max_bytes:
                    raise _PeerError(f"more than {self._max_bytes} bytes")
                chunks.append(chunk)
            return b"".join(chunks)

    async def _register(self, sha256: str) -> None:
        """Create this broker's ephemeral replica znode (idempotent within a session)."""
        session_id = self._current_session()
        if session_id is None:
            return  # not connected: registered again once connected
        if self._session_id != session_id:
            self._registered.clear()  # the old session's ephemerals are gone
            self._session_id = session_id
        if sha256 in self._registered:
            return
        try:
            await self._create_replica_node(f"{self._dir}/{sha256}/{self._broker_id}", session_id)
        except _ZK_ERRORS as exc:
            # The next sync (or reconnection) tries again.
            logger.info("code artifact %s: replica not registered yet: %r", sha256, exc)
            return
        if self._current_session() == session_id:
            self._registered.add(sha256)
            logger.debug("code artifact %s: replica registered", sha256)

    async def _create_replica_node(self, path: str, session_id: int) -> None:
        def create() -> Any:
            # ephemeral, not sequential, makepath (the artifact's node is persistent)
            return self._zk.create_async(path, b"", None, True, False, True)

        try:
            await kazoo_result(create(), self._timeout_s)
        except NodeExistsError:
            # Ours from this session (a create whose reply was lost), or left by an earlier
            # process of this broker whose session has not expired yet: take it over.
            stat = await kazoo_result(self._zk.exists_async(path), self._timeout_s)
            if stat is not None and stat.ephemeralOwner != session_id:
                with contextlib.suppress(NoNodeError):
                    await kazoo_result(self._zk.delete_async(path), self._timeout_s)
                await kazoo_result(create(), self._timeout_s)

    async def _sync_loop(self) -> None:
        while True:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self._sync_interval_s):
                    await self._resync.wait()
            self._resync.clear()
            try:
                await self._sync()
            except Exception:
                logger.exception("code sync failed")

    async def _sync(self) -> None:
        """Fetch what the state knows and is missing here; register what is stored."""
        stored = await asyncio.to_thread(self._stored)
        wanted = set(stored)
        if self._known is not None:
            wanted.update(sha for sha in self._known() if SHA256_RE.fullmatch(sha))
        if self._session_id != self._current_session():
            self._registered.clear()
        for sha256 in sorted(wanted - self._registered):
            self.ensure(sha256)

    def _stored(self) -> list[str]:
        """sha256s of the artifacts in the local store (blocking: a directory scan)."""
        try:
            names = os.listdir(self._store.directory)
        except FileNotFoundError:
            return []
        return sorted(name for name in names if SHA256_RE.fullmatch(name))

    def _current_session(self) -> int | None:
        if self._zk.state != KazooState.CONNECTED:
            return None
        client_id = self._zk.client_id
        return int(client_id[0]) if client_id else None

    # -- kazoo thread -> loop ------------------------------------------------------------

    def _on_kazoo_state(self, state: Any) -> None:
        # On kazoo's thread: must not block or call ZooKeeper. A (re)connection may come
        # with a new session whose ephemerals are gone: the sync registers them again.
        if state == KazooState.CONNECTED:
            call_on_loop(self._loop, self._resync.set)


class _PeerError(Exception):
    """A peer's answer is unusable."""
