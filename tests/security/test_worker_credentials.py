"""Issue 14, item 5: worker credentials a task can't use, and that can't do much.

- The worker token comes from a file or the environment, never the command line, and the
  worker removes it from its environment (a real broker and real workers: their
  ``/proc/PID/cmdline`` and what a task and its child processes see); the command-line
  flags still work but warn.
- A scoped worker credential (``steward token create NAME --worker --tenants a``) cannot
  register to serve another tenant nor receive its tasks; a second live connection for a
  connected worker id is refused (a reconnect once it is gone still works); a worker id
  stays bound to its credential; a revoked credential loses its connection.
- A worker credential downloads only the code of tasks currently running on its own
  workers; reports are accepted only from the connection the attempt is assigned to.

The protocol-level tests run a Node on in-memory ledgers with a WorkerLink and the HTTP
API in process, driven by :class:`tests.support.fake_worker.FakeWorker`; every wait is bounded.
"""

from __future__ import annotations

import hashlib
import logging
import os
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from broker.core import TaskState, WorkerState
from clients import cli
from clients.worker.__main__ import build_parser, worker_token
from tests.support.fake_worker import FakeWorker
from tests.support.procs import HOST, authenticated_broker
from tests.support.secured_link import (
    SecuredBroker,
    secured_broker,
)
from tests.support.worker_procs import WorkerProcess
from wire import worker_protocol as p

ADMIN = "admin-secret-for-the-credentials-test"
SHARED = "shared-worker-token-for-the-test"
PEER = "peer-secret-for-the-test"


@pytest.fixture
async def broker(tmp_path: Path) -> AsyncIterator[SecuredBroker]:
    async with secured_broker(
        tmp_path, admin=ADMIN, worker_token=SHARED, peer=PEER, code_store=True, hello_timeout_s=2.0
    ) as harness:
        yield harness


async def refused(worker: FakeWorker, code: str) -> p.Error:
    """The broker answers the connection with an Error frame of ``code`` and closes it."""
    error = await worker.expect(p.Error)
    assert error.code == code, error
    assert error.message
    await worker.wait_closed_by_peer()
    return error


def hello(worker: FakeWorker, running: tuple[tuple[int, int], ...] = ()) -> None:
    """Send a Hello without waiting for the answer."""
    worker.send(
        p.Hello(
            worker_id=worker.worker_id,
            process_id=worker.process_id,
            task_types=dict(worker.task_types),
            tenants=worker.tenants,
            running=tuple(p.TaskAttempt(t, a) for t, a in running),
            token=worker.token,
        )
    )


# --- the token never on a command line, gone from the environment -------------------------------

JOB = b"""\
import os
import subprocess
import sys


def run(params, ctx):
    # What a task can see: its environment, and a child process's.
    child = subprocess.run(
        [sys.executable, "-c", "import os, json; print(json.dumps(dict(os.environ)))"],
        capture_output=True, text=True, timeout=60, check=True,
    )
    return {"environ": dict(os.environ), "child_environ": child.stdout}
"""


def test_worker_token_from_a_file_or_the_environment_is_out_of_a_tasks_reach(
    tmp_path: Path,
) -> None:
    with authenticated_broker(tmp_path, admin_token=ADMIN, worker_token=SHARED) as auth:
        broker, http, token_file, worker_port = (
            auth.broker,
            auth.http,
            auth.worker_token_file,
            auth.worker_port,
        )
        workers: list[WorkerProcess] = []
        try:
            # One worker reads the token from a file, the other from the environment.
            for worker_id, tenant, args, extra_env in (
                ("from-file", "a", ("--token-file", str(token_file)), {}),
                ("from-env", "b", (), {"STEWARD_WORKER_TOKEN": SHARED}),
            ):
                worker = WorkerProcess(
                    broker=f"{HOST}:{worker_port}",
                    http_url=broker.url,
                    worker_id=worker_id,
                    log_dir=tmp_path / "logs",
                    cache_dir=tmp_path / "cache" / worker_id,
                    extra_args=(*args, "--tenant", tenant),
                    env=extra_env,
                ).start()
                workers.append(worker)
                worker.wait_connected(http)

            for pid in (broker.pid, *(w.proc.pid for w in workers if w.proc is not None)):
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
                assert SHARED.encode() not in cmdline, cmdline
                assert ADMIN.encode() not in cmdline, cmdline

            uploaded = http.post("/api/v1/code", params={"name": "job.py"}, content=JOB)
            assert uploaded.status_code == 201, uploaded.text
            sha = uploaded.json()["sha256"]
            ids = []
            for tenant in ("a", "b"):
                task = {"type": "job:run", "tenant": tenant, "code": sha}
                submitted = http.post("/api/v1/tasks", json=task)
                assert submitted.status_code == 201, submitted.text
                ids.append(submitted.json()["id"])
            for task_id, worker in zip(ids, workers, strict=True):
                done = http.get(f"/api/v1/tasks/{task_id}", params={"wait_s": 60}, timeout=90)
                body = done.json()
                assert body["state"] == "finished", (body, worker.log_tail())
                assert body["worker"] == worker.worker_id
                seen = body["result"]
                assert "STEWARD_WORKER_TOKEN" not in seen["environ"]
                assert SHARED not in repr(seen["environ"])
                assert SHARED not in seen["child_environ"]
        except BaseException:
            for worker in workers:
                print(worker.log_tail())
            print(broker.log_tail())
            raise
        finally:
            for worker in workers:
                worker.stop()


