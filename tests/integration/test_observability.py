"""A real ``steward standalone --log-format json`` and ``steward worker --log-format json``:
every line they log is one JSON object, task lines carry task_id and tenant, and the
broker serves ``/metrics`` that count the task."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tests.procs import HOST, BrokerProcess, free_port
from tests.worker_procs import WorkerProcess, wait_until

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
                assert samples[("steward_log_append_latency_seconds_count", ())] >= 4
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
