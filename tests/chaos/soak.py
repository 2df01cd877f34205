"""Chaos soak (issue 7, acceptance 3): a cluster under load while a seeded schedule of faults
hits it, then a check that nothing acknowledged was lost or run twice.

A 3-broker cluster (real ``steward broker`` processes on a real ZooKeeper, file or pulsar
ledgers) and 2 real workers run short tasks (``chaos_tasks:record``, a code artifact that
appends start, done and end records of (task id, attempt) to a shared file) while several
client threads submit them through the multi-URL :class:`~clients.client.StewardClient`
with idempotency keys. ``random.Random(seed)`` draws the fault schedule: kill -9 a broker
(the leader or a follower) and restart it on its data dir, SIGSTOP a broker (sometimes
past the session timeout) then SIGCONT, kill -9 a worker and start a new one, SIGSTOP a
worker, restart ZooKeeper (crash or clean stop, same port and data), SIGTERM the leader,
keep a follower down past retention, kill a broker during its start, start one while
ZooKeeper is down, kill or pause pulsar-lite, freeze a worker holding a long task until
its re-run starts elsewhere (a zombie; tests/chaos/soak_faults.py), with random gaps.
Normally at most one broker is down or frozen; sometimes a second one goes too, rarely
all three (no leader at all for a while). Every fault and recovery is printed as it happens.

Afterwards (faults healed, load stopped, bounded waits; tests/chaos/soak_checks.py):
every acknowledged task is on the leader as submitted and ends ``finished`` (``cancelled``
only when the load asked); the drain bound grows with the backlog and names stuck tasks;
no submission became two tasks; no (task, attempt) ran twice; a finished task's result is
from its last attempt, also after a zombie (a stale attempt that ran alongside its
re-run); tree children and transactions are whole; all brokers report the same digest; a
snapshot at the final position passes the invariants with the leader's digest; no two
brokers claimed to lead at once; each outage of the leader alone stayed within the
session timeout plus a margin; rolls, retention deletes, snapshot downloads and zombie
overlaps all happened. docs/TESTING.md ("Chaos soak") has the details.

The seed fixes every draw of the schedule (kind, gap, duration, target choice; see
:class:`FaultDraw`); whether a drawn fault can land (at most so many brokers down) and
which broker leads at that moment depend on the run's timing.

The long version::

    python -m tests.chaos.soak --seed 7 --faults 500 [--ledgers file|pulsar|apache-pulsar]
        [--keep DIR]

The configuration, fault draw, fault log and client load are in tests/chaos/soak_parts.py.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import heapq
import itertools
import os
import random
import shutil
import signal
import sys
import tempfile
import threading
import time
import traceback
from collections import Counter
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx

from broker.core import StateMachine
from clients.client import StewardClient
from clients.dev.zk import ZooKeeperServer
from snapshot.format import read_snapshot
from tests.chaos.soak_checks import (
    check_counted,
    check_effects,
    check_final_states,
    check_outages,
    check_split_brain,
    check_tasks,
    check_transactions,
    check_trees,
    check_zombies,
    count_log_events,
    drain_bound_s,
    measure_outages,
    read_effects,
    stuck_tasks,
    zombie_overlaps,
)
from tests.chaos.soak_faults import ExtraFaults, _Pausable
from tests.chaos.soak_parts import (
    FINAL_STATES,
    LEDGERS,
    MAX_START_FAILURES,
    TASK_MODULE,
    ChaosLoad,
    FaultDraw,
    FaultLog,
    SoakConfig,
    SoakResult,
    _Recovery,
)
from tests.chaos.soak_watch import LeaderWatch
from tests.support.cluster_procs import (
    START_TIMEOUT_S,
    BrokerNode,
    ClusterError,
    ClusterProcesses,
    ClusterWorker,
)
from tests.support.pulsar_fixture import reserved_standalone
from tests.support.worker_procs import wait_until
from tests.support.write_load import fetch_tasks


class ChaosSoak(ExtraFaults):
    """One soak run (see the module docstring). ``run()`` raises AssertionError with the
    seed and the fault log when a check fails."""

    def __init__(
        self,
        config: SoakConfig,
        zookeeper: ZooKeeperServer,
        root: Path,
        *,
        pulsar_url: str | None = None,
        pulsar_admin_url: str | None = None,
        pulsar: _Pausable | None = None,
    ) -> None:
        if config.on_pulsar and pulsar_url is None:
            raise ValueError("the pulsar ledger backends need pulsar_url")
        if (config.ledgers == "apache-pulsar") != (pulsar_admin_url is not None):
            raise ValueError("pulsar_admin_url: for apache-pulsar (and only for it)")
        self.config = config
        self.zookeeper = zookeeper
        self.root = root
        self.pulsar_url = pulsar_url if config.on_pulsar else None
        # Apache Pulsar: brokers with --pulsar-flavor pulsar (ClusterProcesses).
        self.pulsar_admin_url = pulsar_admin_url
        self.rng = random.Random(config.seed)
        self.log = FaultLog(config.seed)
        # Tasks run under uids of their own (docs/SECURITY.md, "Task processes"): their
        # record file lives in a directory they can write (removed when the run ends).
        self.effects_dir = Path(tempfile.mkdtemp(prefix="steward-soak-effects-"))
        os.chmod(self.effects_dir, 0o1777)
        self.effects_path = self.effects_dir / "effects.jsonl"
        # Each tenant's tasks run under a uid of their own: all append to one file.
        self.effects_path.touch()
        os.chmod(self.effects_path, 0o666)
        self._pending: list[_Recovery] = []
        self._seq = itertools.count()
        self._worker_names = itertools.count(config.workers)
        self._start_failures: Counter[str] = Counter()
        self._starting: dict[str, float] = {}  # broker -> when its restart began
        self._healing = False  # healing everything: wait for each restart
        self._killed_workers: set[int] = set()  # id() of the worker processes killed
        self._worker_args = ("--task-type", f"*={config.worker_slots}")
        self.cluster: ClusterProcesses | None = None
        self.load: ChaosLoad | None = None
        self.pulsar = pulsar if config.on_pulsar else None
        self.leader_faults: list[tuple[str, float, bool]] = []  # (kind, when, nothing else down)
        self.other_faults: list[float] = []  # when other brokers or ZooKeeper went down
        self.zombie_thread: threading.Thread | None = None
        self.zombie_worker: str | None = None
        self.zombie_runs = 0
        self.watch: LeaderWatch | None = None

    # -- the run ------------------------------------------------------------------------------

    def run(self) -> SoakResult:
        print(f"chaos soak seed {self.config.seed} (rerun: --seed {self.config.seed})", flush=True)
        started = time.monotonic()
        cluster = ClusterProcesses(
            self.zookeeper.connect_string,
            self.root / "cluster",
            brokers=self.config.brokers,
            session_timeout_ms=self.config.session_timeout_ms,
            heartbeat_timeout_ms=self.config.heartbeat_timeout_ms,
            extra_args=(
                "--snapshot-interval-s",
                str(self.config.snapshot_interval_s),
                "--ledger-roll-age-s",
                str(self.config.ledger_roll_age_s),
                "--ledger-retention-h",
                str(self.config.ledger_retention_h),
            ),
            pulsar_url=self.pulsar_url,
            pulsar_admin_url=self.pulsar_admin_url,
        )
        with cluster:
            self.cluster = cluster
            try:
                result = self._run(cluster, started)
            except BaseException:
                print(f"\nchaos soak FAILED with seed {self.config.seed}", flush=True)
                print(self.log.dump(), flush=True)
                if self.load is not None:
                    with contextlib.suppress(AssertionError):  # the first error matters
                        self.load.stop()
                raise
            finally:
                if self.watch is not None:
                    self.watch.stop()
                shutil.rmtree(self.effects_dir, ignore_errors=True)
        print(self.log.dump(), flush=True)
        print(result.summary(), flush=True)
        return result

    def _run(self, cluster: ClusterProcesses, started: float) -> SoakResult:
        config = self.config
        leader = cluster.wait_for_leader(60)
        self.log.note("leader", leader.broker_id, leader.pid)
        with StewardClient(cluster.urls(), timeout_s=10, failover_timeout_s=60) as client:
            code_sha = client.upload_code(TASK_MODULE)
        workers = [self._start_worker(f"w{i}") for i in range(config.workers)]
        cluster.wait_workers_connected([w.worker_id for w in workers], 60)
        self.load = ChaosLoad(
            cluster.urls(),
            seed=config.seed,
            code_sha=code_sha,
            effects_path=self.effects_path,
            config=config,
        ).start()
        load = self.load
        self.watch = LeaderWatch(
            lambda: {n.broker_id: n.url for n in cluster.nodes.values()},
            self.zookeeper.connect_string,
            cluster.name,
        ).start()
        wait_until(lambda: load.acked_count() >= 20, 60, "20 acknowledged tasks before the faults")

        injected = 0
        kinds = config.fault_weights()
        zombies = 0
        while injected < config.faults:
            self._recover_due()
            draw = FaultDraw.draw(self.rng, config)
            self._sleep_recovering(draw.gap_s)
            # Not in the last faults (unless none ran yet): a zombie run takes ~30 s.
            late = injected > config.faults - 10 and zombies > 0
            due = injected >= zombies * config.zombie_every and not late
            if due and self._start_zombie(zombies):
                zombies += 1
            missing = sorted(set(kinds) - set(self.log.faults))
            if config.faults - injected <= len(missing):
                # Every kind of fault at least once, however short the run.
                draw = dataclasses.replace(draw, kind=missing[draw.index % len(missing)])
            if self._inject(draw):
                injected += 1
            self._check_alive()
        self.log.note("faults over", "-", None, f"{injected} faults; healing everything")
        if self.zombie_thread is not None:
            self.zombie_thread.join(config.settle_timeout_s)
            assert not self.zombie_thread.is_alive(), "the zombie run did not end"
        self._heal_all()
        self._check_alive()
        healed_at = time.monotonic()
        acked_then = load.acked_count()
        wait_until(
            lambda: load.acked_count() >= acked_then + 20,
            config.settle_timeout_s,
            "20 more acknowledged tasks after the faults",
            pause_s=0.2,
        )
        load.stop()
        self.log.note(
            "load stopped",
            "-",
            None,
            f"{len(load.acked)} acknowledged of {len(load.attempted)} attempted; "
            f"retried {dict(load.retries)}; progress {time.monotonic() - healed_at:.1f} s "
            "after healing",
        )
        return self._check(cluster, load, started)

    # -- faults -------------------------------------------------------------------------------

    def _faulted_brokers(self) -> set[str]:
        kinds = ("restart_broker", "await_broker", "cont_broker")
        return {r.target for r in self._pending if r.kind in kinds}

    def _faulted_workers(self) -> set[str]:
        found = {r.target for r in self._pending if r.kind in ("start_worker", "cont_worker")}
        return found | ({self.zombie_worker} if self.zombie_worker is not None else set())

    def _pending_kinds(self) -> list[str]:
        return [r.kind for r in self._pending]

    def _quiet(self) -> bool:
        """Nothing else is down or frozen (an outage now is this fault's alone)."""
        return not any(
            r.kind
            in ("restart_broker", "cont_broker", "start_zookeeper", "start_pulsar", "cont_pulsar")
            for r in self._pending
        )

    def _schedule(self, delay_s: float, kind: str, target: str) -> None:
        heapq.heappush(
            self._pending, _Recovery(time.monotonic() + delay_s, next(self._seq), kind, target)
        )

    def _pick_broker(self, draw: FaultDraw) -> tuple[BrokerNode, str] | None:
        """The leader when the draw prefers it (and one is known), else any healthy broker;
        with its role."""
        assert self.cluster is not None
        faulted = self._faulted_brokers()
        candidates = [n for n in self.cluster.live() if n.broker_id not in faulted]
        if not candidates:
            return None
        leader = self.cluster.leader()
        if draw.leader and leader is not None and leader in candidates:
            return leader, "leader"
        node = candidates[draw.index % len(candidates)]
        return node, "leader" if node is leader else "follower"

    def _inject(self, draw: FaultDraw) -> bool:
        """Inject the drawn fault if the cluster's state allows it now."""
        assert self.cluster is not None
        config = self.config
        kind = draw.kind
        session_s = config.session_timeout_ms / 1000
        if self.zombie_worker is not None:
            # A zombie is being arranged: its re-run needs one leader for a heartbeat
            # timeout (a new leader judges a worker it never saw from its own start), so
            # other faults wait until the re-run started or its wait ended.
            return False
        if kind in ("kill_broker", "stop_broker"):
            # Mostly one broker down or frozen at a time (the others make progress); now
            # and then a second one too, rarely all of them (no leader at all for a while).
            faulted = len(self._faulted_brokers())
            allowed = faulted == 0 or (faulted == 1 and draw.allow < 0.25) or draw.allow < 0.1
            picked = self._pick_broker(draw) if allowed else None
            if picked is None:
                return False
            node, role = picked
            pid = node.pid
            down = faulted + 1
            if role == "leader":
                self.leader_faults.append((kind, time.monotonic(), self._quiet()))
            else:
                self.other_faults.append(time.monotonic())
            if kind == "kill_broker":
                down_s = 0.2 + 5.8 * draw.duration
                node.kill9()
                self.log.fault(
                    kind, node.broker_id, pid, f"{role}; restart in {down_s:.2f} s; {down} down"
                )
                self._schedule(down_s, "restart_broker", node.broker_id)
            else:
                if draw.variant < 0.4:  # past the session timeout: the leader is replaced
                    down_s = session_s + 0.5 + (session_s - 0.5) * draw.duration
                else:
                    down_s = 0.3 + 1.7 * draw.duration
                node.sigstop()
                self.log.fault(
                    kind, node.broker_id, pid, f"{role}; SIGCONT in {down_s:.2f} s; {down} down"
                )
                self._schedule(down_s, "cont_broker", node.broker_id)
            return True
        if kind in ("kill_worker", "stop_worker"):
            heartbeat_s = config.heartbeat_timeout_ms / 1000
            faulted_ids = self._faulted_workers()
            candidates = [
                w
                for w in self._current_workers()
                if w.running() and not w.stopped and w.worker_id not in faulted_ids
            ]
            if not candidates or (faulted_ids and draw.allow >= 0.3):
                return False
            worker = candidates[draw.index % len(candidates)]
            pid = worker.pid
            if kind == "kill_worker":
                down_s = 0.2 + 2.8 * draw.duration
                worker.kill9()
                self._killed_workers.add(id(worker))
                same_id = draw.variant < 0.5
                next_id = worker.worker_id if same_id else f"w{next(self._worker_names)}"
                self.log.fault(kind, worker.worker_id, pid, f"start {next_id} in {down_s:.2f} s")
                # The target names the dead worker; the replacement's id follows "->".
                self._schedule(down_s, "start_worker", f"{worker.worker_id}->{next_id}")
            else:
                # Up to 1.5 heartbeat timeouts: sometimes declared dead (tasks re-run).
                down_s = 0.5 + (1.5 * heartbeat_s - 0.5) * draw.duration
                worker.sigstop()
                self.log.fault(
                    kind,
                    worker.worker_id,
                    pid,
                    f"SIGCONT in {down_s:.2f} s (heartbeat timeout {heartbeat_s:.1f} s)",
                )
                self._schedule(down_s, "cont_worker", worker.worker_id)
            return True
        if kind == "restart_zookeeper":
            if any(r.kind == "start_zookeeper" for r in self._pending):
                return False
            down_s = 1.2 * session_s * draw.duration
            crash = draw.variant < 0.5
            zk_pid = self.zookeeper.pid
            self.other_faults.append(time.monotonic())
            if crash:
                self.zookeeper.kill9()
            else:
                self.zookeeper.stop()
            how = "kill -9" if crash else "clean stop"
            self.log.fault(kind, "zookeeper", zk_pid, f"{how}; start in {down_s:.2f} s")
            self._schedule(down_s, "start_zookeeper", "zookeeper")
            return True
        return self._inject_extra(draw)

    def _current_workers(self) -> list[ClusterWorker]:
        """The newest worker process of every worker id."""
        assert self.cluster is not None
        newest: dict[str, ClusterWorker] = {}
        for worker in self.cluster.workers:
            newest[worker.worker_id] = worker
        return list(newest.values())

    def _start_worker(self, worker_id: str) -> ClusterWorker:
        assert self.cluster is not None
        return self.cluster.start_worker(worker_id, *self._worker_args)

    # -- recoveries ---------------------------------------------------------------------------

    def _sleep_recovering(self, duration_s: float) -> None:
        end = time.monotonic() + duration_s
        while True:
            self._recover_due()
            left = end - time.monotonic()
            if left <= 0:
                return
            time.sleep(min(left, 0.05))

    def _recover_due(self, everything: bool = False) -> None:
        while self._pending and (everything or self._pending[0].due <= time.monotonic()):
            self._recover(heapq.heappop(self._pending))

    def _await_broker(self, target: str) -> None:
        """A restarted broker serves (done), still starts (look again), or exited: a start
        without ZooKeeper is tried again (bounded), else it is a failure."""
        assert self.cluster is not None
        node = self.cluster.node(target)
        if node.running():
            if self._healing:
                node.wait_serving()
            elif node.health() is None:
                if time.monotonic() - self._starting[target] > START_TIMEOUT_S:
                    raise ClusterError(f"{target} did not serve within {START_TIMEOUT_S} s")
                self._schedule(0.3, "await_broker", target)
                return
            self.log.note("restart broker", target, node.pid, f"http {node.http_port}")
            return
        self._start_failures[target] += 1
        tail = node.log_tail(3000)
        if "address already in use" in tail.lower():
            self.cluster.restart(target)  # new ports (rare): the blocking start handles it
            self.log.note("restart broker", target, node.pid, f"http {node.http_port}")
            return
        if (
            "cannot reach ZooKeeper" not in tail
            or self._start_failures[target] > MAX_START_FAILURES
        ):
            raise ClusterError(f"broker {target} exited during its start\n{tail}")
        self.log.note("restart failed", target, None, "cannot reach ZooKeeper; again")
        self._schedule(1.0, "restart_broker", target)

    def _recover(self, recovery: _Recovery) -> None:
        assert self.cluster is not None
        kind, target = recovery.kind, recovery.target
        if kind == "restart_broker":
            node = self.cluster.node(target)
            # A broker that cannot reach ZooKeeper at start exits (code 2): like a
            # supervisor, start it again once ZooKeeper is back.
            zookeeper_due = [r.due for r in self._pending if r.kind == "start_zookeeper"]
            if zookeeper_due or not self.zookeeper.is_running():
                if not node.running():
                    # Started while ZooKeeper is down: it waits for ZooKeeper or exits
                    # (code 2); once ZooKeeper is back it must serve (or be restarted).
                    node.spawn()
                    self.log.fault("restart_zk_down", target, node.pid, "ZooKeeper is down")
                due = max([time.monotonic(), *zookeeper_due]) + 0.1
                heapq.heappush(self._pending, _Recovery(due, next(self._seq), kind, target))
                return
            if not node.running():
                node.spawn()
            # Not waited for here (a start takes seconds on a loaded machine and the
            # schedule goes on meanwhile): "await_broker" checks on it.
            self._starting[target] = time.monotonic()
            self._schedule(0.3, "await_broker", target)
        elif kind == "await_broker":
            self._await_broker(target)
        elif kind == "cont_broker":
            node = self.cluster.node(target)
            if node.running():
                node.sigcont()
                self.log.note("SIGCONT broker", target, node.pid)
        elif kind == "start_worker":
            old_id, new_id = target.split("->")
            worker = self._start_worker(new_id)
            self.log.note("start worker", new_id, worker.pid, f"(replaces {old_id})")
        elif kind == "cont_worker":
            worker = next(w for w in self._current_workers() if w.worker_id == target)
            if worker.running():
                worker.sigcont()
                self.log.note("SIGCONT worker", target, worker.pid)
        elif kind == "start_zookeeper":
            self.zookeeper.start()
            self.log.note("start zookeeper", "zookeeper", self.zookeeper.pid)
        elif not self._recover_extra(kind):
            raise ValueError(f"unknown recovery {kind!r}")

    def _heal_all(self) -> None:
        """Run every pending recovery now, then make sure everything runs unfrozen."""
        assert self.cluster is not None
        self._healing = True
        self._recover_due(everything=True)
        if not self.zookeeper.is_running():
            self.zookeeper.start()
        for node in self.cluster.nodes.values():
            if node.running() and node.stopped:
                node.sigcont()
            if not node.running():
                self.cluster.restart(node.broker_id)
        running = [w for w in self._current_workers() if w.running()]
        for worker in running:
            if worker.stopped:
                worker.sigcont()
        for _ in range(self.config.workers - len(running)):
            self._start_worker(f"w{next(self._worker_names)}")

    def _check_alive(self) -> None:
        """Only the faults end processes: a broker or worker that exited by itself crashed."""
        assert self.cluster is not None
        faulted = self._faulted_brokers()
        for node in self.cluster.nodes.values():
            if not node.running() and node.broker_id not in faulted:
                raise AssertionError(f"broker {node.broker_id} exited by itself\n{node.log_tail()}")
        for worker in self.cluster.workers:
            if not worker.running() and id(worker) not in self._killed_workers:
                raise AssertionError(
                    f"worker {worker.worker_id} exited by itself\n{worker.log_tail()}"
                )
        load = self.load
        if load is not None and not load.stopping():
            dead = load.dead_threads()
            assert not dead, f"load threads {dead} died"

    # -- checks -------------------------------------------------------------------------------

    def _check(self, cluster: ClusterProcesses, load: ChaosLoad, started: float) -> SoakResult:
        config = self.config
        problems: list[str] = []
        problems += [f"unexpected client error: {u}" for u in load.unexpected[:10]]
        leader = cluster.wait_for_leader(config.settle_timeout_s)
        self.log.note("leader", leader.broker_id, leader.pid, "(after the faults)")
        acked = {a.task_id: key for key, a in load.acked.items()}
        # The drain may take in proportion to the backlog, at the rate runs ended while the
        # load ran (docs/TESTING.md, "Chaos soak").
        ended = sum(1 for e in read_effects(self.effects_path) if e["event"] == "end")
        rate = ended / max(1.0, time.monotonic() - started)
        backlog = len(stuck_tasks(acked, fetch_tasks(leader)))
        bound_s = drain_bound_s(backlog, rate, floor_s=config.drain_floor_s)
        self.log.note(
            "drain", "-", None, f"{backlog} not final; {rate:.1f} runs/s; bound {bound_s:.0f} s"
        )
        drain_started = time.monotonic()

        def drained() -> dict[int, dict[str, Any]] | None:
            current = cluster.leader()
            if current is None:
                return None
            try:
                tasks = fetch_tasks(current)
            except (httpx.TransportError, httpx.HTTPStatusError):
                return None
            # Every task, not only the acknowledged ones: tree children too (a root can be
            # final while the children its last run spawned still run).
            unfinished = any(t["state"] not in FINAL_STATES for t in tasks.values())
            return None if unfinished or stuck_tasks(acked, tasks) else tasks

        try:
            tasks: dict[int, dict[str, Any]] = wait_until(
                drained, bound_s, "every acknowledged task to be final", 0.5
            )
        except AssertionError:
            tasks = fetch_tasks(cluster.wait_for_leader(config.settle_timeout_s))
            stuck = stuck_tasks(acked, tasks)
            problems.append(
                f"{len(stuck)} acknowledged tasks stuck (not final {bound_s:.0f} s into the "
                f"drain with healthy workers): {dict(list(stuck.items())[:40])}"
            )
        drain_s = time.monotonic() - drain_started
        self._check_alive()  # nothing crashed while draining
        problems += check_tasks(load.acked, load.attempted, tasks)
        problems += check_final_states(acked, tasks, load.cancel_requested)
        problems += check_trees(load.acked, tasks, load.cancel_requested)
        problems += check_transactions(load.txn_unknown, tasks)
        effects = read_effects(self.effects_path)
        problems += check_effects(tasks, effects)
        overlaps = zombie_overlaps(effects)
        problems += check_zombies(overlaps, tasks)
        if not overlaps:
            problems.append("no zombie attempt in this run (a stale run alongside its re-run)")
        try:
            digest = cluster.wait_for_equal_digests(config.settle_timeout_s)
        except AssertionError as exc:
            problems.append(f"digests differ: {exc}")
            digest = "?"
        live = cluster.live()
        if len(live) != config.brokers:
            problems.append(f"only {[n.broker_id for n in live]} are live at the end")
        problems += self._check_snapshot(cluster)
        assert self.watch is not None
        self.watch.stop()
        split, ambiguous = check_split_brain(self.watch.rounds)
        problems += split
        outage_bound_s = config.session_timeout_ms / 1000 + config.outage_margin_s
        outages = measure_outages(self.leader_faults, load.ack_times(), self.other_faults)
        problems += check_outages(outages, outage_bound_s)
        counts = count_log_events(n.log_path for n in cluster.nodes.values())
        problems += check_counted(
            counts, ["ledger_rolls", "retention_deletes", "snapshot_downloads"]
        )
        clean = [o.seconds for o in outages if o.clean and o.seconds is not None]
        counts.update(
            zombie_overlaps=len(overlaps),
            zombie_runs=self.zombie_runs,
            leader_outages=len(clean),
            leader_watch_polls=self.watch.polls,
            zookeeper_disagreements=self.watch.zk_disagreements,
            zookeeper_leader_reads=sum(self.watch.zk_leaders.values()),
            two_claims_ambiguous=ambiguous,
            cancels_asked=len(load.cancel_requested),
            batches=load.batches,
            transactions=load.transactions,
            transactions_unknown=len(load.txn_unknown),
            trees=load.trees,
            tenants=len({a.tenant for a in load.acked.values()}),
            types=len({a.type for a in load.acked.values()}),
        )
        result = SoakResult(
            seed=config.seed,
            faults=self.log.faults,
            acked=len(load.acked),
            tasks=len(tasks),
            states=Counter(tasks[i]["state"] for i in acked if i in tasks),
            reruns=len({e["task"] for e in effects if e["attempt"] > 1}),
            digest=digest,
            duration_s=time.monotonic() - started,
            fault_log=self.log.dump(),
            counts=counts,
            outage_max_s=max(clean, default=0.0),
            outage_bound_s=outage_bound_s,
            drain_s=drain_s,
            drain_bound_s=bound_s,
        )
        if problems:
            raise AssertionError(
                f"chaos soak seed {config.seed}: {len(problems)} problems\n"
                + "\n".join(problems[:40])
                + f"\n{result.summary()}"
            )
        return result

    def _check_snapshot(self, cluster: ClusterProcesses) -> list[str]:
        """A snapshot at the final position (the load has stopped: the snapshot loop takes
        one within an interval) loads, passes the state machine's invariants, and has the
        leader's digest at that position. Waits boundedly; never skipped."""
        leader = cluster.wait_for_leader(self.config.settle_timeout_s)
        deadline = time.monotonic() + 10 * self.config.snapshot_interval_s + 30
        while True:
            now = leader.get_json("/api/v1/state/digest", timeout_s=30)
            position = (now["position"]["ledger_id"], now["position"]["entry_id"])
            response = httpx.get(leader.url + "/api/v1/snapshot/latest", timeout=30)
            if response.status_code == 200:
                path = self.root / "leader-latest.snap"
                path.write_bytes(response.content)
                header, body = read_snapshot(path)
                if header.position == position:
                    break
                newest = f"{header.ledger_id}:{header.entry_id}"
            else:
                newest = f"none (HTTP {response.status_code})"
            if time.monotonic() > deadline:
                return [f"no snapshot at the final position {position}; the newest is {newest}"]
            time.sleep(self.config.snapshot_interval_s / 4)
        machine = StateMachine.from_snapshot(body)
        try:
            machine.check_invariants()
        except AssertionError as exc:
            return [f"snapshot at {header.ledger_id}:{header.entry_id} breaks an invariant: {exc}"]
        if machine.digest() != header.digest:
            return [f"snapshot digest {header.digest} but its state hashes to {machine.digest()}"]
        if now["digest"] != header.digest:
            return [
                f"the leader's digest at {position} is {now['digest']}, its snapshot's is "
                f"{header.digest}"
            ]
        live = [t for t in machine.tasks.values() if str(t.state) not in FINAL_STATES]
        self.log.note(
            "snapshot checked",
            leader.broker_id,
            leader.pid,
            f"at the final position {header.ledger_id}:{header.entry_id}, "
            f"{len(machine.tasks)} tasks ({len(live)} not final), invariants and digest ok",
        )
        return []


#: Steward's default Pulsar namespace (``--pulsar-namespace``), made as an admin would.
PULSAR_NAMESPACE = "public/steward"


def run_soak(
    config: SoakConfig, root: Path, *, zookeeper: ZooKeeperServer | None = None
) -> SoakResult:
    """Start what the soak needs (ZooKeeper; pulsar-lite or an Apache Pulsar standalone with
    Steward's namespace) under ``root`` unless given."""
    with ExitStack() as stack:
        if zookeeper is None:
            zookeeper = stack.enter_context(
                ZooKeeperServer(root / "zookeeper", stop_with_parent=True)
            )
        pulsar_url = None
        if config.ledgers == "pulsar":
            from clients.dev.pulsar_lite import PulsarLiteServer

            pulsar = stack.enter_context(
                PulsarLiteServer(root / "pulsar-lite", stop_with_parent=True)
            )
            pulsar_url = pulsar.service_url
            return ChaosSoak(config, zookeeper, root, pulsar_url=pulsar_url, pulsar=pulsar).run()
        if config.ledgers == "apache-pulsar":
            standalone = stack.enter_context(reserved_standalone(root / "pulsar-standalone"))
            standalone.create_namespace(PULSAR_NAMESPACE)
            return ChaosSoak(
                config,
                zookeeper,
                root,
                pulsar_url=standalone.service_url,
                pulsar_admin_url=standalone.admin_url,
                pulsar=standalone,
            ).run()
        return ChaosSoak(config, zookeeper, root).run()


def _stop_on_sigterm(signum: int, frame: object) -> None:
    """SIGTERM ends the soak as Ctrl-C does: the with-blocks on the way out stop the
    cluster's brokers and workers, ZooKeeper and the Pulsar engine (nothing else would: the
    default action leaves them running). A second one is ignored while they stop."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tests.chaos.soak", description=__doc__.split("\n\n")[0] if __doc__ else ""
    )
    parser.add_argument("--seed", type=int, default=None, help="default: a random one (printed)")
    parser.add_argument("--faults", type=int, default=500, help="default %(default)s")
    parser.add_argument("--ledgers", choices=LEDGERS, default="file")
    parser.add_argument("--clients", type=int, default=SoakConfig.clients)
    parser.add_argument("--heartbeat-timeout-ms", type=int, default=SoakConfig.heartbeat_timeout_ms)
    parser.add_argument("--keep", type=Path, default=None, help="keep data and logs in DIR")
    args = parser.parse_args(argv)
    if args.faults < 1:
        parser.error("--faults must be at least 1")
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(2**32)
    if args.clients < 1 or args.heartbeat_timeout_ms < 1:
        parser.error("--clients and --heartbeat-timeout-ms must be positive")
    config = SoakConfig(
        seed=seed,
        faults=args.faults,
        ledgers=args.ledgers,
        clients=args.clients,
        heartbeat_timeout_ms=args.heartbeat_timeout_ms,
    )
    previous = signal.signal(signal.SIGTERM, _stop_on_sigterm)
    try:
        with ExitStack() as stack:
            if args.keep is not None:
                args.keep.mkdir(parents=True, exist_ok=True)
                root = args.keep
            else:
                root = Path(
                    stack.enter_context(tempfile.TemporaryDirectory(prefix="steward-chaos-"))
                )
            try:
                run_soak(config, root)
            except AssertionError:
                traceback.print_exc()
                print(f"chaos soak FAILED, seed {seed}", file=sys.stderr)
                return 1
    except KeyboardInterrupt:
        print(f"chaos soak stopped (interrupted), seed {seed}", file=sys.stderr, flush=True)
        return 130
    finally:
        signal.signal(signal.SIGTERM, previous)
    print(f"chaos soak passed, seed {seed}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
