"""Issue 3 end to end: a real standalone broker, real worker processes, real Spark.

Each test uses its own tenants and workers that serve only those tenants, so the
tests share one broker without taking each other's tasks. The PySpark word count of two
tenants equal to plain Python's is the demo's, run by tests/integration/test_readme_lines.py.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.procs import HOST, BrokerProcess, free_port
from tests.support.worker_procs import TcpProxy, WorkerProcess, wait_until

HEARTBEAT_TIMEOUT_MS = 1500


class Cluster:
    def __init__(self, broker: BrokerProcess, worker_port: int, root: Path) -> None:
        self.broker = broker
        self.worker_address = f"{HOST}:{worker_port}"
        self.root = root
        self.http = httpx.Client(base_url=broker.url, timeout=30)
        self.workers: list[WorkerProcess] = []

    def worker(
        self,
        worker_id: str,
        *args: str,
        via: str | None = None,
        wait: bool = True,
        spark: bool = False,
    ) -> WorkerProcess:
        process = WorkerProcess(
            broker=via or self.worker_address,
            http_url=self.broker.url,
            worker_id=worker_id,
            log_dir=self.root / "logs",
            cache_dir=self.root / "cache" / worker_id,
            extra_args=args,
            spark=spark,
        ).start()
        self.workers.append(process)
        if wait:
            process.wait_connected(self.http)
        return process

    def submit(self, **task: Any) -> int:
        response = self.http.post("/api/v1/tasks", json=task)
        assert response.status_code == 201, response.text
        return int(response.json()["id"])

    def task(self, task_id: int, wait_s: float = 0.0) -> dict[str, Any]:
        params = {"wait_s": wait_s} if wait_s else None
        result: dict[str, Any] = self.http.get(
            f"/api/v1/tasks/{task_id}", params=params, timeout=wait_s + 30
        ).json()
        return result

    def wait_state(self, task_id: int, states: set[str], timeout_s: float) -> dict[str, Any]:
        def reached() -> dict[str, Any] | None:
            task = self.task(task_id)
            return task if task["state"] in states else None

        found: dict[str, Any] = wait_until(reached, timeout_s, f"task {task_id} to reach {states}")
        return found

    def wait_final(self, task_id: int, timeout_s: float = 60.0) -> dict[str, Any]:
        return self.wait_state(task_id, {"finished", "error", "cancelled"}, timeout_s)

    def tenant_running(self, name: str) -> int:
        return int(self.http.get(f"/api/v1/tenants/{name}").json()["counts"]["running"])


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    root = tmp_path_factory.mktemp("e2e")
    worker_port = free_port()
    broker = BrokerProcess(
        root / "data",
        log_path=root / "logs" / "broker.log",
        extra_args=(
            "--worker-listen",
            f"{HOST}:{worker_port}",
            "--heartbeat-interval-ms",
            "250",
            "--heartbeat-timeout-ms",
            str(HEARTBEAT_TIMEOUT_MS),
        ),
    )
    broker.start()
    cluster = Cluster(broker, worker_port, root)
    try:
        yield cluster
    finally:
        for worker in cluster.workers:
            worker.stop()
        cluster.http.close()
        broker.kill9()


def _spark_is_free(cluster: Cluster, tenant: str) -> float:
    """A tiny Spark query's run time: long if the cancelled job still holds the cores."""
    started = time.monotonic()
    task_id = cluster.submit(type="spark.sql", tenant=tenant, params={"query": "SELECT 1 AS one"})
    task = cluster.wait_final(task_id, timeout_s=60)
    assert task["state"] == "finished", task
    assert task["result"] == [{"one": 1}]
    return time.monotonic() - started


LONG_QUERY = {"query": "SELECT sum(id % 13) AS s FROM range(0, 10000000000000, 1, 2)"}


def test_cancel_and_deadline_stop_the_spark_job(cluster: Cluster) -> None:
    cluster.worker("spark-2", "--tenant", "sparkstop", "--task-type", "spark.sql=2", spark=True)
    _spark_is_free(cluster, "sparkstop")  # warm the SparkSession up
    long_id = cluster.submit(type="spark.sql", tenant="sparkstop", params=LONG_QUERY)
    cluster.wait_state(long_id, {"running"}, 30)
    time.sleep(1.5)  # the job is really running on the executors
    response = cluster.http.post(f"/api/v1/tasks/{long_id}/cancel")
    assert response.status_code == 200, response.text
    assert cluster.task(long_id)["state"] == "cancelled"
    # The cancelled job no longer holds the cores: a tiny query is quick.
    assert _spark_is_free(cluster, "sparkstop") < 10

    deadline_id = cluster.submit(
        type="spark.sql",
        tenant="sparkstop",
        params=LONG_QUERY,
        deadline=time.time() + 4,
    )
    task = cluster.wait_final(deadline_id, timeout_s=30)
    assert task["state"] == "error"
    assert "deadline" in task["error"]
    assert _spark_is_free(cluster, "sparkstop") < 10
    log = cluster.workers[-1].log_tail(200_000)
    assert "cancel" in log.lower()


