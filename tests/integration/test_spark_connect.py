"""Spark through the worker's Spark Connect server, with task processes (issue 14 item 2).

One Spark Connect server for the module (it takes seconds to start), given to each test's
worker (``Worker(config, spark_server=...)``); the worker runs every task in task
processes, under a uid per tenant (CI runs as root), and the server under a uid of its own.
The fake broker and the artifact server come from tests/support/worker_harness.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import re
import signal
import threading
import time
import urllib.request
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from clients.worker import Worker, WorkerConfig
from clients.worker.spark.connect_server import SparkConnectServer, free_port, new_session_id
from tests.support.worker_harness import (
    WAIT_S,
    Env,
    result_of,
    task,
    until,
    worker_env,
    zip_bytes,
)
from tests.support.worker_procs import task_reachable_dir, task_writable_dir, wait_until
from wire.worker_protocol import Cancel, TaskAttempt

pytestmark = pytest.mark.slow

SPARK_WAIT_S = 120.0  # a task's first query: a new session, code generation, UDF workers
WORKER_TOKEN = "worker-secret-7d1f0c9a2b4e4f6a8c3d5e7f9a1b3c5d"

JOB = {
    "scjob/__init__.py": "",
    "scjob/job.py": """
import json
import os
import time


def make_view(params, ctx):
    spark = ctx.spark
    spark.range(3).createOrReplaceTempView("steward_view")
    spark.conf.set("steward.test.key", params["value"])
    return {
        "session": spark.session_id,
        "view": spark.catalog.tableExists("steward_view"),
        "conf": spark.conf.get("steward.test.key"),
    }


def peek(params, ctx):
    spark = ctx.spark
    return {
        "session": spark.session_id,
        "view": spark.catalog.tableExists("steward_view"),
        "conf": spark.conf.get("steward.test.key", None),
    }


def what_i_see(params, ctx):
    seen = {"env": dict(os.environ), "spark_token": ctx.spark.client.token}
    with open("/proc/self/cmdline", "rb") as f:  # (environ: the process is non-dumpable)
        seen["cmdline"] = f.read().decode(errors="replace")
    return seen


def slow_udf_query(params, ctx):
    from pyspark.sql import functions as sf

    marker_dir = params["marker_dir"]

    def slow(x):  # runs on the server, in its Python UDF workers
        with open(os.path.join(marker_dir, "udf-%d" % x), "w") as f:
            f.write(str(os.getpid()))
        time.sleep(600)
        return x

    with open(os.path.join(marker_dir, "task-pid"), "w") as f:
        f.write(str(os.getpid()))
    df = ctx.spark.range(0, 2, 1, 2).select(sf.udf(slow, "long")("id").alias("x"))
    return [row.x for row in df.collect()]


def udf_before_session(params, ctx):
    from pyspark.sql import functions as sf

    plus_one = sf.udf(lambda x: x + 1, "long")  # parses "long" on a session: none yet
    return [row.x for row in ctx.spark.range(2).select(plus_one("id").alias("x")).collect()]


def udf_after_session(params, ctx):
    from pyspark.sql import functions as sf

    spark = ctx.spark  # first: the attempt's session, made the active one
    plus_one = sf.udf(lambda x: x + 1, "long")
    # Analysed on the server, not run: no UDF worker to start.
    return spark.range(2).select(plus_one("id").alias("x")).schema.simpleString()


def pooled(params, ctx):
    spark = ctx.spark
    total = spark.range(0, 1000, 1, 2).selectExpr("sum(id) AS s").collect()[0].s
    return {"session": spark.session_id, "sum": total}


def classic_sum(params, ctx):
    sc = ctx.classic_spark.sparkContext
    return sc.parallelize([1, 2, 3], 2).sum()
