"""The replicated simulation's schedule and settle-point checks (tests/sim/test_replicated.py):
proposals, clock jumps, leader changes, kills, restarts, pauses, snapshots and power
losses; at each settle point the digests, acknowledged entries and fencing are checked.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import traceback
from collections import Counter
from collections.abc import Callable
from typing import Any

import msgspec

from broker.core import entries as e
from broker.replication.node import Role
from log.api import LedgerState
from tests.support.sim_cluster import ReplicaCluster
from tests.support.sim_common import SimulationFailure, encode_result, fail
from tests.support.sim_schedules import check_schedules, count_firing
from tests.support.sim_virtual import (
    POLL_S,
    SETTLE_TIMEOUT_S,
    Replica,
    VirtualTimeLoop,
    cancel_leftovers,
    quiet_logs,
)


class Simulation(ReplicaCluster):
    """A seeded schedule of proposals and faults over a ReplicaCluster, checked at every
    settle point."""

    # --- the schedule -----------------------------------------------------------------------

    def live(self) -> list[Replica]:
        return [r for r in self.replicas if r.alive]

    async def run(self) -> Counter[str]:
        for replica in self.replicas:
            await self.start_replica(replica)
        self.elect(self.rng.choice(self.replicas))
        actions: list[tuple[Callable[[], Any], float]] = [
            (self.act_propose, 40),
            (self.act_idle, 12),
            (self.act_clock_jump, 4),
            (self.act_leader_change, 6),
            (self.act_kill, 3),
            (self.act_kill_leader_mid_write, 2),
            (self.act_restart, 4),
            (self.act_pause, 3),
            (self.act_resume, 3),
            (self.act_snapshot, 4),
            (self.act_power_loss, 0.4),
            (self.act_settle, 3),
        ]
        functions = [a for a, _ in actions]
        weights = [w for _, w in actions]
        for step in range(self.steps):
            self.step = step
            action = self.rng.choices(functions, weights)[0]
            self.stats[f"action {action.__name__}"] += 1
            await action()
            await asyncio.sleep(self.rng.choice((0, 0.0005, 0.001, 0.003, 0.01, 0.03)))
            for replica in self.live():
                self._check_position(replica)
            self.raise_violations()
        self.step = self.steps
        await self.act_power_loss()
        await self.settle(final=True)
        for replica in self.live():
            await self.kill(replica)
        self.stats["entries committed"] = len(self.ref_log)
        fingerprint = hashlib.sha256(b"".join(data for _, data in self.ref_log)).digest()
        self.stats[f"log fingerprint {fingerprint[:8].hex()}"] = 1
        self.stats["ledgers"] = len(self.archive)
        return self.stats

    async def act_propose(self) -> None:
        live = self.live()
        if not live:
            return
        leader = self.by_name.get(self.elected or "")
        for _ in range(self.rng.choice((1, 1, 2, 4, 8, 16))):
            if leader is not None and leader.alive and self.rng.random() < 0.85:
                target = leader
            else:
                target = self.rng.choice(live)  # a stale leader or a follower
            self.propose(target)

    async def act_idle(self) -> None:
        await asyncio.sleep(self.rng.choice((0.005, 0.02, 0.1, 0.5)))

    async def act_clock_jump(self) -> None:
        self.offset_ms += self.rng.choice((100, 1_000, 10_000, 120_000, 7_200_000, 50 * 3_600_000))

    async def act_leader_change(self) -> None:
        live = self.live()
        old = self.by_name.get(self.elected or "")
        candidates = [r for r in live if r is not old]
        if not candidates:
            return
        new = self.rng.choice(candidates)
        if old is not None and old.alive:
            mode = self.rng.choice(("polite", "silent", "stale"))
            self.stats[f"leader change {mode}"] += 1
            if mode == "polite":
                self.report_lost_lock(old)
            elif mode == "silent":
                old.elector_says_leader = False  # its watcher has not fired yet
            else:
                # Its elector still says leader (kazoo's Lock during a partition) until
                # the session expires; meanwhile only ZooKeeper or fencing tell it.
                delay_s = self.rng.choice((0.05, 0.3, 1.0, 3.0))
                loop = asyncio.get_running_loop()
                loop.call_later(delay_s, self._session_expired, old, old.node)
        else:
            self.stats["leader change after a kill"] += 1
        self.elect(new)

    async def act_kill(self) -> None:
        live = self.live()
        if len(live) < 2:
            return
        await self.kill(self.rng.choice(live))

    async def act_kill_leader_mid_write(self) -> None:
        """Kill the leader while a batch is written but not synced yet: followers may
        have read entries the crash then erases (they must not have applied them)."""
        leader = self.by_name.get(self.elected or "")
        if leader is None or not leader.alive or len(self.live()) < 2:
            return
        for _ in range(self.rng.choice((1, 4, 16))):
            self.propose(leader)
        await asyncio.sleep(self.rng.choice((0, 0.5, 1.0, 1.5)) * self.sync_delay_s)
        if leader.alive:
            await self.kill(leader)

    async def act_restart(self) -> None:
        dead = [r for r in self.replicas if not r.alive]
        if dead:
            await self.start_replica(self.rng.choice(dead))
            self.stats["restarts"] += 1
        if self.elected is None and self.rng.random() < 0.8:
            self.elect(self.rng.choice(self.live()))

    async def act_pause(self) -> None:
        followers = [r for r in self.live() if not r.paused and r.name != self.elected]
        if followers:
            replica = self.rng.choice(followers)
            replica.paused = True
            self.stats["follower paused"] += 1
            await self._stop_following(replica)

    async def act_resume(self) -> None:
        paused = [r for r in self.live() if r.paused]
        if paused:
            replica = self.rng.choice(paused)
            replica.paused = False
            replica.changed.set()

    async def act_snapshot(self) -> None:
        live = self.live()
        if live:
            replica = self.rng.choice(live)
            assert replica.node is not None
            if replica.node.position < (0, 0):
                return  # nothing applied yet: nothing to snapshot
            task = self._spawn(replica, replica.node.take_snapshot(), "snapshot")
            self.stats["snapshots"] += 1
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def act_power_loss(self) -> None:
        self.stats["power losses"] += 1
        for replica in self.live():
            await self.kill(replica)
        for replica in self.replicas:
            await self.start_replica(replica)
        self.elect(self.rng.choice(self.replicas))

    async def act_settle(self) -> None:
        await self.settle(final=False)

    # --- settle and check -------------------------------------------------------------------

    async def _wait_for(self, what: Callable[[], str] | str, condition: Callable[[], bool]) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + SETTLE_TIMEOUT_S
        while not condition():
            self.raise_violations()
            if loop.time() > deadline:
                described = what if isinstance(what, str) else what()
                fail(f"timed out ({SETTLE_TIMEOUT_S} virtual s) waiting for {described}")
            await asyncio.sleep(POLL_S)

    def _healthy_leader(self) -> Replica | None:
        leader = self.by_name.get(self.elected or "")
        if leader is None or leader.node is None:
            return None
        node = leader.node
        if not (node.role == Role.LEADER and node.writable and leader.elector_says_leader):
            return None
        if self.shared_list.last_writer != leader.tag:
            return None
        return leader

    async def settle(self, *, final: bool) -> None:
        self.stats["settles"] += 1
        if final:
            for replica in self.replicas:
                if not replica.alive:
                    await self.start_replica(replica)
                if replica.paused:
                    replica.paused = False
                    replica.changed.set()
        await self._wait_for("proposals to finish", lambda: not self.proposal_tasks)
        self.frozen_at_ms = self._loop_ms()
        try:
            await self._settle_frozen()
        finally:
            self.frozen_at_ms = None

    async def _settle_frozen(self) -> None:
        # Who the elector picked stays; stale leaders learn they are not (their watcher).
        elected = self.by_name.get(self.elected or "")
        if elected is None or not elected.alive:
            self.elect(self.rng.choice(self.live()))
        for replica in self.live():
            if replica.name != self.elected and replica.elector_says_leader:
                replica.elector_says_leader = False
                replica.changed.set()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + SETTLE_TIMEOUT_S
        while self._healthy_leader() is None:
            self.raise_violations()
            if loop.time() > deadline:
                fail("no healthy leader after settling: " + self._describe())
            await asyncio.sleep(POLL_S)
        leader = self._healthy_leader()
        assert leader is not None and leader.node is not None
        lnode = leader.node

        def quiet() -> bool:
            # Idle: nothing in flight, and a Confirm marker after the last real entry.
            term = lnode.leader
            if self._healthy_leader() is not leader or term is None or term.inflight:
                return False
            due_ms = lnode.state.next_timer_ms()
            if due_ms is not None and due_ms <= lnode.clock_ms():
                return False  # the timer loop is about to propose a Tick
            if any(
                s.next_ms <= lnode.clock_ms() and s.paused_ms is None
                for s in lnode.state.schedules.values()
            ):
                return False  # the schedule loop is about to fire (a paused one: never)
            return term.last_real_position == term.marked_position

        await self._wait_for("the leader to go idle", quiet)
        await asyncio.sleep(0.02)  # the marker's own sync
        self._advance_reference(leader)
        digest = self.reference.digest()
        if lnode.state.digest() != digest:
            fail(f"leader {leader.tag} digest differs from the committed log's replay")
        followers = [r for r in self.live() if r is not leader and not r.paused]

        def caught_up() -> bool:
            return all(r.node is not None and r.node.state.digest() == digest for r in followers)

        def behind() -> str:
            lagging = [
                f"{r.tag} at {r.node.position} (leader at {lnode.position})"
                for r in followers
                if r.node is not None and r.node.state.digest() != digest
            ]
            return "followers to reach the committed state: " + "; ".join(lagging)

        await self._wait_for(behind, caught_up)
        for replica in self.live():
            assert replica.node is not None
            replica.node.state.check_invariants()
        self._check_acknowledged([*followers, leader])
        self._check_fencing()
        if (problem := check_schedules(self.reference, lnode.clock_ms())) is not None:
            fail(problem)
        self.raise_violations()

    def _describe(self) -> str:
        parts = [f"elected={self.elected}", f"list writer={self.shared_list.last_writer}"]
        for r in self.replicas:
            node = r.node
            if node is None:
                parts.append(f"{r.tag}: dead")
                continue
            parts.append(
                f"{r.tag}: role={node.role} writable={node.writable} "
                f"elector={r.elector_says_leader} position={node.position}"
            )
        return "; ".join(parts)

    def _committed_log(self, leader: Replica) -> list[tuple[tuple[int, int], bytes]]:
        assert leader.node is not None
        current = self.shared_list.current
        open_ids = [i.ledger_id for i in current.ledgers if i.state != LedgerState.CLOSED]
        log: list[tuple[tuple[int, int], bytes]] = []
        for ledger_id in sorted(self.shared_list.ever_listed):
            ledger = self.archive[ledger_id]
            if ledger_id in self.shared_list.closed_at:
                last = self.shared_list.closed_at[ledger_id]
            elif open_ids == [ledger_id] and current.ledgers[-1].ledger_id == ledger_id:
                # The settled leader's ledger: it applied everything durable in it.
                last = len(ledger.entries) - 1
                position = leader.node.position
                if last >= 0 and position != (ledger_id, last):
                    fail(
                        f"idle leader {leader.tag} at {position} but its ledger "
                        f"{ledger_id} holds entries up to {last}"
                    )
            else:
                fail(f"ledger {ledger_id} left {open_ids} open while a leader is settled")
            if len(ledger.entries) < last + 1:
                fail(f"ledger {ledger_id} closed at {last} holds {len(ledger.entries)} entries")
            log += [((ledger_id, x.entry_id), x.data) for x in ledger.entries[: last + 1]]
        return log

    def _advance_reference(self, leader: Replica) -> None:
        log = self._committed_log(leader)
        known = len(self.ref_log)
        if log[:known] != self.ref_log:
            for i, (old, new) in enumerate(zip(self.ref_log, log, strict=False)):
                if old != new:
                    fail(f"the committed log changed at {old[0]}: now {new[0]} (index {i})")
            fail(f"the committed log shrank from {known} to {len(log)} entries")
        for position, data in log[known:]:
            record = e.decode_record(data)
            self.ref_log.append((position, data))
            if isinstance(record, e.Confirm):
                continue
            self.reference.position = position  # as the applier does (webhook outboxes)
            result = self.reference.apply(record).result
            if (problem := count_firing(self.stats, self.reference, record, result)) is not None:
                fail(problem)
            self.ref_results[position] = (type(result).__name__, encode_result(result))
            self.positions_by_data.setdefault(data, []).append(position)

    def _check_acknowledged(self, replicas: list[Replica]) -> None:
        acked = [p for p in self.proposals if p.outcome == "acked"]
        need = Counter(p.data for p in acked)
        for data, count in need.items():
            assert data is not None
            have = len(self.positions_by_data.get(data, ()))
            if have < count:
                proposal = next(p for p in acked if p.data == data)
                fail(
                    f"acknowledged entry lost: proposal {proposal.index} via "
                    f"{proposal.target} ({count} acknowledged, {have} committed): "
                    f"{e.decode_entry(data)!r}"[:600]
                )
        for p in acked:
            assert p.data is not None
            results = {self.ref_results[pos] for pos in self.positions_by_data[p.data]}
            if (p.result_type, p.result) not in results:
                fail(
                    f"proposal {p.index} via {p.target} was answered "
                    f"{p.result_type} {msgspec.msgpack.decode(p.result or b'')!r} but the "
                    f"committed log gives {sorted(results)!r}"[:800]
                )
        # Real-time order: acknowledged before another was sent -> earlier in the log.
        unique = [p for p in acked if len(self.positions_by_data[p.data or b""]) == 1]
        position = {p.index: self.positions_by_data[p.data or b""][0] for p in unique}
        by_ack = sorted(unique, key=lambda p: p.acked_seq)
        latest: tuple[int, int] = (-1, -1)
        latest_index = -1
        i = 0
        for p in sorted(unique, key=lambda p: p.called_seq):
            while i < len(by_ack) and by_ack[i].acked_seq < p.called_seq:
                if position[by_ack[i].index] > latest:
                    latest, latest_index = position[by_ack[i].index], by_ack[i].index
                i += 1
            if latest >= position[p.index]:
                fail(
                    f"proposal {p.index} sent after proposal {latest_index} was acknowledged "
                    f"is before it in the log ({position[p.index]} <= {latest})"
                )
        for p in acked:
            for task_id in p.accepted_ids:
                if task_id in self.reference.deleted:
                    continue
                for replica in replicas:
                    assert replica.node is not None
                    if task_id not in replica.node.state.tasks:
                        fail(
                            f"task {task_id} acknowledged to proposal {p.index} is missing "
                            f"on {replica.tag}"
                        )

    def _check_fencing(self) -> None:
        for ledger_id, last in self.shared_list.closed_at.items():
            stored = len(self.archive[ledger_id].entries)
            if stored != last + 1:
                fail(
                    f"ledger {ledger_id} closed at entry {last} stores {stored} entries: "
                    "a writer kept appending after it was recovered (not fenced)"
                )


def run_seed(
    make: Callable[[], Simulation],
    seed: int,
    steps: int,
    *,
    name: str,
    reproduce: str,
    final: str = "in the final check",
    expected: type[BaseException] = SimulationFailure,
) -> Counter[str]:
    """Run ``make()``'s simulation on a fresh virtual-time loop; on any error raise a
    SimulationFailure naming the seed, the step (or ``final``), the virtual time and the
    command that reproduces it (``reproduce``: the pytest arguments), with a traceback
    unless the error is ``expected``."""
    loop = VirtualTimeLoop()
    sim = make()
    try:
        with quiet_logs():
            return loop.run_until_complete(sim.run())
    except Exception as exc:
        where = f"at step {sim.step}" if sim.step < steps else final
        crash = ""
        if not isinstance(exc, expected):
            crash = "\n" + "".join(traceback.format_exception(exc, limit=-8))
        raise SimulationFailure(
            f"{name} seed {seed} failed {where} (virtual time {loop.time():.3f} s): "
            f"{type(exc).__name__}: {exc}\n"
            f"reproduce with STEWARD_SIM_SEED={seed} .venv/bin/pytest {reproduce}{crash}"
        ) from exc
    finally:
        with contextlib.suppress(Exception):
            cancel_leftovers(loop)
        loop.close()