def test_kill9_of_a_worker_reruns_its_task_elsewhere(cluster: Cluster) -> None:
    first = cluster.worker("k9-a", "--tenant", "killnine", "--task-type", "sleep=1")
    task_id = cluster.submit(type="sleep", tenant="killnine", params={"seconds": 3}, max_attempts=2)
    running = cluster.wait_state(task_id, {"running"}, 20)
    assert running["worker"] == "k9-a" and running["attempt"] == 1
    cluster.worker("k9-b", "--tenant", "killnine", "--task-type", "sleep=1")
    first.kill9()
    task = cluster.wait_final(task_id, timeout_s=30)
    assert task["state"] == "finished", task
    assert task["attempt"] == 2
    assert task["worker"] is None or task["worker"] == "k9-b"
    workers = {w["id"]: w for w in cluster.http.get("/api/v1/cluster").json()["workers"]}
    assert workers["k9-a"]["state"] == "dead"


def test_kill9_with_max_lost_0_ends_in_error_naming_the_worker(cluster: Cluster) -> None:
    # A lost worker does not use up max_attempts (docs/DESIGN.md §6, "Lost workers"):
    # a task that may lose no attempt (max_lost 0) ends with its worker, saying which.
    worker = cluster.worker("k9-c", "--tenant", "killonce", "--task-type", "sleep=1")
    task_id = cluster.submit(type="sleep", tenant="killonce", params={"seconds": 30}, max_lost=0)
    cluster.wait_state(task_id, {"running"}, 20)
    worker.kill9()
    task = cluster.wait_final(task_id, timeout_s=30)
    assert task["state"] == "error"
    assert "k9-c" in task["error"] and "max_lost 0" in task["error"]
    assert (task["attempt"], task["lost"]) == (1, 1)


def test_worker_restart_requeues_the_tasks_it_lost(cluster: Cluster) -> None:
    worker = cluster.worker("restarter", "--tenant", "restart", "--task-type", "sleep=1")
    task_id = cluster.submit(type="sleep", tenant="restart", params={"seconds": 2}, max_attempts=2)
    cluster.wait_state(task_id, {"running"}, 20)
    worker.kill9()
    # Back at once (well inside the heartbeat timeout) as a new process: it
    # reports no running task, so the broker re-queues the lost attempt.
    cluster.worker("restarter", "--tenant", "restart", "--task-type", "sleep=1", wait=False)
    task = cluster.wait_final(task_id, timeout_s=30)
    assert task["state"] == "finished", task
    assert task["attempt"] == 2
    log = cluster.broker.log_text()
    assert "restarter" in log and "lost 1" in log


def test_dropped_connection_keeps_the_running_task(cluster: Cluster) -> None:
    host, port = cluster.worker_address.rsplit(":", 1)
    proxy = TcpProxy((host, int(port)))
    try:
        cluster.worker(
            "proxied", "--tenant", "dropped", "--task-type", "sleep=1", via=proxy.address
        )
        task_id = cluster.submit(type="sleep", tenant="dropped", params={"seconds": 3})
        cluster.wait_state(task_id, {"running"}, 20)
        # "running" is the broker's state once it assigned the task; the Assign frame may
        # still be in the proxy. Cut only once the broker's next bytes (the Assign, or a
        # heartbeat behind it) reached the worker, and the worker had a moment to read them.
        forwarded = proxy.bytes_to_client
        wait_until(lambda: proxy.bytes_to_client > forwarded, 10, "the Assign to pass")
        time.sleep(0.3)
        proxy.cut()
        wait_until(lambda: proxy.connections >= 2, 10, "the worker to reconnect")
        task = cluster.wait_final(task_id, timeout_s=30)
        # Finished by the same attempt: no re-execution.
        assert task["state"] == "finished", task
        assert task["attempt"] == 1
        workers = {w["id"]: w for w in cluster.http.get("/api/v1/cluster").json()["workers"]}
        assert workers["proxied"]["state"] == "connected"
    finally:
        proxy.close()


def _running_counts(cluster: Cluster) -> dict[str, int]:
    """Every tenant's running tasks, from one request (so from one state)."""
    listing = cluster.http.get("/api/v1/tenants").json()["tenants"]
    return {t["name"]: int(t["counts"]["running"]) for t in listing}


def _mean_running(cluster: Cluster, tenants: list[str], seconds: float) -> dict[str, float]:
    totals = dict.fromkeys(tenants, 0)
    samples = 0
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        running = _running_counts(cluster)
        for tenant in tenants:
            totals[tenant] += running[tenant]
        samples += 1
        time.sleep(0.1)
    return {t: totals[t] / samples for t in tenants}


