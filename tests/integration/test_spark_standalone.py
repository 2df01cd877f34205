"""Issue 20, item 2: Steward's PySpark tasks on a real Spark standalone cluster.

A master and two Spark workers from pyspark's own ``spark-class`` on 127.0.0.1
(``tests/support/spark_cluster.py``), a standalone broker, and one Steward worker with
``--spark-master spark://127.0.0.1:PORT`` (its Spark Connect server is the cluster's
driver; executors of 512 MiB, one core each). The demo's word count and the fan-out example
give the answers a plain-Python computation gives (the answers ``local[*]`` gives in
test_readme_lines.py and test_example_spark_fanout.py); a Steward cancel kills the task's Spark job
on the cluster (Spark's REST API says so); a Spark worker killed with -9 under a running
task costs the task nothing but Spark's own retry, and the Steward worker lives on.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from importlib import resources
from pathlib import Path
from typing import Any

import httpx
import pytest

from clients.client import StewardClient
from clients.demo.run import JOB_TYPE, corpus_lines, plain_python_count
from examples.spark_fanout.run import direct_answer, run_fanout
from tests.support.logged_process import log_tail
from tests.support.procs import HOST, BrokerProcess, free_port
from tests.support.spark_cluster import SparkCluster, spark_cluster
from tests.support.worker_procs import WorkerProcess, task_writable_dir, wait_until

pytestmark = pytest.mark.slow

TASK_WAIT_S = 150.0  # the first task waits for the Connect server and the cluster's executors
SPARK_WAIT_S = 60.0

# slow_sum: Spark SQL only, each row sleeping in an executor's JVM, so that the job runs
# long enough to be killed or cancelled. udf_sum: a Python UDF (a lambda: pickled by value,
# the executors do not have the artifact's modules) run by the executors' Python, which the
# worker sets to its own (spark.pyspark.python).
SLOW_JOB = """
def udf_sum(params, ctx):
    from pyspark.sql import functions as sf

    df = ctx.spark.range(0, int(params["rows"]), 1, 2)  # first: the session is made lazily
    double = sf.udf(lambda n: n * 2, "long")
    return {"total": df.select(sf.sum(double("id")).alias("t")).collect()[0]["t"]}


def slow_sum(params, ctx):
    rows, sleep_ms = int(params["rows"]), int(params["sleep_ms"])
    row = ctx.spark.sql(
        "SELECT sum(id) AS total, count(slept) AS n FROM (SELECT id,"
        f" reflect('java.lang.Thread', 'sleep', CAST({sleep_ms} AS BIGINT)) AS slept"
        f" FROM range(0, {rows}, 1, {rows}))"
    ).collect()[0]
    return {"total": row["total"], "rows": row["n"]}
"""


class Setup:
    def __init__(
        self,
        cluster: SparkCluster,
        broker: BrokerProcess,
        worker: WorkerProcess,
        ui_port: int,
        work_dir: Path,
        shared: Path,
        slow_code: str,
    ) -> None:
        self.cluster = cluster
        self.broker = broker
        self.worker = worker
        self.ui = f"http://{HOST}:{ui_port}"  # the driver's (Connect server's) UI
        self.work_dir = work_dir  # the drivers' logs: spark-tenants/<uid>/server.log
        self.shared = shared
        self.slow_code = slow_code

    def logs(self) -> str:
        logs = sorted(self.work_dir.glob("spark-tenants/*/server.log"))
        driver = "\n".join(log_tail(log, 3000) for log in logs)
        return f"{self.worker.log_tail()}\n--- driver ---\n{driver}\n{self.cluster.logs()}"


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Setup]:
    root = tmp_path_factory.mktemp("spark-standalone")
    # The Spark workers start while the Steward worker's driver does (it waits for executors).
    with spark_cluster(root / "spark", workers=2, wait=False) as cluster:
        worker_port, ui_port = free_port(), free_port()
        broker = BrokerProcess(
            root / "data",
            log_path=root / "logs" / "broker.log",
            extra_args=("--worker-listen", f"{HOST}:{worker_port}"),
        )
        # The driver's UI, for its REST API (jobs and their tags); on loopback like the rest.
        conf = {
            **cluster.driver_conf(),
            "spark.ui.enabled": "true",
            "spark.ui.port": str(ui_port),
        }
        spark_args = [
            arg for key, value in conf.items() for arg in ("--spark-conf", f"{key}={value}")
        ]
        worker: WorkerProcess | None = None
        dirs = contextlib.ExitStack()
        try:
            # A directory the test removes, not the worker's default under /tmp.
            work_dir = dirs.enter_context(task_writable_dir("steward-spark-work-"))
            shared = dirs.enter_context(task_writable_dir())
            broker.start()  # its URL (the worker's --http-url) is known once it runs
            worker = WorkerProcess(
                broker=f"{HOST}:{worker_port}",
                http_url=broker.url,
                worker_id="spark-standalone",
                log_dir=root / "logs",
                cache_dir=root / "cache",
                extra_args=(
                    *("--task-type", "*=4", "--work-dir", str(work_dir)),
                    *("--spark-master", cluster.master_url, *spark_args),
                ),
                spark=True,
            ).start()
            with httpx.Client(base_url=broker.url, timeout=30) as http:
                worker.wait_connected(http)
            cluster.wait_workers(2)
            job = root / "slow_job.py"
            job.write_text(SLOW_JOB, encoding="utf-8")
            with StewardClient(broker.url) as client:
                slow_code = client.upload_code(job)
            yield Setup(cluster, broker, worker, ui_port, work_dir, shared, slow_code)
        finally:
            if worker is not None:
                worker.stop()
            broker.kill9()
            dirs.close()


def _app_id(setup: Setup) -> str:
    apps = httpx.get(f"{setup.ui}/api/v1/applications", timeout=5).json()
    app_id: str = apps[0]["id"]
    return app_id


def _jobs(setup: Setup) -> list[dict[str, Any]]:
    try:
        response = httpx.get(f"{setup.ui}/api/v1/applications/{_app_id(setup)}/jobs", timeout=5)
        jobs: list[dict[str, Any]] = response.json()
        return jobs
    except (httpx.HTTPError, ValueError, IndexError, KeyError):
        return []


def _tagged(setup: Setup, task_id: int, attempt: int = 1) -> list[dict[str, Any]]:
    """The Spark jobs carrying the Steward attempt's tag (Connect prefixes it)."""
    tag = f"steward-{task_id}-{attempt}"
    return [j for j in _jobs(setup) if any(t.endswith(tag) for t in j.get("jobTags", []))]


