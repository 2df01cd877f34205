"""Authentication and authorization on the HTTP API (broker/security/auth.py,
broker/api/http_api.py).

Every endpoint is called as its owner (a tenant token of the tenant the resource belongs
to), as another tenant, as admin (the configured bootstrap token and a created admin
token), as a worker, as a peer broker, with an unknown token and with no token. A
refusal must be 401 (no or unknown credentials) or 403/404 with a JSON error, and must
never show anything of another tenant: its tasks answer exactly like missing ones.
"""

from __future__ import annotations

import hashlib
import re
from typing import Any

import httpx
import pytest

from broker.api.routes import ROUTES, Route
from broker.core import StateMachine
from broker.core import entries as e
from broker.security.auth import Role as CallerRole
from broker.security.auth import hash_token
from tests.support.auth_env import ADMIN_SECRET, Env, error_code

TASKS = "/api/v1/tasks"
SCRIPT = b"def run(ctx, params):\n    return 1\n"


def refused_without_credentials(response: httpx.Response) -> None:
    assert error_code(response, 401) == "unauthorized"
    assert response.headers["www-authenticate"].startswith("Bearer")


def forbidden(response: httpx.Response) -> None:
    assert error_code(response, 403) == "forbidden"


async def submit(env: Env, who: str, **fields: Any) -> int:
    response = await env.call(who, "POST", TASKS, json={"type": "noop", **fields})
    assert response.status_code == 201, response.text
    return int(response.json()["id"])


async def call_logging_nothing(
    env: Env, who: str, method: str, path: str, kwargs: dict[str, Any]
) -> httpx.Response:
    """``who``'s call, which must leave the state as it was (nothing was logged)."""
    before = env.node.state.digest()
    response = await env.call(who, method, path, **kwargs)
    assert env.node.state.digest() == before
    return response


# --- who may call at all -------------------------------------------------------------------

NO_CREDENTIALS = ("nobody", "forged")
# Only an admin may call these (test_admin_endpoints_refuse_everybody_else).
ADMIN_ONLY = [
    ("PUT", "/api/v1/tenants/alice", {"json": {"weight": 2}}),
    ("GET", "/api/v1/config", {}),
    ("PUT", "/api/v1/config", {"json": {"finished_task_retention_s": 60}}),
    ("POST", "/api/v1/tokens", {"json": {"name": "x", "tenant": "alice"}}),
    ("GET", "/api/v1/tokens", {}),
    ("DELETE", "/api/v1/tokens/abcd", {}),
    ("GET", "/api/v1/cluster/brokers", {}),
    ("GET", "/api/v1/workers", {}),
    ("GET", "/api/v1/stats/throughput", {}),
]
# Every endpoint but the public ones (/healthz, the schema).
EVERY_ENDPOINT = [
    ("POST", TASKS, {"json": {"type": "noop"}}),
    ("GET", TASKS, {}),
    ("GET", f"{TASKS}/1", {}),
    ("POST", f"{TASKS}/1/cancel", {}),
    ("POST", "/api/v1/transactions", {"json": {}}),
    ("POST", "/api/v1/transactions/1/commit", {}),
    ("POST", "/api/v1/transactions/1/rollback", {}),
    ("GET", "/api/v1/tenants", {}),
    ("GET", "/api/v1/tenants/alice", {}),
    ("POST", "/api/v1/code?name=a.py", {"content": SCRIPT}),
    ("GET", "/api/v1/code", {}),
    ("GET", "/api/v1/code/" + "0" * 64, {}),
    ("GET", "/api/v1/cluster", {}),
    ("GET", "/api/v1/state/digest", {}),
    ("GET", "/api/v1/snapshot/latest", {}),
    ("GET", "/api/v1/whoami", {}),
    ("GET", f"{TASKS}/recent", {}),
    ("GET", "/metrics", {}),
    *ADMIN_ONLY,
]


@pytest.mark.parametrize("who", NO_CREDENTIALS)
@pytest.mark.parametrize(("method", "path", "kwargs"), EVERY_ENDPOINT)
async def test_every_endpoint_needs_a_valid_token(
    env: Env, who: str, method: str, path: str, kwargs: dict[str, Any]
) -> None:
    refused_without_credentials(await call_logging_nothing(env, who, method, path, kwargs))


