"""A batch's own ``tenant`` (issue 30, docs/API.md, "Batches") goes through the same rule as a
task's: a tenant token files tasks for its own tenant only, so naming another tenant next to
``tasks`` is refused (403) and creates nothing; an admin files a batch for any tenant.

Through the authenticated HTTP API (tests/support/auth_env.py's ``env``).
"""

from __future__ import annotations

from tests.support.auth_env import Env, error_code

TASKS = "/api/v1/tasks"


async def test_a_tenant_token_cannot_file_a_batch_for_another_tenant(env: Env) -> None:
    before = env.node.state.digest()
    for tasks in ([{"type": "noop"}], [{"type": "noop"}, {"type": "noop", "tenant": "bob"}]):
        refused = await env.call("alice", "POST", TASKS, json={"tenant": "bob", "tasks": tasks})
        assert error_code(refused, 403) == "forbidden"
        assert "alice" in refused.json()["error"]["message"]
    assert env.node.state.digest() == before  # nothing was filed, for bob or anybody
    assert not [t for t in env.node.state.tasks.values() if t.tenant == "bob"]


async def test_a_tenant_token_files_a_batch_for_its_own_tenant(env: Env) -> None:
    response = await env.call(
        "alice", "POST", TASKS, json={"tenant": "alice", "tasks": [{"type": "a"}, {"type": "b"}]}
    )
    assert response.status_code == 200, response.text
    ids = [t["id"] for t in response.json()["tasks"]]
    assert [env.node.state.tasks[i].tenant for i in ids] == ["alice", "alice"]


async def test_an_admin_files_a_batch_for_any_tenant(env: Env) -> None:
    response = await env.call(
        "admin", "POST", TASKS, json={"tenant": "bob", "tasks": [{"type": "a"}]}
    )
    assert response.status_code == 200, response.text
    [task] = response.json()["tasks"]
    assert env.node.state.tasks[task["id"]].tenant == "bob"
