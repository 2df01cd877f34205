"""Issue 30, item 8: a task type no worker of the cluster ever served is refused at submit,
unless the submitter asks to wait (docs/DESIGN.md §6, "Served task types"; docs/API.md,
"Task types"). A real standalone broker, a real ``steward worker`` serving every tenant
(the built-in types) and an embedded worker dedicated to tenant alice that registered
``alice.report``; the submits go through the real HTTP API and the real ``steward`` CLI."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.support.cli_runs import steward
from tests.support.procs import BrokerProcess
from tests.support.worker_procs import broker_with_worker, wait_until

REPO = Path(__file__).resolve().parents[2]
CONNECT_S = 30.0
# An embedding program's worker: serves tenant alice only, with one type of its own.
EMBEDDED = """
import asyncio, sys
from pathlib import Path
from clients.worker import Worker, WorkerConfig

def report(params, ctx):
    return "reported"

root = Path(sys.argv[3])
config = WorkerConfig(
    broker=sys.argv[1], http_url=sys.argv[2], worker_id="alice-embedded", tenants=["alice"],
    task_isolation="thread", spark="off", cache_dir=root / "cache", work_dir=root / "work",
)
worker = Worker(config)
worker.runtime.register("alice.report", report)
asyncio.run(worker.run())
"""


@pytest.fixture(scope="module")
def broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BrokerProcess]:
    root = tmp_path_factory.mktemp("served-types")
    with broker_with_worker(root, "served-shared", ("--task-type", "*=1")) as (broker, worker):
        script = root / "embedded.py"
        script.write_text(EMBEDDED)
        log = (root / "embedded.log").open("wb")
        env = dict(os.environ, PYTHONPATH=str(REPO), PYTHONUNBUFFERED="1")
        embedded = subprocess.Popen(
            [sys.executable, str(script), worker.broker, broker.url, str(root / "embedded")],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            stdin=subprocess.DEVNULL,
        )
        try:
            with httpx.Client(base_url=broker.url) as http:

                def connected() -> bool:
                    assert embedded.poll() is None, (root / "embedded.log").read_text()
                    workers = http.get("/api/v1/cluster").json()["workers"]
                    return any(w["id"] == "alice-embedded" for w in workers)

                wait_until(connected, CONNECT_S, "the embedded worker to connect")
            yield broker
        finally:
            embedded.terminate()
            try:
                embedded.wait(timeout=20)
            except subprocess.TimeoutExpired:
                embedded.kill()
                embedded.wait(timeout=10)
            log.close()


def _submit(http: httpx.Client, body: dict[str, object]) -> httpx.Response:
    return http.post("/api/v1/tasks", json=body)


def _refusal(answer: httpx.Response) -> str:
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["code"] == "invalid_request", error
    message: str = error["message"]
    return message


def test_served_types_are_accepted_and_unknown_ones_refused_unless_asked_to_wait(
    broker: BrokerProcess,
) -> None:
    with httpx.Client(base_url=broker.url, timeout=10) as http:
        # A built-in type every worker lists, and the embedded worker's own for its tenant.
        assert _submit(http, {"type": "noop", "tenant": "bob"}).status_code == 201
        own = _submit(http, {"type": "alice.report", "tenant": "alice"})
        assert own.status_code == 201, own.text
        done = http.get(f"/api/v1/tasks/{own.json()['id']}", params={"wait_s": 20}).json()
        assert (done["state"], done["result"]) == ("finished", "reported"), done

        message = _refusal(_submit(http, {"type": "sleeep", "tenant": "bob"}))
        assert "'sleeep' is not served" in message, message
        assert "start a worker that registers it" in message and "allow_unknown_type" in message
        # Only alice's dedicated worker serves alice.report: bob is refused, in the same
        # words as for a name nobody serves (nothing of alice's types is shown).
        theirs = _refusal(_submit(http, {"type": "alice.report", "tenant": "bob"}))
        assert theirs == message.replace("sleeep", "alice.report"), theirs
        # A batch and a transaction are checked too; nothing of a refused batch is created.
        batch = {"tenant": "bob", "tasks": [{"type": "noop"}, {"type": "sleeep"}]}
        assert _refusal(_submit(http, batch)).startswith("tasks[1]: task type 'sleeep'")
        txn = http.post("/api/v1/transactions", json={"tenant": "bob"}).json()["id"]
        _refusal(_submit(http, {"type": "sleeep", "tenant": "bob", "transaction": txn}))
        assert http.post(f"/api/v1/transactions/{txn}/rollback").status_code == 200

        # Asked to: accepted (a worker that will register it runs it; the shared worker,
        # which takes any type, may take it first and fail it: docs/API.md, "Task types").
        waiting = _submit(http, {"type": "sleeep", "tenant": "bob", "allow_unknown_type": True})
        assert waiting.status_code == 201, waiting.text
        batch["allow_unknown_type"] = True
        assert _submit(http, batch).status_code == 200
        cancelled = http.post("/api/v1/tasks/cancel", json={"tenant": "bob", "type": "sleeep"})
        assert cancelled.status_code == 200, cancelled.text


def test_the_cli_prints_the_refusal_in_one_line(broker: BrokerProcess) -> None:
    refused = steward("--url", broker.url, "submit", "sleeep", "--tenant", "bob")
    assert refused.code == 1 and refused.err.count("\n") == 1 and not refused.out, refused
    assert refused.err.startswith("steward: ") and "400" in refused.err, refused
    assert "start a worker that registers it" in refused.err, refused
    assert "--allow-unknown-type" in refused.err and "usage:" not in refused.err, refused
    accepted = steward(
        "--url", broker.url, "submit", "sleeep", "--tenant", "bob", "--allow-unknown-type"
    )
    assert accepted.code == 0 and accepted.out.strip().isdigit(), accepted
