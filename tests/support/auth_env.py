"""The authenticated HTTP API harness: an ApiApp on an in-memory Node with a bootstrap admin
secret, a worker and a peer secret, and a tenant token each for ``alice`` and ``bob``; the
``env`` fixture (registered in tests/conftest.py) and ``error_code``, which checks the JSON
error body of a refusal.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from broker.api.http_api import ApiApp, ApiConfig
from broker.artifacts.code_store import CodeStore
from broker.replication.node import Node
from broker.security.auth import AuthConfig
from tests.support.memory_node import memory_node

ADMIN_SECRET = "bootstrap-admin-secret"
WORKER_SECRET = "worker-secret"
PEER_SECRET = "peer-secret"


@dataclass
class Env:
    node: Node
    client: httpx.AsyncClient
    tokens: dict[str, str | None]  # caller name -> bearer secret (None: no header)
    statuses: list[int]

    async def call(self, who: str, method: str, path: str, **kwargs: Any) -> httpx.Response:
        secret = self.tokens[who]
        headers = dict(kwargs.pop("headers", {}))
        if secret is not None:
            headers["authorization"] = f"Bearer {secret}"
        return await self.client.request(method, path, headers=headers, **kwargs)


@pytest.fixture
async def env(tmp_path: Path) -> AsyncIterator[Env]:
    node = memory_node(tmp_path)
    await node.start()
    auth = AuthConfig.from_secrets([ADMIN_SECRET], WORKER_SECRET, PEER_SECRET)
    app = ApiApp(node, ApiConfig(auth=auth), code_store=CodeStore(tmp_path / "code"))
    statuses: list[int] = []

    async def record(response: httpx.Response) -> None:
        statuses.append(response.status_code)

    transport = httpx.ASGITransport(app=app)  # type: ignore[arg-type]
    async with httpx.AsyncClient(
        transport=transport, base_url="http://test", event_hooks={"response": [record]}
    ) as client:
        harness = Env(
            node,
            client,
            {
                "admin": ADMIN_SECRET,
                "worker": WORKER_SECRET,
                "peer": PEER_SECRET,
                "nobody": None,
                "forged": "stw_not-a-token-anybody-issued",
            },
            statuses,
        )
        for tenant in ("alice", "bob"):
            created = await harness.call(
                "admin", "POST", "/api/v1/tokens", json={"name": f"{tenant}'s", "tenant": tenant}
            )
            assert created.status_code == 201, created.text
            harness.tokens[tenant] = created.json()["token"]
        try:
            yield harness
        finally:
            await node.stop(snapshot=False)
            await node.ledgers.close()
    assert not [s for s in statuses if s >= 500], statuses


def error_code(response: httpx.Response, status: int) -> str:
    assert response.status_code == status, (response.status_code, response.text)
    body = response.json()
    assert set(body) == {"error"}, body
    assert body["error"]["message"], body
    code: str = body["error"]["code"]
    return code