@pytest.mark.parametrize("header", ["Basic YWxpY2U6cHc=", "Bearer", "Bearer  ", "token abc"])
async def test_malformed_authorization_headers_are_401(env: Env, header: str) -> None:
    response = await env.client.get(TASKS, headers={"authorization": header})
    refused_without_credentials(response)


async def test_two_authorization_headers_are_401(env: Env) -> None:
    response = await env.client.get(
        TASKS,
        headers=[("authorization", f"Bearer {ADMIN_SECRET}"), ("authorization", "Bearer x")],
    )
    refused_without_credentials(response)


@pytest.mark.parametrize("who", ["nobody", "forged", "alice", "worker"])
async def test_health_and_the_schema_are_public(env: Env, who: str) -> None:
    assert (await env.call(who, "GET", "/healthz")).status_code == 200
    schema = await env.call(who, "GET", "/api/v1/openapi.json")
    assert schema.status_code == 200
    document = schema.json()
    assert document["components"]["securitySchemes"]["bearer"]["scheme"] == "bearer"
    assert document["paths"]["/healthz"]["get"]["security"] == []


# --- admin-only endpoints ------------------------------------------------------------------


@pytest.mark.parametrize("who", ["alice", "bob", "worker", "peer"])
@pytest.mark.parametrize(("method", "path", "kwargs"), ADMIN_ONLY)
async def test_admin_endpoints_refuse_everybody_else(
    env: Env, who: str, method: str, path: str, kwargs: dict[str, Any]
) -> None:
    forbidden(await call_logging_nothing(env, who, method, path, kwargs))


async def test_admin_sets_service_levels_and_config(env: Env) -> None:
    put = await env.call("admin", "PUT", "/api/v1/tenants/alice", json={"weight": 3})
    assert put.status_code == 200 and put.json()["weight"] == 3
    config = await env.call("admin", "PUT", "/api/v1/config", json={"global_limits": {"gpu": 2}})
    assert config.status_code == 200
    assert (await env.call("admin", "GET", "/api/v1/config")).json()["global_limits"] == {"gpu": 2}


# --- tasks ---------------------------------------------------------------------------------


async def test_a_tenant_token_submits_for_its_own_tenant(env: Env) -> None:
    alice_task = await submit(env, "alice")  # no tenant: the token's
    assert env.node.state.tasks[alice_task].tenant == "alice"
    assert env.node.state.tasks[await submit(env, "alice", tenant="alice")].tenant == "alice"
    before = env.node.state.digest()
    forbidden(await env.call("alice", "POST", TASKS, json={"type": "noop", "tenant": "bob"}))
    batch = {"tasks": [{"type": "noop"}, {"type": "noop", "tenant": "bob"}]}
    forbidden(await env.call("alice", "POST", TASKS, json=batch))
    assert env.node.state.digest() == before  # the whole batch was refused
    # The admin submits for anyone; without a tenant, for "default" as before.
    assert env.node.state.tasks[await submit(env, "admin", tenant="bob")].tenant == "bob"
    assert env.node.state.tasks[await submit(env, "admin")].tenant == "default"


@pytest.mark.parametrize("who", ["worker", "peer"])
async def test_workers_and_peers_cannot_submit(env: Env, who: str) -> None:
    forbidden(await env.call(who, "POST", TASKS, json={"type": "noop"}))


async def test_another_tenants_task_answers_like_a_missing_one(env: Env) -> None:
    alice_task = await submit(env, "alice", params={"secret": 42})
    missing = alice_task + 1000
    as_bob = await env.call("bob", "GET", f"{TASKS}/{alice_task}")
    nothing = await env.call("bob", "GET", f"{TASKS}/{missing}")
    assert error_code(as_bob, 404) == error_code(nothing, 404) == "not_found"
    assert as_bob.json()["error"]["message"].replace(str(alice_task), "N") == nothing.json()[
        "error"
    ]["message"].replace(str(missing), "N")
    assert "secret" not in as_bob.text and "alice" not in as_bob.text
    # Long polling does not help either.
    waited = await env.call("bob", "GET", f"{TASKS}/{alice_task}", params={"wait_s": 0.05})
    assert error_code(waited, 404) == "not_found"
    for who in ("alice", "admin"):
        mine = await env.call(who, "GET", f"{TASKS}/{alice_task}")
        assert mine.status_code == 200 and mine.json()["params"] == {"secret": 42}
    forbidden(await env.call("worker", "GET", f"{TASKS}/{alice_task}"))