""",
}


@pytest.fixture(scope="module")
def work_root() -> Iterator[Path]:
    with task_reachable_dir("steward-test-sc-") as root:
        yield root / "work"


def worker_config(env: Env, work_dir: Path, **overrides: Any) -> WorkerConfig:
    settings = {
        "worker_id": "sc1",
        "task_types": {"*": 2},
        "resources": {"cpu": 2.0, "memory_mb": 1024.0},
        "spark_master": "local[2]",
        "work_dir": work_dir,
        "token": WORKER_TOKEN,
    }
    return WorkerConfig(**env.worker_settings(**{**settings, **overrides}))


@pytest.fixture(scope="module")
def ui_port() -> int:
    return free_port()


@pytest.fixture(scope="module")
def server(work_root: Path, ui_port: int) -> Iterator[SparkConnectServer]:
    config = WorkerConfig(
        broker="127.0.0.1:1",
        http_url="http://127.0.0.1:1",
        spark_master="local[2]",
        work_dir=work_root,
        # Spark's UI and REST API, to see the fair-scheduler pools.
        spark_conf={"spark.ui.enabled": "true", "spark.ui.port": str(ui_port)},
    )
    from clients.worker.task_env import WorkArea

    WorkArea(work_root)  # the worker's directories, as a worker makes them
    spark_server = SparkConnectServer.from_config(config)
    spark_server.set_tenant_weights({"heavy": 3.0})  # as a worker does with its Welcome
    spark_server.start()
    try:
        spark_server.wait_ready(240.0)
        yield spark_server
    finally:
        spark_server.stop()


@pytest.fixture
async def env(tmp_path: Path) -> AsyncIterator[Env]:
    async with worker_env(tmp_path, stop_timeout_s=1.0, stop_wait_s=30) as environment:
        yield environment


async def start_worker(
    env: Env, server: SparkConnectServer, work_dir: Path, **overrides: Any
) -> tuple[Worker, Any, str]:
    worker = Worker(worker_config(env, work_dir, **overrides), spark_server=server)
    env.workers.append((worker, asyncio.ensure_future(worker.run())))
    conn = await env.broker.connect()
    await asyncio.wait_for(worker.wait_connected(), WAIT_S)
    return worker, conn, env.http.add(zip_bytes(JOB))


async def test_tenants_get_sessions_of_their_own(
    env: Env, server: SparkConnectServer, work_root: Path
) -> None:
    _, conn, sha = await start_worker(env, server, work_root)
    conn.assign(task(1, "scjob.job:make_view", {"value": "a's"}, tenant="a", code=sha))
    made = result_of(await conn.report(SPARK_WAIT_S))
    assert made["view"] is True and made["conf"] == "a's"
    conn.assign(
        task(2, "scjob.job:peek", tenant="b", code=sha),
        task(3, "scjob.job:peek", tenant="a", code=sha),  # a's next attempt: a new session
    )
    reports = await conn.reports(2, SPARK_WAIT_S)
    other_tenant, next_attempt = result_of(reports[2, 1]), result_of(reports[3, 1])
    for seen in (other_tenant, next_attempt):
        assert seen["view"] is False and seen["conf"] is None, seen
    assert len({made["session"], other_tenant["session"], next_attempt["session"]}) == 3


async def test_a_task_never_sees_the_worker_token(
    env: Env, server: SparkConnectServer, work_root: Path
) -> None:
    _, conn, sha = await start_worker(env, server, work_root)
    conn.assign(task(11, "scjob.job:what_i_see", tenant="a", code=sha))
    seen = result_of(await conn.report(SPARK_WAIT_S))
    assert WORKER_TOKEN not in json.dumps(seen)
    assert seen["spark_token"] and seen["spark_token"] != WORKER_TOKEN
    # The Spark token reaches the server only through its environment, never its argv.
    assert server.pid is not None
    cmdline = await asyncio.to_thread(Path(f"/proc/{server.pid}/cmdline").read_bytes)
    assert b"SparkConnectServer" in cmdline
    assert seen["spark_token"].encode() not in cmdline


async def _udf_running(marker_dir: Path) -> int:
    def started() -> bool:
        return (marker_dir / "task-pid").exists() and any(marker_dir.glob("udf-*"))

    await asyncio.to_thread(wait_until, started, SPARK_WAIT_S, "the UDF to run on the server")
    return int((marker_dir / "task-pid").read_text())


@contextlib.asynccontextmanager
async def _slow_udf_query(conn: Any, sha: str, task_id: int) -> AsyncIterator[int]:
    """Task ``task_id`` (tenant a) runs a query whose UDFs sleep on the server; yields the
    task process's pid once they run."""
    with task_writable_dir() as marker_dir:
        params = {"marker_dir": str(marker_dir)}
        conn.assign(task(task_id, "scjob.job:slow_udf_query", params, tenant="a", code=sha))
        yield await _udf_running(marker_dir)


async def _server_is_free(server: SparkConnectServer) -> None:
    # local[2]: the two sleeping UDF tasks hold both of the server's cores, so this query
    # only runs once they were interrupted (left alone they would sleep for 600 s). Asked
    # straight from the test: the worker's link plays no part in it.
    def query() -> list[Any]:
        session = server.attach(new_session_id())
        try:
            return list(session.sql("SELECT 1 AS one").collect())
        finally:
            session.stop()

    rows = await asyncio.wait_for(asyncio.to_thread(query), SPARK_WAIT_S)
    assert [row.one for row in rows] == [1]


async def test_cancel_interrupts_the_query_on_the_server(
    env: Env, server: SparkConnectServer, work_root: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="clients.worker")
    _, conn, sha = await start_worker(env, server, work_root)
    async with _slow_udf_query(conn, sha, 21):
        conn.send(Cancel(tasks=(TaskAttempt(21, 1),), reason="cancelled by user"))
        report = await conn.report(SPARK_WAIT_S)
        assert report.error is not None and report.error.startswith("cancelled: cancelled by user")
        await _server_is_free(server)

    # The cancelled task released its session on its way out: the worker's interrupt of it
    # afterwards finds it closed, which is done, not a warning.
    def interrupted() -> bool:
        alive = {thread.name for thread in threading.enumerate()}
        return "steward-spark-interrupt" not in alive

    await until(interrupted)
    assert "could not interrupt" not in caplog.text, caplog.text


