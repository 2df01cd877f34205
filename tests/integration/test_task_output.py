"""Issue 14 item 4 end to end: each attempt's output, readable by its owner only.

A real ``steward standalone`` with authentication on and a real ``steward worker`` (as CI
runs them, as root: each tenant's task processes get a uid of their own). Two tenants'
tasks run at once in different task processes; what each writes to stdout, stderr and
``ctx.logger`` reaches the leader and is readable through ``GET /api/v1/tasks/{id}/logs``
and ``steward logs`` with that tenant's token, and by no other tenant. Output over 1 MiB
keeps its last 1 MiB; ``steward logs --follow`` prints a running task's output before the
task ends. Every wait is bounded; processes are stopped when the test ends.
"""

from __future__ import annotations

import os
import selectors
import signal
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.procs import BrokerProcess, steward_command
from tests.support.tenant_jobs import tenant_jobs
from tests.support.worker_procs import WorkerProcess, wait_until

ADMIN = "admin-secret-for-the-task-output-test"
WORKER_TOKEN = "worker-token-for-the-task-output-test-0123"
MIB = 1024 * 1024

JOB = b"""\
import os, sys, time


def chatty(params, ctx):
    marker = params["marker"]
    print("stdout says", marker)
    print("stderr says", marker, file=sys.stderr)
    ctx.logger.warning("ctx.logger says %s", marker)
    # Both tenants' tasks wait until both started: they run at the same time.
    open(os.path.join(params["dir"], marker), "w").close()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if all(os.path.exists(os.path.join(params["dir"], m)) for m in params["all"]):
            break
        time.sleep(0.02)
    return {"pid": os.getpid(), "uid": os.getuid()}


def big(params, ctx):
    line = "x" * 99 + "\\n"
    for n in range(params["lines"]):
        sys.stdout.write(line)
    print("THE END")
    return params["lines"]


def slow(params, ctx):
    print("first line, before the task ends")
    deadline = time.monotonic() + 60
    while not os.path.exists(params["release"]) and time.monotonic() < deadline:
        time.sleep(0.05)
    print("second line, at the end")
    return "done"
"""


@dataclass
class Setup:
    broker: BrokerProcess
    worker: WorkerProcess
    admin: httpx.Client
    tenants: dict[str, httpx.Client]
    tokens: dict[str, str]
    sha: str
    shared: Path

    def submit(self, tenant: str, fn: str, params: dict[str, Any]) -> int:
        task = {"type": f"job:{fn}", "code": self.sha, "params": params}
        response = self.tenants[tenant].post("/api/v1/tasks", json=task)
        assert response.status_code == 201, response.text
        task_id: int = response.json()["id"]
        return task_id

    def wait_final(self, tenant: str, task_id: int) -> dict[str, Any]:
        done = self.tenants[tenant].get(f"/api/v1/tasks/{task_id}", params={"wait_s": 60})
        body: dict[str, Any] = done.json()
        assert body["state"] == "finished", (body, self.worker.log_tail())
        return body

    def steward(self, tenant: str, *args: str) -> subprocess.Popen[bytes]:
        return subprocess.Popen(
            [*steward_command(), "--url", self.broker.url, *args],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env={**os.environ, "STEWARD_TOKEN": self.tokens[tenant], "PYTHONPATH": os.getcwd()},
        )


@pytest.fixture
def setup(tmp_path: Path) -> Iterator[Setup]:
    # The same bytes for bob: each tenant uploads the code it uses.
    with tenant_jobs(
        tmp_path,
        admin_token=ADMIN,
        worker_token=WORKER_TOKEN,
        worker_id="w-output",
        job=JOB,
        slots=4,
        uploaders=("alice", "bob"),
    ) as env:
        yield Setup(env.broker, env.worker, env.admin, env.tenants, env.tokens, env.sha, env.shared)


def _logs(client: httpx.Client, task_id: int, **params: Any) -> httpx.Response:
    return client.get(f"/api/v1/tasks/{task_id}/logs", params=params)


def test_two_tenants_outputs_are_captured_apart_and_readable_by_their_owner_only(
    setup: Setup,
) -> None:
    markers = {"alice": "alice-marker-7f3a", "bob": "bob-marker-91c2"}
    ids = {
        tenant: setup.submit(
            tenant,
            "chatty",
            {"marker": marker, "dir": str(setup.shared), "all": list(markers.values())},
        )
        for tenant, marker in markers.items()
    }
    results = {tenant: setup.wait_final(tenant, ids[tenant])["result"] for tenant in ids}
    assert results["alice"]["pid"] != results["bob"]["pid"]
    for tenant, other in (("alice", "bob"), ("bob", "alice")):
        client, task_id = setup.tenants[tenant], ids[tenant]
        answer = _logs(client, task_id)
        assert answer.status_code == 200, answer.text
        logs = answer.json()
        assert logs["attempt"] == 1 and logs["complete"] is True
        assert logs["truncated"] is False and logs["available"] is True
        output = logs["output"]
        marker = markers[tenant]
        for line in (f"stdout says {marker}", f"stderr says {marker}", f"ctx.logger says {marker}"):
            assert line in output, output
        assert markers[other] not in output
        # The other tenant: the same 404 as for a task that does not exist.
        refused = _logs(setup.tenants[other], task_id)
        missing = _logs(setup.tenants[other], 999_999)
        assert refused.status_code == missing.status_code == 404
        assert refused.json()["error"]["code"] == missing.json()["error"]["code"] == "not_found"
        assert marker not in refused.text
        # Through the CLI with the owner's token; a one-line error for the other tenant.
        shown = setup.steward(tenant, "logs", str(task_id))
        out, err = shown.communicate(timeout=60)
        assert shown.returncode == 0, err
        assert f"stdout says {marker}" in out.decode() and f"stderr says {marker}" in out.decode()
        denied = setup.steward(other, "logs", str(task_id))
        out, err = denied.communicate(timeout=60)
        assert denied.returncode == 1 and out == b""
        assert err.decode().count("\n") == 1 and "does not exist" in err.decode(), err
    # The admin reads any tenant's; a bad attempt is a 4xx with a JSON error.
    assert markers["bob"] in _logs(setup.admin, ids["bob"]).json()["output"]
    bad = _logs(setup.admin, ids["bob"], attempt=2)
    assert bad.status_code == 400 and bad.json()["error"]["code"] == "invalid_request"