def test_the_word_count_gives_the_plain_python_answer(setup: Setup) -> None:
    lines = corpus_lines()[:600]
    chunks = [lines[i : i + 200] for i in range(0, len(lines), 200)]
    job = resources.files("clients.demo").joinpath("wordcount_job.py")
    with StewardClient(setup.broker.url) as client, resources.as_file(job) as job_path:
        sha = client.upload_code(job_path)
        handles = [client.submit(JOB_TYPE, {"lines": chunk}, code=sha) for chunk in chunks]
        done = client.wait_many(handles, timeout=TASK_WAIT_S)
    counts: dict[str, int] = {}
    for handle in handles:
        task = done[handle.id]
        assert task["state"] == "finished", (task.get("error"), setup.logs())
        for word, n in task["result"]["counts"].items():
            counts[word] = counts.get(word, 0) + n
    assert counts == dict(plain_python_count(lines))
    # They ran on the cluster: the master knows the worker's driver, with executors.
    apps = setup.cluster.state()["activeapps"]
    assert [a["name"] for a in apps] == ["steward-spark-connect"], apps
    assert apps[0]["memoryperexecutor"] == 512, apps


def test_the_fanout_gives_the_direct_answer(setup: Setup) -> None:
    rows = 30_001
    with StewardClient(setup.broker.url) as client:
        outcome = run_fanout(
            client, setup.shared / "out", rows=rows, partitions=3, timeout_s=TASK_WAIT_S
        )
    assert outcome.root["tree"]["state"] == "completed", (outcome.root, setup.logs())
    assert outcome.answer == direct_answer(rows)


def test_a_cancel_kills_the_tasks_spark_job_on_the_cluster(setup: Setup) -> None:
    with StewardClient(setup.broker.url) as client:
        handle = client.submit(
            "slow_job:slow_sum", {"rows": 4, "sleep_ms": 60_000}, code=setup.slow_code
        )
        running = wait_until(
            lambda: [j for j in _tagged(setup, handle.id) if j["status"] == "RUNNING"],
            TASK_WAIT_S,
            "the task's Spark job to run on the cluster",
            pause_s=0.5,
        )
        started = time.monotonic()
        client.cancel(handle.id)
        task = client.wait_many([handle], timeout=SPARK_WAIT_S)[handle.id]
    assert task["state"] == "cancelled", task
    job_id = running[0]["jobId"]

    def killed() -> dict[str, Any] | None:
        # FAILED comes first; its executors' tasks are counted out as each reports its kill
        # (2 still active at the FAILED on a loaded machine).
        job = next((j for j in _jobs(setup) if j["jobId"] == job_id), None)
        done = job is not None and job["status"] == "FAILED" and job["numActiveTasks"] == 0
        return job if done else None

    job = wait_until(
        killed,
        SPARK_WAIT_S,
        f"Spark job {job_id} to be cancelled, none of its tasks running",
        pause_s=0.5,
    )
    # Cancelled, and nothing of it running, long before its rows' 60 s sleeps were over.
    assert time.monotonic() - started < 50, job


def test_a_spark_worker_killed_under_a_task_costs_only_sparks_retry(setup: Setup) -> None:
    rows = 4  # two per executor at 1 core each: both Spark workers busy
    with StewardClient(setup.broker.url) as client:
        handle = client.submit(
            "slow_job:slow_sum",
            {"rows": rows, "sleep_ms": 3_000},
            code=setup.slow_code,
            max_attempts=3,
        )
        running = wait_until(
            lambda: [
                j
                for j in _tagged(setup, handle.id)
                if j["status"] == "RUNNING" and j["numActiveTasks"] >= 2
            ],
            TASK_WAIT_S,
            "the task's Spark job to run on both Spark workers",
            pause_s=0.5,
        )
        setup.cluster.kill9(setup.cluster.workers[0])
        task = client.wait_many([handle], timeout=TASK_WAIT_S)[handle.id]
        assert task["state"] == "finished", (task.get("error"), setup.logs())
        assert task["result"] == {"total": sum(range(rows)), "rows": rows}
        # The kill hit the job: Spark lost tasks and ran them again, or Steward did.
        job = next(j for j in _jobs(setup) if j["jobId"] == running[0]["jobId"])
        assert job["numFailedTasks"] >= 1 or task["attempt"] > 1, (job, task)
        # The Steward worker lives on and still runs Spark tasks (Python on the executors too)
        # on what is left.
        assert setup.worker.running(), setup.worker.log_tail()
        again = client.submit("slow_job:udf_sum", {"rows": 100}, code=setup.slow_code)
        task = client.wait_many([again], timeout=TASK_WAIT_S)[again.id]
    assert task["state"] == "finished", (task.get("error"), setup.logs())
    assert task["result"] == {"total": 2 * sum(range(100))}
