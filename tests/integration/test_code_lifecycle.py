"""Code artifact lifecycle on real processes (issue 18 item 6, docs/DESIGN.md §7).

A cluster of 3 ``steward broker`` processes with one ``steward worker``:

- an artifact is uploaded and a task of it runs on the worker (so the worker caches it);
- ``DELETE /api/v1/code/{sha}`` is refused (409, naming the task) while the task runs,
  and allowed once it finished (``steward code delete``): the file then leaves every
  broker's store, its replica znodes and the worker's cache, the store metrics say so,
  and a submit that uses it is refused;
- an artifact no task needed for ``--code-retention-h`` is deleted by the leader the same
  way.
"""

from __future__ import annotations

import re
import subprocess
import time
from pathlib import Path
from typing import Any

import httpx
from kazoo.client import KazooClient  # type: ignore[import-untyped]

from clients.dev.zk import ZooKeeperServer
from tests.support.cluster_procs import BrokerNode, ClusterProcesses
from tests.support.procs import steward_command

JOB = b"import time\n\n\ndef run(params, ctx):\n    time.sleep(params['s'])\n    return 1\n"
OTHER_JOB = b"def run(params, ctx):\n    return 2\n"
# 7.2 s: long enough for the test to submit its task after the upload, short enough to
# watch the leader delete an unused artifact.
RETENTION_H = "0.002"


def wait_until(what: str, condition: Any, timeout_s: float, interval_s: float = 0.05) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(interval_s)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")


def upload(leader: BrokerNode, name: str, data: bytes) -> str:
    response = httpx.post(
        f"{leader.url}/api/v1/code", params={"name": name}, content=data, timeout=10
    )
    assert response.status_code == 201, response.text
    sha256: str = response.json()["sha256"]
    return sha256


def task_state(leader: BrokerNode, task_id: int) -> str:
    state: str = httpx.get(f"{leader.url}/api/v1/tasks/{task_id}", timeout=5).json()["state"]
    return state


def store_files(cluster: ClusterProcesses, sha256: str) -> dict[str, bool]:
    return {node.broker_id: (node.data_dir / "code" / sha256).exists() for node in cluster.live()}


def cached(cache_dir: Path, sha256: str) -> bool:
    return any(p.name.startswith(sha256) for p in cache_dir.glob(f"{sha256}*"))


def store_metric(node: BrokerNode, name: str) -> float:
    text = httpx.get(f"{node.url}/metrics", timeout=5).text
    match = re.search(rf"^{name} (\S+)$", text, re.MULTILINE)
    assert match, f"{name} missing from {node.broker_id}'s metrics"
    return float(match[1])


def test_delete_refused_while_needed_then_gone_everywhere_and_retention(
    zookeeper: ZooKeeperServer, tmp_path: Path
) -> None:
    with ClusterProcesses(
        zookeeper.connect_string, tmp_path, extra_args=("--code-retention-h", RETENTION_H)
    ) as cluster:
        cluster.wait_for_leader()
        worker = cluster.start_worker("w1")
        leader = cluster.wait_workers_connected(["w1"], 60)
        cache_dir = tmp_path / "cache" / "w1"
        sha256 = upload(leader, "job.py", JOB)
        submitted = httpx.post(
            f"{leader.url}/api/v1/tasks",
            json={"type": "job:run", "code": sha256, "params": {"s": 3}},
            timeout=10,
        )
        assert submitted.status_code == 201, submitted.text
        task_id = submitted.json()["id"]
        wait_until("the task to run", lambda: task_state(leader, task_id) == "running", 30)
        wait_until(
            "every broker to hold the artifact",
            lambda: all(store_files(cluster, sha256).values()),
            15,
        )
        assert cached(cache_dir, sha256), sorted(p.name for p in cache_dir.iterdir())

        # Needed by a running task: refused, naming it (followers redirect to the leader).
        for node in cluster.live():
            refused = httpx.delete(
                f"{node.url}/api/v1/code/{sha256}", timeout=10, follow_redirects=True
            )
            assert refused.status_code == 409, (node.broker_id, refused.text)
            error = refused.json()["error"]
            assert error["code"] == "conflict" and str(task_id) in error["message"], error
        assert all(store_files(cluster, sha256).values())

        final = httpx.get(
            f"{leader.url}/api/v1/tasks/{task_id}", params={"wait_s": 30}, timeout=40
        ).json()
        assert final["state"] == "finished", final
        # Through the CLI (and so the Python client), given every broker's URL.
        urls = ",".join(node.url for node in cluster.live())
        result = subprocess.run(
            [*steward_command(), "--url", urls, "code", "delete", sha256],
            capture_output=True,
            text=True,
            timeout=30,
            stdin=subprocess.DEVNULL,
            check=False,
        )
        assert result.returncode == 0, (result.stdout, result.stderr)
        assert f"deleted code artifact {sha256} (job.py)" in result.stdout

        wait_until(
            "the file to leave every broker's store",
            lambda: not any(store_files(cluster, sha256).values()),
            15,
        )
        wait_until(
            "the worker to drop it from its cache", lambda: not cached(cache_dir, sha256), 15
        )
        # Its replica znodes go too (the artifact's parent node with the last of them).
        zk = KazooClient(hosts=zookeeper.connect_string)
        zk.start(timeout=15)
        try:
            replicas = f"/steward/{cluster.name}/code/{sha256}"
            wait_until("its replica znodes to go", lambda: zk.exists(replicas) is None, 15)
        finally:
            zk.stop()
            zk.close()
        for node in cluster.live():
            gone = httpx.get(f"{node.url}/api/v1/code/{sha256}", timeout=5)
            assert gone.status_code == 404, (node.broker_id, gone.status_code)
            assert store_metric(node, "steward_code_store_artifacts") == 0
            assert store_metric(node, "steward_code_store_bytes") == 0
        refused_submit = httpx.post(
            f"{leader.url}/api/v1/tasks", json={"type": "job:run", "code": sha256}, timeout=10
        )
        assert refused_submit.status_code == 404, refused_submit.text
        assert "dropped from the cache" in worker.log_text()

        # Retention: an artifact no task needs goes by itself, from every broker.
        other = upload(leader, "other.py", OTHER_JOB)
        wait_until("every broker to hold it", lambda: all(store_files(cluster, other).values()), 15)
        size = store_metric(leader, "steward_code_store_bytes")
        assert size == len(OTHER_JOB), size
        started = time.monotonic()
        wait_until(
            "retention to delete it everywhere",
            lambda: not any(store_files(cluster, other).values()),
            40,
            interval_s=0.2,
        )
        print(f"\nunused artifact deleted by retention after {time.monotonic() - started:.1f} s")
        listing = httpx.get(f"{leader.url}/api/v1/code", timeout=5).json()["artifacts"]
        assert listing == []
        assert "no task needed it" in (cluster.leader() or leader).log_text()