def test_output_over_a_mib_keeps_its_last_mib(setup: Setup) -> None:
    lines = (MIB + MIB // 2) // 100  # 1.5 MiB of 100-byte lines
    task_id = setup.submit("alice", "big", {"lines": lines})
    setup.wait_final("alice", task_id)
    logs = _logs(setup.tenants["alice"], task_id).json()
    assert logs["truncated"] is True and logs["complete"] is True
    data = logs["output"].encode()
    assert len(data) == MIB
    assert data.endswith(b"THE END\n")
    written = lines * 100 + len(b"THE END\n")
    assert logs["offset"] == written - MIB and logs["next_offset"] == written
    # A follower asking from next_offset gets nothing new.
    after = _logs(setup.tenants["alice"], task_id, offset=logs["next_offset"]).json()
    assert after["output"] == "" and after["truncated"] is False


def _read_until(process: subprocess.Popen[bytes], needle: bytes, timeout_s: float) -> bytes:
    """What the process printed until ``needle`` appeared, it closed stdout, or the time
    is up (never blocks longer)."""
    assert process.stdout is not None
    seen = b""
    with selectors.DefaultSelector() as selector:
        selector.register(process.stdout, selectors.EVENT_READ)
        deadline = time.monotonic() + timeout_s
        while needle not in seen and time.monotonic() < deadline:
            if selector.select(timeout=0.5):
                chunk = os.read(process.stdout.fileno(), 65536)
                if not chunk:
                    break
                seen += chunk
    return seen


def test_logs_follow_prints_a_running_tasks_output_before_it_ends(setup: Setup) -> None:
    release = setup.shared / "release-slow"
    task_id = setup.submit("alice", "slow", {"release": str(release)})
    wait_until(
        lambda: setup.tenants["alice"].get(f"/api/v1/tasks/{task_id}").json()["state"] == "running",
        30,
        "the slow task to start",
    )
    follow = setup.steward("alice", "logs", str(task_id), "--follow")
    try:
        seen = _read_until(follow, b"first line", 30)
        assert b"first line, before the task ends" in seen, seen
        # Printed while the task still runs (it waits for the release file).
        task = setup.tenants["alice"].get(f"/api/v1/tasks/{task_id}").json()
        assert task["state"] == "running" and not release.exists()
        # Ctrl-C ends another follower cleanly: exit status 130, no traceback.
        interrupted = setup.steward("alice", "logs", str(task_id), "--follow")
        assert b"first line" in _read_until(interrupted, b"first line", 30)  # following now
        interrupted.send_signal(signal.SIGINT)
        _, err = interrupted.communicate(timeout=30)
        assert interrupted.returncode == 130 and b"Traceback" not in err, err
        release.touch()
        rest, err = follow.communicate(timeout=60)
        assert follow.returncode == 0, err
        assert b"second line, at the end" in seen + rest
        assert (seen + rest).count(b"first line") == 1  # offsets: nothing twice
    finally:
        if follow.poll() is None:
            follow.kill()
            follow.wait(timeout=10)
    assert setup.wait_final("alice", task_id)["result"] == "done"


def test_a_restarted_broker_gets_a_finished_tasks_output_from_its_worker(setup: Setup) -> None:
    """The leader keeps output in memory only: after a restart it asks the worker that
    ran the attempt (FetchOutput), which still holds it."""
    marker = "kept-on-the-worker-5d1e"
    task_id = setup.submit(
        "alice", "chatty", {"marker": marker, "dir": str(setup.shared), "all": [marker]}
    )
    setup.wait_final("alice", task_id)
    assert setup.broker.terminate() == 0
    setup.broker.start()  # a new HTTP port; the worker port stays
    headers = {"authorization": f"Bearer {setup.tokens['alice']}"}
    with (
        httpx.Client(base_url=setup.broker.url, headers=headers, timeout=30) as alice,
        httpx.Client(
            base_url=setup.broker.url, headers={"authorization": f"Bearer {ADMIN}"}, timeout=30
        ) as admin,
    ):
        setup.worker.wait_connected(admin)
        # Connected in the recovered state may precede the worker's reconnection: until it
        # is back, the answer is "not available" (complete: the task is over).
        logs = wait_until(
            lambda: (
                (answer := alice.get(f"/api/v1/tasks/{task_id}/logs").json())["available"]
                and answer
            ),
            30,
            "the worker to send the output",
        )
        assert logs["complete"] is True, logs
        assert f"stdout says {marker}" in logs["output"]
        assert f"ctx.logger says {marker}" in logs["output"]
