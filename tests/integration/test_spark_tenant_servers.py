"""A root worker's Spark Connect servers per tenant: started on first use, the least recently
used idle one stopped to make room (``--spark-max-servers``), an idle one stopped after
``--spark-server-idle-s`` (clients/worker/spark/tenant_servers.py); the spare task process a tenant
whose Spark was granted keeps (clients/worker/task_processes/pool.py, "Spares"). Real JVMs, a worker
with room for one server; the fake broker and artifact server come from
tests/support/worker_harness.py.
"""

from __future__ import annotations

import logging
import os
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import msgspec
import pytest

from clients.worker.spark.connect_server import SparkConnectServer
from clients.worker.spark.tenant_servers import TenantSparkServers
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

SPARK_WAIT_S = 240.0  # a tenant's first Spark task starts its server (a JVM)
IDLE_S = 10.0

JOB = {
    "pidjob/__init__.py": "",
    "pidjob/job.py": """
import os
import resource


def count(params, ctx):
    return {"uid": os.getuid(), "rows": ctx.spark.range(3).count(), "pid": os.getpid(),
            "as": list(resource.getrlimit(resource.RLIMIT_AS))}
""",
}


@pytest.fixture
def work_root() -> Iterator[Path]:
    with task_reachable_dir("steward-test-spark-lru-") as root:
        yield root / "work"


@pytest.fixture
async def env(tmp_path: Path) -> AsyncIterator[Env]:
    async with worker_env(tmp_path, stop_timeout_s=1.0, stop_wait_s=30) as environment:
        yield environment


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def spare_pids(uid: int) -> list[int]:
    """Task processes started as spares under ``uid`` (their command line says so)."""
    pids = []
    for entry in Path("/proc").iterdir():
        try:
            if not entry.name.isdigit():
                continue
            argv = (entry / "cmdline").read_bytes().split(b"\0")
            if b"clients.worker.task_processes.child" not in argv or b"--spare" not in argv:
                continue
            # Not the directory's owner: a non-dumpable process's /proc entry is root's.
            status = (entry / "status").read_text()
        except OSError:  # it exited meanwhile
            continue
        real_uid = next(line.split()[1] for line in status.splitlines() if line.startswith("Uid:"))
        if int(real_uid) == uid:
            pids.append(int(entry.name))
    return pids


def server_pid(servers: TenantSparkServers, tenant: str) -> int:
    server = servers.server_of(tenant)
    assert isinstance(server, SparkConnectServer)
    assert server.pid is not None
    return server.pid


async def test_a_new_tenant_takes_the_idle_servers_place_and_idle_servers_stop(
    env: Env, work_root: Path, caplog: pytest.LogCaptureFixture
) -> None:
    assert os.geteuid() == 0, "needs a root worker (task uids per tenant); CI runs as root"
    caplog.set_level(logging.INFO, logger="clients.worker.spark")
    worker, conn = await env.started(
        worker_id="lru1",
        task_isolation="process",
        task_types={"*": 1},
        resources={"cpu": 1.0, "memory_mb": 4096.0},
        spark_master="local[1]",
        work_dir=work_root,
        spark_max_servers=1,
        spark_server_idle_s=IDLE_S,
        spark_driver_memory_mb=512,
    )
    servers = worker.spark_server
    assert isinstance(servers, TenantSparkServers)
    assert servers.tenants() == {}  # none started before a task asks
    sha = env.http.add(zip_bytes(JOB))

    conn.assign(task(1, "pidjob.job:count", tenant="alice", code=sha))
    alice = result_of(await conn.report(SPARK_WAIT_S))
    assert alice["rows"] == 3
    assert servers.tenants() == {"alice": 0}  # kept warm, held by no task
    alice_pid = server_pid(servers, "alice")
    assert os.stat(f"/proc/{alice_pid}").st_uid == alice["uid"]  # the tenant's task uid

    # Its Spark granted, alice keeps a spare process; alice's next task that finds no idle
    # process of its key (here: another memory limit) runs in it, with that limit.
    await until(lambda: len(spare_pids(alice["uid"])) == 1, 60)
    [spare] = spare_pids(alice["uid"])
    assert spare != alice["pid"]
    limited = msgspec.structs.replace(
        task(3, "pidjob.job:count", tenant="alice", code=sha), resources={"memory_mb": 3000.0}
    )
    conn.assign(limited)
    again = result_of(await conn.report(SPARK_WAIT_S))
    assert again["rows"] == 3 and again["pid"] == spare
    assert again["as"] == [3000 * 1024 * 1024] * 2

    conn.assign(task(2, "pidjob.job:count", tenant="bob", code=sha))
    bob = result_of(await conn.report(SPARK_WAIT_S))
    assert bob["rows"] == 3 and bob["uid"] != alice["uid"]
    assert servers.tenants() == {"bob": 0}
    assert not alive(alice_pid)
    assert "stopping tenant alice's Spark Connect server (idle; its place goes to tenant bob" in (
        caplog.text
    )
    bob_pid = server_pid(servers, "bob")
    assert os.stat(f"/proc/{bob_pid}").st_uid == bob["uid"]

    await until(lambda: servers.tenants() == {}, IDLE_S + 30)
    await until(lambda: not alive(bob_pid), 30)
    assert f"stopping tenant bob's Spark Connect server: idle for {IDLE_S:.0f} s" in caplog.text


async def test_a_tenants_server_that_cannot_start_fails_its_task_saying_why(
    env: Env, work_root: Path
) -> None:
    assert os.geteuid() == 0, "needs a root worker (task uids per tenant); CI runs as root"
    worker, conn = await env.started(
        worker_id="bad1",
        task_isolation="process",
        task_types={"*": 1},
        spark_master="local[1]",
        work_dir=work_root,
        spark_conf={"spark.driver.memory": "1k"},  # a heap no JVM starts with
    )
    servers = worker.spark_server
    assert isinstance(servers, TenantSparkServers)
    sha = env.http.add(zip_bytes(JOB))
    conn.assign(task(1, "pidjob.job:count", tenant="alice", code=sha))
    report = await conn.report(SPARK_WAIT_S)
    assert not report.ok
    error = report.error or ""
    assert "Spark is not available: the Spark Connect server exited" in error, error
    assert "server log tail" in error, error  # the JVM's own words come with it
    assert servers.tenants() == {"alice": 0}  # released: the next task starts a new one
