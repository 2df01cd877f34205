"""The HTTP API (broker/api/http_api.py) in process: routing, health, cluster, digest,
OpenAPI, unavailability, idempotency keys, task trees and what fuzzing found.

The ``api`` fixture (tests/support/http_api.py) fails a test on any unexpected 5xx.
"""

from __future__ import annotations

import asyncio
import json
import re
from typing import Any

import pytest

from tests.support.http_api import (
    CONFIG,
    FAR_FUTURE_UNIX,
    STATES,
    TASKS,
    TXNS,
    Api,
    all_tasks,
    begin,
    error_of,
    get_task,
    observe,
    run_and_finish,
    submit,
)

# --- routing, health, cluster, digest, OpenAPI ------------------------------------------


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("DELETE", TASKS),
        ("PUT", TASKS),
        ("PATCH", TASKS),
        ("HEAD", TASKS),
        ("DELETE", f"{TASKS}/1"),
        ("POST", f"{TASKS}/1"),
        ("GET", TXNS),
        ("GET", f"{TXNS}/1/commit"),
        ("POST", "/api/v1/tenants"),
        ("DELETE", "/api/v1/tenants/x"),
        ("POST", "/api/v1/cluster"),
        ("POST", "/api/v1/state/digest"),
        ("POST", "/healthz"),
        ("POST", "/api/v1/openapi.json"),
    ],
)
async def test_method_not_allowed_is_405(api: Api, method: str, path: str) -> None:
    before = await observe(api)
    response = await api.client.request(method, path, json={"type": "a"})
    assert response.status_code == 405
    if method != "HEAD":
        assert "use " in error_of(response, 405, "method_not_allowed")
    assert await observe(api) == before


@pytest.mark.parametrize(
    "path", ["/api", "/api/v1", "/api/v1/", "/api/v2/tasks", "/api/v1/tasks/", "/healthz/"]
)
async def test_unknown_path_is_404(api: Api, path: str) -> None:
    assert "no such endpoint" in error_of(await api.get(path), 404, "not_found")
    error_of(await api.post(path, json={}), 404, "not_found")


async def test_healthz(api: Api) -> None:
    response = await api.get("/healthz")
    assert response.status_code == 200
    body = response.json()
    assert body["status"] == "ok"
    assert body["writable"] is True
    assert set(body["position"]) == {"ledger_id", "entry_id"}


async def test_cluster_shape(api: Api) -> None:
    await submit(api)
    await submit(api, start_after=FAR_FUTURE_UNIX)
    response = await api.get("/api/v1/cluster")
    assert response.status_code == 200
    summary = response.json()
    assert summary["cluster_id"] == "standalone"
    assert summary["leader"] == "standalone"
    assert summary["workers"] == []
    assert summary["tenants"] == 1
    assert summary["tasks"] == {**dict.fromkeys(STATES, 0), "waiting": 1, "delayed": 1}
    [broker] = summary["brokers"]
    assert set(broker) == {
        "id",
        "host",
        "port",
        "uptime_secs",
        "is_leader",
        "version",
        "position",
        "digest",
        "role",
        "lag_entries",
        "reachable",
        "last_seen_secs_ago",
        "started_at",
        "member",
        "unknown_reason",
        "url",
        "worker_address",
        "worker_tls",
    }
    assert broker["role"] == "standalone"
    # The one answering: a leader of itself, seen now, nothing unknown.
    assert (broker["lag_entries"], broker["reachable"], broker["member"]) == (0, True, True)
    assert broker["last_seen_secs_ago"] == 0.0 and broker["unknown_reason"] is None
    assert broker["started_at"].endswith("Z")
    assert broker["digest"] == api.node.state.digest()
    assert summary["leader_url"] is None  # the test app has no cluster view
    assert broker["id"] == "standalone"
    assert broker["host"] == CONFIG.host
    assert broker["port"] == CONFIG.port
    assert isinstance(broker["uptime_secs"], float | int) and broker["uptime_secs"] >= 0
    assert broker["is_leader"] is True
    assert isinstance(broker["version"], str) and broker["version"]
    assert set(broker["position"]) == {"ledger_id", "entry_id"}
    assert all(isinstance(v, int) for v in broker["position"].values())


