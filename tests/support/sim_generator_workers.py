"""The simulation's worker-liveness entries (WorkerDead, WorkerSilent, WorkerDisconnected):
a part of tests/support/sim_generator.py's EntryGenerator, which supplies ``rng``, ``view``,
``_time`` and ``_connected``."""

from __future__ import annotations

import random
from typing import TYPE_CHECKING

from broker.core import entries as e
from tests.support.sim_model import NOT_FOUND, WORKERS, Expect

if TYPE_CHECKING:
    from broker.core import StateMachine


class WorkerEntries:
    rng: random.Random
    view: StateMachine

    def _time(self) -> int:
        raise NotImplementedError

    def _connected(self) -> list[str]:
        raise NotImplementedError

    def _worker_dead(self) -> tuple[e.Entry, Expect]:
        time_ms = self._time()
        rng = self.rng
        expect = Expect()
        connected = self._connected()
        if rng.random() < 0.15 or not connected:
            worker_id = rng.choice((*WORKERS, "ghost", ""))
        else:
            worker_id = rng.choice(connected)
        if worker_id in self.view.workers:
            expect.accept.add(0)
        else:
            expect.reject[0] = NOT_FOUND
        entry = e.WorkerDead(
            time_ms=time_ms,
            worker_id=worker_id,
            reason="sim",
            v=self._lost_version(bool(self.view.running_by_worker.get(worker_id))),
        )
        return entry, expect

    def _lost_version(self, loses_attempts: bool) -> int:
        """As a leader writes a death or a return: format 5 (attempts lost, not counted) when
        it ends running attempts; now and then an older leader's (they count)."""
        if self.rng.random() < 0.1:
            return 4
        return e.lost_attempts_version(loses_attempts)

    def _worker_silent(self) -> tuple[e.Entry, Expect]:
        """A leader's batch of silent workers (docs/DESIGN.md §8, "Silence across leader
        changes"): connected ones mostly, sometimes one heard again (None), one of an
        earlier registration, a dead or unknown one (skipped), a time before its
        registration or ahead of the entry (bounded by apply)."""
        time_ms = self._time()
        rng = self.rng
        silent: list[e.SilentWorker] = []
        for worker_id in rng.sample((*WORKERS, "ghost"), rng.randint(1, 3)):
            worker = self.view.workers.get(worker_id)
            connected_ms = worker.connected_ms if worker is not None else 0
            if rng.random() < 0.1:
                connected_ms -= 1  # registered again since the leader saw it
            since_ms: int | None = time_ms - rng.choice((0, 1, 5_000, 60_000, 10**9))
            if rng.random() < 0.1:
                since_ms = time_ms + 1_000
            elif rng.random() < 0.2:
                since_ms = None
            silent.append(e.SilentWorker(worker_id, since_ms, connected_ms))
        return e.WorkerSilent(time_ms=time_ms, workers=tuple(silent)), Expect()

    def _worker_disconnected(self) -> tuple[e.Entry, Expect]:
        """A leader's batch of closed connections (docs/DESIGN.md §8, "Closed connections"):
        connected workers mostly, sometimes one of an earlier registration, a disconnected,
        dead or unknown one (skipped), a last frame before its registration or ahead of the
        entry (bounded by apply)."""
        time_ms = self._time()
        rng = self.rng
        closed: list[e.DisconnectedWorker] = []
        for worker_id in rng.sample((*WORKERS, "ghost"), rng.randint(1, 2)):
            worker = self.view.workers.get(worker_id)
            connected_ms = worker.connected_ms if worker is not None else 0
            if rng.random() < 0.1:
                connected_ms -= 1  # registered again since the leader saw it close
            last_seen_ms = time_ms - rng.choice((0, 1, 5_000, 10**9))
            if rng.random() < 0.1:
                last_seen_ms = time_ms + 1_000
            closed.append(e.DisconnectedWorker(worker_id, last_seen_ms, connected_ms))
        return e.WorkerDisconnected(time_ms=time_ms, workers=tuple(closed)), Expect()