async def test_task_lists_show_the_callers_tasks_only(env: Env) -> None:
    alice_ids = [await submit(env, "alice") for _ in range(3)]
    bob_ids = [await submit(env, "bob") for _ in range(2)]

    async def listed(who: str, **query: Any) -> list[int]:
        response = await env.call(who, "GET", TASKS, params=query)
        assert response.status_code == 200, response.text
        return [t["id"] for t in response.json()["tasks"]]

    assert await listed("alice") == alice_ids
    assert await listed("alice", tenant="alice") == alice_ids
    assert await listed("bob") == bob_ids
    assert await listed("admin") == sorted(alice_ids + bob_ids)
    assert await listed("admin", tenant="bob") == bob_ids
    forbidden(await env.call("alice", "GET", TASKS, params={"tenant": "bob"}))
    forbidden(await env.call("worker", "GET", TASKS))


@pytest.mark.parametrize("who", ["nobody", "forged", "alice", "worker"])
async def test_the_dashboard_page_is_public(env: Env, who: str) -> None:
    # It holds no data: it reads the API with the token typed into it.
    for path in ("/", "/dashboard/app.js", "/dashboard/style.css", "/dashboard/icon.svg"):
        assert (await env.call(who, "GET", path)).status_code == 200, path
    document = (await env.call(who, "GET", "/api/v1/openapi.json")).json()
    assert document["paths"]["/"]["get"]["security"] == []


async def test_recent_tasks_show_the_callers_tasks_only(env: Env) -> None:
    alice_ids = [await submit(env, "alice") for _ in range(3)]
    bob_ids = [await submit(env, "bob") for _ in range(2)]

    async def recent(who: str, **query: Any) -> list[int]:
        response = await env.call(who, "GET", f"{TASKS}/recent", params=query)
        assert response.status_code == 200, response.text
        return [t["id"] for t in response.json()["tasks"]]

    assert await recent("alice") == alice_ids[::-1]
    assert await recent("bob", tenant="bob") == bob_ids[::-1]
    assert await recent("admin") == sorted(alice_ids + bob_ids, reverse=True)
    forbidden(await env.call("alice", "GET", f"{TASKS}/recent", params={"tenant": "bob"}))
    forbidden(await env.call("worker", "GET", f"{TASKS}/recent"))


async def test_only_the_owner_or_admin_cancels(env: Env) -> None:
    first = await submit(env, "alice")
    second = await submit(env, "alice")
    before = env.node.state.digest()
    assert error_code(await env.call("bob", "POST", f"{TASKS}/{first}/cancel"), 404) == "not_found"
    forbidden(await env.call("worker", "POST", f"{TASKS}/{first}/cancel"))
    assert env.node.state.digest() == before
    assert (await env.call("alice", "POST", f"{TASKS}/{first}/cancel")).json()["state"] == (
        "cancelled"
    )
    assert (await env.call("admin", "POST", f"{TASKS}/{second}/cancel")).json()["state"] == (
        "cancelled"
    )


# --- transactions --------------------------------------------------------------------------


