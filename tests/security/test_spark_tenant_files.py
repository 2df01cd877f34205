"""A tenant's Spark work runs under the tenant's own uid (docs/SECURITY.md, "Spark").

A real worker (root, task processes under a uid per tenant) starts a Spark Connect server
per tenant on first use, as that tenant's task uid: each tenant's ``df.write.parquet`` into
its own home writes files its uid owns, and the other tenant's task can neither read nor
write them, through Spark or the file system. The fake broker and the artifact server come
from tests/support/worker_harness.py.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from tests.support.worker_harness import (
    Env,
    result_of,
    task,
    worker_env,
    zip_bytes,
)
from tests.support.worker_procs import task_reachable_dir

pytestmark = pytest.mark.slow

SPARK_WAIT_S = 240.0  # a tenant's first Spark task starts its server (a JVM)

JOB = {
    "ownjob/__init__.py": "",
    "ownjob/job.py": """
import os


def owners(path):
    return sorted({os.stat(os.path.join(d, f)).st_uid for d, _, fs in os.walk(path) for f in fs})


def write(params, ctx):
    path = os.path.join(os.environ["HOME"], "spark-out")
    ctx.spark.range(5).write.mode("overwrite").parquet(path)
    return {"path": path, "uid": os.getuid(), "owners": owners(path),
            "rows": ctx.spark.read.parquet(path).count()}


def attempt(what, step):
    try:
        return "allowed: %r" % (step(),)
    except Exception as exc:
        return "refused: %s" % str(exc).splitlines()[0][:300]


def poke(params, ctx):
    other = params["other"]
    spark = ctx.spark
    return {
        "list": attempt("list", lambda: os.listdir(other)),
        "spark_read": attempt("read", lambda: spark.read.parquet(other).count()),
        "spark_append": attempt(
            "append", lambda: spark.range(1).write.mode("append").parquet(other)
        ),
        "spark_overwrite": attempt(
            "overwrite", lambda: spark.range(1).write.mode("overwrite").parquet(other)
        ),
    }
""",
}


@pytest.fixture
def work_root() -> Iterator[Path]:
    with task_reachable_dir("steward-test-spark-own-") as root:
        yield root / "work"


@pytest.fixture
async def env(tmp_path: Path) -> AsyncIterator[Env]:
    async with worker_env(tmp_path, stop_timeout_s=1.0, stop_wait_s=30) as environment:
        yield environment


async def test_each_tenants_spark_files_are_its_own_uids_and_out_of_the_others_reach(
    env: Env, work_root: Path
) -> None:
    assert os.geteuid() == 0, "needs a root worker (task uids per tenant); CI runs as root"
    _, conn = await env.started(
        worker_id="own1",
        task_isolation="process",
        task_types={"*": 2},
        resources={"cpu": 2.0, "memory_mb": 2048.0},
        spark_master="local[1]",
        work_dir=work_root,
        spark_driver_memory_mb=512,
    )
    sha = env.http.add(zip_bytes(JOB))
    conn.assign(
        task(1, "ownjob.job:write", tenant="alice", code=sha),
        task(2, "ownjob.job:write", tenant="bob", code=sha),
    )
    reports = await conn.reports(2, SPARK_WAIT_S)
    alice, bob = result_of(reports[1, 1]), result_of(reports[2, 1])
    assert alice["uid"] != bob["uid"]
    assert alice["owners"] == [alice["uid"]], alice  # Spark wrote as alice's task uid
    assert bob["owners"] == [bob["uid"]], bob
    assert alice["rows"] == bob["rows"] == 5
    conn.assign(task(3, "ownjob.job:poke", {"other": alice["path"]}, tenant="bob", code=sha))
    poked = result_of(await conn.report(SPARK_WAIT_S))
    for step, outcome in poked.items():
        assert outcome.startswith("refused"), (step, outcome)
    # alice's output is as she left it, still hers alone.
    files = [Path(d) / f for d, _, fs in os.walk(alice["path"]) for f in fs]
    assert files and {path.stat().st_uid for path in files} == {alice["uid"]}