async def test_digest_shape_and_progress(api: Api) -> None:
    empty = (await api.get("/api/v1/state/digest")).json()
    assert empty["position"] == {"ledger_id": -1, "entry_id": -1}  # nothing logged yet
    await submit(api)
    first = (await api.get("/api/v1/state/digest")).json()
    assert first["digest"] != empty["digest"]
    assert set(first) == {"position", "digest"}
    assert set(first["position"]) == {"ledger_id", "entry_id"}
    assert re.fullmatch(r"[0-9a-f]{64}", first["digest"])
    assert first == (await api.get("/api/v1/state/digest")).json()
    await submit(api)
    second = (await api.get("/api/v1/state/digest")).json()
    assert second["digest"] != first["digest"]
    assert second["position"]["ledger_id"] == first["position"]["ledger_id"]
    assert second["position"]["entry_id"] == first["position"]["entry_id"] + 1
    cluster = (await api.get("/api/v1/cluster")).json()
    assert cluster["brokers"][0]["position"] == second["position"]


def _path_shape(path: str) -> str:
    """A route regex or an OpenAPI path with every parameter as ``{}``."""
    path = path.removeprefix("^").removesuffix("$")
    path = re.sub(r"\([^)]*\)", "{}", path)
    return re.sub(r"\{\w*\}", "{}", path)


async def test_openapi_document_lists_every_route(api: Api) -> None:
    response = await api.get("/api/v1/openapi.json")
    assert response.status_code == 200
    assert response.headers["content-type"] == "application/json"
    doc = json.loads(response.content)
    assert doc["openapi"].startswith("3.")
    assert doc["info"]["title"] == "Steward"
    served = {
        (_path_shape(route.pattern.pattern), method.lower())
        for route in api.app._routes
        for method in route.handlers
    }
    documented = {
        (_path_shape(path), method)
        for path, operations in doc["paths"].items()
        for method in operations
    }
    missing = {(p, m) for p, m in served if p != "/api/v1/openapi.json"} - documented
    assert not missing, f"routes missing from the OpenAPI document: {sorted(missing)}"
    assert documented <= served
    for path in ("/api/v1/tasks", "/api/v1/tasks/{id}", "/api/v1/tenants/{name}", "/healthz"):
        assert path in doc["paths"]
    # Every $ref resolves to a component schema.
    refs = re.findall(r'"\$ref":\s*"#/components/schemas/([^"]+)"', response.text)
    assert refs
    assert set(refs) <= set(doc["components"]["schemas"])
    # The same bytes every time (cached).
    assert (await api.get("/api/v1/openapi.json")).content == response.content


async def test_lifespan_and_other_scopes(api: Api) -> None:
    incoming = [{"type": "lifespan.startup"}, {"type": "lifespan.shutdown"}]
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return incoming.pop(0)

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    await api.app({"type": "lifespan"}, receive, send)
    assert [m["type"] for m in sent] == [
        "lifespan.startup.complete",
        "lifespan.shutdown.complete",
    ]
    sent.clear()
    await api.app({"type": "websocket", "path": "/"}, receive, send)
    assert sent == []


# --- unavailable -----------------------------------------------------------------------------


async def test_writes_after_stop_are_503_unavailable(api: Api) -> None:
    task = await submit(api)
    txn = await begin(api)
    await api.node.stop(snapshot=False)
    api.stopped = True
    api.allow_503 = True
    writes = [
        await api.post(TASKS, json={"type": "a"}),
        await api.post(TASKS, json={"tasks": [{"type": "a"}]}),
        await api.post(f"{TASKS}/{task['id']}/cancel"),
        await api.post(TXNS),
        await api.post(f"{TXNS}/{txn}/commit"),
        await api.put("/api/v1/tenants/t", json={"weight": 2}),
    ]
    for response in writes:
        assert "shutting down" in error_of(response, 503, "unavailable")
    health = await api.get("/healthz")
    assert health.status_code == 503
    assert health.json()["status"] == "unavailable"
    assert health.json()["writable"] is False
    assert health.json()["reason"]
    # Reads still work and client mistakes are still 4xx.
    assert (await get_task(api, task["id"]))["state"] == "waiting"
    error_of(await api.post(TASKS, content=b"{"), 400, "invalid_json")
    error_of(await api.post(f"{TASKS}/999/cancel"), 404, "not_found")


