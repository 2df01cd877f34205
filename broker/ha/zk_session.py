"""The elector's ZooKeeper session as seen from the event loop (docs/DESIGN.md §4).

:class:`ZkSession` owns the kazoo client and the connection state machine described in
:mod:`broker.ha.election` (SUSPENDED, LOST, CONNECTED, "presumed lost" after one session
timeout suspended), hands kazoo's thread callbacks to the loop, and makes every ZooKeeper
request from the loop with the operation timeout. The election recipe on top
(:class:`~broker.ha.election.LeaderElector`) is told of each state change through
``on_state`` and of each fired watch through ``on_watch``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import time
from collections.abc import Callable
from typing import Any

from kazoo.client import KazooClient  # type: ignore[import-untyped]
from kazoo.exceptions import KazooException, NoNodeError  # type: ignore[import-untyped]
from kazoo.protocol.states import KazooState  # type: ignore[import-untyped]
from kazoo.retry import KazooRetry  # type: ignore[import-untyped]

from log.zk_list import kazoo_result

# The elector's logger: these messages are the elector's (docs/DESIGN.md §4).
logger = logging.getLogger("broker.ha.election")

# Reconnect attempts back off up to this, so a restarted server is found again quickly
# (kazoo's default backs off up to an hour).
_MAX_RECONNECT_DELAY_S = 1.0
_SEQUENCE_RE = re.compile(r"_(\d{10})$")


def sequence(name: str) -> int | None:
    """The sequence number of an ephemeral sequential node's name (None: not one)."""
    match = _SEQUENCE_RE.search(name)
    return int(match.group(1)) if match else None


def sorted_queue(children: list[str]) -> list[str]:
    """Queue nodes in sequence order (names that are not sequence nodes are ignored)."""
    numbered = [(seq, name) for name in children if (seq := sequence(name)) is not None]
    return [name for _, name in sorted(numbered)]


def default_client_factory(
    hosts: str, session_timeout_s: float, **client_options: Any
) -> Callable[[], Any]:
    """Factory of unstarted kazoo clients that reconnect forever, at most 1 s apart
    (``client_options``: more ``KazooClient`` arguments, e.g. authentication)."""

    def make() -> Any:
        retry = KazooRetry(
            max_tries=-1,
            delay=0.1,
            backoff=2,
            max_delay=min(_MAX_RECONNECT_DELAY_S, max(0.1, session_timeout_s / 4)),
        )
        return KazooClient(
            hosts=hosts, timeout=session_timeout_s, connection_retry=retry, **client_options
        )

    return make


