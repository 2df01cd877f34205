"""Issue 18 item 2 end to end: trees you can see, on real processes.

A real ``steward standalone`` with authentication on and a real ``steward worker``. A
tenant's fan-out tree is watched while its children run (``GET /api/v1/trees/{root}``:
state, age, its tasks by state, the acks it waits for; ``steward tree ROOT``), then
completes; another tree times out and a third fails, and ``GET /api/v1/trees?state=...``
lists each under its state, for its tenant only; the tree metrics count them. Every wait
is bounded; processes are stopped when the test ends.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.procs import steward_command
from tests.support.tenant_jobs import tenant_jobs
from tests.support.worker_procs import wait_until

pytestmark = pytest.mark.slow

ADMIN = "admin-secret-for-the-trees-view-test"
WORKER_TOKEN = "worker-token-for-the-trees-view-test-0123"

JOB = b"""\
import os, time


def fan(params, ctx):
    for n in range(params["children"]):
        ctx.spawn(params["child"], {"release": params["release"], "n": n})
    return "fanned"


def wait(params, ctx):
    deadline = time.monotonic() + 60
    while not os.path.exists(params["release"]) and time.monotonic() < deadline:
        time.sleep(0.05)
    return params["n"]


def boom(params, ctx):
    raise RuntimeError("boom")
"""


@dataclass
class Setup:
    admin: httpx.Client
    alice: httpx.Client
    bob: httpx.Client
    alice_token: str
    url: str
    sha: str
    shared: Path

    def root(self, child: str, children: int, release: str, timeout_s: float = 60) -> int:
        task = {
            "type": "job:fan",
            "code": self.sha,
            "track_tree": True,
            "tree_timeout_s": timeout_s,
            "params": {"child": child, "children": children, "release": release},
        }
        response = self.alice.post("/api/v1/tasks", json=task)
        assert response.status_code == 201, response.text
        root: int = response.json()["id"]
        return root

    def tree(self, root: int) -> dict[str, Any]:
        response = self.alice.get(f"/api/v1/trees/{root}")
        assert response.status_code == 200, response.text
        tree: dict[str, Any] = response.json()
        return tree

    def wait_tree(self, root: int) -> dict[str, Any]:
        done = self.alice.get(f"/api/v1/tasks/{root}", params={"wait_s": 60, "wait_tree": True})
        assert done.status_code == 200 and done.json()["tree"]["state"] != "pending", done.text
        return self.tree(root)

    def listed(self, client: httpx.Client, state: str) -> list[int]:
        response = client.get("/api/v1/trees", params={"state": state})
        assert response.status_code == 200, response.text
        return [tree["root"] for tree in response.json()["trees"]]

    def steward(self, *args: str) -> str:
        done = subprocess.run(
            [*steward_command(), "--url", self.url, *args],
            stdin=subprocess.DEVNULL,
            capture_output=True,
            timeout=60,
            env={**os.environ, "STEWARD_TOKEN": self.alice_token, "PYTHONPATH": os.getcwd()},
        )
        assert done.returncode == 0, done.stderr.decode()
        return done.stdout.decode()


@pytest.fixture
def setup(tmp_path: Path) -> Iterator[Setup]:
    with tenant_jobs(
        tmp_path,
        admin_token=ADMIN,
        worker_token=WORKER_TOKEN,
        worker_id="w-trees",
        job=JOB,
        slots=8,
    ) as env:
        yield Setup(
            env.admin,
            env.tenants["alice"],
            env.tenants["bob"],
            env.tokens["alice"],
            env.broker.url,
            env.sha,
            env.shared,
        )


def test_a_tree_is_visible_while_it_runs_and_after_it_ends(setup: Setup) -> None:
    release = setup.shared / "release"
    root = setup.root("job:wait", 3, str(release))

    def three_awaited() -> dict[str, Any] | None:
        tree = setup.tree(root)
        return tree if tree["tasks"]["running"] == 3 and tree["pending_count"] == 3 else None

    tree = wait_until(three_awaited, 60, "the three children running")
    assert tree["state"] == "pending" and tree["tenant"] == "alice" and tree["attempt"] == 1
    assert tree["tasks"]["finished"] == 1 and tree["timeout_s"] == 60.0
    assert len(tree["pending_anchors"]) == 3 and root not in tree["pending_anchors"]
    assert tree["age_s"] > 0 and tree["deadline"] is not None and tree["ended_at"] is None
    # Tenant-scoped: another tenant sees neither the tree nor its listing; an admin does.
    assert setup.bob.get(f"/api/v1/trees/{root}").status_code == 404
    assert setup.listed(setup.bob, "pending") == []
    assert setup.listed(setup.alice, "pending") == [root]
    assert setup.listed(setup.admin, "pending") == [root]

    table = setup.steward("tree", str(root))
    assert "pending" in table and "3 acks awaited" in table
    assert "running" in table and str(tree["pending_anchors"][0]) in table
    as_json = json.loads(setup.steward("tree", str(root), "--json"))
    assert as_json["root"] == root and as_json["pending_count"] == 3

    release.touch()
    done = setup.wait_tree(root)
    assert done["state"] == "completed" and done["pending_count"] == 0
    assert done["tasks"]["finished"] == 4 and done["ended_at"] is not None
    assert setup.listed(setup.alice, "completed") == [root]
    age = done["age_s"]
    assert setup.tree(root)["age_s"] == age  # an ended tree's age no longer grows


def test_timed_out_and_failed_trees_are_listed_apart_and_counted(setup: Setup) -> None:
    never = str(setup.shared / "never")
    failed = setup.root("job:boom", 1, never)
    # A tree's timeout counts from its root's start (docs/API.md), so on a loaded machine
    # the root itself may outlive a short one: the tree then times out with only its root
    # cancelled and no children to show. Such a run is tried again with a longer timeout.
    timed_roots: list[int] = []
    for timeout_s in (1.0, 4.0, 16.0):
        timed = setup.root("job:wait", 2, never, timeout_s=timeout_s)
        timed_roots.append(timed)
        timed_view = setup.wait_tree(timed)
        assert timed_view["state"] == "timed_out" and timed_view["reason"] == "tree timed out"
        assert timed_view["pending_count"] == 0, timed_view
        if timed_view["tasks"]["finished"] == 1:  # the root ended before its tree's deadline
            break
        assert timed_view["tasks"]["cancelled"] == 1, timed_view  # the root, mid-run
    assert timed_view["tasks"]["cancelled"] == 2, timed_view
    failed_view = setup.wait_tree(failed)
    assert failed_view["state"] == "failed" and "ended in error" in failed_view["reason"]
    assert setup.listed(setup.alice, "timed_out") == timed_roots
    assert setup.listed(setup.alice, "failed") == [failed]
    assert setup.listed(setup.alice, "pending") == []
    bad = setup.alice.get("/api/v1/trees", params={"state": "lost"})
    assert bad.status_code == 400 and bad.json()["error"]["code"] == "invalid_request"

    metrics = setup.admin.get("/metrics")
    assert metrics.status_code == 200, metrics.text
    text = metrics.text
    tries = len(timed_roots)
    assert f'steward_trees_started_total{{tenant="alice"}} {tries + 1}.0' in text
    assert f'steward_trees_timed_out_total{{tenant="alice"}} {tries}.0' in text
    assert 'steward_trees_failed_total{tenant="alice"} 1.0' in text
    assert "steward_tree_completion_seconds_count 0.0" in text
    assert 'steward_trees_pending{tenant="alice"}' not in text