async def test_transactions_belong_to_their_tenant(env: Env) -> None:
    begun = await env.call("alice", "POST", "/api/v1/transactions", json={"ttl_s": 30})
    assert begun.status_code == 201 and begun.json()["tenant"] == "alice"
    txn = begun.json()["id"]
    forbidden(await env.call("bob", "POST", "/api/v1/transactions", json={"tenant": "alice"}))
    forbidden(await env.call("worker", "POST", "/api/v1/transactions", json={}))
    # Bob can neither add to it, nor end it: it does not exist for him.
    joined = await env.call("bob", "POST", TASKS, json={"type": "noop", "transaction": txn})
    assert error_code(joined, 404) == "not_found"
    for action in ("commit", "rollback"):
        ended = await env.call("bob", "POST", f"/api/v1/transactions/{txn}/{action}")
        assert error_code(ended, 404) == "not_found"
    await submit(env, "alice", transaction=txn)
    done = await env.call("alice", "POST", f"/api/v1/transactions/{txn}/commit")
    assert done.status_code == 200 and done.json()["outcome"] == "committed"
    admin_txn = (
        await env.call("admin", "POST", "/api/v1/transactions", json={"tenant": "bob"})
    ).json()["id"]
    assert (
        await env.call("admin", "POST", f"/api/v1/transactions/{admin_txn}/rollback")
    ).status_code == 200


# --- tenants -------------------------------------------------------------------------------


async def test_a_tenant_sees_its_own_service_level_only(env: Env) -> None:
    await submit(env, "alice")
    await submit(env, "bob")

    async def names(who: str) -> list[str]:
        response = await env.call(who, "GET", "/api/v1/tenants")
        assert response.status_code == 200
        return sorted(t["name"] for t in response.json()["tenants"])

    assert await names("alice") == ["alice"]
    assert await names("admin") == ["alice", "bob"]
    assert (await env.call("alice", "GET", "/api/v1/tenants/alice")).status_code == 200
    # Another tenant and a tenant that does not exist answer alike.
    forbidden(await env.call("alice", "GET", "/api/v1/tenants/bob"))
    forbidden(await env.call("alice", "GET", "/api/v1/tenants/nobody-at-all"))
    forbidden(await env.call("worker", "GET", "/api/v1/tenants"))


# --- code artifacts ------------------------------------------------------------------------


async def test_artifacts_belong_to_the_tenant_that_uploaded_them(env: Env) -> None:
    uploaded = await env.call("alice", "POST", "/api/v1/code?name=job.py", content=SCRIPT)
    assert uploaded.status_code == 201, uploaded.text
    sha = uploaded.json()["sha256"]
    assert sha == hashlib.sha256(SCRIPT).hexdigest()
    assert env.node.state.artifacts[sha].owners == ["alice"]

    async def listed(who: str) -> list[str]:
        response = await env.call(who, "GET", "/api/v1/code")
        assert response.status_code == 200
        return [a["sha256"] for a in response.json()["artifacts"]]

    assert await listed("alice") == [sha]
    assert await listed("bob") == []
    for who in ("admin", "peer"):
        assert await listed(who) == [sha]
    # Workers read only the code of tasks assigned to them (tests/security/
    # test_worker_credentials.py): none yet.
    assert await listed("worker") == []
    for who in ("bob", "worker"):
        assert error_code(await env.call(who, "GET", f"/api/v1/code/{sha}"), 404) == "not_found"
    for who in ("alice", "admin", "peer"):
        download = await env.call(who, "GET", f"/api/v1/code/{sha}")
        assert download.status_code == 200 and download.content == SCRIPT
    # Bob cannot run it: it does not exist for him.
    refused = await env.call("bob", "POST", TASKS, json={"type": "python", "code": sha})
    assert error_code(refused, 404) == "not_found"
    await submit(env, "alice", type="python", code=sha)
    # Nor can the admin run Alice's code as Bob.
    as_admin = await env.call(
        "admin", "POST", TASKS, json={"type": "python", "code": sha, "tenant": "bob"}
    )
    assert error_code(as_admin, 404) == "not_found"
    # Bob uploading the same bytes makes it his too; an admin upload shares it with all.
    assert (
        await env.call("bob", "POST", "/api/v1/code?name=mine.py", content=SCRIPT)
    ).status_code == 201
    assert env.node.state.artifacts[sha].owners == ["alice", "bob"]
    assert await listed("bob") == [sha]
    forbidden(await env.call("worker", "POST", "/api/v1/code?name=w.py", content=SCRIPT))


