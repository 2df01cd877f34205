"""Batch bodies on a real standalone broker (issue 30, docs/API.md, "Batches"): the tenant
given next to ``tasks`` files every task of the batch under it, and an unknown field, at
the top level or inside a task, is a 400 whose JSON body names it, creating nothing.

No worker runs: the tasks stay waiting, which is all this looks at.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from tests.support.procs import BrokerProcess

pytestmark = [pytest.mark.slow, pytest.mark.timeout(90)]


def _task_count(client: httpx.Client) -> int:
    listed = client.get("/api/v1/tasks", params={"limit": 1000})
    listed.raise_for_status()
    return len(listed.json()["tasks"])


def test_a_batch_tenant_applies_and_unknown_fields_are_refused(tmp_path: Path) -> None:
    with BrokerProcess(tmp_path / "data", log_path=tmp_path / "broker.log") as broker:
        broker.start()
        with httpx.Client(base_url=broker.url, timeout=10) as client:
            body = {"tenant": "acme", "tasks": [{"type": "noop"}, {"type": "noop"}]}
            answer = client.post("/api/v1/tasks", json=body)
            assert answer.status_code == 200, answer.text
            for submitted in answer.json()["tasks"]:
                view = client.get(f"/api/v1/tasks/{submitted['id']}").json()
                assert view["tenant"] == "acme", view

            created = _task_count(client)
            for bad, unknown in (
                ({"tenant": "acme", "tasks": [{"type": "noop"}], "tennant": "x"}, "tennant"),
                ({"tasks": [{"type": "noop"}, {"type": "noop", "tenat": "acme"}]}, "tenat"),
            ):
                refused = client.post("/api/v1/tasks", json=bad)
                assert refused.status_code == 400, refused.text
                error = refused.json()["error"]
                assert error["code"] == "invalid_request"
                assert f"unknown field `{unknown}`" in error["message"], error
            assert _task_count(client) == created
