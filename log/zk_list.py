"""The ledger list in a ZooKeeper znode, changed only by compare-and-set (docs/DESIGN.md §3).

The znode (``/steward/<cluster>/ledgers`` by convention, see :func:`ledger_list_path`) holds the
:class:`~log.api.LedgerList` as JSON (msgspec, like the file store); its version is the znode's
data version, so ``compare_and_set`` is ``set(path, data, version=expected)``, or ``create``
when ``expected_version`` is -1.

kazoo calls block, and with the quorum lost a plain call blocks forever (checked here), so
every call goes through kazoo's ``*_async`` API and :func:`kazoo_result`, which hands the result to
the event loop and gives up after a timeout. Every failure that is not a lost compare-and-set
comes out as :class:`~log.api.LedgerError`; after a timeout or a connection loss the outcome
of a write is unknown and the caller must read the list again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import Any

import msgspec
from kazoo.exceptions import (  # type: ignore[import-untyped]
    BadVersionError as KazooBadVersionError,
)
from kazoo.exceptions import (
    KazooException,
    NodeExistsError,
    NoNodeError,
)
from kazoo.protocol.states import KazooState  # type: ignore[import-untyped]

from log.api import BadVersionError, LedgerError, LedgerList, LedgerListStore

logger = logging.getLogger(__name__)

#: Root of everything Steward keeps in ZooKeeper.
ZK_ROOT = "/steward"
DEFAULT_OPERATION_TIMEOUT_S = 5.0
#: ZooKeeper refuses znodes larger than ``jute.maxbuffer`` (1 MiB by default); stay below it.
MAX_ZNODE_BYTES = 1024 * 1024 - 1024


class KazooTimeoutError(TimeoutError):
    """A ZooKeeper call did not complete in time (its outcome is unknown)."""


def cluster_path(cluster: str) -> str:
    """``/steward/<cluster>``; ``cluster`` must be a single path component."""
    if not cluster or "/" in cluster or cluster in (".", ".."):
        raise ValueError(f"invalid cluster name {cluster!r}")
    return f"{ZK_ROOT}/{cluster}"


def ledger_list_path(cluster: str) -> str:
    return f"{cluster_path(cluster)}/ledgers"


async def kazoo_result(async_result: Any, timeout_s: float) -> Any:
    """Await a kazoo ``IAsyncResult`` without blocking the event loop.

    kazoo completes the result on its own thread; the value (or exception) is handed to the
    loop with ``call_soon_threadsafe``. Raises :class:`KazooTimeoutError` after ``timeout_s``
    (the request may still be executed by the server later) and whatever kazoo raised.
    """
    loop = asyncio.get_running_loop()
    future: asyncio.Future[Any] = loop.create_future()

    def transfer(result: Any) -> None:  # on the loop
        if future.done():  # timed out and cancelled meanwhile
            return
        try:
            value = result.get_nowait()
        except Exception as exc:
            future.set_exception(exc)
        else:
            future.set_result(value)

    def completed(result: Any) -> None:  # on kazoo's completion thread
        # RuntimeError: the loop was closed meanwhile; nobody waits for the result any more.
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(transfer, result)

    async_result.rawlink(completed)
    try:
        # asyncio.timeout, not wait_for: on Python 3.11 wait_for can swallow a cancellation
        # that races with the result, and the caller would never learn it was cancelled.
        async with asyncio.timeout(timeout_s):
            return await future
    except TimeoutError:
        async_result.unlink(completed)
        raise KazooTimeoutError(f"ZooKeeper did not answer within {timeout_s:g} s") from None


async def call_connected(
    client: Any,
    start: Callable[[], Any],
    timeout_s: float,
    where: str,
    passthrough: tuple[type[BaseException], ...],
) -> Any:
    """Issue one kazoo request (``start`` calls a ``*_async`` method) and await it.

    Errors become :class:`LedgerError` naming ``where``, except ``passthrough`` ones. kazoo
    queues requests while disconnected and sends them after a reconnect; a broker that is
    not connected must not have a late write land, so this fails fast instead.
    """
    if client.state != KazooState.CONNECTED:
        raise LedgerError(f"{where}: ZooKeeper client is {client.state}, not connected")
    try:
        return await kazoo_result(start(), timeout_s)
    except KazooTimeoutError as exc:
        raise LedgerError(f"{where}: {exc}; outcome unknown") from exc
    except passthrough:
        raise
    except KazooException as exc:
        raise LedgerError(f"{where}: ZooKeeper error {type(exc).__name__}: {exc}") from exc


class ZooKeeperLedgerListStore(LedgerListStore):
    """:class:`~log.api.LedgerListStore` on one znode of a started ``KazooClient``.

    The client belongs to the caller (it is neither started nor stopped here). Calls fail at
    once with :class:`~log.api.LedgerError` while the client is not connected: a broker that
    lost its ZooKeeper connection must not act on the list anyway.
    """

    def __init__(
        self,
        client: Any,
        path: str,
        *,
        operation_timeout_s: float = DEFAULT_OPERATION_TIMEOUT_S,
    ) -> None:
        if not path.startswith("/") or path.endswith("/"):
            raise ValueError(f"invalid znode path {path!r}")
        self._client = client
        self._path = path
        self._timeout_s = operation_timeout_s

    @property
    def path(self) -> str:
        return self._path

    async def get(self) -> tuple[LedgerList, int]:
        try:
            data, stat = await self._call(lambda: self._client.get_async(self._path))
        except NoNodeError:
            return LedgerList(), -1
        try:
            ledger_list = msgspec.json.decode(data, type=LedgerList)
        except msgspec.DecodeError as exc:
            raise LedgerError(f"corrupt ledger list in znode {self._path}: {exc}") from exc
        version: int = stat.version
        return ledger_list, version

    async def compare_and_set(self, new: LedgerList, expected_version: int) -> int:
        if expected_version < -1:
            raise ValueError(f"invalid expected version {expected_version}")
        data = msgspec.json.encode(new)
        if len(data) > MAX_ZNODE_BYTES:
            raise LedgerError(
                f"ledger list of {len(data)} bytes does not fit a znode ({MAX_ZNODE_BYTES})"
            )
        try:
            if expected_version == -1:
                await self._call(lambda: self._client.create_async(self._path, data, makepath=True))
                return 0  # a new znode's data version
            # Never pass -1 to set(): ZooKeeper reads it as "any version".
            stat = await self._call(
                lambda: self._client.set_async(self._path, data, expected_version)
            )
        except NodeExistsError:
            raise BadVersionError(f"ledger list {self._path} exists already") from None
        except NoNodeError:
            raise BadVersionError(
                f"ledger list {self._path} does not exist, expected version {expected_version}"
            ) from None
        except KazooBadVersionError:
            raise BadVersionError(
                f"ledger list {self._path} is not at version {expected_version}"
            ) from None
        version: int = stat.version
        return version

    async def sync(self) -> None:
        """Make a following read see every write committed before this call.

        A ZooKeeper server may lag behind the quorum; ``sync`` makes it catch up first. The
        leader runs ``sync`` then :meth:`get` after each durable group commit to confirm the
        list version is still the one it wrote (that nobody deposed it).
        """
        await self._call(lambda: self._client.sync_async(self._path))

    async def confirmed_version(self) -> int:
        """``sync`` and ``exists`` sent back to back, awaited together: one round trip.

        ZooKeeper answers one session's requests in order, so the ``exists`` is served
        after the ``sync`` made this server catch up with the quorum.
        """
        if self._client.state != KazooState.CONNECTED:
            raise LedgerError(f"ZooKeeper client is {self._client.state}, not connected")
        synced = self._client.sync_async(self._path)
        stat_result = self._client.exists_async(self._path)
        try:
            await kazoo_result(synced, self._timeout_s)
            stat = await kazoo_result(stat_result, self._timeout_s)
        except KazooTimeoutError as exc:
            raise LedgerError(f"ledger list {self._path}: {exc}") from exc
        except KazooException as exc:
            raise LedgerError(
                f"ledger list {self._path}: ZooKeeper error {type(exc).__name__}: {exc}"
            ) from exc
        if stat is None:
            return -1
        version: int = stat.version
        return version

    async def _call(self, start: Callable[[], Any]) -> Any:
        """Issue one request (``start`` calls a kazoo ``*_async`` method) and await it."""
        return await call_connected(
            self._client,
            start,
            self._timeout_s,
            f"ledger list {self._path}",
            (NoNodeError, NodeExistsError, KazooBadVersionError),
        )


def ledger_ids_path(cluster: str) -> str:
    """``/steward/<cluster>/ledger-ids``: one sequential znode per ledger of a shared store."""
    return f"{cluster_path(cluster)}/ledger-ids"


class ZooKeeperLedgerIdAllocator:
    """Ledger ids for stores without a shared disk (the ``pulsar`` backend), from ZooKeeper.

    Each id is a persistent sequential znode ``ledger-<n>`` under :func:`ledger_ids_path`; the
    id is ``n + 1`` (ids start at 1 like the other backends). ZooKeeper numbers children of a
    parent from a counter that only grows (creations and deletions both advance it), so ids
    are strictly increasing across brokers and restarts, and never reused after a deletion, as
    long as the parent znode itself is never deleted (that would restart the count).

    The znode is kept until the ledger is deleted (:meth:`remove`, called by the store's
    ``delete_ledger``), which makes the children the catalog of the ledgers in the store:
    :meth:`exists` and :meth:`list_ids` answer for every broker, after restarts, even where
    the ledger store itself cannot list or delete (pulsar-lite has no admin API). Their
    number is bounded by the live ledgers (retention deletes old ones), plus the ids of
    ledgers whose creation failed half-way when their cleanup failed too.

    Calling the allocator allocates (it is the ``ledger_ids`` callable of
    :class:`log.pulsar.PulsarLedgerStore`). Every call is bounded like the rest of this
    module; after a timeout the outcome is unknown (an allocation may have happened: that id
    is then never used, which is harmless).
    """

    #: Name prefix of the sequential znodes.
    PREFIX = "ledger-"

    def __init__(
        self,
        client: Any,
        cluster: str,
        *,
        operation_timeout_s: float = DEFAULT_OPERATION_TIMEOUT_S,
    ) -> None:
        self._client = client
        self._path = ledger_ids_path(cluster)
        self._timeout_s = operation_timeout_s

    @property
    def path(self) -> str:
        return self._path

    def _znode(self, ledger_id: int) -> str:
        # ZooKeeper pads sequence numbers to 10 digits.
        return f"{self._path}/{self.PREFIX}{ledger_id - 1:010d}"

    async def __call__(self) -> int:
        return await self.allocate()

    async def allocate(self) -> int:
        """A new ledger id, greater than every id allocated before (by anyone)."""
        created: str = await self._call(
            lambda: self._client.create_async(
                f"{self._path}/{self.PREFIX}", b"", sequence=True, makepath=True
            ),
            "allocate a ledger id",
        )
        return int(created.rsplit("-", 1)[1]) + 1

    async def exists(self, ledger_id: int) -> bool:
        """Whether ``ledger_id`` was allocated and not removed since."""
        if ledger_id < 1:
            return False
        stat = await self._call(
            lambda: self._client.exists_async(self._znode(ledger_id)), "look up a ledger id"
        )
        return stat is not None

    async def list_ids(self) -> list[int]:
        """Every allocated, not removed id, ascending."""
        try:
            children: list[str] = await self._call(
                lambda: self._client.get_children_async(self._path), "list ledger ids"
            )
        except NoNodeError:
            return []
        ids = [
            int(name[len(self.PREFIX) :]) + 1
            for name in children
            if name.startswith(self.PREFIX) and name[len(self.PREFIX) :].isdigit()
        ]
        return sorted(ids)

    async def remove(self, ledger_id: int) -> None:
        """Forget ``ledger_id`` (the ledger was deleted); removing an unknown id is a no-op."""
        if ledger_id < 1:
            return
        with contextlib.suppress(NoNodeError):
            await self._call(
                lambda: self._client.delete_async(self._znode(ledger_id)), "remove a ledger id"
            )

    async def _call(self, start: Callable[[], Any], what: str) -> Any:
        return await call_connected(
            self._client, start, self._timeout_s, f"cannot {what} in {self._path}", (NoNodeError,)
        )
