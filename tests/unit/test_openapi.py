"""The OpenAPI document (broker/api/openapi.py) is one a client generator is happy with:
named operations and tags, one TaskState enum, date-times, honest ``required`` lists, and
every status the server answers. The generated client itself runs against real brokers in
tests/integration/test_newcomer_openapi.py."""

from __future__ import annotations

from typing import Any

from broker.api.openapi import openapi_document
from broker.api.routes import ROUTES

DOC = openapi_document()
SCHEMAS: dict[str, Any] = DOC["components"]["schemas"]


def _operations() -> list[tuple[str, str, dict[str, Any]]]:
    return [
        (method.upper(), path, operation)
        for path, item in DOC["paths"].items()
        for method, operation in item.items()
    ]


def test_every_operation_has_a_unique_id_and_a_tag() -> None:
    ids = [op["operationId"] for _, _, op in _operations()]
    assert len(ids) == len(ROUTES) == len(set(ids))
    assert all(id_.isidentifier() and id_.islower() for id_ in ids), ids
    assert {"submit_task", "get_task", "list_tasks"} <= set(ids)
    tags = {tag["name"] for tag in DOC["tags"]}
    for _, _, op in _operations():
        assert len(op["tags"]) == 1 and op["tags"][0] in tags


def test_one_task_state_enum_used_everywhere_a_task_state_is() -> None:
    states = {"pending", "delayed", "waiting", "running", "finished", "error", "cancelled"}
    assert set(SCHEMAS["TaskState"]["enum"]) == states
    ref = {"$ref": "#/components/schemas/TaskState"}
    assert SCHEMAS["TaskView"]["properties"]["state"] == ref
    assert SCHEMAS["TaskRefBody"]["properties"]["state"] == ref
    params = DOC["paths"]["/api/v1/tasks"]["get"]["parameters"]
    assert next(p for p in params if p["name"] == "state")["schema"] == ref
    # No other schema repeats the states as an inline enum.
    assert not [k for k, v in SCHEMAS.items() if k != "TaskState" and _enums(v) & states]


def _enums(schema: Any) -> set[str]:
    """Every enum value anywhere in ``schema``."""
    if isinstance(schema, dict):
        found = set(schema.get("enum", ()))
        for value in schema.values():
            found |= _enums(value)
        return found
    if isinstance(schema, list):
        return set().union(*(_enums(item) for item in schema)) if schema else set()
    return set()


def test_timestamps_are_date_times() -> None:
    view = SCHEMAS["TaskView"]["properties"]
    assert view["created_at"]["format"] == "date-time"
    assert {"format": "date-time", "type": "string"} in view["finished_at"]["anyOf"]
    for schema, field in (("TransactionView", "expires_at"), ("ArtifactView", "created_at"),
                          ("TokenView", "created_at"), ("WorkerView", "connected_at")):  # fmt: skip
        assert SCHEMAS[schema]["properties"][field]["format"] == "date-time"


def test_required_lists_what_is_always_sent_and_what_a_request_must_carry() -> None:
    task_view = SCHEMAS["TaskView"]
    assert set(task_view["required"]) == set(task_view["properties"])
    assert SCHEMAS["SubmitOneBody"]["required"] == ["type"]
    assert SCHEMAS["SubmitBatchBody"]["required"] == ["tasks"]
    body = DOC["paths"]["/api/v1/tasks"]["post"]["requestBody"]
    assert body["required"] is True
    one_of = body["content"]["application/json"]["schema"]["oneOf"]
    assert [s["$ref"].rsplit("/", 1)[1] for s in one_of] == ["SubmitOneBody", "SubmitBatchBody"]
    # Fields a response leaves out when at their default stay optional.
    assert SCHEMAS["SubmittedTask"].get("required", []) == []


def test_every_status_the_server_answers_is_documented() -> None:
    for method, path, op in _operations():
        statuses = set(op["responses"])
        assert not {s for s in statuses if "X" in s}, (method, path)
        assert {"400", "404", "503"} <= statuses, (method, path)
        public = op.get("security") == []
        if not public:
            unauthorized = op["responses"]["401"]
            assert "WWW-Authenticate" in unauthorized["headers"], (method, path)
            assert "403" in statuses
        if method != "GET" and not public:
            redirect = op["responses"]["307"]
            assert redirect["headers"]["Location"]["required"] is True, (method, path)
    submit = DOC["paths"]["/api/v1/tasks"]["post"]["responses"]
    assert {"201", "200", "409", "413", "429"} <= set(submit)
    health = DOC["paths"]["/healthz"]["get"]["responses"]["503"]
    one_of = health["content"]["application/json"]["schema"]["oneOf"]
    assert [s["$ref"].rsplit("/", 1)[1] for s in one_of] == ["Health", "ErrorBody"]