async def test_pyspark_functions_before_ctx_spark_say_to_touch_it_first(
    env: Env, server: SparkConnectServer, work_root: Path
) -> None:
    _, conn, sha = await start_worker(env, server, work_root)
    conn.assign(task(25, "scjob.job:udf_before_session", tenant="a", code=sha))
    report = await conn.report(SPARK_WAIT_S)
    assert not report.ok and "touch ctx.spark first" in (report.error or ""), report.error
    conn.assign(task(26, "scjob.job:udf_after_session", tenant="a", code=sha))
    assert result_of(await conn.report(SPARK_WAIT_S)) == "struct<x:bigint>"


async def test_a_killed_task_process_has_its_query_interrupted_by_the_worker(
    env: Env, server: SparkConnectServer, work_root: Path
) -> None:
    # SIGKILL: the task process cannot interrupt anything itself; only the worker can.
    _, conn, sha = await start_worker(env, server, work_root)
    async with _slow_udf_query(conn, sha, 31) as pid:
        os.kill(pid, signal.SIGKILL)
        report = await conn.report(SPARK_WAIT_S)
        assert "signal 9" in (report.error or ""), report.error
        await _server_is_free(server)


async def test_classic_spark_needs_the_flag(
    env: Env, server: SparkConnectServer, work_root: Path
) -> None:
    _, conn, sha = await start_worker(env, server, work_root)
    conn.assign(task(41, "scjob.job:classic_sum", tenant="a", code=sha))
    report = await conn.report(SPARK_WAIT_S)
    assert not report.ok
    assert "classic Spark is off" in (report.error or "")
    assert "--allow-classic-spark" in (report.error or "")


def _rest(ui_port: int, path: str) -> Any:
    with urllib.request.urlopen(f"http://127.0.0.1:{ui_port}{path}", timeout=60) as answer:
        return json.loads(answer.read()) if path.startswith("/api/") else answer.read().decode()


async def test_tenants_jobs_run_in_their_fair_pools(
    env: Env, server: SparkConnectServer, work_root: Path, ui_port: int
) -> None:
    # Item 5 of issue 18: a pool per tenant, weighted like the tenant, seen in Spark's REST
    # API (each stage's schedulingPool) and UI (the pools' weights).
    _, conn, sha = await start_worker(env, server, work_root)
    conn.assign(
        task(61, "scjob.job:pooled", tenant="heavy", code=sha),
        task(62, "scjob.job:pooled", tenant="light", code=sha),
    )
    reports = await conn.reports(2, SPARK_WAIT_S)
    sessions = {
        tenant: result_of(reports[t, 1])["session"] for t, tenant in ((61, "heavy"), (62, "light"))
    }
    app = (await asyncio.to_thread(_rest, ui_port, "/api/v1/applications"))[0]["id"]
    jobs = await asyncio.to_thread(_rest, ui_port, f"/api/v1/applications/{app}/jobs")
    stages = await asyncio.to_thread(_rest, ui_port, f"/api/v1/applications/{app}/stages")
    pool_of_stage = {s["stageId"]: s["schedulingPool"] for s in stages if s["status"] == "COMPLETE"}
    for tenant, session in sessions.items():
        pools = {
            pool_of_stage[stage]
            for job in jobs
            if any(f"_Session_{session}_" in tag for tag in job.get("jobTags", []))
            for stage in job["stageIds"]
            if stage in pool_of_stage
        }
        assert pools == {f"tenant-{tenant}"}, (tenant, pools)
    page = await asyncio.to_thread(_rest, ui_port, "/stages/")
    # The UI's "Fair Scheduler Pools" table comes first: name, minimum share, weight, ...
    cells = re.sub(r"<[^>]+>", " ", page.split("Fair Scheduler Pools", 1)[1]).split()
    weights: dict[str, str] = {}
    for i, cell in enumerate(cells):
        if cell.startswith("tenant-"):
            weights.setdefault(cell, cells[i + 2])
    assert weights["tenant-heavy"] == "3" and weights["tenant-light"] == "1", weights
    allocation = work_root / "spark" / "fairscheduler.xml"
    assert allocation.stat().st_mode & 0o777 == 0o600


async def test_the_welcome_s_tenant_weights_reach_the_server(
    env: Env, server: SparkConnectServer, work_root: Path
) -> None:
    worker = Worker(worker_config(env, work_root, worker_id="sc-weights"), spark_server=server)
    env.workers.append((worker, asyncio.ensure_future(worker.run())))
    await env.broker.connect(tenant_weights={"heavy": 3.0, "big": 5.0})
    await asyncio.wait_for(worker.wait_connected(), WAIT_S)
    assert server.tenant_weights() == {"heavy": 3.0, "big": 5.0}


async def test_classic_spark_with_the_flag(
    env: Env, server: SparkConnectServer, work_root: Path
) -> None:
    server.stop()  # the module's last test: one JVM at a time (the task process starts one)
    _, conn, sha = await start_worker(
        env, server, work_root, worker_id="sc-classic", allow_classic_spark=True
    )
    started = time.monotonic()
    conn.assign(task(51, "scjob.job:classic_sum", tenant="c", code=sha))
    report = await conn.report(SPARK_WAIT_S)
    assert result_of(report) == 6, (report.error, time.monotonic() - started)
