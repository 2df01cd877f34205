"""The replicated simulations' world (tests/sim/test_replicated.py, test_trees_sim.py): an
asyncio loop on virtual time with inline executors, the shared "ZooKeeper" ledger list
and ledger archive, replicas and proposals, the reference machine, quiet logs.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import selectors
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final, TypeVar

from broker.core import StateMachine, Task
from broker.replication.node import Node
from log.api import LedgerError, LedgerList, LedgerListStore, LedgerReader, LedgerState
from log.memory import MemoryLedgerCluster, MemoryLedgerListStore, MemoryLedgerStore
from tests.support.sim_common import SimulationFailure

REPLICAS: Final = ("r0", "r1", "r2", "r3")
BASE_MS: Final = 1_750_000_000_000
CLUSTER_ID: Final = "sim"
SETTLE_TIMEOUT_S: Final = 60.0  # virtual seconds
POLL_S: Final = 0.005

_T = TypeVar("_T")


# --- a deterministic event loop -------------------------------------------------------------


class _InlineExecutor(concurrent.futures.ThreadPoolExecutor):
    """Runs ``asyncio.to_thread`` work (snapshot IO) inline: one thread, one replay."""

    def submit(  # type: ignore[override]
        self, fn: Callable[..., _T], /, *args: Any, **kwargs: Any
    ) -> concurrent.futures.Future[_T]:
        future: concurrent.futures.Future[_T] = concurrent.futures.Future()
        try:
            future.set_result(fn(*args, **kwargs))
        except BaseException as exc:
            future.set_exception(exc)
        return future


class _VirtualSelector(selectors.DefaultSelector):  # type: ignore[misc,valid-type]
    """Never blocks: when nothing is ready, time jumps to the next timer."""

    def __init__(self) -> None:
        super().__init__()
        self.now = 0.0

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        events: list[tuple[selectors.SelectorKey, int]] = super().select(0)
        if events:
            return events
        if timeout is None:
            raise SimulationFailure("deadlock: nothing runnable and no timer pending")
        self.now += timeout
        return []


class VirtualTimeLoop(asyncio.SelectorEventLoop):  # type: ignore[misc,valid-type]
    def __init__(self) -> None:
        self._virtual = _VirtualSelector()
        super().__init__(self._virtual)
        self.set_default_executor(_InlineExecutor(max_workers=1))

    def time(self) -> float:
        return self._virtual.now


# --- the shared "ZooKeeper" ledger list and the ledger archive --------------------------------


class _ArchivingDict(dict[int, Any]):
    """The memory cluster's ledger table, remembering ledgers retention deleted."""

    def __init__(self, archive: dict[int, Any]) -> None:
        super().__init__()
        self._archive = archive

    def __setitem__(self, key: int, value: Any) -> None:
        self._archive[key] = value
        super().__setitem__(key, value)


class SharedLedgerList(MemoryLedgerListStore):
    """The ledger list every replica sees, with who changed it last and each ledger's end."""

    def __init__(self, violations: list[str]) -> None:
        super().__init__()
        self.violations = violations
        self.last_writer = ""
        self.closed_at: dict[int, int] = {}  # ledger id -> last entry id, once closed
        self.ever_listed: set[int] = set()

    @property
    def current(self) -> LedgerList:
        return self._ledger_list

    def record(self, writer: str, new: LedgerList) -> None:
        self.last_writer = writer
        for info in new.ledgers:
            self.ever_listed.add(info.ledger_id)
            known = self.closed_at.get(info.ledger_id)
            if info.state == LedgerState.CLOSED:
                last = info.last_entry_id if info.last_entry_id is not None else -1
                if known is not None and known != last:
                    self.violations.append(
                        f"{writer} changed the end of closed ledger {info.ledger_id} "
                        f"from {known} to {last}"
                    )
                self.closed_at[info.ledger_id] = last
            elif known is not None:
                self.violations.append(f"{writer} reopened closed ledger {info.ledger_id}")


class ReplicaLedgerList(LedgerListStore):
    """One broker's ZooKeeper client: tags its changes; dead once its process is killed."""

    def __init__(self, shared: SharedLedgerList, owner: str) -> None:
        self.shared = shared
        self.owner = owner
        self.dead = False

    def _check(self) -> None:
        if self.dead:
            raise LedgerError(f"{self.owner} was killed")

    async def get(self) -> tuple[LedgerList, int]:
        self._check()
        return await self.shared.get()

    async def compare_and_set(self, new: LedgerList, expected_version: int) -> int:
        self._check()
        version = await self.shared.compare_and_set(new, expected_version)
        self.shared.record(self.owner, new)
        return version

    async def sync(self) -> None:
        self._check()


class SlowRecoveryStore(MemoryLedgerStore):
    """Recovery fences at once, then takes a while to find the ledger's end (as
    BookKeeper reads the bookies): a window for a deposed writer that was not told."""

    def __init__(self, cluster: MemoryLedgerCluster, recovery_delay_s: float) -> None:
        super().__init__(cluster)
        self.recovery_delay_s = recovery_delay_s

    async def open_ledger(self, ledger_id: int, *, recovery: bool) -> LedgerReader:
        reader = await super().open_ledger(ledger_id, recovery=recovery)
        if recovery and self.recovery_delay_s > 0:
            await asyncio.sleep(self.recovery_delay_s)
        return reader


# --- replicas, proposals ----------------------------------------------------------------------


@dataclass(eq=False)
class Proposal:
    index: int
    target: str  # replica name#incarnation the client sent it to
    called_seq: int
    data: bytes | None = None  # the entry as logged (None: refused before stamping)
    outcome: str = "pending"  # acked | refused | killed
    result: bytes | None = None
    result_type: str = ""
    acked_seq: int = -1
    accepted_ids: tuple[int, ...] = ()


@dataclass(eq=False)
class Replica:
    name: str
    skew_ms: int
    snapshot_dir: Path
    incarnation: int = 0
    node: Node | None = None
    store: MemoryLedgerStore | None = None
    ledger_list: ReplicaLedgerList | None = None
    manager: asyncio.Task[None] | None = None
    follow_task: asyncio.Task[None] | None = None
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    deposed: str | None = None
    paused: bool = False
    elector_says_leader: bool = False
    last_position: tuple[int, int] = (-1, -1)
    tasks: set[asyncio.Task[Any]] = field(default_factory=set)

    @property
    def tag(self) -> str:
        return f"{self.name}#{self.incarnation}"

    @property
    def alive(self) -> bool:
        return self.node is not None


class ReferenceMachine(StateMachine):
    """Replays the committed log on its own; remembers which tasks were deleted (purged)."""

    def __init__(self) -> None:
        super().__init__()
        self.deleted: set[int] = set()

    def delete_task(self, task: Task) -> None:
        self.deleted.add(task.id)
        super().delete_task(task)


@contextlib.contextmanager
def quiet_logs() -> Iterator[None]:
    # Depositions and fenced appends are the point here: keep the log noise down.
    names = ("broker.replication.node", "log.memory", "snapshot.store")
    loggers = [logging.getLogger(name) for name in names]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.CRITICAL + 1)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels, strict=True):
            lg.setLevel(level)


def cancel_leftovers(loop: asyncio.AbstractEventLoop) -> None:
    tasks = asyncio.all_tasks(loop)
    for task in tasks:
        task.cancel()
    if tasks:
        loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
