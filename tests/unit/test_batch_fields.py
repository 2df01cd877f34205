"""Batch bodies of POST /api/v1/tasks (issue 30, docs/API.md, "Batches"): a shared field
given next to ``tasks`` applies to every task that does not set it, a task naming another
tenant than the batch's is refused, fields of one task only are refused next to ``tasks``,
and an unknown field anywhere is a 400 naming it. In process, through the ASGI API.
"""

from __future__ import annotations

from typing import Any

import pytest

from broker.api import api_models as m
from tests.support.http_api import TASKS, Api, error_of, get_task, observe


async def _batch(api: Api, body: dict[str, Any]) -> list[dict[str, Any]]:
    response = await api.post(TASKS, json=body)
    assert response.status_code == 200, response.text
    tasks = response.json()["tasks"]
    assert all("id" in t for t in tasks), tasks
    return [await get_task(api, t["id"]) for t in tasks]


async def test_the_batch_tenant_applies_to_each_task(api: Api) -> None:
    views = await _batch(api, {"tenant": "acme", "tasks": [{"type": "noop"}, {"type": "b"}]})
    assert [v["tenant"] for v in views] == ["acme", "acme"]


async def test_a_task_naming_the_batch_tenant_is_accepted(api: Api) -> None:
    body = {"tenant": "acme", "tasks": [{"type": "noop", "tenant": "acme"}]}
    assert [v["tenant"] for v in await _batch(api, body)] == ["acme"]


async def test_a_task_naming_another_tenant_is_refused(api: Api) -> None:
    before = await observe(api)
    body = {"tenant": "acme", "tasks": [{"type": "noop"}, {"type": "noop", "tenant": "other"}]}
    message = error_of(await api.post(TASKS, json=body), 400, "invalid_request")
    assert "tasks[1]" in message and "'other'" in message and "'acme'" in message
    assert await observe(api) == before  # nothing of the batch was created


async def test_shared_fields_apply_unless_the_task_sets_its_own(api: Api) -> None:
    body = {
        "max_attempts": 3,
        "priority": 5,
        "resources": {"cpu": 2},
        "retry_backoff_s": 1.5,
        "deadline": 4_000_000_000,
        "tasks": [
            {"type": "a"},
            # Its own values win, the defaults' values included.
            {"type": "b", "max_attempts": 1, "priority": 0, "resources": {}},
        ],
    }
    first, second = await _batch(api, body)
    assert (first["max_attempts"], first["priority"], first["resources"]) == (3, 5, {"cpu": 2})
    assert first["retry_backoff_s"] == 1.5 and first["deadline"] == "2096-10-02T07:06:40.000Z"
    assert (second["max_attempts"], second["priority"], second["resources"]) == (1, 0, {})
    assert second["retry_backoff_s"] == 1.5  # not set by the task: the batch's


async def test_shared_fields_are_every_optional_field_but_params_and_slot() -> None:
    options = {f for f in m.TaskSubmission.__struct_fields__ if f != "type"}
    assert options - set(m.SHARED_TASK_FIELDS) == {"params", "slot"}
    assert set(m.SHARED_TASK_FIELDS) <= set(m.SubmitBatchBody.__struct_fields__)


@pytest.mark.parametrize(
    ("field", "value"), [("params", {"x": 1}), ("slot", "nightly"), ("type", "noop")]
)
async def test_one_task_fields_next_to_tasks_are_refused(api: Api, field: str, value: Any) -> None:
    before = await observe(api)
    response = await api.post(TASKS, json={field: value, "tasks": [{"type": "a"}]})
    assert field in error_of(response, 400, "invalid_request")
    assert await observe(api) == before


@pytest.mark.parametrize(
    ("body", "unknown", "where"),
    [
        ({"tasks": [{"type": "a"}], "tenat": "acme"}, "tenat", ""),
        ({"tasks": [{"type": "a"}, {"type": "b", "tenat": "acme"}]}, "tenat", "$.tasks[1]"),
        ({"tenant": "acme", "tasks": [{"type": "a", "prio": 1}]}, "prio", "$.tasks[0]"),
    ],
)
async def test_an_unknown_field_anywhere_is_400_naming_it(
    api: Api, body: dict[str, Any], unknown: str, where: str
) -> None:
    before = await observe(api)
    message = error_of(await api.post(TASKS, json=body), 400, "invalid_request")
    assert f"unknown field `{unknown}`" in message and where in message
    assert await observe(api) == before


async def test_a_batch_without_shared_fields_is_as_before(api: Api) -> None:
    views = await _batch(api, {"tasks": [{"type": "a", "tenant": "x"}, {"type": "b"}]})
    assert [v["tenant"] for v in views] == ["x", "default"]
