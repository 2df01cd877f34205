"""A real ``steward standalone --log-format json`` and ``steward worker --log-format json``:
every line they log is one JSON object, task lines carry task_id and tenant, and the
broker serves ``/metrics`` that count the task."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from clients.dev.zk import ZooKeeperServer
from tests.support.cluster_procs import ClusterProcesses
from tests.support.procs import HOST, BrokerProcess, free_port
from tests.support.worker_procs import WorkerProcess, wait_until

WAIT_S = 60.0


def json_lines(text: str, allowed_plain: tuple[str, ...]) -> list[dict[str, Any]]:
    """Every line parsed as JSON, except the known plain lines (test headers, ready)."""
    parsed = []
    for line in text.splitlines():
        if not line.strip() or line.startswith(allowed_plain):
            continue
        try:
            parsed.append(json.loads(line))
        except json.JSONDecodeError:
            raise AssertionError(f"not a JSON log line: {line!r}") from None
    return parsed


def test_json_logs_and_metrics_of_real_processes(tmp_path: Path) -> None:
    worker_port = free_port()
    broker = BrokerProcess(
        tmp_path / "data",
        log_path=tmp_path / "broker.log",
        extra_args=("--worker-listen", f"{HOST}:{worker_port}", "--log-format", "json"),
    )
    worker = WorkerProcess(
        broker=f"{HOST}:{worker_port}",
        http_url=f"http://{HOST}:0",
        worker_id="w-json",
        log_dir=tmp_path / "logs",
        cache_dir=tmp_path / "cache",
        extra_args=("--log-format", "json"),
    )
    with broker:
        broker.start(WAIT_S)
        worker.http_url = broker.url
        try:
            worker.start()
            with httpx.Client(base_url=broker.url, timeout=10.0) as client:
                worker.wait_connected(client, WAIT_S)
                response = client.post(
                    "/api/v1/tasks",
                    json={"type": "fail", "tenant": "acme", "params": {"message": "on purpose"}},
                )
                assert response.status_code == 201, response.text
                task_id = response.json()["id"]

                def failed() -> bool:
                    state = client.get(f"/api/v1/tasks/{task_id}").json()["state"]
                    return bool(state == "error")

                wait_until(failed, WAIT_S, f"task {task_id} to fail")
                metrics = client.get("/metrics")
                assert metrics.status_code == 200
                assert metrics.headers["content-type"].startswith("text/plain; version=0.0.4")
                samples = {
                    (s.name, tuple(sorted(s.labels.items()))): s.value
                    for family in text_string_to_metric_families(metrics.text)
                    for s in family.samples
                }
                labels = (("tenant", "acme"), ("type", "fail"))
                for name in (
                    "steward_tasks_submitted_total",
                    "steward_tasks_assigned_total",
                    "steward_tasks_failed_total",
                    "steward_task_attempt_failures_total",
                ):
                    assert samples.get((name, labels)) == 1.0, name
                assert samples[("steward_workers_connected", ())] == 1.0
                # Registration, the submit (carrying its assignment: a slot was free) and
                # the finish (docs/DESIGN.md §6).
                assert samples[("steward_log_append_latency_seconds_count", ())] >= 3
        finally:
            worker.stop()
        assert broker.terminate() == 0

    broker_lines = json_lines(broker.log_path.read_text(), ("=====", "steward standalone ready on"))
    assert broker_lines, "the broker logged nothing"
    for line in broker_lines:
        assert {"ts", "level", "logger", "message"} <= set(line), line
    [failure] = [
        line
        for line in broker_lines
        if line["logger"] == "steward.tasks" and "failed for good" in line["message"]
    ]
    assert (failure["task_id"], failure["tenant"]) == (task_id, "acme")

    worker_lines = json_lines(worker.log_path.read_text(), ())
    task_lines = [line for line in worker_lines if "task_id" in line]
    assert task_lines, "the worker logged no task line"
    for line in task_lines:
        assert (line["task_id"], line["tenant"], line["worker"]) == (task_id, "acme", "w-json")
    assert any("failed" in line["message"] for line in task_lines)


def scrape(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    response = httpx.get(url + "/metrics", timeout=10.0)
    assert response.status_code == 200, response.text
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(response.text)
        for s in family.samples
    }


def test_cluster_metrics_leader_followers_and_a_hand_over(
    zookeeper: ZooKeeperServer, tmp_path: Path
) -> None:
    with ClusterProcesses(
        zookeeper.connect_string, tmp_path, extra_args=("--log-format", "json")
    ) as cluster:
        leader = cluster.wait_for_leader(WAIT_S)
        for _ in range(5):
            response = httpx.post(
                leader.url + "/api/v1/tasks", json={"type": "noop", "tenant": "acme"}, timeout=10
            )
            assert response.status_code == 201, response.text
        cluster.wait_for_equal_digests(WAIT_S)
        submitted = ("steward_tasks_submitted_total", (("tenant", "acme"), ("type", "noop")))
        for node in cluster.live():
            samples = scrape(node.url)
            role = "leader" if node is leader else "follower"
            assert samples[("steward_broker_role", (("role", role),))] == 1.0, node
            assert samples[("steward_queue_length", (("tenant", "acme"),))] == 5.0
            assert samples[("steward_leader_changes_total", ())] >= 1.0
            if node is leader:
                assert samples[submitted] == 5.0
                assert samples[("steward_leaderships_acquired_total", ())] == 1.0
            else:
                assert submitted not in samples  # counted by the leader only
                assert samples[("steward_leaderships_acquired_total", ())] == 0.0
                assert 0.0 <= samples[("steward_follower_lag_seconds", ())] < WAIT_S

        cluster.sigterm(leader.broker_id)
        assert leader.wait_exit(WAIT_S) == 0, leader.log_tail()
        new = cluster.wait_for_leader(WAIT_S, excluding=[leader.broker_id])
        wait_until(
            lambda: scrape(new.url).get(("steward_broker_role", (("role", "leader"),))),
            WAIT_S,
            "the new leader's role in its metrics",
        )
        samples = scrape(new.url)
        assert samples[("steward_leaderships_acquired_total", ())] == 1.0
        assert samples[("steward_leader_changes_total", ())] >= 2.0
        assert samples[("steward_follower_lag_seconds", ())] == 0.0

    for node in cluster.nodes.values():
        lines = json_lines(node.log_text(), ("=====", "steward broker "))
        assert lines, f"{node.broker_id} logged nothing"
        assert all(line["broker"] == node.broker_id for line in lines)