class ZkSession:
    """One kazoo client and its connection state, kept on the event loop.

    ``on_state(state)`` runs on the loop after this object took in a kazoo state change
    (not once :meth:`begin_stop` was called); ``on_presumed_lost()`` when the session is
    presumed lost; ``on_watch()`` on the loop whenever a watch set through this session fires.
    """

    def __init__(
        self,
        client_factory: Callable[[], Any],
        name: str,
        *,
        session_timeout_s: float,
        operation_timeout_s: float,
        on_state: Callable[[Any], None],
        on_presumed_lost: Callable[[], None],
        on_watch: Callable[[], None],
    ) -> None:
        self._client_factory = client_factory
        self._name = name
        self._session_timeout_s = session_timeout_s
        self._operation_timeout_s = operation_timeout_s
        self._on_state_cb = on_state
        self._on_presumed_lost_cb = on_presumed_lost
        self._on_watch_cb = on_watch

        self.client: Any = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._connected_event = asyncio.Event()
        self._stopping = False
        # Connection, as seen from the loop.
        self._connected = False
        self._epoch = 0  # +1 on every SUSPENDED/LOST: invalidates running reads
        self._suspended_at: float | None = None
        self._suspend_timer: asyncio.TimerHandle | None = None
        self._presumed_lost = False
        self._down_since: float | None = None  # connection lost (SUSPENDED or LOST) at

    # -- state ------------------------------------------------------------------------------

    @property
    def up(self) -> bool:
        """Connected, as the loop last learned it (kazoo's own state may be ahead)."""
        return self._connected

    @property
    def epoch(self) -> int:
        """Changes on every SUSPENDED or LOST: a read begun in an older epoch may be stale."""
        return self._epoch

    @property
    def presumed_lost(self) -> bool:
        """SUSPENDED for longer than the session timeout and not reconnected yet."""
        return self._presumed_lost

    def down_for_s(self) -> float | None:
        """How long the connection has been down (None: up, or never connected)."""
        down_since = self._down_since
        return None if down_since is None else time.monotonic() - down_since

    def hosts(self) -> str:
        """The servers the client tries, ``host:port,...`` (for messages)."""
        client = self.client
        if client is None:
            return "?"
        return ",".join(f"{host}:{port}" for host, port in client.hosts)

    def clear_presumed_lost(self) -> bool:
        """Take the "presumed lost" mark (handled by the caller); whether it was set."""
        was, self._presumed_lost = self._presumed_lost, False
        return was

    def client_connected(self) -> bool:
        """kazoo's state right now is CONNECTED (read from any thread)."""
        client = self.client
        return client is not None and client.state == KazooState.CONNECTED

    def session_id(self) -> int | None:
        client = self.client
        client_id = client.client_id if client is not None else None
        return client_id[0] if client_id is not None else None

    # -- lifecycle --------------------------------------------------------------------------

    def open(self) -> None:
        """Make the client and listen to its states (from the loop; not connected yet)."""
        self._loop = asyncio.get_running_loop()
        self.client = self._client_factory()
        self.client.add_listener(self._on_kazoo_state)

    async def connect(self) -> None:
        """Start the client and wait until connected (the caller bounds the wait)."""
        # start_async() may wait for an earlier connection thread: keep it off the loop.
        await asyncio.to_thread(self.client.start_async)
        await self._connected_event.wait()

    def begin_stop(self) -> None:
        """From now on state changes are no longer passed on."""
        self._stopping = True

    def stop_listening(self) -> bool:
        """Cancel the suspension timer and stop listening; False when never opened."""
        self._cancel_suspend_timer()
        if self.client is None:
            return False
        self.client.remove_listener(self._on_kazoo_state)
        return True

    async def close(self) -> None:
        """Close the session (its ephemeral nodes go with it)."""
        client = self.client
        self._connected = False
        if client is None:
            return
        # kazoo waits up to max(10 s, session timeout) for its connection thread.
        close_timeout_s = max(10.0, self._session_timeout_s) + 2.0
        try:
            async with asyncio.timeout(close_timeout_s):
                await asyncio.to_thread(_close_client, client)
        except TimeoutError:
            logger.warning("ZooKeeper client of %s did not close in time", self._name)

    # -- kazoo thread -> loop -----------------------------------------------------------------

    def _call_on_loop(self, func: Callable[..., None], *args: Any) -> None:
        """Called on kazoo's threads: hand ``func`` to the loop, never block."""
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
            loop.call_soon_threadsafe(func, *args)

    def _on_kazoo_state(self, state: Any) -> None:
        # A kazoo state listener: must not block and must not call ZooKeeper.
        self._call_on_loop(self._on_state, state)

    def watch(self, event: Any) -> None:
        """A kazoo watch callback (also fired with a NONE event when the connection drops)."""
        self._call_on_loop(self._on_watch_cb)

    # -- connection state (loop) --------------------------------------------------------------

    def _on_state(self, state: Any) -> None:
        if self._stopping:
            return
        if state in (KazooState.SUSPENDED, KazooState.LOST) and self._down_since is None:
            self._down_since = time.monotonic()
        if state == KazooState.SUSPENDED:
            self._connected = False
            self._connected_event.clear()
            self._epoch += 1
            if self._suspended_at is None:
                self._suspended_at = time.monotonic()
                assert self._loop is not None
                self._suspend_timer = self._loop.call_later(
                    self._session_timeout_s, self._presume_session_lost
                )
            logger.warning("elector %s: ZooKeeper connection suspended", self._name)
        elif state == KazooState.LOST:
            self._connected = False
            self._connected_event.clear()
            self._epoch += 1
            self._cancel_suspend_timer()
            self._presumed_lost = False
            logger.warning("elector %s: ZooKeeper session lost", self._name)
        elif state == KazooState.CONNECTED:
            if (
                self._suspended_at is not None
                and time.monotonic() - self._suspended_at > self._session_timeout_s
            ):
                self._presumed_lost = True  # the timer may not have run yet
            self._cancel_suspend_timer()
            self._down_since = None
            self._connected = True
            self._connected_event.set()
            logger.info("elector %s: ZooKeeper connected", self._name)
        self._on_state_cb(state)

    def _presume_session_lost(self) -> None:
        self._suspend_timer = None
        if self._connected or self._stopping:
            return
        self._presumed_lost = True
        logger.warning(
            "elector %s: suspended for over the session timeout (%g s), presuming the session"
            " lost; will re-queue when reconnected",
            self._name,
            self._session_timeout_s,
        )
        self._on_presumed_lost_cb()

    def _cancel_suspend_timer(self) -> None:
        if self._suspend_timer is not None:
            self._suspend_timer.cancel()
            self._suspend_timer = None
        self._suspended_at = None

    # -- requests (loop) ----------------------------------------------------------------------

    async def request(self, method: Callable[..., Any], *args: Any) -> Any:
        """One ZooKeeper request from the loop, bounded by the operation timeout."""
        return await kazoo_result(method(*args), self._operation_timeout_s)

    async def ensure_path(self, path: str) -> None:
        await self.request(self.client.ensure_path_async, path)

    async def get_children(self, directory: str, *, watched: bool = False) -> list[str]:
        """Children of ``directory``; raises ``NoNodeError`` when it is missing."""
        watch = self.watch if watched else None
        children: list[str] = await self.request(self.client.get_children_async, directory, watch)
        return children

    async def children(self, directory: str) -> list[str]:
        """Children of ``directory``; none when it is missing."""
        try:
            children: list[str] = await self.request(self.client.get_children_async, directory)
        except NoNodeError:
            return []
        return children

    async def exists_watched(self, path: str) -> bool:
        return await self.request(self.client.exists_async, path, self.watch) is not None

    async def read_info(self, path: str) -> dict[str, Any] | None:
        """A node's JSON object; None when the node is gone, {} when it holds no object."""
        try:
            data, _ = await self.request(self.client.get_async, path)
        except NoNodeError:
            return None
        try:
            info = json.loads(data)
        except (ValueError, UnicodeDecodeError):
            info = None
        if not isinstance(info, dict):
            logger.warning("elector %s: node %s holds no JSON object", self._name, path)
            return {}
        return info

    async def create_or_adopt(self, directory: str, token: str, prefix: str, data: bytes) -> str:
        """Create our ephemeral sequential node ``<prefix>_<token>_<seq>`` holding ``data``,
        or find the one an earlier try created; its name."""
        # A create whose reply was lost may still have happened in this session.
        for name in await self.children(directory):
            if f"_{token}_" in name:
                return name
        path: str = await self.request(
            self.client.create_async,
            f"{directory}/{prefix}_{token}_",
            data,
            None,  # acl
            True,  # ephemeral
            True,  # sequence
            True,  # makepath
        )
        return path.rsplit("/", 1)[1]

    async def delete_matching(self, directory: str, fragment: str) -> None:
        """Delete the children of ``directory`` whose name holds ``fragment``."""
        for name in await self.children(directory):
            if fragment in name:
                with contextlib.suppress(NoNodeError):
                    await self.request(self.client.delete_async, f"{directory}/{name}")


