"""The Python client (sync and asyncio) and the worker-era CLI against a real broker
with a real worker process."""

from __future__ import annotations

import hashlib
import hmac
import json
import queue
import subprocess
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

import httpx
import pytest

from clients.client import (
    AsyncStewardClient,
    ConflictError,
    ConnectionFailedError,
    InvalidRequestError,
    NotFoundError,
    StewardClient,
    TaskFailedError,
    TaskHandle,
    TaskTimeoutError,
    TenantQueueFullError,
)
from tests.support.procs import HOST, free_port, steward_command
from tests.support.worker_procs import broker_with_worker


@pytest.fixture(scope="module")
def broker_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    root = tmp_path_factory.mktemp("client")
    task_args = ("--task-type", "*=4", "--resource", "cpu=4", "--resource", "licence=5")
    with broker_with_worker(root, "client-worker", task_args) as (broker, _):
        yield broker.url


def test_sync_handles_results_and_errors(broker_url: str) -> None:
    with StewardClient(broker_url) as client:
        handle = client.submit("sleep", {"seconds": 0.05}, tenant="sync")
        assert isinstance(handle, TaskHandle)
        assert handle.result(timeout=30) == {"slept": 0.05}
        failing = client.submit("fail", {"message": "kaput"}, tenant="sync")
        with pytest.raises(TaskFailedError) as info:
            failing.result(timeout=30)
        assert "kaput" in str(info.value)
        assert "Traceback" in info.value.task["error"]
        slow = client.submit("sleep", {"seconds": 30}, tenant="sync")
        with pytest.raises(TaskTimeoutError):
            slow.result(timeout=0.3)
        assert slow.cancel()["state"] == "cancelled"
        with pytest.raises(TaskFailedError):
            slow.result(timeout=10)
        batch = client.submit_many(
            [{"type": "noop", "tenant": "sync"}, {"type": "noop", "tenant": "sync"}]
        )
        assert all(isinstance(h, TaskHandle) and h.result(30) is None for h in batch)


def test_sync_errors_map_to_exceptions(broker_url: str) -> None:
    with StewardClient(broker_url) as client:
        with pytest.raises(NotFoundError):
            client.task(10**12)
        with pytest.raises(InvalidRequestError):
            client.submit("noop", tenant="bad tenant!")
        client.set_tenant("fullq", max_waiting=1)
        client.submit("sleep", {"seconds": 5}, tenant="fullq", start_after=time.time() + 60)
        with pytest.raises(TenantQueueFullError):
            client.submit("noop", tenant="fullq")
        client.submit(
            "sleep", {"seconds": 1}, tenant="sync", slot="one", start_after=time.time() + 60
        )
        with pytest.raises(ConflictError):
            client.submit("noop", tenant="sync", slot="one")
    with StewardClient(f"http://{HOST}:{free_port()}", timeout_s=2) as dead:
        with pytest.raises(ConnectionFailedError) as info:
            dead.cluster()
        assert "HTTP 0" not in str(info.value)


def test_transaction_context_manager(broker_url: str) -> None:
    with StewardClient(broker_url) as client:
        with client.transaction(tenant="txn") as txn:
            kept = [txn.submit("noop") for _ in range(3)]
            assert {client.task(h.id)["state"] for h in kept} == {"pending"}
        assert all(h.result(timeout=30) is None for h in kept)
        with pytest.raises(RuntimeError), client.transaction(tenant="txn") as txn:
            dropped = txn.submit("noop")
            raise RuntimeError("changed my mind")
        with pytest.raises(NotFoundError):
            client.task(dropped.id)


