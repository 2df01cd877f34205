"""The replicated simulation's cluster (tests/sim/test_replicated.py): Node replicas on one
memory ledger cluster, each with a manager mirroring the broker's (take over, follow,
install a peer's snapshot), a simulated elector, client proposals, and the checks that run
all along.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import shutil
import traceback
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec

from broker.core import Applied, Rejected, StateMachine, TaskRef
from broker.core import entries as e
from broker.replication.node import (
    BrokerUnavailableError,
    HistoryGapError,
    Node,
    NodeConfig,
    Role,
    Stamp,
)
from log.api import LedgerError
from log.memory import MemoryLedgerCluster
from snapshot.store import SnapshotStore
from tests.support.sim_common import encode_result, fail
from tests.support.sim_generator import EntryGenerator
from tests.support.sim_schedules import schedule_entry
from tests.support.sim_virtual import (
    BASE_MS,
    CLUSTER_ID,
    REPLICAS,
    Proposal,
    ReferenceMachine,
    Replica,
    ReplicaLedgerList,
    SharedLedgerList,
    SlowRecoveryStore,
    _ArchivingDict,
)


class ReplicaCluster:
    """The replicas of a replicated simulation, their managers and the client proposals;
    the checks run all along (tests/support/sim_replicated.py adds the schedule and the
    checks at settle points)."""

    def __init__(self, seed: int, steps: int, root: Path) -> None:
        self.seed = seed
        self.steps = steps
        self.root = root
        self.rng = random.Random(seed)
        rng = self.rng
        self.violations: list[str] = []
        self.stats: Counter[str] = Counter()
        self.archive: dict[int, Any] = {}
        # Seed-level personality: how fast the store syncs, how small ledgers are, ...
        self.sync_delay_s = rng.choice((0.0, 0.0005, 0.002, 0.01))
        self.cluster = MemoryLedgerCluster(sync_delay_s=self.sync_delay_s)
        self.recovery_delay_s = rng.choice((0.0, 0.001, 0.005))
        self.cluster.ledgers = _ArchivingDict(self.archive)
        self.shared_list = SharedLedgerList(self.violations)
        self.config_template = {
            "cluster_id": CLUSTER_ID,
            "ledger_roll_bytes": rng.choice((1_500, 4_000, 20_000)),
            "ledger_roll_age_ms": rng.choice((2_000, 30_000, 3_600_000)),
            "ledger_retention_ms": rng.choice((5_000, 60_000, 48 * 3_600_000)),
            "snapshot_interval_s": rng.choice((0.2, 1.0, 3600.0)),
            "snapshot_keep": rng.choice((1, 2, 3)),
            "timer_poll_interval_s": 0.05,
            "confirm_idle_ms": 5,
            "follower_list_poll_s": rng.choice((0.01, 0.05)),
        }
        self.replicas = [
            Replica(name, rng.randint(-1_500, 1_500), root / name)
            for name in REPLICAS[: rng.choice((3, 3, 4))]
        ]
        self.by_name = {r.name: r for r in self.replicas}
        self.elected: str | None = None  # who holds the ZooKeeper leadership lock
        self.offset_ms = 0
        self.frozen_at_ms: int | None = None
        self.seq = 0
        self.step = -1
        self.proposals: list[Proposal] = []
        self.proposal_tasks: set[asyncio.Task[None]] = set()
        self.generator = EntryGenerator(seed, StateMachine())
        self.reference = ReferenceMachine()
        self.ref_log: list[tuple[tuple[int, int], bytes]] = []
        self.ref_results: dict[tuple[int, int], tuple[str, bytes]] = {}
        self.positions_by_data: dict[bytes, list[tuple[int, int]]] = {}
        self.downloads = 0

    # --- clock ------------------------------------------------------------------------

    def _loop_ms(self) -> int:
        return int(asyncio.get_running_loop().time() * 1000)

    def clock_for(self, replica: Replica) -> Callable[[], int]:
        def clock_ms() -> int:
            now = self.frozen_at_ms if self.frozen_at_ms is not None else self._loop_ms()
            return BASE_MS + now + self.offset_ms + replica.skew_ms

        return clock_ms

    # --- checks run all along ---------------------------------------------------------------

    def violation(self, message: str) -> None:
        # Raised at the next step: exceptions inside the node's listeners are swallowed.
        self.violations.append(message)

    def raise_violations(self) -> None:
        if self.violations:
            fail("; ".join(self.violations[:5]))

    def _on_apply(
        self, replica: Replica, node: Node, entry: e.Entry, _applied: Applied, *_: object
    ) -> None:
        if replica.node is not node:
            self.violation(f"a killed incarnation of {replica.name} applied {entry!r}"[:300])
            return
        self._check_position(replica)
        if node.role != Role.LEADER:
            return
        # A leader applies an entry right before it answers the client.
        fences = node.ledgers.can_fence
        if not fences and self.shared_list.last_writer != replica.tag:
            # Without a fence the leader confirms in ZooKeeper before it applies.
            self.violation(
                f"deposed leader {replica.tag} applied (acknowledged) an entry at "
                f"{node.position} after {self.shared_list.last_writer} changed the "
                "ledger list"
            )
        ledger = self.archive.get(node.position[0])
        fenced_last = ledger.fenced_last_entry_id if ledger is not None else None
        # With a fence the leader may still acknowledge what was durable before it (the
        # recovery keeps it: docs/DESIGN.md §4), never an entry past the fenced end.
        if fenced_last is not None and (not fences or node.position[1] > fenced_last):
            self.violation(
                f"leader {replica.tag} applied (acknowledged) entry {node.position} of a "
                f"ledger fenced at {fenced_last}"
            )

    def _check_position(self, replica: Replica) -> None:
        node = replica.node
        if node is None:
            return
        if node.position < replica.last_position:
            self.violation(
                f"{replica.tag} position went back from {replica.last_position} to {node.position}"
            )
        replica.last_position = node.position

    def _on_deposed(self, replica: Replica, node: Node, reason: str) -> None:
        if replica.node is not node:
            return
        if "fenced" in reason:
            self.stats["deposed: append fenced"] += 1
        elif "ledger list changed" in reason:
            self.stats["deposed: ledger list changed"] += 1
        elif "lost the election" in reason:
            self.stats["deposed: elector"] += 1
        else:
            self.stats["deposed: other"] += 1
        # As broker/server/cluster.py: deposed while the elector still says "leader" -> requeue.
        if replica.elector_says_leader:
            replica.deposed = reason
        replica.changed.set()

    # --- replica lifecycle ------------------------------------------------------------------

    async def start_replica(self, replica: Replica) -> None:
        replica.incarnation += 1
        replica.store = SlowRecoveryStore(self.cluster, self.recovery_delay_s)
        # Half the seeds run the leader's path for a backend without a fence (a ZooKeeper
        # confirmation per group commit; the memory store fences anyway), half the fencing
        # path (docs/DESIGN.md §4). From the seed, not the rng: seeds keep their schedule.
        replica.store.can_fence = self.seed % 2 == 0
        replica.ledger_list = ReplicaLedgerList(self.shared_list, replica.tag)
        config = NodeConfig(
            data_dir=replica.snapshot_dir,
            broker_id=replica.name,
            **self.config_template,  # type: ignore[arg-type]
        )
        node = Node(
            config,
            ledgers=replica.store,
            ledger_list=replica.ledger_list,
            snapshots=SnapshotStore(
                replica.snapshot_dir, keep=config.snapshot_keep, cluster_id=CLUSTER_ID
            ),
            clock_ms=self.clock_for(replica),
        )
        node.leadership_check = lambda: replica.elector_says_leader
        node.on_deposed = lambda reason: self._on_deposed(replica, node, reason)
        node.listeners.append(lambda *args: self._on_apply(replica, node, *args))
        replica.node = node
        replica.last_position = (-1, -1)
        replica.deposed = None
        replica.paused = False
        replica.elector_says_leader = self.elected == replica.name
        await node.boot()
        replica.last_position = node.position
        replica.changed = asyncio.Event()
        replica.changed.set()
        replica.manager = self._spawn(replica, self._manage(replica, node), "manager")

    def _spawn(self, replica: Replica, coro: Any, name: str) -> asyncio.Task[Any]:
        task = asyncio.create_task(coro, name=f"{replica.tag}-{name}")
        replica.tasks.add(task)
        task.add_done_callback(replica.tasks.discard)
        return task

    async def kill(self, replica: Replica) -> None:
        """kill -9: no cleanup; its store loses what was not synced; its tasks stop."""
        node = replica.node
        assert node is not None and replica.store is not None and replica.ledger_list
        self.stats["kills"] += 1
        replica.ledger_list.dead = True
        stored = sum(len(ledger.entries) for ledger in self.archive.values())
        replica.store.crash()
        if sum(len(ledger.entries) for ledger in self.archive.values()) < stored:
            self.stats["kill lost unsynced entries"] += 1
        replica.node = None
        replica.elector_says_leader = False
        if self.elected == replica.name:
            self.elected = None  # its ZooKeeper session expires
        term = node.leader
        tasks = [
            *replica.tasks,
            *node._background,
            *(term.tasks if term is not None else []),
            *([term.roll_task] if term is not None and term.roll_task is not None else []),
        ]
        for _ in range(20):
            pending = [t for t in tasks if not t.done()]
            if not pending:
                break
            for task in pending:
                task.cancel()
            await asyncio.sleep(0)
        else:
            fail(f"tasks of killed {replica.tag} keep running: {pending}")
        replica.tasks.clear()
        replica.manager = replica.follow_task = None

    # --- the per-replica manager (mirrors broker/server/cluster.py) ---------------------------

    async def _manage(self, replica: Replica, node: Node) -> None:
        while replica.node is node:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(1.0):
                    await replica.changed.wait()
            replica.changed.clear()
            await self._manage_step(replica, node)

    async def _manage_step(self, replica: Replica, node: Node) -> None:
        if replica.deposed is not None:
            reason, replica.deposed = replica.deposed, None
            await node.step_down(reason)
            self.requeue(replica)
        if replica.elector_says_leader and node.role == Role.LEADER and not node.writable:
            # Deposed, then elected again before this step ran: lead afresh. (cluster.py's
            # _step has no such case: such a node stays a deposed leader.)
            self.stats["deposed and re-elected"] += 1
            await node.step_down("deposed before being elected again")
        if replica.elector_says_leader and node.role not in (Role.LEADER, Role.CANDIDATE):
            await self._take_over(replica, node)
        elif not replica.elector_says_leader and node.role in (Role.LEADER, Role.CANDIDATE):
            await node.step_down("lost the election or the ZooKeeper connection")
        if node.role in (Role.FOLLOWER, Role.IDLE) and not replica.paused:
            await self._ensure_following(replica, node)

    def requeue(self, replica: Replica) -> None:
        """Back of the leader queue: another live replica gets the lock if there is one."""
        replica.elector_says_leader = False
        if self.elected == replica.name:
            others = [r for r in self.replicas if r.alive and r is not replica]
            self.elect(self.rng.choice(others) if others else replica)

    def elect(self, replica: Replica) -> None:
        node = replica.node
        stale = node is not None and node.role in (Role.LEADER, Role.CANDIDATE)
        if self.elected != replica.name and (replica.elector_says_leader or stale):
            # Leading from an older term: the elector reports the lost lock before it
            # wins the lock again.
            self.report_lost_lock(replica)
        self.elected = replica.name
        replica.elector_says_leader = True
        replica.changed.set()

    def report_lost_lock(self, replica: Replica) -> None:
        """broker/server/cluster.py's status watcher: no longer the leader -> depose at once."""
        replica.elector_says_leader = False
        node = replica.node
        if node is not None and node.role in (Role.LEADER, Role.CANDIDATE):
            node.depose("lost the election or the ZooKeeper connection")
        replica.changed.set()

    def _session_expired(self, replica: Replica, node: Node) -> None:
        if replica.node is node and replica.elector_says_leader and self.elected != replica.name:
            self.stats["stale elector expired"] += 1
            self.report_lost_lock(replica)

    async def _take_over(self, replica: Replica, node: Node) -> None:
        await self._stop_following(replica)
        try:
            await node.recover_log()
        except HistoryGapError:
            self.stats["take-over: history gap"] += 1
            await node.step_down("history gap")
            await self._download_snapshot(replica, node)
            self.requeue(replica)
            return
        except (LedgerError, BrokerUnavailableError):
            self.stats["take-over: failed"] += 1
            await node.step_down("take-over failed")
            self.requeue(replica)
            return
        if not replica.elector_says_leader:
            await node.step_down("lost the election while taking over")
            return
        try:
            await node.open_for_writes()
        except (LedgerError, BrokerUnavailableError):
            self.stats["take-over: failed"] += 1
            await node.step_down("could not open a ledger")
            self.requeue(replica)
            return
        self.stats["take-overs"] += 1

    async def _ensure_following(self, replica: Replica, node: Node) -> None:
        if replica.node is not node:
            return
        task = replica.follow_task
        if task is not None and not task.done():
            return
        if task is not None:
            replica.follow_task = None
            failure = None if task.cancelled() else task.exception()
            if isinstance(failure, HistoryGapError):
                self.stats["follower: history gap"] += 1
                await self._download_snapshot(replica, node)
            elif isinstance(failure, LedgerError):
                self.stats["follower: ledger error"] += 1  # a ledger deleted under it
                await asyncio.sleep(0.05)
            elif failure is not None:
                self.violation(
                    f"{replica.tag} follow() failed: "
                    + "".join(traceback.format_exception(failure, limit=-4))
                )
        replica.follow_task = self._spawn(replica, self._follow(replica, node), "follow")

    async def _follow(self, replica: Replica, node: Node) -> None:
        try:
            await node.follow()
        finally:
            replica.changed.set()

    async def _stop_following(self, replica: Replica) -> None:
        task, replica.follow_task = replica.follow_task, None
        if task is not None:
            task.cancel()
            # asyncio.wait: a cancellation of the caller itself is not swallowed.
            await asyncio.wait([task])
            if not task.cancelled():
                task.exception()

    async def _download_snapshot(self, replica: Replica, node: Node) -> None:
        """The peer download of broker/server/cluster.py: the newest snapshot any replica has."""
        best: tuple[tuple[int, int], Path] | None = None
        for peer in self.replicas:
            if peer is replica:
                continue
            info = SnapshotStore(peer.snapshot_dir, cluster_id=CLUSTER_ID).newest()
            if info is None:
                continue
            position = (info.header.ledger_id, info.header.entry_id)
            if best is None or position > best[0]:
                best = (position, info.path)
        if best is None or best[0] <= node.position:
            await asyncio.sleep(0.05)
            return
        self.downloads += 1
        download = self.root / "downloads" / f"{self.downloads}.snap"
        download.parent.mkdir(exist_ok=True)
        shutil.copyfile(best[1], download)
        node.snapshots.install(download)
        if await node.load_snapshot():
            self.stats["snapshot downloads"] += 1
            replica.last_position = node.position

    # --- client proposals -------------------------------------------------------------------

    def propose(self, replica: Replica) -> None:
        node = replica.node
        assert node is not None
        proposal = Proposal(len(self.proposals), replica.tag, self._next_seq())
        self.proposals.append(proposal)
        task = self._spawn(replica, self._propose(replica, node, proposal), "propose")
        self.proposal_tasks.add(task)
        task.add_done_callback(self.proposal_tasks.discard)

    def _next_seq(self) -> int:
        self.seq += 1
        return self.seq

    async def _propose(self, replica: Replica, node: Node, proposal: Proposal) -> None:
        def build(stamp: Stamp) -> e.Entry:
            self.generator.view = node.state
            self.generator.now_ms = stamp.now_ms
            entry = schedule_entry(self.rng, node.state, stamp, self.stats)
            if entry is None:
                entry, _expect = self.generator.next()
            entry = msgspec.structs.replace(entry, time_ms=stamp.now_ms)
            proposal.data = e.encode_entry(entry)
            return entry

        try:
            result = await node.propose(build)
        except BrokerUnavailableError:
            proposal.outcome = "refused"
            self.stats["proposals refused"] += 1
            return
        except asyncio.CancelledError:
            proposal.outcome = "killed"
            raise
        if replica.node is not node:
            self.violation(f"proposal {proposal.index} acknowledged by killed {proposal.target}")
        proposal.outcome = "acked"
        proposal.acked_seq = self._next_seq()
        proposal.result = encode_result(result)
        proposal.result_type = type(result).__name__
        if isinstance(result, list):
            proposal.accepted_ids = tuple(r.id for r in result if isinstance(r, TaskRef))
        self.stats["proposals acked"] += 1
        if isinstance(result, Rejected) or (
            isinstance(result, list) and any(isinstance(r, Rejected) for r in result)
        ):
            self.stats["acked with a rejection"] += 1
