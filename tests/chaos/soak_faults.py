"""The chaos soak's newer faults (tests/chaos/soak.py): graceful hand-over, a follower down
past retention, a kill during a broker's start, pulsar-lite kill and pause, and the
zombie worker (a stale attempt still running, and reporting late, while its replacement
runs). A mixin of :class:`tests.chaos.soak.ChaosSoak`."""

from __future__ import annotations

import threading
import time
from typing import Any, Protocol

from clients.client import StewardClient
from tests.chaos.soak_parts import (
    TASK_TYPE,
    TENANT,
    Acked,
    ChaosLoad,
    FaultDraw,
    FaultLog,
    SoakConfig,
)
from tests.support.cluster_procs import BrokerNode, ClusterProcesses, ClusterWorker

# The zombie's task is re-queued ahead of the backlog (docs/API.md, priorities).
ZOMBIE_PRIORITY = 1000


class _Pausable(Protocol):
    def kill(self) -> None: ...
    def start(self, timeout_s: float | None = None) -> None: ...
    def pause(self) -> None: ...
    def resume(self) -> None: ...
    def is_running(self) -> bool: ...

    @property
    def pid(self) -> int | None: ...


class ExtraFaults:
    config: SoakConfig
    log: FaultLog
    cluster: ClusterProcesses | None
    load: ChaosLoad | None
    pulsar: _Pausable | None
    effects_path: Any
    leader_faults: list[tuple[str, float, bool]]
    other_faults: list[float]
    zombie_thread: threading.Thread | None
    zombie_worker: str | None
    zombie_runs: int

    # provided by ChaosSoak
    def _schedule(self, delay_s: float, kind: str, target: str) -> None:
        raise NotImplementedError

    def _faulted_brokers(self) -> set[str]:
        raise NotImplementedError

    def _faulted_workers(self) -> set[str]:
        raise NotImplementedError

    def _current_workers(self) -> list[ClusterWorker]:
        raise NotImplementedError

    def _pick_broker(self, draw: FaultDraw) -> tuple[BrokerNode, str] | None:
        raise NotImplementedError

    def _quiet(self) -> bool:
        raise NotImplementedError

    def _pending_kinds(self) -> list[str]:
        raise NotImplementedError

    def _inject_extra(self, draw: FaultDraw) -> bool:
        assert self.cluster is not None
        kind = draw.kind
        if kind in ("term_leader", "kill_follower_long", "kill_starting_broker"):
            if self._faulted_brokers():
                return False  # one broker at a time for these: they measure one thing
            leader = self.cluster.leader()
            if leader is None:
                return False
            if kind == "term_leader":
                clean = self._quiet()
                at = leader.sigterm()
                self.leader_faults.append((kind, at, clean))
                self.log.fault(kind, leader.broker_id, leader.pid, "graceful hand-over")
                leader.wait_exit()
                self._schedule(0.5 + 2.0 * draw.duration, "restart_broker", leader.broker_id)
                return True
            followers = [n for n in self.cluster.live() if n is not leader]
            if not followers:
                return False
            node = followers[draw.index % len(followers)]
            pid = node.pid
            self.other_faults.append(time.monotonic())
            node.kill9()
            if kind == "kill_follower_long":
                # Past roll age + the kept snapshots + retention (SoakConfig): the ledgers
                # after its snapshot are gone when it returns.
                down_s = 12.0 + 4.0 * draw.duration
                self.log.fault(kind, node.broker_id, pid, f"follower; restart in {down_s:.1f} s")
                self._schedule(down_s, "restart_broker", node.broker_id)
                return True
            # Start it and kill it again while it starts (loads its snapshot, replays,
            # joins the election), then start it for good.
            node.spawn()
            time.sleep(0.05 + 1.5 * draw.duration)
            started_pid = node.pid
            node.kill9()
            self.log.fault(
                kind,
                node.broker_id,
                started_pid,
                f"killed {0.05 + 1.5 * draw.duration:.2f} s into its start",
            )
            self._schedule(0.3, "restart_broker", node.broker_id)
            return True
        if kind in ("kill_pulsar", "stop_pulsar"):
            pulsar = self.pulsar
            if pulsar is None or any(
                r in ("start_pulsar", "cont_pulsar") for r in self._pending_kinds()
            ):
                return False
            pulsar_pid = pulsar.pid
            self.other_faults.append(time.monotonic())
            down_s = 0.3 + 4.0 * draw.duration
            if kind == "kill_pulsar":
                pulsar.kill()
                self._schedule(down_s, "start_pulsar", "pulsar")
            else:
                pulsar.pause()
                self._schedule(down_s, "cont_pulsar", "pulsar")
            self.log.fault(kind, "pulsar", pulsar_pid, f"back in {down_s:.2f} s")
            return True
        raise ValueError(f"unknown fault {kind!r}")

    def _recover_extra(self, kind: str) -> bool:
        pulsar = self.pulsar
        if kind == "start_pulsar" and pulsar is not None:
            pulsar.start()
            self.log.note("start pulsar", "pulsar", pulsar.pid)
            return True
        if kind == "cont_pulsar" and pulsar is not None:
            pulsar.resume()
            self.log.note("SIGCONT pulsar", "pulsar", pulsar.pid)
            return True
        return False

    # -- the zombie worker ---------------------------------------------------------------------

    def _start_zombie(self, number: int) -> bool:
        """Start one zombie run in a thread (the fault loop goes on)."""
        if self.zombie_thread is not None and self.zombie_thread.is_alive():
            return False
        healthy = [w for w in self._current_workers() if w.running() and not w.stopped]
        if len(healthy) < 2:
            return False
        self.zombie_thread = threading.Thread(
            target=self._zombie, args=(number,), name="chaos-zombie", daemon=True
        )
        self.zombie_thread.start()
        return True

    def _zombie(self, number: int) -> None:
        """Submit a long task ahead of the backlog; once it runs, SIGSTOP its worker past
        the heartbeat timeout; once the re-run started on another worker, SIGCONT: the
        stale attempt (its task process ran on) ends and reports while the new one runs.
        Every wait is bounded; a run that does not line up is logged, and the summary
        counts only real overlaps (from the task records)."""
        assert self.cluster is not None and self.load is not None
        config = self.config
        heartbeat_s = config.heartbeat_timeout_ms / 1000
        key = f"chaos-{config.seed}-zombie-{number}"
        params = {"key": key, "seconds": 1.5 * heartbeat_s + 6.0, "effects": str(self.effects_path)}
        self.load.attempted[key] = params
        with StewardClient(self.cluster.urls(), timeout_s=3.0, failover_timeout_s=60) as client:
            handle = client.submit(
                TASK_TYPE,
                params,
                tenant=TENANT,
                idempotency_key=key,
                code=self.load.code_sha,
                max_attempts=config.max_attempts,
                max_lost=config.max_attempts,
                priority=ZOMBIE_PRIORITY,
            )
            self.load.acked[key] = Acked(key, handle.id, params, time.monotonic())
            task = self._wait_task(client, handle.id, lambda t: t["state"] == "running", 30)
            if task is None:
                self.log.note("zombie skipped", "-", None, f"task {handle.id} did not start")
                return
            worker = next(
                (w for w in self._current_workers() if w.worker_id == task["worker"]), None
            )
            if (
                worker is None
                or not worker.running()
                or worker.stopped
                or worker.worker_id in self._faulted_workers()
            ):
                self.log.note("zombie skipped", "-", None, f"task {handle.id} on a faulted worker")
                return
            self.zombie_worker = worker.worker_id
            try:
                worker.sigstop()
                self.log.fault(
                    "zombie_worker",
                    worker.worker_id,
                    worker.pid,
                    f"holds task {handle.id} attempt {task['attempt']}; SIGCONT once it re-runs",
                )
                rerun = self._wait_task(
                    client,
                    handle.id,
                    lambda t: (
                        t["attempt"] > task["attempt"]
                        and t["state"] == "running"
                        and t["worker"] != worker.worker_id
                    ),
                    3 * heartbeat_s + 30,
                )
            finally:
                if worker.running() and worker.stopped:
                    worker.sigcont()
                self.zombie_worker = None
            detail = (
                f"task {handle.id} attempt {rerun['attempt']} runs on {rerun['worker']}"
                if rerun is not None
                else f"task {handle.id} was not re-run in time"
            )
            self.log.note("SIGCONT zombie", worker.worker_id, worker.pid, detail)
            self.zombie_runs += 1

    def _wait_task(
        self, client: StewardClient, task_id: int, ready: Any, timeout_s: float
    ) -> dict[str, Any] | None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                task = client.task(task_id)
            except Exception:  # failover under the faults: ask again
                task = None
            if task is not None and ready(task):
                return task
            time.sleep(0.1)
        return None