async def test_an_admin_upload_is_shared(env: Env) -> None:
    shared = b"def run(ctx, params):\n    return 2\n"
    uploaded = await env.call("admin", "POST", "/api/v1/code?name=shared.py", content=shared)
    sha = uploaded.json()["sha256"]
    assert env.node.state.artifacts[sha].owners == []
    for who in ("alice", "bob"):
        assert (await env.call(who, "GET", f"/api/v1/code/{sha}")).status_code == 200
        await submit(env, who, type="python", code=sha)


# --- cluster views -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "allowed"),
    [
        ("/api/v1/cluster", {"admin", "worker", "peer"}),
        ("/api/v1/state/digest", {"admin", "peer"}),
        ("/api/v1/snapshot/latest", {"admin", "peer"}),
        ("/metrics", {"admin", "peer"}),
    ],
)
async def test_cluster_views_are_for_operators_workers_and_peers(
    env: Env, path: str, allowed: set[str]
) -> None:
    for who in ("admin", "worker", "peer", "alice"):
        response = await env.call(who, "GET", path)
        if who in allowed:
            # The snapshot endpoint answers 404 before the first snapshot: not a refusal.
            assert response.status_code in (200, 404), (who, response.text)
            if response.status_code == 404:
                assert error_code(response, 404) == "not_found"
        else:
            forbidden(response)


# --- tokens --------------------------------------------------------------------------------


async def test_tokens_are_created_listed_and_revoked_by_admins(env: Env) -> None:
    listed = (await env.call("admin", "GET", "/api/v1/tokens")).json()["tokens"]
    assert sorted(t["tenant"] for t in listed) == ["alice", "bob"]
    assert all("token" not in t and "sha256" not in t for t in listed)
    # No secret is in the state, the log or the digest: only its hash.
    alice_secret = env.tokens["alice"]
    assert alice_secret is not None
    for token in env.node.state.tokens.values():
        assert alice_secret not in repr(token)
    assert hash_token(alice_secret) in env.node.state.token_ids_by_hash

    # A created admin token is an admin.
    created = await env.call(
        "admin", "POST", "/api/v1/tokens", json={"name": "ops", "role": "admin"}
    )
    assert created.status_code == 201 and created.json()["role"] == "admin"
    env.tokens["ops"] = created.json()["token"]
    assert (await env.call("ops", "GET", "/api/v1/whoami")).json()["role"] == "admin"
    assert (await env.call("ops", "GET", "/api/v1/tokens")).status_code == 200

    # Revoking Alice's token locks her out at once; her tasks stay.
    task = await submit(env, "alice")
    alice_id = next(t["id"] for t in listed if t["tenant"] == "alice")
    revoked = await env.call("ops", "DELETE", f"/api/v1/tokens/{alice_id}")
    assert revoked.status_code == 200 and revoked.json()["id"] == alice_id
    refused_without_credentials(await env.call("alice", "GET", TASKS))
    assert (await env.call("admin", "GET", f"{TASKS}/{task}")).status_code == 200
    again = await env.call("admin", "DELETE", f"/api/v1/tokens/{alice_id}")
    assert error_code(again, 404) == "not_found"


@pytest.mark.parametrize(
    "body",
    [
        {"name": "x"},  # a tenant token without its tenant
        {"name": "x", "role": "admin", "tenant": "alice"},
        {"name": "x", "role": "root"},
        {"name": "", "tenant": "alice"},
        {"name": "x", "tenant": "not a tenant name!"},
        {"name": "x", "tenant": "alice", "extra": 1},
    ],
)
async def test_bad_token_requests_are_400(env: Env, body: dict[str, Any]) -> None:
    before = env.node.state.digest()
    response = await env.call("admin", "POST", "/api/v1/tokens", json=body)
    assert error_code(response, 400) == "invalid_request"
    assert env.node.state.digest() == before


@pytest.mark.parametrize(
    ("who", "expected"),
    [
        ("admin", {"role": "admin", "tenant": None, "token_id": None, "auth": True}),
        ("worker", {"role": "worker", "tenant": None, "token_id": None, "auth": True}),
        ("peer", {"role": "peer", "tenant": None, "token_id": None, "auth": True}),
    ],
)
async def test_whoami(env: Env, who: str, expected: dict[str, Any]) -> None:
    assert (await env.call(who, "GET", "/api/v1/whoami")).json() == expected