def test_the_worker_removes_the_token_from_its_environment(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("STEWARD_WORKER_TOKEN", SHARED)
    assert worker_token(build_parser().parse_args([])) == SHARED
    assert "STEWARD_WORKER_TOKEN" not in os.environ
    assert capsys.readouterr().err == ""


def test_a_token_on_the_command_line_still_works_but_warns(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # The worker.
    assert worker_token(build_parser().parse_args(["--token", SHARED])) == SHARED
    warning = capsys.readouterr().err
    assert len(warning.splitlines()) == 1, warning
    assert "--token" in warning and "--token-file" in warning
    assert "STEWARD_WORKER_TOKEN" in warning and SHARED not in warning
    # ... and the brokers' --worker-token and --cluster-token.
    admin_file = tmp_path / "admin"
    admin_file.write_text(ADMIN)
    args = cli.build_parser().parse_args(
        [
            "standalone",
            "--admin-token-file",
            str(admin_file),
            "--worker-token",
            SHARED,
            "--cluster-token",
            PEER,
        ]
    )
    auth = cli._auth_config(args)
    assert auth.enabled and args.worker_token == SHARED and args.cluster_token == PEER
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 2, lines
    assert "--worker-token-file" in lines[0] and "--cluster-token-file" in lines[1]
    assert all(line.startswith("steward: warning: ") for line in lines)
    # A file and the flag at once: a usage error, not a guess.
    token_file = tmp_path / "token"
    token_file.write_text(SHARED)
    with pytest.raises(ValueError, match="not both"):
        worker_token(build_parser().parse_args(["--token", "x", "--token-file", str(token_file)]))


def test_the_token_file_option_reads_the_first_line(tmp_path: Path) -> None:
    token_file = tmp_path / "token"
    token_file.write_text(f"  {SHARED}  \nsecond line\n")
    args = build_parser().parse_args(["--worker-token-file", str(token_file)])
    assert worker_token(args) == SHARED
    empty = tmp_path / "empty"
    empty.write_text("\n")
    with pytest.raises(ValueError, match="holds no token"):
        worker_token(build_parser().parse_args(["--token-file", str(empty)]))


# --- scoped credentials ------------------------------------------------------------------------


async def test_a_scoped_credential_serves_its_tenants_only(broker: SecuredBroker) -> None:
    secret = await broker.worker_credential("for-a", ["a"])
    whoami = await broker.call(secret, "GET", "/api/v1/whoami")
    assert whoami.json()["role"] == "worker"

    # Asking to serve b (alone or besides a) is refused with a clear error frame.
    for tenants in (("b",), ("a", "b")):
        greedy = broker.worker("greedy", token=secret, tenants=tenants)
        await greedy.connect()
        hello(greedy)
        error = await refused(greedy, "forbidden")
        assert "b" in error.message
    assert "greedy" not in broker.node.state.workers

    # Asking for every tenant narrows to the credential's.
    scoped = broker.worker("scoped", token=secret, task_types={"*": 10})
    await scoped.hello()
    assert broker.node.state.workers["scoped"].tenants == ["a"]
    b_task = await broker.submit("b")
    a_task = await broker.submit("a")
    assign = await scoped.expect(p.Assign)
    assert [t.task_id for t in assign.tasks] == [a_task]
    await scoped.expect_none(p.Assign, within=0.3)
    assert broker.state_of(b_task) == (TaskState.WAITING, None)

    # The shared token (legacy, unscoped) still works and gets b's task.
    legacy = broker.worker("legacy", token=SHARED)
    await legacy.hello()
    assert [t.task_id for t in (await legacy.expect(p.Assign)).tasks] == [b_task]

    # A token that is no worker credential cannot connect as a worker.
    tenant_token = (
        await broker.call(
            ADMIN, "POST", "/api/v1/tokens", json={"name": "t", "role": "tenant", "tenant": "a"}
        )
    ).json()["token"]
    for token in (tenant_token, ADMIN, "stw_guessed"):
        intruder = broker.worker("intruder", token=token)
        await intruder.connect()
        hello(intruder)
        await refused(intruder, "unauthorized")


async def test_token_api_validates_worker_credentials(broker: SecuredBroker) -> None:
    for body in (
        {"name": "x", "role": "tenant", "tenant": "a", "tenants": ["a"]},
        {"name": "x", "role": "worker", "tenant": "a"},
        {"name": "x", "role": "worker", "tenants": ["bad name"]},
        {"name": "x", "role": "worker", "tenants": ["a", "a"]},
        {"name": "x", "role": "worker", "tenants": "a"},
    ):
        response = await broker.call(ADMIN, "POST", "/api/v1/tokens", json=body)
        assert response.status_code == 400, (body, response.text)
        assert set(response.json()) == {"error"}
    listed = await broker.call(ADMIN, "GET", "/api/v1/tokens")
    assert listed.json()["tokens"] == []
    await broker.worker_credential("scoped", ["a", "b"])
    [view] = (await broker.call(ADMIN, "GET", "/api/v1/tokens")).json()["tokens"]
    assert (view["role"], view["tenants"]) == ("worker", ["a", "b"])
    # Worker credentials live in the replicated state: snapshots and digests carry them.
    from broker.core import StateMachine

    state = broker.node.state
    reloaded = StateMachine.from_snapshot(state.encode_snapshot())
    assert [t.tenants for t in reloaded.tokens.values()] == [["a", "b"]]
    assert reloaded.digest() == state.digest()


async def test_a_second_live_connection_for_a_worker_id_is_refused(broker: SecuredBroker) -> None:
    secret = await broker.worker_credential("w")
    first = broker.worker("w1", token=secret, process_id="proc-1")
    await first.hello()
    task_id = await broker.submit("a")
    await first.expect(p.Assign)

    # Same id, same or another credential (or the shared token): refused, no take-over.
    for token in (secret, SHARED, await broker.worker_credential("other")):
        thief = broker.worker("w1", token=token, process_id="proc-thief")
        await thief.connect()
        hello(thief, running=((task_id, 1),))
        error = await refused(thief, "worker_id_in_use")
        assert "w1" in error.message
    assert broker.node.state.workers["w1"].process_id == "proc-1"
    assert not first.closed_by_peer
    assert broker.state_of(task_id) == (TaskState.RUNNING, "w1")

    # Once the connection is gone, the worker reconnects with its id and keeps its task.
    await first.close()
    await broker.until(lambda: "w1" not in broker.link.sessions)
    again = broker.worker("w1", token=secret, process_id="proc-1")
    welcome = await again.hello(running=[(task_id, 1)])
    assert [(k.task_id, k.attempt) for k in welcome.keep] == [(task_id, 1)]

    # While the state counts it connected, the id stays bound to its credential: another
    # credential may not claim it (and its running task) even with the connection gone.
    await again.close()
    await broker.until(lambda: "w1" not in broker.link.sessions)
    other = broker.worker("w1", token=SHARED, process_id="proc-1")
    await other.connect()
    hello(other, running=((task_id, 1),))
    await refused(other, "worker_id_in_use")
    assert broker.node.state.workers["w1"].credential is not None
    assert broker.state_of(task_id) == (TaskState.RUNNING, "w1")


async def test_a_revoked_worker_credential_loses_its_connection(broker: SecuredBroker) -> None:
    secret = await broker.worker_credential("short-lived")
    worker = broker.worker("w1", token=secret)
    await worker.hello()
    [token_id] = broker.node.state.tokens
    revoked = await broker.call(ADMIN, "DELETE", f"/api/v1/tokens/{token_id}")
    assert revoked.status_code == 200
    await refused(worker, "unauthorized")
    again = broker.worker("w1-again", token=secret)
    await again.connect()
    hello(again)
    await refused(again, "unauthorized")


# --- artifacts --------------------------------------------------------------------------------


async def test_a_worker_credential_downloads_only_code_assigned_to_its_workers(
    broker: SecuredBroker,
) -> None:
    code_a = await broker.upload(b"def run(params, ctx):\n    return 'a'\n")
    code_b = await broker.upload(b"def run(params, ctx):\n    return 'b'\n")
    secret = await broker.worker_credential("for-a", ["a"])
    bystander = await broker.worker_credential("bystander")

    async def status(token: str, sha: str) -> int:
        response = await broker.call(token, "GET", f"/api/v1/code/{sha}")
        if response.status_code != 200:
            assert set(response.json()) == {"error"}, response.text
            assert response.json()["error"]["code"] == "not_found"
        else:
            assert hashlib.sha256(response.content).hexdigest() == sha
        return response.status_code

    async def listed(token: str) -> list[str]:
        response = await broker.call(token, "GET", "/api/v1/code")
        return [a["sha256"] for a in response.json()["artifacts"]]

    # Nothing assigned to anybody: no worker credential reads any code.
    for token in (secret, bystander, SHARED):
        assert await status(token, code_a) == 404
        assert await listed(token) == []

    worker = broker.worker("w1", token=secret)
    await worker.hello()
    task_a = await broker.submit("a", code=code_a)
    await broker.submit("b", code=code_b)  # waits: no worker serves b
    await worker.expect(p.Assign)
    assert await status(secret, code_a) == 200
    assert await listed(secret) == [code_a]
    assert await status(secret, code_b) == 404
    # Another credential, and the shared token with no worker of its own, read nothing.
    for token in (bystander, SHARED):
        assert await status(token, code_a) == 404

    # Once the task is over, its code is out of reach again.
    worker.finish_ok(task_a, 1)
    await worker.expect(p.FinishAck)
    assert broker.state_of(task_a)[0] == TaskState.FINISHED
    assert await status(secret, code_a) == 404

    # The shared token reads the code of tasks running on workers connected with it.
    legacy = broker.worker("legacy", token=SHARED)
    await legacy.hello()
    await legacy.expect(p.Assign)
    assert await status(SHARED, code_b) == 200
    assert await status(secret, code_b) == 404
    assert broker.node.state.workers["legacy"].state == WorkerState.CONNECTED


# --- reports ------------------------------------------------------------------------------------


async def test_reports_are_accepted_only_from_the_attempts_connection(
    broker: SecuredBroker, caplog: pytest.LogCaptureFixture
) -> None:
    secret = await broker.worker_credential("w")
    owner = broker.worker("w1", token=secret, task_types={"*": 1})
    await owner.hello()
    task_id = await broker.submit("a")
    await owner.expect(p.Assign)

    # Another worker's connection reports it: refused (and logged with its address).
    other = broker.worker("w2", token=secret)
    await other.hello()
    with caplog.at_level(logging.WARNING, logger="broker.workers.worker_link"):
        other.finish_ok(task_id, 1, b'"forged"')
        await other.expect(p.FinishAck)
    assert broker.state_of(task_id) == (TaskState.RUNNING, "w1")
    assert any("refused a report" in r.getMessage() for r in caplog.records)
    assert any("127.0.0.1" in r.getMessage() for r in caplog.records)

    # A second connection claiming the owner's id (let in, it would take the live one over
    # and report as it) is refused before it can report; a Finish without a Hello too.
    thief = broker.worker("w1", token=secret, process_id="proc-thief")
    await thief.connect()
    hello(thief, running=((task_id, 1),))
    await refused(thief, "worker_id_in_use")
    sneaky = broker.worker("w1", token=secret)
    await sneaky.connect()
    sneaky.finish_ok(task_id, 1, b'"forged"')
    await refused(sneaky, "bad_handshake")
    assert broker.state_of(task_id) == (TaskState.RUNNING, "w1")

    # The owner's own report is applied.
    owner.finish_ok(task_id, 1, b'"mine"')
    await owner.expect(p.FinishAck)
    task = broker.node.state.tasks[task_id]
    assert (task.state, task.result) == (TaskState.FINISHED, b'"mine"')


async def test_snapshots_from_before_worker_credentials_still_load(broker: SecuredBroker) -> None:
    """Tokens and workers of older snapshots lack the trailing ``tenants`` / ``credential``
    fields: they load as unscoped tokens and shared-token workers."""
    import msgspec

    from broker.core import StateMachine

    await broker.call(ADMIN, "POST", "/api/v1/tokens", json={"name": "t", "tenant": "a"})
    worker = broker.worker("w1", token=SHARED)
    await worker.hello()
    body = msgspec.msgpack.decode(broker.node.state.encode_snapshot())
    body["tokens"] = [token[:-1] for token in body["tokens"]]
    body["workers"] = [w[:-1] for w in body["workers"]]
    old = StateMachine.from_snapshot(msgspec.msgpack.encode(body))
    [token] = old.tokens.values()
    assert (token.role, token.tenant, token.tenants) == ("tenant", "a", [])
    assert old.workers["w1"].credential is None
    old.check_invariants()
