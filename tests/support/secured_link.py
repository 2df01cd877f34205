"""A broker with authentication on, in process: a Node on in-memory ledgers with a
WorkerLink (a shared worker token, tenant isolation and worker credentials) and the HTTP
API, driven by :class:`tests.support.fake_worker.FakeWorker`. Used by the security tests of
the worker port (tests/security/test_task_output_frames.py,
tests/security/test_worker_credentials.py); every wait is bounded.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from broker.api.http_api import ApiApp, ApiConfig
from broker.api.output_store import OutputStore
from broker.artifacts.code_store import CodeStore
from broker.replication.node import Node
from broker.security.auth import AuthConfig
from broker.workers.worker_link import WorkerLink, WorkerLinkConfig
from tests.support.fake_worker import FakeWorker
from tests.support.memory_node import memory_node
from wire import worker_protocol as p

INTERVAL_MS = 100
# Long enough that a worker whose connection dropped is not declared dead mid-test.
TIMEOUT_MS = 5000
WAIT_S = 5.0


@dataclass
class SecuredBroker:
    node: Node
    link: WorkerLink
    http: httpx.AsyncClient
    admin: str  # the bootstrap admin secret
    worker_token: str | None = None  # what worker() sends unless told otherwise
    workers: list[FakeWorker] = field(default_factory=list)

    @property
    def outputs(self) -> OutputStore:
        return self.link.outputs

    def worker(self, worker_id: str, **options: Any) -> FakeWorker:
        worker = FakeWorker(self.link.port, worker_id, **{"token": self.worker_token, **options})
        self.workers.append(worker)
        return worker

    async def call(
        self, token: str | None, method: str, path: str, **kwargs: Any
    ) -> httpx.Response:
        headers = {"authorization": f"Bearer {token}"} if token is not None else {}
        return await self.http.request(method, path, headers=headers, **kwargs)

    async def get(self, token: str, path: str, **params: Any) -> httpx.Response:
        return await self.call(token, "GET", path, params=params)

    async def tenant_token(self, tenant: str) -> str:
        created = await self.call(
            self.admin, "POST", "/api/v1/tokens", json={"name": f"{tenant}-key", "tenant": tenant}
        )
        assert created.status_code == 201, created.text
        token: str = created.json()["token"]
        return token

    async def worker_credential(self, name: str, tenants: list[str] | None = None) -> str:
        body: dict[str, Any] = {"name": name, "role": "worker"}
        if tenants is not None:
            body["tenants"] = tenants
        created = await self.call(self.admin, "POST", "/api/v1/tokens", json=body)
        assert created.status_code == 201, created.text
        assert created.json()["role"] == "worker"
        assert created.json()["tenants"] == (tenants or [])
        secret: str = created.json()["token"]
        return secret

    async def submit(self, tenant: str, code: str | None = None) -> int:
        task: dict[str, Any] = {"type": "job:run" if code else "noop", "tenant": tenant}
        if code is not None:
            task["code"] = code
        response = await self.call(self.admin, "POST", "/api/v1/tasks", json=task)
        assert response.status_code == 201, response.text
        return int(response.json()["id"])

    async def upload(self, script: bytes) -> str:
        response = await self.call(self.admin, "POST", "/api/v1/code?name=job.py", content=script)
        assert response.status_code == 201, response.text
        sha: str = response.json()["sha256"]
        return sha

    def state_of(self, task_id: int) -> tuple[str, str | None]:
        task = self.node.state.tasks[task_id]
        return task.state, task.worker

    async def until(self, condition: Callable[[], bool], wait_s: float = WAIT_S) -> None:
        deadline = time.monotonic() + wait_s
        while not condition():
            if time.monotonic() > deadline:
                raise TimeoutError(f"condition still false after {wait_s} s")
            await asyncio.sleep(0.01)


@asynccontextmanager
async def secured_broker(
    tmp_path: Path,
    *,
    admin: str,
    worker_token: str,
    peer: str,
    outputs: OutputStore | None = None,
    code_store: bool = False,
    workers_send_token: bool = False,
    **link_options: Any,
) -> AsyncIterator[SecuredBroker]:
    """``outputs``: one store for the link and the API's logs route; ``code_store``: serve
    code artifacts; ``workers_send_token``: ``worker()`` gives its workers the shared
    ``worker_token``; ``link_options``: more WorkerLinkConfig settings."""
    node = memory_node(tmp_path)
    await node.start()
    settings: dict[str, Any] = {
        "port": 0,
        "heartbeat_interval_ms": INTERVAL_MS,
        "heartbeat_timeout_ms": TIMEOUT_MS,
        "token": worker_token,
        "tenant_isolation": True,
        "worker_credentials": True,
        **link_options,
    }
    link = WorkerLink(node, WorkerLinkConfig(**settings), outputs)
    await link.start()
    app = ApiApp(
        node,
        ApiConfig(auth=AuthConfig.from_secrets([admin], worker_token, peer)),
        code_store=CodeStore(tmp_path / "code") if code_store else None,
        outputs=outputs,
    )
    transport = httpx.ASGITransport(app=app)  # type: ignore[arg-type]
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
        harness = SecuredBroker(
            node, link, http, admin, worker_token if workers_send_token else None
        )
        try:
            yield harness
        finally:
            for worker in harness.workers:
                await worker.close()
            await link.stop()
            await node.stop(snapshot=False)
            node.state.check_invariants()


def frames_broker(
    tmp_path: Path, name: str
) -> contextlib.AbstractAsyncContextManager[SecuredBroker]:
    """A broker taking task frames (Output, Progress) from workers that send the shared
    token, with secrets named after the test ``name``."""
    return secured_broker(
        tmp_path,
        admin=f"admin-secret-for-the-{name}-test",
        worker_token=f"shared-worker-token-for-the-{name}-test",
        peer=f"peer-secret-for-the-{name}-test",
        outputs=OutputStore(),
        workers_send_token=True,
    )


@dataclass
class AssignedAttempt:
    """Alice's task running on worker ``owner`` (attempt 1), beside a worker ``other`` that
    was assigned nothing: who may send frames for the attempt, and who may not."""

    alice: str  # the tenants' API tokens
    bob: str
    owner: FakeWorker
    welcome: p.Welcome  # the owner's
    task_id: int
    other: FakeWorker


async def assigned_attempt(broker: SecuredBroker) -> AssignedAttempt:
    alice, bob = await broker.tenant_token("alice"), await broker.tenant_token("bob")
    owner = broker.worker("w1", task_types={"*": 1})
    welcome = await owner.hello()
    task_id = await broker.submit("alice")
    await owner.expect(p.Assign)
    other = broker.worker("w2")
    await other.hello()
    return AssignedAttempt(alice, bob, owner, welcome, task_id, other)
