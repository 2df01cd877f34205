"""Issue 30 acceptance: a worker killed (``kill -9``) under a task does not use up the task's
attempts (docs/DESIGN.md §6, "Lost workers"). Real processes: a standalone broker and
``steward worker`` processes; the task is submitted, and then read, through the CLI.

A task of ``max_attempts`` 1 runs the built-in ``sleep`` on w1; w1 is killed with -9; the
broker declares it dead and the task waits again (lost 1, not failed); w2, started
afterwards, runs it to the end as attempt 2. Without the rule the task ends in error
(``worker w1 died: ... (attempt 1 of 1)``) and w2 never gets it.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.procs import HOST, BrokerProcess, free_port, steward_command
from tests.support.worker_procs import WorkerProcess, wait_until

pytestmark = pytest.mark.slow

CLI_TIMEOUT_S = 30.0


def _cli(url: str, *args: str) -> str:
    env = {k: v for k, v in os.environ.items() if k != "STEWARD_URL"}
    done = subprocess.run(
        [*steward_command(), "--url", url, *args],
        capture_output=True,
        text=True,
        timeout=CLI_TIMEOUT_S,
        env=env,
        stdin=subprocess.DEVNULL,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def _task(url: str, task_id: int) -> dict[str, Any]:
    task: dict[str, Any] = json.loads(_cli(url, "task", str(task_id), "--json"))
    return task


def test_a_task_whose_worker_is_killed_runs_again_without_using_an_attempt(
    tmp_path: Path,
) -> None:
    worker_port = free_port()
    broker = BrokerProcess(
        tmp_path / "data",
        log_path=tmp_path / "broker.log",
        extra_args=(
            "--worker-listen",
            f"{HOST}:{worker_port}",
            "--heartbeat-interval-ms",
            "250",
            "--heartbeat-timeout-ms",
            "1500",
        ),
    )
    workers: list[WorkerProcess] = []

    def worker(worker_id: str) -> WorkerProcess:
        started = WorkerProcess(
            broker=f"{HOST}:{worker_port}",
            http_url=broker.url,
            worker_id=worker_id,
            log_dir=tmp_path / "logs",
            cache_dir=tmp_path / "cache" / worker_id,
        ).start()
        workers.append(started)
        return started

    def logs() -> str:
        return "\n".join(
            [broker.log_tail(), *(f"--- {w.worker_id}:\n{w.log_tail()}" for w in workers)]
        )

    broker.start()
    try:
        with httpx.Client(base_url=broker.url, timeout=30) as http:
            w1 = worker("w1")
            w1.wait_connected(http)
            submitted = _cli(
                broker.url,
                "submit",
                "sleep",
                "--params",
                '{"seconds": 4}',
                "--max-attempts",
                "1",
            )
            task_id = int(submitted.strip())
            wait_until(
                lambda: _task(broker.url, task_id)["state"] == "running",
                30,
                "the task to run on w1",
            )
            assert _task(broker.url, task_id)["worker"] == "w1"

            w1.kill9()
            lost = wait_until(
                lambda: (t := _task(broker.url, task_id))["lost"] == 1 and t,
                30,
                "w1 to be declared dead and its attempt lost",
            )
            # Not failed: waiting for a worker, its one attempt unused.
            assert lost["state"] == "waiting", (lost, logs())
            assert (lost["attempt"], lost["max_attempts"], lost["max_lost"]) == (1, 1, 3)
            assert "worker w1 died" in lost["error"], lost

            w2 = worker("w2")
            w2.wait_connected(http)
            done = wait_until(
                lambda: (t := _task(broker.url, task_id))["state"] in ("finished", "error") and t,
                60,
                "w2 to run the task to its end",
            )
            assert done["state"] == "finished", (done, logs())
            assert (done["attempt"], done["lost"], done["worker"]) == (2, 1, "w2"), done
            shown = _cli(broker.url, "task", str(task_id))
            fields = dict(
                (name.strip(), value.strip())
                for name, _, value in (line.partition(":") for line in shown.splitlines())
            )
            assert (fields["state"], fields["lost"], fields["max_attempts"]) == (
                "finished",
                "1",
                "1",
            ), shown
    finally:
        for started in workers:
            started.stop()
        broker.kill9()