# --- idempotency keys --------------------------------------------------------------------------


async def test_idempotency_key_header_replays_a_single_submission(api: Api) -> None:
    headers = {"Idempotency-Key": "retry-me-1"}
    first = await api.post(TASKS, json={"type": "a"}, headers=headers)
    assert first.status_code == 201, first.text
    assert set(first.json()) == {"id", "state"}
    before = await all_tasks(api)
    again = await api.post(TASKS, json={"type": "a"}, headers=headers)
    assert again.status_code == 201, again.text
    assert again.json() == {**first.json(), "replayed": True}
    assert await all_tasks(api) == before
    # Another key, or none, creates a task.
    other = await api.post(TASKS, json={"type": "a"}, headers={"Idempotency-Key": "another"})
    assert other.status_code == 201 and other.json()["id"] != first.json()["id"]
    assert len(await all_tasks(api)) == len(before) + 1


async def test_idempotency_key_field_replays_a_batch(api: Api) -> None:
    body = {"idempotency_key": "batch-1", "tasks": [{"type": "a"}, {"type": "b", "slot": "s"}]}
    first = await api.post(TASKS, json=body)
    assert first.status_code == 200, first.text
    ids = [t["id"] for t in first.json()["tasks"]]
    assert "replayed" not in first.json()
    cluster = (await api.get("/api/v1/cluster")).json()["tasks"]
    # The same key in the header, as a retrying client may send it: same answer.
    again = await api.post(TASKS, json=body, headers={"Idempotency-Key": "batch-1"})
    assert again.status_code == 200, again.text
    assert again.json() == {**first.json(), "replayed": True}
    assert [t["id"] for t in again.json()["tasks"]] == ids
    assert (await api.get("/api/v1/cluster")).json()["tasks"] == cluster


async def test_replayed_batch_repeats_its_per_task_errors(api: Api) -> None:
    await submit(api, slot="held")
    body = {"idempotency_key": "k", "tasks": [{"type": "a"}, {"type": "b", "slot": "held"}]}
    first = await api.post(TASKS, json=body)
    assert first.status_code == 200
    assert first.json()["tasks"][1]["error"]["code"] == "slot_busy"
    again = await api.post(TASKS, json=body)
    assert again.json() == {**first.json(), "replayed": True}


async def test_key_reused_for_another_number_of_tasks_is_409(api: Api) -> None:
    await api.post(TASKS, json={"type": "a"}, headers={"Idempotency-Key": "k"})
    before = await all_tasks(api)
    response = await api.post(
        TASKS, json={"tasks": [{"type": "a"}, {"type": "a"}]}, headers={"Idempotency-Key": "k"}
    )
    assert "new key" in error_of(response, 409, "conflict")
    assert await all_tasks(api) == before


@pytest.mark.parametrize(
    ("headers", "fields", "fragment"),
    [
        ({"Idempotency-Key": "k" * 129}, {}, "1-128 printable ASCII"),
        ({"Idempotency-Key": "caf\xe9".encode("latin-1")}, {}, "1-128 printable ASCII"),
        ({}, {"idempotency_key": ""}, "length >= 1"),
        ({}, {"idempotency_key": "k" * 129}, "length <= 128"),
        ({}, {"idempotency_key": "clé"}, "matching regex"),
        ({}, {"idempotency_key": "line\n"}, "1-128 printable ASCII"),
        ({}, {"idempotency_key": 7}, "Expected `str | null`"),
        ({"Idempotency-Key": "a"}, {"idempotency_key": "b"}, "differ"),
    ],
)
async def test_bad_idempotency_key_is_400_and_applies_nothing(
    api: Api, headers: dict[str, Any], fields: dict[str, Any], fragment: str
) -> None:
    before = await observe(api)
    for body in ({"type": "a", **fields}, {"tasks": [{"type": "a"}], **fields}):
        response = await api.post(TASKS, json=body, headers=headers)
        assert fragment in error_of(response, 400, "invalid_request")
    assert await observe(api) == before


async def test_idempotency_key_sent_twice_is_400(api: Api) -> None:
    before = await observe(api)
    headers = [("Idempotency-Key", "a"), ("Idempotency-Key", "a")]
    response = await api.post(TASKS, json={"type": "a"}, headers=headers)
    assert "twice" in error_of(response, 400, "invalid_request")
    assert await observe(api) == before


