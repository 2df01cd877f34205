"""``steward standalone --workers N`` keeps its workers running (issue 30, friction 6): a
worker killed with -9 is started again (logged, with the exit and the delay), under the
same worker id, and tasks run on it; before, after two kills the broker had no worker and
said nothing. Real processes; every wait bounded."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from pathlib import Path

import httpx

from tests.support.logged_process import log_text
from tests.support.procs import BrokerProcess

WAIT_S = 60.0  # a restart's delay (1 s, then 2 s), the worker's start and its hello


def _worker_children(broker_pid: int) -> list[int]:
    """The pids of the broker's child processes running ``clients.worker``."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue  # gone meanwhile
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        if ppid == broker_pid and b"clients.worker" in cmdline:
            pids.append(int(entry.name))
    return pids


def _wait_for(check: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not check():
        assert time.monotonic() < deadline, f"timed out after {WAIT_S:.0f} s waiting for {what}"
        time.sleep(0.1)


def _connected(client: httpx.Client) -> list[str]:
    workers = client.get("/api/v1/cluster").json()["workers"]
    return [w["id"] for w in workers if w["state"] == "connected"]


def test_a_killed_worker_is_started_again_and_runs_tasks(tmp_path: Path) -> None:
    log = tmp_path / "broker.log"
    with BrokerProcess(tmp_path / "data", log_path=log, extra_args=("--workers", "1")) as broker:
        broker.start()
        assert broker.proc is not None
        with httpx.Client(base_url=broker.url, timeout=10) as client:
            _wait_for(lambda: len(_connected(client)) == 1, "the worker to connect")
            broker_pid = broker.proc.pid
            for kill in (1, 2):  # two kills: the broker is left without a worker before
                (pid,) = _worker_children(broker_pid)
                os.kill(pid, signal.SIGKILL)

                def replaced(old: int = pid) -> bool:
                    return _worker_children(broker_pid) not in ([], [old])

                _wait_for(replaced, f"a new worker process after kill {kill}")
            _wait_for(lambda: len(_connected(client)) == 1, "the restarted worker to connect")
            (worker_id,) = _connected(client)
            assert worker_id.endswith("-worker-1")  # the same worker, back
            task = client.post("/api/v1/tasks", json={"type": "noop"}).json()
            _wait_for(
                lambda: client.get(f"/api/v1/tasks/{task['id']}").json()["state"] == "finished",
                "a task on the restarted worker",
            )
        text = log_text(log)
        assert "exited on signal SIGKILL" in text, text[-3000:]
        assert text.count(f"worker {worker_id} restarted (pid") == 2, text[-3000:]
