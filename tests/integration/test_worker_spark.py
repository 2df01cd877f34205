"""The worker with real Spark (local mode): SQL, PySpark artifacts, job-group cancels.

One SparkSession for the module (starting one takes seconds): the module fixture
creates it through the worker's own ``shared_spark``, so every worker here uses it.
The fake broker and the artifact server come from tests/support/worker_harness.py.
"""

from __future__ import annotations

import re
import time
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from clients.worker import TaskContext
from clients.worker.runtime import task_runtime as worker_runtime
from clients.worker.runtime.task_runtime import shared_spark
from tests.support.worker_harness import (
    Env,
    result_of,
    task,
    until,
    worker_env,
    zip_bytes,
)
from wire.worker_protocol import Cancel, TaskAttempt

pytestmark = pytest.mark.slow

LONG_SQL = "SELECT sum(id % 7) AS s FROM range(1000000000000)"  # ~ an hour here
SPARK_WAIT_S = 60.0  # the first job of a fresh session compiles and starts Python workers


@pytest.fixture(scope="module")
def spark() -> Iterator[Any]:
    session = shared_spark("local[2]")
    yield session
    session.stop()
    worker_runtime._spark_session = None


@pytest.fixture
async def env(tmp_path: Path, spark: Any) -> AsyncIterator[Env]:
    async with worker_env(tmp_path, stop_timeout_s=1.0, stop_wait_s=30) as environment:
        yield environment


def group_jobs(spark: Any, group: str) -> list[tuple[int, str]]:
    tracker = spark.sparkContext.statusTracker()
    jobs = []
    for job_id in tracker.getJobIdsForGroup(group):
        info = tracker.getJobInfo(job_id)
        jobs.append((job_id, info.status if info is not None else "UNKNOWN"))
    return jobs


def active_in_group(spark: Any, group: str) -> list[int]:
    tracker = spark.sparkContext.statusTracker()
    return sorted(set(tracker.getActiveJobsIds()) & set(tracker.getJobIdsForGroup(group)))


async def test_spark_sql_returns_rows_as_json_objects(env: Env, spark: Any) -> None:
    _, conn = await env.started()
    conn.assign(
        task(11, "spark.sql", {"query": "SELECT id, id * 2 AS d FROM range(5)"}),
        task(12, "spark.sql", {"query": "SELECT 1 AS a, NULL AS b, 'x' AS `c.d`"}),
        task(13, "spark.sql", {"query": "SELECT id FROM range(11)", "max_rows": 10}),
        task(14, "spark.sql", {"query": "SELECT id FROM range(10)", "max_rows": 10}),
        task(15, "spark.sql", {"query": "SELEKT 1"}),
    )
    reports = await conn.reports(5, SPARK_WAIT_S)
    assert result_of(reports[11, 1]) == [{"id": i, "d": 2 * i} for i in range(5)]
    assert result_of(reports[12, 1]) == [{"a": 1, "b": None, "c.d": "x"}]  # nulls kept
    assert "more than max_rows=10 rows" in (reports[13, 1].error or "")
    assert len(result_of(reports[14, 1])) == 10
    assert "PARSE_SYNTAX_ERROR" in (reports[15, 1].error or "")


async def test_spark_sql_result_over_max_result_bytes_is_an_error(env: Env) -> None:
    _, conn = await env.started(max_result_bytes=200)
    conn.assign(task(21, "spark.sql", {"query": "SELECT id FROM range(100)"}))
    report = await conn.report(SPARK_WAIT_S)
    assert not report.ok
    assert "over the max_result_bytes limit of 200" in (report.error or "")


WORDCOUNT = {
    "wc/__init__.py": "",
    "wc/text.py": (
        "import re\n"
        "\n"
        "def tokenize(line):\n"
        "    return [w for w in re.split(r'[^a-z]+', line.lower()) if w]\n"
    ),
    "wc/job.py": (
        "from operator import add\n"
        "\n"
        "from wc.text import tokenize  # absolute import inside the artifact\n"
        "\n"
        "def run(params, ctx):\n"
        "    sc = ctx.spark.sparkContext\n"
        "    lines = sc.parallelize(params['lines'], 3)\n"
        "    counts = lines.flatMap(tokenize).map(lambda w: (w, 1)).reduceByKey(add)\n"
        "    ctx.logger.info('counting %d lines', len(params['lines']))\n"
        "    return dict(counts.collect())\n"
    ),
}
TEXT = [
    "The quick brown fox jumps over the lazy dog.",
    "The dog barks; the fox runs.",
    "",
    "A quick quick end",
]


