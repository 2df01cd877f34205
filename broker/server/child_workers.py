"""The worker processes a standalone broker runs itself (``steward standalone --workers N``),
kept running: one that exits while the broker runs is started again, after a backoff that
grows while it keeps exiting soon after its start, each exit and restart logged (issue 30:
after two ``kill -9`` a standalone broker had no worker left, and said nothing).

Each runs ``python -m clients.worker`` with this broker's pid in its environment
(``STEWARD_WORKER_PARENT_PID``, clients/worker/config.py): its default work dir carries the
pid, and it stops when the broker dies, even by ``kill -9``. A restart keeps the worker id:
the broker sees the same worker come back (docs/DESIGN.md §6, "Lost assignments").
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import sys
from collections.abc import Sequence
from dataclasses import dataclass

logger = logging.getLogger(__name__)

#: The first restart's delay, doubled for each exit that came soon after its start.
FIRST_RESTART_DELAY_S = 1.0
MAX_RESTART_DELAY_S = 30.0
#: A worker that ran this long before it exited restarts after the first delay again.
STEADY_RUN_S = 60.0
#: How long a stopping worker may take (its own grace is shorter; then its reports go out).
STOP_TIMEOUT_S = 20.0


@dataclass(frozen=True)
class ChildSpec:
    """How to start one worker: its id, its arguments after ``python -m clients.worker``."""

    worker_id: str
    args: tuple[str, ...]


def restart_delay_s(previous_delay_s: float | None, ran_s: float) -> float:
    """The delay before restarting a worker that exited after running ``ran_s``:
    the first delay after a steady run (or the first exit), doubled up to the cap after a
    quick one."""
    if previous_delay_s is None or ran_s >= STEADY_RUN_S:
        return FIRST_RESTART_DELAY_S
    return min(previous_delay_s * 2, MAX_RESTART_DELAY_S)


class ChildWorkers:
    """Starts, restarts and stops the standalone broker's worker processes."""

    def __init__(self, specs: Sequence[ChildSpec], env: dict[str, str]) -> None:
        self._specs = list(specs)
        self._env = env
        self._processes: dict[str, asyncio.subprocess.Process] = {}
        self._supervisors: list[asyncio.Task[None]] = []
        self._stopping = False
        self.restarts = 0  # how many times a worker was started again

    @property
    def processes(self) -> list[asyncio.subprocess.Process]:
        """The workers' current processes (a restarted worker's newest)."""
        return list(self._processes.values())

    async def start(self) -> None:
        for spec in self._specs:
            self._processes[spec.worker_id] = await self._spawn(spec)
        self._supervisors = [
            asyncio.create_task(self._supervise(spec), name=f"supervise {spec.worker_id}")
            for spec in self._specs
        ]

    async def _spawn(self, spec: ChildSpec) -> asyncio.subprocess.Process:
        return await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "clients.worker",
            *spec.args,
            env=self._env,
            # Their own session: a Ctrl-C in the terminal reaches the broker only, which
            # passes one SIGTERM on (a second would hurry their stop).
            start_new_session=True,
        )

    async def _supervise(self, spec: ChildSpec) -> None:
        loop = asyncio.get_running_loop()
        delay_s: float | None = None
        started = loop.time()
        while True:
            process = self._processes[spec.worker_id]
            code = await process.wait()
            if self._stopping:
                return
            ran_s = loop.time() - started
            delay_s = restart_delay_s(delay_s, ran_s)
            logger.warning(
                "worker %s (pid %d) exited %s after %.1f s; restarting it in %.0f s",
                spec.worker_id,
                process.pid,
                _exit_text(code),
                ran_s,
                delay_s,
            )
            await asyncio.sleep(delay_s)
            if self._stopping:
                return
            try:
                self._processes[spec.worker_id] = await self._spawn(spec)
            except OSError as exc:
                logger.error("could not restart worker %s: %s", spec.worker_id, exc)
                continue  # the same process is waited for again: at once, then the next delay
            self.restarts += 1
            started = loop.time()
            logger.warning(
                "worker %s restarted (pid %d)", spec.worker_id, self._processes[spec.worker_id].pid
            )

    def signal(self, sig: signal.Signals) -> None:
        """Send ``sig`` to every running worker and restart none from now on."""
        self._stopping = True
        for process in self._processes.values():
            if process.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    process.send_signal(sig)

    async def stop(self) -> None:
        """SIGTERM each worker (a second one if it had one: it gives its tasks back at once)
        and wait for it, bounded; SIGKILL one that does not exit."""
        self.signal(signal.SIGTERM)
        for supervisor in self._supervisors:
            supervisor.cancel()
        for supervisor in self._supervisors:
            with contextlib.suppress(asyncio.CancelledError):
                await supervisor
        for process in self._processes.values():
            try:
                await asyncio.wait_for(process.wait(), timeout=STOP_TIMEOUT_S)
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    process.kill()
                await process.wait()


def _exit_text(code: int) -> str:
    if code < 0:
        try:
            return f"on signal {signal.Signals(-code).name}"
        except ValueError:
            return f"on signal {-code}"
    return f"with code {code}"


def child_env(worker_token: str | None) -> dict[str, str]:
    """The workers' environment: this one's, the shared worker token (never on a command
    line) and this broker's pid (they stop when it dies)."""
    env = dict(os.environ)
    if worker_token is not None:
        env["STEWARD_WORKER_TOKEN"] = worker_token
    env["STEWARD_WORKER_PARENT_PID"] = str(os.getpid())
    return env
