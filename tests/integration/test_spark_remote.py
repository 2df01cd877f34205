"""PySpark tasks on a remote Spark Connect server (``--spark-remote``, issue 20 item 3).

One Spark Connect server for the module, in a process of its own, from pyspark's jars
(tests/support/spark_connect_remote.py); each test's worker (task processes, a uid per
tenant when CI runs as root) points ``spark_remote`` at it and starts no Spark of its own.
The fake broker and the artifact server come from tests/support/worker_harness.py.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from clients.worker import Worker, WorkerConfig
from clients.worker.spark.connect_server import free_port
from tests.support.spark_connect_remote import RemoteConnectServer, remote_connect_server
from tests.support.worker_harness import (
    Env,
    result_of,
    task,
    until,
    worker_env,
    zip_bytes,
)
from tests.support.worker_procs import task_reachable_dir

pytestmark = pytest.mark.slow

SPARK_WAIT_S = 120.0  # a task's first query on a fresh server: code generation and all
ERROR_WAIT_S = 45.0  # a wrong or unreachable server: the task fails well within this

JOB = {
    "rjob/__init__.py": "",
    "rjob/job.py": """
import os


def total(params, ctx):
    spark = ctx.spark
    spark.range(1, params["n"] + 1).createOrReplaceTempView("numbers")
    row = spark.sql("SELECT sum(id) AS s FROM numbers").collect()[0]
    with open("/proc/self/cmdline", "rb") as f:
        cmdline = f.read().decode(errors="replace")
    return {
        "sum": row.s,
        "session": spark.session_id,
        "env": dict(os.environ),
        "cmdline": cmdline,
    }


def peek(params, ctx):
    spark = ctx.spark
    return {"session": spark.session_id, "view": spark.catalog.tableExists("numbers")}
""",
}


@pytest.fixture(scope="module")
def work_root() -> Iterator[Path]:
    with task_reachable_dir("steward-test-remote-") as root:
        yield root


@pytest.fixture(scope="module")
def remote(work_root: Path) -> Iterator[RemoteConnectServer]:
    with remote_connect_server(work_root / "remote") as server:
        yield server


@pytest.fixture
async def env(tmp_path: Path) -> AsyncIterator[Env]:
    async with worker_env(tmp_path, stop_timeout_s=1.0, stop_wait_s=30) as environment:
        yield environment


async def start_worker(env: Env, work_root: Path, spark_remote: str) -> tuple[Any, str]:
    config = WorkerConfig(
        **env.worker_settings(
            worker_id="remote1",
            task_types={"*": 2},
            work_dir=work_root / "work",
            spark_remote=spark_remote,
        )
    )
    worker = Worker(config)
    env.workers.append((worker, asyncio.ensure_future(worker.run())))
    conn = await env.broker.connect()
    await asyncio.wait_for(worker.wait_connected(), 30.0)
    return conn, env.http.add(zip_bytes(JOB))


async def test_tasks_run_on_the_remote_server_in_sessions_of_their_own(
    env: Env, remote: RemoteConnectServer, work_root: Path
) -> None:
    conn, sha = await start_worker(env, work_root, remote.url)
    conn.assign(task(1, "rjob.job:total", {"n": 100}, tenant="a", code=sha))
    made = result_of(await conn.report(SPARK_WAIT_S))
    assert made["sum"] == 5050
    # The token reaches the task in its Run frame only: not its environment or argv.
    assert remote.token not in json.dumps(made["env"]) and remote.token not in made["cmdline"]
    conn.assign(
        task(2, "rjob.job:peek", tenant="b", code=sha),
        task(3, "rjob.job:peek", tenant="a", code=sha),  # a's next task: a new session
    )
    reports = await conn.reports(2, SPARK_WAIT_S)
    other_tenant, next_task = result_of(reports[2, 1]), result_of(reports[3, 1])
    assert other_tenant["view"] is False and next_task["view"] is False
    assert len({made["session"], other_tenant["session"], next_task["session"]}) == 3


async def test_an_unreachable_remote_fails_the_task_clearly(
    env: Env, work_root: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.ERROR, logger="clients.worker.spark")
    conn, sha = await start_worker(env, work_root, f"sc://localhost:{free_port()}")
    # The worker says so when it starts, before any task...
    await until(lambda: "is not usable" in caplog.text, ERROR_WAIT_S)
    assert "unreachable" in caplog.text
    # ... and a task fails with the reason, not a hang.
    started = time.monotonic()
    conn.assign(task(21, "rjob.job:total", {"n": 3}, tenant="a", code=sha))
    report = await conn.report(ERROR_WAIT_S)
    assert not report.ok
    assert "unreachable" in (report.error or "") and "--spark-remote" in (report.error or "")
    assert time.monotonic() - started < ERROR_WAIT_S


async def test_a_wrong_token_fails_the_task_clearly(
    env: Env, remote: RemoteConnectServer, work_root: Path
) -> None:
    conn, sha = await start_worker(env, work_root, f"{remote.address}/;token=not-the-token")
    conn.assign(task(31, "rjob.job:total", {"n": 3}, tenant="a", code=sha))
    report = await conn.report(ERROR_WAIT_S)
    assert not report.ok
    assert remote.token not in (report.error or "")
    assert "UNAUTHENTICATED" in (report.error or "") or "token" in (report.error or "").lower()