def test_weighted_fair_shares_and_runtime_weight_change(cluster: Cluster) -> None:
    for n in (1, 2):
        cluster.worker(f"fair-{n}", "--tenant", "fa", "--tenant", "fb", "--task-type", "sleep=4")
    cluster.http.put("/api/v1/tenants/fa", json={"weight": 3})
    cluster.http.put("/api/v1/tenants/fb", json={"weight": 1})
    # One batch: both queues exist when the first slots are handed out (with one batch per
    # tenant, fa's could fill every slot before fb's arrived, skewing the first second).
    batch = [
        {"type": "sleep", "tenant": tenant, "params": {"seconds": 1.0}}
        for tenant in ("fa", "fb")
        for _ in range(600)
    ]
    assert cluster.http.post("/api/v1/tasks", json={"tasks": batch}).status_code == 200

    # Measure once both workers' 8 slots are busy, with both tenants in them.
    def saturated() -> bool:
        running = _running_counts(cluster)
        return running["fa"] + running["fb"] == 8 and running["fb"] > 0

    wait_until(saturated, 20, "the two workers to be saturated")
    shares = _mean_running(cluster, ["fa", "fb"], 5.0)
    ratio = shares["fa"] / shares["fb"]
    assert 3 * 0.9 <= ratio <= 3 * 1.1, shares
    # A weight change applies to the tasks already waiting, without resubmission.
    cluster.http.put("/api/v1/tenants/fb", json={"weight": 3})
    # Tasks last 1 s: the new shares settle as running tasks finish.
    wait_until(lambda: cluster.tenant_running("fb") >= 4, 20, "fb to reach its new share")
    shares = _mean_running(cluster, ["fa", "fb"], 4.0)
    ratio = shares["fa"] / shares["fb"]
    assert 0.9 <= ratio <= 1.1, shares
    for tenant in ("fa", "fb"):
        listing = cluster.http.get(
            "/api/v1/tasks", params={"tenant": tenant, "state": "waiting", "limit": 1000}
        ).json()["tasks"]
        for task in listing:
            cluster.http.post(f"/api/v1/tasks/{task['id']}/cancel")


def test_tenant_max_running_is_never_exceeded(cluster: Cluster) -> None:
    cluster.worker("limit-1", "--tenant", "capped", "--task-type", "sleep=6")
    cluster.http.put("/api/v1/tenants/capped", json={"max_running": 2})
    batch = [{"type": "sleep", "tenant": "capped", "params": {"seconds": 0.2}} for _ in range(30)]
    ids = [
        t["id"] for t in cluster.http.post("/api/v1/tasks", json={"tasks": batch}).json()["tasks"]
    ]
    peak = 0
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        peak = max(peak, cluster.tenant_running("capped"))
        if all(cluster.task(i)["state"] == "finished" for i in ids[-3:]):
            break
        time.sleep(0.05)
    assert peak == 2
    for task_id in ids:
        assert cluster.wait_final(task_id, 30)["state"] == "finished"


def test_slots_and_transactions_through_real_workers(cluster: Cluster) -> None:
    cluster.worker("slotter", "--tenant", "slots", "--task-type", "*=4")
    first = cluster.submit(type="sleep", tenant="slots", slot="nightly", params={"seconds": 1})
    cluster.wait_state(first, {"running"}, 20)
    busy = cluster.http.post(
        "/api/v1/tasks", json={"type": "noop", "tenant": "slots", "slot": "nightly"}
    )
    assert busy.status_code == 409 and busy.json()["error"]["code"] == "slot_busy"
    assert cluster.wait_final(first)["state"] == "finished"
    again = cluster.submit(type="noop", tenant="slots", slot="nightly")
    assert cluster.wait_final(again)["state"] == "finished"

    txn = cluster.http.post("/api/v1/transactions", json={"tenant": "slots"}).json()["id"]
    dropped = [cluster.submit(type="noop", tenant="slots", transaction=txn) for _ in range(3)]
    time.sleep(0.5)  # pending tasks are never scheduled
    assert {cluster.task(i)["state"] for i in dropped} == {"pending"}
    assert cluster.http.post(f"/api/v1/transactions/{txn}/rollback").status_code == 200
    for task_id in dropped:
        assert cluster.http.get(f"/api/v1/tasks/{task_id}").status_code == 404

    txn = cluster.http.post("/api/v1/transactions", json={"tenant": "slots"}).json()["id"]
    kept = [cluster.submit(type="noop", tenant="slots", transaction=txn) for _ in range(3)]
    assert cluster.http.post(f"/api/v1/transactions/{txn}/commit").status_code == 200
    for task_id in kept:
        assert cluster.wait_final(task_id)["state"] == "finished"
    # The worker never heard of the rolled-back tasks.
    log = cluster.workers[-1].log_tail(100_000)
    for task_id in dropped:
        assert f"task {task_id} " not in log