async def test_async_client(broker_url: str) -> None:
    async with AsyncStewardClient(broker_url) as client:
        handle = await client.submit("sleep", {"seconds": 0.05}, tenant="async")
        assert await handle.result(timeout=30) == {"slept": 0.05}
        async with client.transaction(tenant="async") as txn:
            inside = await txn.submit("noop")
        assert await inside.result(timeout=30) is None
        failing = await client.submit("fail", tenant="async")
        with pytest.raises(TaskFailedError):
            await failing.result(timeout=30)
        summary = await client.cluster()
        assert summary["workers"][0]["id"] == "client-worker"
        tenant = await client.set_tenant("async", weight=2)
        assert tenant["weight"] == 2


async def test_async_client_schedules_and_bulk_cancel(broker_url: str) -> None:
    """The asyncio client's issue-18 calls: schedules (create, list, delete) and bulk cancel."""
    async with AsyncStewardClient(broker_url) as client:
        created = await client.create_schedule(
            "async-hourly", "noop", {"x": 1}, tenant="async-s", interval_s=3600, missed="run_once"
        )
        assert (created["name"], created["interval_s"], created["missed"]) == (
            "async-hourly",
            3600,
            "run_once",
        )
        listed = await client.schedules(tenant="async-s")
        assert [s["name"] for s in listed] == ["async-hourly"]
        deleted = await client.delete_schedule("async-hourly", tenant="async-s")
        assert deleted["name"] == "async-hourly"
        assert await client.schedules(tenant="async-s") == []
        with pytest.raises(NotFoundError):
            await client.delete_schedule("async-hourly", tenant="async-s")

        # Tasks due in an hour (delayed): cancelled by filter, the other type left alone.
        later = time.time() + 3600
        doomed = [await client.submit("noop", tenant="async-c", start_after=later) for _ in "ab"]
        kept = await client.submit("sleep", {"seconds": 0}, tenant="async-c", start_after=later)
        summary = await client.cancel_matching(tenant="async-c", type="noop")
        assert (summary["matched"], summary["cancelled"]) == (2, 2), summary
        assert [(await h.wait(timeout=10))["state"] for h in doomed] == ["cancelled"] * 2
        assert (await client.task(kept.id))["state"] == "delayed"
        assert (await kept.cancel())["state"] == "cancelled"
        assert (await client.whoami())["role"] == "admin"


def test_global_limit_is_enforced_across_workers(broker_url: str) -> None:
    with httpx.Client(base_url=broker_url) as http:
        response = http.put("/api/v1/config", json={"global_limits": {"licence": 1}})
        assert response.status_code == 200, response.text
        assert http.get("/api/v1/config").json()["global_limits"] == {"licence": 1.0}
        bad = http.put("/api/v1/config", json={"global_limits": {"licence": -1}})
        assert bad.status_code == 400
        assert http.put("/api/v1/config", json={"retention": 1}).status_code == 400
    with StewardClient(broker_url) as client:
        started = time.monotonic()
        handles = [
            client.submit("sleep", {"seconds": 0.5}, tenant="licensed", resources={"licence": 1})
            for _ in range(3)
        ]
        for handle in handles:
            handle.result(timeout=30)
        # One licence: the three tasks ran one after another.
        assert time.monotonic() - started >= 1.4
    with httpx.Client(base_url=broker_url) as http:
        http.put("/api/v1/config", json={"global_limits": {}})


def _cli(url: str, *args: str, timeout_s: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*steward_command(), "--url", url, *args],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
    )