async def test_idempotency_key_inside_a_batch_item_is_400(api: Api) -> None:
    response = await api.post(TASKS, json={"tasks": [{"type": "a", "idempotency_key": "k"}]})
    assert "idempotency_key" in error_of(response, 400, "invalid_request")


async def test_openapi_documents_the_idempotency_key(api: Api) -> None:
    doc = (await api.get("/api/v1/openapi.json")).json()
    post = doc["paths"]["/api/v1/tasks"]["post"]
    assert [p["name"] for p in post["parameters"]] == ["Idempotency-Key"]
    for body in ("SubmitOneBody", "SubmitBatchBody"):
        assert "idempotency_key" in doc["components"]["schemas"][body]["properties"]
    assert "replayed" in doc["components"]["schemas"]["TaskRefBody"]["properties"]


# --- task trees ---------------------------------------------------------------------------


async def _run_and_finish(api: Api, task_id: int, *children: str, ok: bool = True) -> list[int]:
    return await run_and_finish(api.node, task_id, *children, ok=ok)


async def test_submit_with_track_tree_shows_the_tree(api: Api) -> None:
    root = (await submit(api, track_tree=True, tree_timeout_s=12.5))["id"]
    plain = (await submit(api))["id"]
    view = await get_task(api, root)
    assert view["tree"] == {"state": "pending", "attempt": 1, "timeout_s": 12.5}
    assert view["root"] == root and view["parent"] is None
    assert (await get_task(api, plain))["tree"] is None
    assert api.node.state.tasks[root].root == root

    [child] = await _run_and_finish(api, root, "child")
    view = await get_task(api, child)
    assert view["root"] == root and view["parent"] == root and view["tree"] is None
    listed = {t["id"]: t for t in await all_tasks(api)}
    assert listed[root]["tree"]["state"] == "pending"


async def test_default_tree_timeout_is_30_s(api: Api) -> None:
    root = (await submit(api, track_tree=True))["id"]
    assert (await get_task(api, root))["tree"]["timeout_s"] == 30.0


@pytest.mark.parametrize(
    ("fields", "fragment"),
    [
        ({"tree_timeout_s": 5}, "tree_timeout_s needs track_tree"),
        ({"track_tree": True, "tree_timeout_s": 0}, "tree_timeout_s must be between"),
        ({"track_tree": True, "tree_timeout_s": 10**9}, "tree_timeout_s must be between"),
        ({"track_tree": "yes"}, "track_tree"),
    ],
)
async def test_bad_tree_fields_are_400(api: Api, fields: dict[str, Any], fragment: str) -> None:
    response = await api.post(TASKS, json={"type": "noop", **fields})
    assert fragment in error_of(response, 400, "invalid_request")


async def test_wait_tree_is_a_boolean_not_a_bare_flag(api: Api) -> None:
    """The document says boolean: an empty value is refused, not read as true."""
    root = (await submit(api, track_tree=True))["id"]
    for value in ("", "yes"):
        response = await api.get(f"{TASKS}/{root}", params={"wait_tree": value})
        assert "wait_tree must be true or false" in error_of(response, 400, "invalid_request")


async def test_wait_tree_answers_when_the_tree_ends(api: Api) -> None:
    root = (await submit(api, track_tree=True))["id"]
    url = f"{TASKS}/{root}"
    response = await api.get(url, params={"wait_tree": "true", "wait_s": 0.05})
    assert response.json()["tree"]["state"] == "pending"
    poll = asyncio.create_task(api.get(url, params={"wait_tree": "true", "wait_s": 10}))
    [child] = await _run_and_finish(api, root, "child")
    await asyncio.sleep(0.05)
    # The root finished, its tree did not: still waiting.
    assert (await get_task(api, root))["state"] == "finished"
    assert not poll.done()
    await api.post(f"{TASKS}/{child}/cancel")  # the tree fails (no attempts left)
    response = await asyncio.wait_for(poll, 5)
    tree = response.json()["tree"]
    assert tree["state"] == "failed"
    assert tree["reason"] == f"task {child} was cancelled"
    # An ended tree is answered at once.
    response = await asyncio.wait_for(api.get(url, params={"wait_tree": "1", "wait_s": 10}), 5)
    assert response.json()["tree"]["state"] == "failed"
    assert not api.app._tree_waiters


