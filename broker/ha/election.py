"""Leader election and broker discovery in ZooKeeper (docs/DESIGN.md §4), over kazoo.

Layout under ``/steward/<cluster>/``:

- ``brokers/<id>_<token>_<seq>``: one ephemeral sequential node per running broker (its
  advertisement), holding ``{"broker_id": ..., **address_info}`` as JSON.
- ``election/<id>_<token>_<seq>``: the leader queue. Each broker that wants to lead holds one
  ephemeral sequential node with the same JSON; the lowest sequence number is the leader.

The ``token`` (random, new for every node this elector creates) lets the elector find a node
whose ``create`` reply was lost with the connection, and delete nodes it gave up on.

Why not kazoo's ``Lock``/``Election``: they keep reporting "acquired" through SUSPENDED and
LOST (checked on this machine). Here leadership is derived from two facts only, both
checked on every :meth:`LeaderElector.is_leader` call: this elector's queue node was the
lowest at its last refresh, and kazoo's connection state is CONNECTED right now.

Threads: kazoo runs state listeners and watch callbacks on its own threads. They only hand
work to the event loop (``call_soon_threadsafe``); every ZooKeeper request is made from the
loop through the async API with a timeout (``log.zk_list.kazoo_result``), and one background
task re-reads the election state whenever a watch fires or the connection comes back
(``_refresh``), so all state changes happen on the loop, one at a time.

Connection states:

- SUSPENDED (connection lost, session maybe alive; kazoo reports it about 0.6x the session
  timeout after the server went silent): stop being leader at once and fire ``on_change``.
  A timer of one session timeout starts; kazoo cannot report LOST while the server is
  unreachable, so when the timer fires the session is *presumed lost*.
- LOST (session expired: the ephemeral nodes are gone): forget the nodes. kazoo reconnects
  with a new session; the elector then advertises again and, if it had joined, re-queues with
  a new node (at the back of the queue).
- CONNECTED again with the same session: if it was presumed lost, the elector still re-queues
  with a new node (deleting the old one), as if the session had ended, so the rule stays
  "away longer than a session timeout -> back of the queue". Otherwise the session survived
  with its nodes: re-read the queue and check whether this elector still holds the lowest
  node. Every reconnect also re-registers the watches (kazoo drops them on SUSPENDED).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from kazoo.exceptions import KazooException, NoNodeError  # type: ignore[import-untyped]
from kazoo.protocol.states import KazooState  # type: ignore[import-untyped]

from broker.ha.leader_queue import LeaderQueue
from broker.ha.membership import BrokerDirectory
from broker.ha.zk_session import ZkSession, default_client_factory
from log.zk_list import KazooTimeoutError, cluster_path

__all__ = [
    "DEFAULT_CONNECT_TIMEOUT_S",
    "DEFAULT_SESSION_TIMEOUT_S",
    "ElectionError",
    "LeaderElector",
    "LeadershipStatus",
    "default_client_factory",
]

logger = logging.getLogger(__name__)

DEFAULT_SESSION_TIMEOUT_S = 4.0
DEFAULT_CONNECT_TIMEOUT_S = 30.0
_MAX_REFRESH_RETRY_DELAY_S = 2.0
# A refresh that keeps seeing nodes vanish between two reads gives up and runs again later.
_MAX_REFRESH_ROUNDS = 20
_UNSAFE_NAME_CHARS_RE = re.compile(r"[^A-Za-z0-9.-]")


class ElectionError(Exception):
    """An election request could not be completed (ZooKeeper unreachable, or not started)."""


@dataclass(frozen=True, slots=True)
class LeadershipStatus:
    """What an elector knows, as handed to ``on_change``."""

    is_leader: bool
    #: The leader's advertised info (``broker_id`` and address info); None when the queue is
    #: empty or nothing was read yet. While disconnected this is the last one seen.
    leader: dict[str, Any] | None
    #: The leader's queue node name: a new name means a new leadership term, even when the
    #: same broker leads again.
    leader_node: str | None
    connected: bool


class LeaderElector:
    """One broker's view of the election, with its own ZooKeeper session.

    ``zookeeper`` is a connect string (``"127.0.0.1:2181,..."``) or a factory returning an
    unstarted ``KazooClient`` (it should reconnect forever: ``connection_retry`` with
    ``max_tries=-1``). ``session_timeout_s`` is asked of the server (which clamps it to its
    bounds) and times the "SUSPENDED for too long" rule. ``on_change`` is called on the event
    loop whenever :class:`LeadershipStatus` changes (leadership gained or lost, another
    leader, connection lost or back); it must not block.

    Use from one event loop: ``await start()``, ``await join()`` to compete for leadership,
    ``await leave()`` to give it back, ``await stop()`` at the end.

    The session and its connection states are a :class:`~broker.ha.zk_session.ZkSession`;
    the advertised brokers a :class:`~broker.ha.membership.BrokerDirectory`; this class is
    the queue recipe on top of them.
    """

    def __init__(
        self,
        zookeeper: str | Callable[[], Any],
        cluster: str,
        broker_id: str,
        address_info: Mapping[str, Any],
        *,
        session_timeout_s: float = DEFAULT_SESSION_TIMEOUT_S,
        on_change: Callable[[LeadershipStatus], None] | None = None,
        operation_timeout_s: float | None = None,
        connect_timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S,
    ) -> None:
        if session_timeout_s <= 0:
            raise ValueError("session_timeout_s must be positive")
        if not broker_id:
            raise ValueError("broker_id must not be empty")
        root = cluster_path(cluster)
        self._brokers_dir = f"{root}/brokers"
        self._election_dir = f"{root}/election"
        self._broker_id = broker_id
        self._info: dict[str, Any] = {**address_info, "broker_id": broker_id}
        # Fails now, not at the first create, when the info cannot be stored.
        self._info_bytes = json.dumps(self._info, sort_keys=True).encode()
        self._name_prefix = _UNSAFE_NAME_CHARS_RE.sub("_", broker_id)[:64]
        self._session_timeout_s = session_timeout_s
        self._connect_timeout_s = connect_timeout_s
        self._on_change = on_change
        self._session = ZkSession(
            (
                default_client_factory(zookeeper, session_timeout_s)
                if isinstance(zookeeper, str)
                else zookeeper
            ),
            broker_id,
            session_timeout_s=session_timeout_s,
            operation_timeout_s=(
                operation_timeout_s if operation_timeout_s is not None else session_timeout_s
            ),
            on_state=self._on_state,
            on_presumed_lost=self._notify,
            on_watch=self._kick,
        )
        self._members = BrokerDirectory(self._brokers_dir, self._name_prefix, self._info_bytes)

        self._lock = asyncio.Lock()  # one ZooKeeper state change at a time
        self._kick_event = asyncio.Event()  # "re-read the election state"
        self._worker: asyncio.Task[None] | None = None
        self._started = False
        self._stopping = False
        self._nodes_session_id: int | None = None  # session that owns the nodes below
        self._dirs_session_id: int | None = None  # session that last made sure of the dirs

        # Our queue node, and the queue as the last refresh read it.
        self._queue = LeaderQueue(
            self._election_dir, broker_id, self._name_prefix, self._info_bytes
        )
        self._last_status: LeadershipStatus | None = None

    # -- queries (synchronous, from the loop's cached view) ---------------------------------

    @property
    def broker_id(self) -> str:
        return self._broker_id

    @property
    def session_timeout_s(self) -> float:
        return self._session_timeout_s

    @property
    def queue_node(self) -> str | None:
        """Name of this elector's node in the leader queue (None when not queued)."""
        return self._queue.node

    @property
    def connected(self) -> bool:
        return self._session.up and self._session.client_connected()

    @property
    def session_presumed_lost(self) -> bool:
        """SUSPENDED for longer than the session timeout and not reconnected yet."""
        return self._session.presumed_lost

    def connection_problem(self) -> str | None:
        """Why this broker cannot take part in the election now, in words for clients and
        operators (None: connected). Without a ZooKeeper quorum no broker may lead
        (docs/DESIGN.md §4), so this names ZooKeeper, not the broker, as the cause."""
        if self.connected or self._stopping:
            return None
        down_s = self._session.down_for_s()
        since = f" for {down_s:.1f} s" if down_s is not None and down_s >= 0.1 else ""
        return (
            f"this broker has had no ZooKeeper connection{since} (ZooKeeper at"
            f" {self._session.hosts()} has lost its quorum or cannot be reached) and takes no"
            " writes until it reconnects; retry"
        )

    def is_leader(self) -> bool:
        """True only while this elector holds the lowest queue node and is connected.

        Reads kazoo's state directly too, so it turns False the moment kazoo reports
        SUSPENDED, before the loop has processed the state change.
        """
        return (
            self._queue.holds_lowest
            and self._session.up
            and not self._stopping
            and self._session.client_connected()
        )

    def leader_info(self) -> dict[str, Any] | None:
        """The current leader's ``broker_id`` and address info (None: no leader known)."""
        return self._queue.leader_info()

    def brokers(self) -> list[dict[str, Any]]:
        """Every advertised broker's ``broker_id`` and address info, oldest first."""
        return self._members.brokers()

    def status(self) -> LeadershipStatus:
        return LeadershipStatus(
            is_leader=self.is_leader(),
            leader=self.leader_info(),
            leader_node=self._queue.leader_node,
            connected=self.connected,
        )

    # -- lifecycle ---------------------------------------------------------------------------

    async def start(self) -> None:
        """Connect (a new session) and advertise this broker.

        Raises :class:`ElectionError` when ZooKeeper is not reachable within the connect
        timeout (the client is closed again).
        """
        if self._started:
            raise ElectionError("elector already started")
        self._started = True
        self._session.open()
        self._worker = asyncio.get_running_loop().create_task(
            self._run(), name=f"elector-{self._broker_id}"
        )
        try:
            async with asyncio.timeout(self._connect_timeout_s):
                await self._session.connect()
            async with self._lock:
                await self._refresh_locked()
        except (TimeoutError, KazooException) as exc:
            await self.stop()
            raise ElectionError(
                f"cannot reach ZooKeeper within {self._connect_timeout_s:g} s: {exc!r}"
            ) from exc
        except BaseException:
            await self.stop()
            raise
        logger.info("elector %s started (advertised as %s)", self._broker_id, self._members.ad_node)

    async def join(self) -> None:
        """Enter the leader queue (no-op when already in it).

        Raises :class:`ElectionError` when ZooKeeper cannot be reached now; the wish to be in
        the queue is kept, and the elector joins once it is connected again (unless
        :meth:`leave` is called).
        """
        self._require_running()
        self._queue.want = True
        if self._queue.node is not None:
            return
        await self._refresh_now("join")
        if self._queue.node is None:
            raise ElectionError("not in the leader queue yet (no ZooKeeper connection)")

    async def leave(self) -> None:
        """Leave the leader queue: give leadership back at once (no-op when not queued).

        Leadership ends locally before ZooKeeper is asked to delete the node. When
        disconnected this returns at once; raises :class:`ElectionError` when the delete
        request failed. Either way the node is deleted once connected again (or vanishes
        with the session). A later :meth:`join` always makes a new node, at the back of the
        queue.
        """
        self._require_running()
        self._queue.want = False
        self._queue.give_up()
        self._notify()
        if self._queue.stale:
            await self._refresh_now("leave")

    async def stop(self) -> None:
        """Leave the queue, remove the advertisement, close the session. Idempotent."""
        if not self._started or self._stopping:
            return
        self._stopping = True
        self._session.begin_stop()
        self._queue.holds_lowest = False
        self._queue.want = False
        self._notify()
        self._kick()  # wakes the worker, which sees _stopping and ends
        if self._worker is not None:
            while not self._worker.done():
                # Repeated: a cancellation that races with a result can be swallowed (e.g. by
                # wait_for on Python 3.11), and the worker must end whatever it was awaiting.
                self._worker.cancel()
                await asyncio.wait({self._worker}, timeout=0.1)
        if not self._session.stop_listening():
            return
        if self._session.client_connected():
            # Closing the session would remove them too; deleting first makes it explicit
            # and independent of how the close goes.
            if self._queue.token is not None:
                with contextlib.suppress(KazooException, KazooTimeoutError):
                    await self._queue.delete(self._session, self._queue.token)
            with contextlib.suppress(KazooException, KazooTimeoutError):
                await self._members.withdraw(self._session)
        self._queue.token = self._queue.node = None
        self._members.forget()
        await self._session.close()
        logger.info("elector %s stopped", self._broker_id)

    def _require_running(self) -> None:
        if not self._started or self._stopping:
            raise ElectionError("elector is not running")

    # -- connection state (loop; the session took it in first) -------------------------------

    def _on_state(self, state: Any) -> None:
        if state == KazooState.SUSPENDED:
            self._queue.holds_lowest = False
        elif state == KazooState.LOST:
            self._forget_nodes()
        elif state == KazooState.CONNECTED:
            self._kick()
        self._notify()

    def _forget_nodes(self) -> None:
        """The session that owned our nodes ended: the server deleted them all."""
        self._members.forget()
        self._queue.forget()
        self._nodes_session_id = None

    # -- refresh -----------------------------------------------------------------------------

    def _kick(self) -> None:
        self._kick_event.set()

    async def _run(self) -> None:
        """Background task: refresh whenever kicked (watch fired, reconnected, retry)."""
        retry_delay_s = 0.1
        while True:
            await self._kick_event.wait()
            self._kick_event.clear()
            if self._stopping:
                return
            if not self._session.up:
                continue  # the CONNECTED state change kicks again
            try:
                async with self._lock:
                    await self._refresh_locked()
                retry_delay_s = 0.1
            except (KazooException, KazooTimeoutError) as exc:
                logger.info("elector %s: refresh failed (%r), retrying", self._broker_id, exc)
                await asyncio.sleep(retry_delay_s)
                retry_delay_s = min(retry_delay_s * 2, _MAX_REFRESH_RETRY_DELAY_S)
                self._kick()
            except Exception:
                logger.exception("elector %s: refresh failed", self._broker_id)
                await asyncio.sleep(_MAX_REFRESH_RETRY_DELAY_S)
                self._kick()

    async def _refresh_now(self, what: str) -> None:
        """Run a refresh for ``join``/``leave``; errors become :class:`ElectionError`."""
        try:
            async with self._lock:
                await self._refresh_locked()
        except (KazooException, KazooTimeoutError) as exc:
            self._kick()  # the background task retries
            raise ElectionError(f"{what} failed: {exc!r}") from exc

    async def _refresh_locked(self) -> None:
        """Bring ZooKeeper in line with what this elector wants, then re-read the election.

        Creates the advertisement and queue node when missing, deletes given-up nodes,
        re-registers the watches and recomputes leadership. Runs under ``self._lock``.
        """
        session = self._session
        session_id = session.session_id()
        if self._stopping or not session.up or session_id is None:
            return
        epoch = session.epoch
        if self._nodes_session_id is not None and self._nodes_session_id != session_id:
            self._forget_nodes()  # a new session: the LOST event may not have been processed
        self._nodes_session_id = session_id
        if self._dirs_session_id != session_id:
            # Persistent parents, created by whoever comes first; re-checked per session since
            # an operator may have wiped the cluster's tree meanwhile.
            for directory in (self._brokers_dir, self._election_dir):
                await session.ensure_path(directory)
            self._dirs_session_id = session_id
        # Treat a session presumed lost as lost although it survived: re-queue with a new node.
        if session.clear_presumed_lost() and self._queue.token is not None:
            logger.info("elector %s: re-queueing after a long suspension", self._broker_id)
            self._queue.give_up()
        await self._queue.delete_stale(session)

        if not await self._members.advertise(session):
            return  # the session ended meanwhile: start over on the next refresh

        for _ in range(_MAX_REFRESH_ROUNDS):
            if not await self._queue.ensure_queued(session):
                # leave() or the end of the session came in between; leave() marked the
                # node stale, the next refresh deletes it.
                self._kick()
                return
            if await self._read_election(epoch):
                break
        else:
            self._kick()  # the queue kept changing under us: look again soon

        try:
            await self._members.refresh(session)
        except NoNodeError:
            self._dirs_session_id = None  # re-created by the next refresh
            raise
        if epoch != session.epoch:
            # The connection dropped while reading: what was read may be stale.
            self._queue.holds_lowest = False
        self._notify()

    async def _read_election(self, epoch: int) -> bool:
        """Read the queue, set the watches and leadership; False when it must be read again."""
        try:
            return await self._queue.read(self._session, epoch=epoch)
        except NoNodeError:  # the directory is gone (an operator wiped the tree)
            self._dirs_session_id = None  # re-created by the next refresh
            raise

    # -- notification ------------------------------------------------------------------------

    def _notify(self) -> None:
        status = self.status()
        if status == self._last_status:
            return
        previous, self._last_status = self._last_status, status
        if previous is None or previous.is_leader != status.is_leader:
            logger.info(
                "elector %s: %s", self._broker_id, "leader" if status.is_leader else "not leader"
            )
        if self._on_change is not None:
            try:
                self._on_change(status)
            except Exception:
                logger.exception("elector %s: on_change callback failed", self._broker_id)