async def test_whoami_of_a_tenant_token(env: Env) -> None:
    body = (await env.call("bob", "GET", "/api/v1/whoami")).json()
    assert body["role"] == "tenant" and body["tenant"] == "bob" and body["token_id"]


# --- the replicated state ------------------------------------------------------------------


def test_tokens_are_replicated_state_in_the_snapshot_and_digest() -> None:
    machine = StateMachine()
    empty_digest = machine.digest()
    created = machine.apply(
        e.CreateToken(
            time_ms=1000, token_id="ab12", name="n", tenant="alice", sha256=hash_token("s")
        )
    ).result
    assert not hasattr(created, "code")  # not Rejected
    assert machine.digest() != empty_digest
    restored = StateMachine.from_snapshot(machine.encode_snapshot())
    restored.check_invariants()
    assert restored.digest() == machine.digest()
    assert restored.token_ids_by_hash == {hash_token("s"): "ab12"}
    # Same id or same secret twice: refused by apply, whoever proposed it.
    for duplicate in (
        e.CreateToken(time_ms=1001, token_id="ab12", name="n", tenant="a", sha256="1" * 64),
        e.CreateToken(time_ms=1001, token_id="cd34", name="n", tenant="a", sha256=hash_token("s")),
    ):
        refused = machine.apply(duplicate).result
        assert getattr(refused, "code", None) is not None
    machine.apply(e.RevokeToken(time_ms=1002, token_id="ab12"))
    machine.check_invariants()
    assert machine.tokens == {} and machine.token_ids_by_hash == {}


@pytest.mark.parametrize(
    "entry",
    [
        e.CreateToken(time_ms=0, token_id="XY", name="n", tenant="a", sha256="0" * 64),
        e.CreateToken(time_ms=0, token_id="ab", name="n", tenant="a", sha256="short"),
        e.CreateToken(time_ms=0, token_id="ab", name="", tenant="a", sha256="0" * 64),
        e.CreateToken(time_ms=0, token_id="ab", name="n", role="root", sha256="0" * 64),
        e.CreateToken(
            time_ms=0, token_id="ab", name="n", role="admin", tenant="a", sha256="0" * 64
        ),
        e.CreateToken(time_ms=0, token_id="ab", name="n", tenant="bad name", sha256="0" * 64),
        e.RevokeToken(time_ms=0, token_id="ab"),
    ],
)
def test_apply_refuses_invalid_token_entries(entry: e.Entry) -> None:
    machine = StateMachine()
    before = machine.digest()
    result = machine.apply(entry).result  # time 0: the clock does not move either
    assert getattr(result, "code", None) is not None
    assert machine.digest() == before


# --- the route table's permissions, enforced for every route ---------------------------------

_ROLE_OF = {"alice": CallerRole.TENANT, "worker": CallerRole.WORKER, "peer": CallerRole.PEER}
_PATH_VALUES = {"id": "1", "root": "1", "name": "alice", "sha256": "0" * 64, "token_id": "ab"}


def _concrete(route: Route) -> str:
    if route.path == "/dashboard/{name}":
        return "/dashboard/app.js"
    return re.sub(r"\{(\w+)\}", lambda found: _PATH_VALUES[found.group(1)], route.path)


@pytest.mark.parametrize("route", ROUTES, ids=lambda r: f"{r.method} {r.path}")
async def test_every_route_enforces_its_permission(env: Env, route: Route) -> None:
    """Whatever the request holds (no body here), a caller the table does not allow gets
    403 and one without credentials 401; public routes answer everyone."""
    path = _concrete(route)
    permission = route.permission
    nobody = await env.call("nobody", route.method, path)
    if permission.public:
        assert nobody.status_code < 400, (path, nobody.text)
        return
    refused_without_credentials(nobody)
    for who, role in _ROLE_OF.items():
        if permission.any_caller or role in permission.roles:
            continue
        forbidden(await env.call(who, route.method, path))