async def test_wait_tree_completed(api: Api) -> None:
    root = (await submit(api, track_tree=True))["id"]
    url = f"{TASKS}/{root}"
    poll = asyncio.create_task(api.get(url, params={"wait_tree": "true", "wait_s": 10}))
    await _run_and_finish(api, root)
    response = await asyncio.wait_for(poll, 5)
    assert response.json()["tree"] == {"state": "completed", "attempt": 1, "timeout_s": 30.0}


async def test_wait_tree_errors(api: Api) -> None:
    plain = (await submit(api))["id"]
    response = await api.get(f"{TASKS}/{plain}", params={"wait_tree": "true", "wait_s": 1})
    assert "does not root a tracked tree" in error_of(response, 400, "invalid_request")
    response = await api.get(f"{TASKS}/{plain}", params={"wait_tree": "maybe"})
    assert "wait_tree must be true or false" in error_of(response, 400, "invalid_request")


# --- found by fuzzing (tests/integration/test_fuzz_http.py) ----------------------------------


async def test_names_with_a_final_newline_are_refused(api: Api) -> None:
    # NAME_RE ends in "$", which lets a final "\n" through .match.
    response = await api.put("/api/v1/tenants/acme%0A", json={"weight": 2})
    assert "is not valid" in error_of(response, 400, "invalid_request")
    response = await api.get("/api/v1/tenants/acme%0A")
    assert "is not valid" in error_of(response, 400, "invalid_request")
    response = await api.post(TXNS, json={"tenant": "acme\n"})
    error_of(response, 400, "invalid_request")
    response = await api.put("/api/v1/config", json={"global_limits": {"cpu\n": 1}})
    error_of(response, 400, "invalid_request")
    assert "acme\n" not in api.node.state.tenants


async def test_openapi_states_the_bounds_the_server_checks(api: Api) -> None:
    document = (await api.get("/api/v1/openapi.json")).json()
    schemas = document["components"]["schemas"]
    paths = document["paths"]

    def param(path: str, method: str, name: str) -> dict[str, Any]:
        found = [p for p in paths[path][method]["parameters"] if p["name"] == name]
        schema: dict[str, Any] = found[0]["schema"]
        return schema

    # The served document tells this broker's limits, not the defaults.
    assert param(TASKS, "get", "limit")["maximum"] == CONFIG.max_list_limit
    assert param(f"{TASKS}/{{id}}", "get", "wait_s")["maximum"] == CONFIG.max_wait_s
    assert param(TASKS, "get", "after")["maximum"] == 2**62
    name_pattern = param("/api/v1/tenants/{name}", "put", "name")["pattern"]
    assert re.search(name_pattern, "acme") and not re.search(name_pattern, "-acme")
    assert param("/api/v1/code", "post", "name")["pattern"]
    txn = schemas["TransactionBegin"]["properties"]
    assert txn["ttl_s"]["exclusiveMinimum"] == 0 and txn["ttl_s"]["maximum"] == 86400
    assert txn["tenant"]["pattern"] == name_pattern
    limits = schemas["TenantLimits"]["properties"]
    assert limits["weight"]["anyOf"][0]["exclusiveMinimum"] == 0
    assert limits["max_waiting"]["anyOf"][0]["minimum"] == 0
    retention = schemas["ClusterConfigPatch"]["properties"]["finished_task_retention_s"]
    assert retention["anyOf"][0]["minimum"] == 1
    # And the server refuses what the document excludes, with a 400.
    for response in [
        await api.put("/api/v1/tenants/acme", json={"weight": 0}),
        await api.put("/api/v1/tenants/acme", json={"max_running": -1}),
        await api.post(TXNS, json={"ttl_s": 86401}),
        await api.post(TXNS, json={"ttl_s": 0}),
        await api.put("/api/v1/config", json={"finished_task_retention_s": 0.5}),
        await api.put("/api/v1/config", json={"global_limits": {"cpu": -1}}),
        await api.get(TASKS, params={"after": 2**62 + 1}),
    ]:
        error_of(response, 400, "invalid_request")
