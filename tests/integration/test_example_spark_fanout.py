"""Issue 6's PySpark fan-out example (examples/spark_fanout) run for real: a standalone
broker process, a worker process with Spark in local mode, the artifact uploaded, one
tracked root, and the combined answer compared with a direct computation."""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from clients.client import StewardClient
from clients.worker.spark.connect_server import DEFAULT_START_TIMEOUT_S
from examples.spark_fanout import fanout_job
from examples.spark_fanout.run import direct_answer, run_fanout
from tests.support.procs import HOST, BrokerProcess, fetch_all_tasks, free_port
from tests.support.worker_procs import WorkerProcess, task_writable_dir

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
# The tree's own work (its Spark server is warm first: below).
TREE_WAIT_S = 120.0
# The tenant's Spark Connect server starts within the worker's own bound, else the worker
# fails the warm-up task saying so (60-90 s here at load 8-10 on 2 cores, JVM and query).
WARM_UP_WAIT_S = DEFAULT_START_TIMEOUT_S + 30.0


class Setup:
    def __init__(
        self, broker: BrokerProcess, worker: WorkerProcess, root: Path, shared: Path
    ) -> None:
        self.broker = broker
        self.worker = worker
        self.root = root
        self.shared = shared  # written by the tasks, under their own uids


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Setup]:
    root = tmp_path_factory.mktemp("fanout")
    worker_port = free_port()
    broker = BrokerProcess(
        root / "data",
        log_path=root / "logs" / "broker.log",
        extra_args=("--worker-listen", f"{HOST}:{worker_port}"),
    )
    broker.start()
    worker = WorkerProcess(
        broker=f"{HOST}:{worker_port}",
        http_url=broker.url,
        worker_id="fanout-spark",
        log_dir=root / "logs",
        cache_dir=root / "cache",
        extra_args=("--task-type", "*=4", "--spark-master", "local[2]"),
        spark=True,
    )
    try:
        worker.start()
        with httpx.Client(base_url=broker.url, timeout=30) as http:
            worker.wait_connected(http)
        # The tenant's Spark server started before the trees are timed.
        with StewardClient(broker.url) as client:
            warm = client.submit("spark.sql", {"query": "SELECT 1 AS one"})
            assert warm.result(timeout=WARM_UP_WAIT_S) == [{"one": 1}]
        with task_writable_dir() as shared:
            yield Setup(broker, worker, root, shared)
    finally:
        worker.stop()
        broker.kill9()


def _tree_tasks(url: str, root_id: int) -> list[dict[str, Any]]:
    with httpx.Client(base_url=url, timeout=30) as http:
        return [t for t in fetch_all_tasks(http) if t.get("root") == root_id]


def test_the_fanout_gives_the_same_answer_as_a_direct_computation(setup: Setup) -> None:
    rows, partitions = 250_001, 5
    with StewardClient(setup.broker.url) as client:
        outcome = run_fanout(
            client,
            setup.shared / "out",
            rows=rows,
            partitions=partitions,
            timeout_s=TREE_WAIT_S,
        )
    assert outcome.root["tree"]["state"] == "completed", (outcome.root, setup.worker.log_tail())
    assert outcome.root["tree"]["attempt"] == 1
    assert outcome.answer == direct_answer(rows)
    assert outcome.answer["rows"] == rows and len(outcome.answer["by_key"]) == fanout_job.KEYS

    tasks = _tree_tasks(setup.broker.url, outcome.root_id)
    parts = [t for t in tasks if t["type"] == "fanout_job:partition"]
    combiners = [t for t in tasks if t["type"] == "fanout_job:combine"]
    assert len(parts) == partitions and len(combiners) == 1, tasks
    assert all(t["state"] == "finished" for t in tasks), tasks
    assert all(t["parent"] == outcome.root_id for t in parts)
    # The combiner is the root's child joined to every partition (no claim files).
    assert combiners[0]["parent"] == outcome.root_id
    assert sorted(combiners[0]["after"]) == sorted(t["id"] for t in parts)
    assert combiners[0]["waiting_for"] == []
    assert all(t["finished_at"] <= combiners[0]["finished_at"] for t in parts)
    assert combiners[0]["result"] == outcome.answer
    run_dir = outcome.final_path.parent
    assert sorted(p.name for p in run_dir.glob("part-*.json")) == [
        f"part-{i:04d}.json" for i in range(partitions)
    ]
    assert not list(run_dir.glob("*claim*"))


def _runner(*args: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run(
        [sys.executable, "-m", "examples.spark_fanout", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=TREE_WAIT_S + 30,
        check=False,
    )


def test_the_runner_prints_the_answer_next_to_the_direct_computation(setup: Setup) -> None:
    done = _runner(
        "--url",
        setup.broker.url,
        "--rows",
        "70001",
        "--partitions",
        "5",
        "--out-dir",
        str(setup.shared / "runner-out"),
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "tree completed on attempt 1" in done.stdout
    assert "the fan-out equals the direct computation" in done.stdout
    assert f"{direct_answer(70001)['sum']:>16}{direct_answer(70001)['sum']:>16}" in done.stdout


def test_the_runner_refuses_bad_input_without_a_traceback() -> None:
    done = _runner("--partitions", "0")
    assert done.returncode == 2
    assert "must be >= 1" in done.stderr and "Traceback" not in done.stderr
    done = _runner("--rows", "3", "--partitions", "4")
    assert done.returncode == 2
    assert "--partitions must be at most" in done.stderr and "Traceback" not in done.stderr


# -- the example's pieces without a broker ------------------------------------------------


def test_split_covers_every_row_once() -> None:
    for rows, partitions in ((10, 3), (7, 7), (1_000_003, 8), (5, 1)):
        bounds = fanout_job.split(rows, partitions)
        assert len(bounds) == partitions
        assert bounds[0][0] == 0 and bounds[-1][1] == rows
        assert all(a[1] == b[0] for a, b in itertools.pairwise(bounds))
        sizes = {end - start for start, end in bounds}
        assert max(sizes) - min(sizes) <= 1


def test_merging_partials_equals_aggregating_at_once() -> None:
    rows = 10_007
    partials = [fanout_job.python_aggregate(s, e) for s, e in fanout_job.split(rows, 9)]
    assert fanout_job.merge(partials) == fanout_job.python_aggregate(0, rows)
    assert fanout_job.merge([fanout_job.empty_aggregate()]) == fanout_job.empty_aggregate()