def _close_client(client: Any) -> None:
    """Stop and close a kazoo client (blocking: run in a thread)."""
    try:
        client.stop()
    except KazooException as exc:
        logger.warning("ZooKeeper client stop failed: %r", exc)
    client.close()


async def wait_connected(client: Any, timeout_s: float, still_wanted: Callable[[], bool]) -> bool:
    """Wait until kazoo ``client`` is CONNECTED (True), at most ``timeout_s`` and only while
    ``still_wanted()`` (False: gave up). Woken by kazoo's state listener, re-checked at
    least every 0.25 s (``still_wanted`` has no event of its own)."""
    loop = asyncio.get_running_loop()
    changed = asyncio.Event()

    def listener(_state: object) -> bool:
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits
            loop.call_soon_threadsafe(changed.set)
        return False  # stay registered until removed below

    client.add_listener(listener)
    try:
        deadline = loop.time() + timeout_s
        while True:
            changed.clear()
            if client.state == KazooState.CONNECTED:
                return True
            left = deadline - loop.time()
            if left <= 0 or not still_wanted():
                return False
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(min(left, 0.25)):
                    await changed.wait()
    finally:
        client.remove_listener(listener)


class ClientReturn:
    """The broker's second ZooKeeper client (ledger list, code replication) as a take-over
    needs it: after a ZooKeeper server's loss the elector's client may reconnect first, so
    a take-over that failed while this one was down waits for it, at most ``timeout_s``
    and while ``still_wanted()``, and is retried instead of giving up the leadership
    (docs/DESIGN.md §4)."""

    def __init__(self, client: Any, timeout_s: float, still_wanted: Callable[[], bool]) -> None:
        self.client = client
        self.timeout_s = timeout_s
        self.still_wanted = still_wanted
        self.waits = 0  # how often it was down when asked

    async def reconnected(self) -> bool:
        """True when the client is down now and comes back in time; False when it is up
        (what failed was not it) or stays down."""
        if self.client.state == KazooState.CONNECTED:
            return False
        self.waits += 1
        logger.info("the ledger list's ZooKeeper client is %s; waiting", self.client.state)
        return await wait_connected(self.client, self.timeout_s, self.still_wanted)