def test_cli_code_upload_status_and_submit_wait(broker_url: str, tmp_path: Path) -> None:
    job = tmp_path / "jobs_hello.py"
    job.write_text("def hello(params, ctx):\n    return {'hello': params['name']}\n")
    upload = _cli(broker_url, "code", "upload", str(job))
    assert upload.returncode == 0, upload.stderr
    sha = upload.stdout.strip()
    assert len(sha) == 64
    assert sha in _cli(broker_url, "code", "list").stdout
    waited = _cli(
        broker_url,
        "submit",
        "jobs_hello:hello",
        "--code",
        sha,
        "--params",
        '{"name": "steward"}',
        "--wait",
        "--timeout-s",
        "60",
    )
    assert waited.returncode == 0, waited.stderr
    assert "finished: result hello=steward" in waited.stdout
    failed = _cli(broker_url, "submit", "fail", "--wait", "--timeout-s", "60")
    assert failed.returncode == 1
    assert "error" in failed.stdout
    many = _cli(broker_url, "submit", "noop", "--count", "20", "--wait", "--timeout-s", "60")
    assert many.returncode == 0, many.stderr
    status = _cli(broker_url, "status")
    assert status.returncode == 0, status.stderr
    assert "client-worker" in status.stdout and "connected" in status.stdout
    assert "NAME" in status.stdout and "WEIGHT" in status.stdout
    bad = _cli(broker_url, "code", "upload", str(tmp_path / "missing.py"))
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
    not_py = tmp_path / "notes.txt"
    not_py.write_text("hello")
    refused = _cli(broker_url, "code", "upload", str(not_py))
    assert refused.returncode == 1 and "invalid_artifact" in refused.stderr


class _Receiver(BaseHTTPRequestHandler):
    """A webhook receiver: keeps each signed delivery's event id and body."""

    deliveries: queue.Queue[tuple[str, bytes, str]] = queue.Queue()

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers["Content-Length"]))
        self.deliveries.put(
            (self.headers["X-Steward-Event-Id"], body, self.headers["X-Steward-Signature"])
        )
        self.send_response(204)
        self.end_headers()

    def log_message(self, *_: object) -> None:
        pass


def test_webhooks_and_one_schedule_through_both_clients(broker_url: str) -> None:
    secret = "a secret for the client's webhook test"
    receiver = HTTPServer((HOST, 0), _Receiver)
    serving = threading.Thread(target=receiver.serve_forever, daemon=True)
    serving.start()
    try:
        with StewardClient(broker_url) as client:
            hook_url = f"http://{HOST}:{receiver.server_port}/hook"
            set_ = client.set_webhook("hooked", hook_url, secret)
            assert (set_["tenant"], set_["url"]) == ("hooked", hook_url) and "secret" not in set_
            assert client.webhook("hooked")["url"] == hook_url
            done = client.submit("noop", tenant="hooked")
            assert done.result(timeout=30) is None
            event_id, body, signature = _Receiver.deliveries.get(timeout=30)
            signed = hmac.new(secret.encode(), body, hashlib.sha256).hexdigest()
            assert hmac.compare_digest(signature, f"sha256={signed}")
            assert json.loads(body)["id"] == done.id and event_id
            assert client.delete_webhook("hooked")["url"] == hook_url
            with pytest.raises(NotFoundError):
                client.webhook("hooked")

            client.create_schedule("sync-daily", "noop", tenant="one-s", interval_s=86400)
            assert client.schedule("sync-daily", tenant="one-s")["interval_s"] == 86400
            client.delete_schedule("sync-daily", tenant="one-s")
            with pytest.raises(NotFoundError):
                client.schedule("sync-daily", tenant="one-s")
    finally:
        receiver.shutdown()
        receiver.server_close()
        serving.join(timeout=10)


async def test_async_client_webhooks_and_one_schedule(broker_url: str) -> None:
    async with AsyncStewardClient(broker_url) as client:
        hook_url = f"http://{HOST}:9/never-called"
        assert (await client.set_webhook("async-h", hook_url, "s3cret"))["url"] == hook_url
        assert (await client.webhook("async-h"))["tenant"] == "async-h"
        assert (await client.delete_webhook("async-h"))["url"] == hook_url
        with pytest.raises(NotFoundError):
            await client.webhook("async-h")
        await client.create_schedule("async-one", "noop", tenant="async-1", interval_s=3600)
        assert (await client.schedule("async-one", tenant="async-1"))["name"] == "async-one"
        await client.delete_schedule("async-one", tenant="async-1")
        with pytest.raises(NotFoundError):
            await client.schedule("async-one", tenant="async-1")