async def test_pyspark_artifact_word_count(env: Env) -> None:
    _, conn = await env.started()
    sha = env.http.add(zip_bytes(WORDCOUNT))
    conn.assign(task(31, "wc.job:run", {"lines": TEXT}, code=sha))
    report = await conn.report(SPARK_WAIT_S)
    expected = Counter(w for line in TEXT for w in re.split(r"[^a-z]+", line.lower()) if w)
    assert result_of(report) == dict(expected)
    assert expected["the"] == 4 and expected["quick"] == 3


async def test_cancel_stops_a_running_spark_job(env: Env, spark: Any) -> None:
    worker, conn = await env.started()
    # Task ids are unique in this module: they name the Spark job groups.
    conn.assign(
        task(41, "spark.sql", {"query": LONG_SQL}),
        task(42, "spark.sql", {"query": "SELECT count(*) AS n FROM range(1000)"}),
    )
    await until(lambda: bool(active_in_group(spark, "steward-41-1")), SPARK_WAIT_S)
    started = time.monotonic()
    conn.send(Cancel(tasks=(TaskAttempt(41, 1),), reason="cancelled by user"))
    reports = await conn.reports(2, SPARK_WAIT_S)
    cancelled = reports[41, 1]
    assert cancelled.error == "cancelled: cancelled by user"
    assert time.monotonic() - started < 10.0
    # The other task's job (another group) was not touched.
    assert result_of(reports[42, 1]) == [{"n": 1000}]
    await until(lambda: not active_in_group(spark, "steward-41-1"), 10.0)
    jobs = group_jobs(spark, "steward-41-1")
    assert jobs and all(status == "FAILED" for _, status in jobs), jobs
    assert all(status == "SUCCEEDED" for _, status in group_jobs(spark, "steward-42-1"))
    assert worker.runtime.running() == []


def sleepy_udf_job(params: Any, ctx: TaskContext) -> int:
    def slow(x: int) -> int:  # runs in Spark's Python workers
        time.sleep(600)
        return x

    rdd = ctx.spark.sparkContext.parallelize(range(2), 2)
    return int(rdd.map(slow).sum())


async def test_deadline_cancels_a_spark_job_sleeping_in_python(env: Env, spark: Any) -> None:
    worker, conn = await env.started()
    worker.runtime.register("sleepy", sleepy_udf_job)
    deadline_ms = int(time.time() * 1000) + 6000
    conn.assign(task(51, "sleepy", deadline_ms=deadline_ms))
    await until(lambda: bool(active_in_group(spark, "steward-51-1")), SPARK_WAIT_S)
    report = await conn.report(30.0)
    late_s = time.time() - deadline_ms / 1000
    assert report.error == "cancelled: deadline exceeded"
    assert -0.5 < late_s < 5.0
    await until(lambda: not active_in_group(spark, "steward-51-1"), 10.0)
    jobs = group_jobs(spark, "steward-51-1")
    assert jobs and all(status == "FAILED" for _, status in jobs), jobs


async def test_one_session_for_all_tasks_and_job_groups_do_not_leak(env: Env, spark: Any) -> None:
    # One task thread: the second task runs on the thread the first one used.
    worker, conn = await env.started(task_types={"*": 1})
    sessions: list[Any] = []
    groups: list[str | None] = []

    def uses_spark(params: Any, ctx: TaskContext) -> int:
        sessions.append(ctx.spark)
        return int(ctx.spark.range(3).count())

    def peeks(params: Any, ctx: TaskContext) -> None:
        # Without ctx.spark: what job group would a job from this thread get?
        groups.append(shared_spark().sparkContext.getLocalProperty("spark.jobGroup.id"))

    worker.runtime.register("uses_spark", uses_spark)
    worker.runtime.register("peeks", peeks)
    conn.assign(task(61, "uses_spark"))
    assert result_of(await conn.report_for(61, SPARK_WAIT_S)) == 3
    conn.assign(task(62, "uses_spark"))
    assert result_of(await conn.report_for(62, SPARK_WAIT_S)) == 3
    conn.assign(task(63, "peeks"))
    peeked = await conn.report_for(63, SPARK_WAIT_S)
    assert peeked.error is None, peeked.error
    assert sessions[0] is sessions[1] is spark
    assert groups == [None]
    for group in ("steward-61-1", "steward-62-1"):  # each task's jobs in its own group
        statuses = {status for _, status in group_jobs(spark, group)}
        assert statuses == {"SUCCEEDED"}, group
