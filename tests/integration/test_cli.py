"""The ``steward`` command line against a real ``steward standalone`` subprocess.

Client commands run as subprocesses with ``--url``; the tests check what a user
reads (stdout, stderr) and the exit codes: 0 on success, 1 for an error answered by
the broker or an unreachable broker, 2 for a usage error. Every wait is bounded and
every broker subprocess is killed when its test or test class ends.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.procs import HOST, BrokerProcess, free_port, get_digest, steward_command

START_TIMEOUT_S = 20.0
STOP_TIMEOUT_S = 15.0
CLI_TIMEOUT_S = 20.0


def run_cli(
    *args: str, url: str | None, timeout_s: float = CLI_TIMEOUT_S
) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "STEWARD_URL"}
    env["PYTHONUNBUFFERED"] = "1"
    command = [*steward_command(), *(["--url", url] if url is not None else []), *args]
    return subprocess.run(
        command,
        capture_output=True,
        text=True,
        timeout=timeout_s,
        env=env,
        stdin=subprocess.DEVNULL,
        check=False,
    )


def ok(result: subprocess.CompletedProcess[str]) -> str:
    assert result.returncode == 0, (result.returncode, result.stdout, result.stderr)
    assert "Traceback" not in result.stderr
    return result.stdout


def failed(result: subprocess.CompletedProcess[str], code: int) -> str:
    """Assert a clean failure (exit code, a message, no traceback); return stderr."""
    assert result.returncode == code, (result.returncode, result.stdout, result.stderr)
    assert "Traceback" not in result.stderr + result.stdout
    assert result.stderr.strip()
    return result.stderr


@pytest.fixture(scope="class")
def broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BrokerProcess]:
    # Class scope: it is stopped before the lifecycle test starts its own broker, so this
    # module never runs two brokers at once (a listener on a fixed default port, such as
    # the worker link's, would make the second one fail).
    base = tmp_path_factory.mktemp("cli-broker")
    with BrokerProcess(base / "data", log_path=base / "broker.log") as proc:
        proc.start(START_TIMEOUT_S)
        yield proc


class Cli:
    def __init__(self, url: str) -> None:
        self.url = url

    def __call__(self, *args: str) -> subprocess.CompletedProcess[str]:
        return run_cli(*args, url=self.url)

    def submit(self, *args: str) -> int:
        out = ok(self("submit", *args)).strip()
        assert re.fullmatch(r"\d+", out), out
        return int(out)

    def task_json(self, task_id: int) -> dict[str, Any]:
        task: dict[str, Any] = json.loads(ok(self("task", str(task_id), "--json")))
        return task

    def tasks_json(self, *args: str) -> dict[str, Any]:
        listing: dict[str, Any] = json.loads(ok(self("tasks", "--json", *args)))
        return listing


@pytest.fixture
def cli(broker: BrokerProcess) -> Cli:
    assert broker.running(), broker.log_tail()
    return Cli(broker.url)


# --- commands -------------------------------------------------------------------------------


class TestCommands:
    """Client commands against one broker shared by the class."""

    def test_submit_prints_the_id_and_task_shows_the_fields(self, cli: Cli) -> None:
        task_id = cli.submit(
            "noop",
            "--tenant",
            "cli-show",
            "--params",
            '{"n": 1, "s": "x"}',
            "--slot",
            "cli-slot-1",
            "--max-attempts",
            "3",
            "--max-lost",
            "1",
            "--resource",
            "cpu=2",
            "--deadline",
            "2100-01-01T00:00:00Z",
        )
        out = ok(cli("task", str(task_id)))
        fields = dict(
            (name.strip(), value.strip())
            for name, _, value in (line.partition(":") for line in out.splitlines())
        )
        assert fields["id"] == str(task_id)
        assert fields["type"] == "noop"
        assert fields["tenant"] == "cli-show"
        assert fields["state"] == "waiting"
        assert fields["slot"] == "cli-slot-1"
        assert fields["max_attempts"] == "3"
        assert (fields["lost"], fields["max_lost"]) == ("0", "1")
        assert json.loads(fields["params"]) == {"n": 1, "s": "x"}
        assert fields["resources"] == "cpu=2"  # a person's notation, not a Python dict
        assert "deadline:" in out and "2100-01-01T00:00:00.000Z" in out
        shown = cli.task_json(task_id)
        assert shown["id"] == task_id
        assert shown["params"] == {"n": 1, "s": "x"}

    def test_a_bad_max_lost_is_one_line_saying_the_range(self, cli: Cli) -> None:
        stderr = failed(cli("submit", "noop", "--tenant", "cli-show", "--max-lost", "101"), 1)
        assert stderr.startswith("steward: ") and stderr.count("\n") == 1, stderr
        assert "max_lost must be between 0 and 100" in stderr

    def test_submit_count_prints_every_id(self, cli: Cli) -> None:
        out = ok(cli("submit", "batch-type", "--tenant", "cli-count", "--count", "3"))
        ids = [int(line) for line in out.split()]
        assert len(ids) == 3
        assert ids == list(range(ids[0], ids[0] + 3))
        listing = cli.tasks_json("--tenant", "cli-count")
        assert [t["id"] for t in listing["tasks"]] == ids

    def test_submit_delayed(self, cli: Cli) -> None:
        task_id = cli.submit("later", "--tenant", "cli-delay", "--start-after", "4102444800")
        assert cli.task_json(task_id)["state"] == "delayed"

    def test_tasks_table_and_json(self, cli: Cli) -> None:
        out = ok(cli("submit", "table-type", "--tenant", "cli-table", "--count", "3"))
        ids = [int(i) for i in out.split()]
        result = cli("tasks", "--tenant", "cli-table", "--limit", "2")
        lines = ok(result).splitlines()
        header = ["ID", "TYPE", "TENANT", "STATE", "ATTEMPT", "WORKER", "UPDATED_AT"]
        assert lines[0].split() == header
        rows = [line.split() for line in lines[1:3]]
        assert [int(row[0]) for row in rows] == ids[:2]
        for row in rows:
            assert row[1:6] == ["table-type", "cli-table", "waiting", "0", "-"]
            assert re.fullmatch(r"\d{4}-\d\d-\d\dT[\d:.]+Z", row[6])
        assert lines[3:] == []  # the paging hint goes to stderr, not into a pipe
        assert result.stderr == f"(more: steward tasks --after {ids[1]})\n"
        listing = cli.tasks_json(
            "--tenant", "cli-table", "--state", "waiting", "--after", str(ids[0])
        )
        assert [t["id"] for t in listing["tasks"]] == ids[1:]
        assert listing["next_after"] is None

    def test_cancel(self, cli: Cli) -> None:
        task_id = cli.submit("to-cancel", "--tenant", "cli-cancel")
        assert ok(cli("cancel", str(task_id))).strip() == f"task {task_id} cancelled"
        assert cli.task_json(task_id)["state"] == "cancelled"
        stderr = failed(cli("cancel", str(task_id)), 1)
        assert stderr.startswith("steward: ")
        assert "already cancelled" in stderr
        assert "409" in stderr

    def test_tenant_set_and_show(self, cli: Cli) -> None:
        changed = cli("tenant", "cli-tenant", "--max-waiting", "2", "--weight", "1.5", "--json")
        view = json.loads(ok(changed))
        assert view["name"] == "cli-tenant"
        assert view["max_waiting"] == 2
        assert view["weight"] == 1.5
        shown = json.loads(ok(cli("tenant", "cli-tenant", "--json")))
        assert shown == view
        human = ok(cli("tenant", "cli-tenant")).splitlines()
        assert [line.split(": ") for line in human] == [
            ["     tenant", "cli-tenant"],
            ["     weight", "1.5"],
            ["max_running", "0 (unlimited)"],
            ["max_waiting", "2"],
            ["submit_rate", "0 (unlimited)"],
            ["      tasks", "none"],
        ]
        cli.submit("q", "--tenant", "cli-tenant")
        cli.submit("q", "--tenant", "cli-tenant")
        stderr = failed(cli("submit", "q", "--tenant", "cli-tenant"), 1)
        assert "tenant_queue_full" in stderr and "429" in stderr
        stderr = failed(cli("submit", "q", "--tenant", "cli-tenant", "--count", "2"), 1)
        assert stderr.count("steward: ") == 2 and stderr.count("tenant_queue_full") == 2
        stderr = failed(cli("tenant", "cli-unknown-tenant"), 1)
        assert "unknown" in stderr and "404" in stderr

    def test_transaction_begin_commit_and_rollback(self, cli: Cli) -> None:
        def states() -> dict[int, str]:
            return {t["id"]: t["state"] for t in cli.tasks_json("--tenant", "cli-txn")["tasks"]}

        txn = int(ok(cli("txn", "begin", "--tenant", "cli-txn", "--ttl-s", "3600")).strip())
        out = ok(
            cli("submit", "t", "--tenant", "cli-txn", "--transaction", str(txn), "--count", "2")
        )
        inside = [int(i) for i in out.split()]
        assert states() == dict.fromkeys(inside, "pending")
        out = ok(cli("txn", "commit", str(txn))).strip()
        assert out == f"transaction {txn} committed: tasks {', '.join(map(str, inside))}"
        assert states() == dict.fromkeys(inside, "waiting")
        assert "not open" in failed(cli("txn", "commit", str(txn)), 1)

        txn = int(ok(cli("txn", "begin", "--tenant", "cli-txn", "--ttl-s", "7200")).strip())
        dropped = cli.submit("t", "--tenant", "cli-txn", "--transaction", str(txn))
        out = ok(cli("txn", "rollback", str(txn))).strip()
        assert out == f"transaction {txn} rolled_back: tasks {dropped}"
        assert states() == dict.fromkeys(inside, "waiting")  # the dropped task is gone
        assert "needs the transaction id" in failed(cli("txn", "commit"), 2)

    def test_cluster_status_is_status(self, cli: Cli, broker: BrokerProcess) -> None:
        out = ok(cli("cluster", "status"))
        lines = [line for line in out.splitlines() if line]
        assert lines[0] == "cluster standalone  leader standalone  (as seen by standalone)"
        assert lines[1].split() == [
            "ID",
            "URL",
            "ROLE",
            "POSITION",
            "LAG",
            "UPTIME",
            "VERSION",
            "STATE",
        ]
        row = lines[2].split()
        assert row[:3] == ["standalone", f"http://{HOST}:{broker.port}", "standalone"]
        assert re.fullmatch(r"\d+:\d+|empty", row[3]) and row[4] == "0" and row[7] == "ok"
        assert any(line.startswith("tasks: ") and "waiting=" in line for line in lines)
        assert ok(cli("status")).splitlines()[0] == lines[0]
        summary = json.loads(ok(cli("cluster", "status", "--json")))
        assert summary["cluster"]["leader"] == "standalone"
        assert isinstance(summary["tenants"], list)

    def test_digest(self, cli: Cli) -> None:
        out = ok(cli("digest", "--json"))
        digest = json.loads(out)
        assert re.fullmatch(r"[0-9a-f]{64}", digest["digest"]), out
        human = ok(cli("digest"))
        position = f"{digest['position']['ledger_id']}:{digest['position']['entry_id']}"
        assert re.fullmatch(rf"position: {position}\n  digest: {digest['digest']}\n", human)
        assert ok(cli("digest", "--json")) == out  # nothing changed in between
        cli.submit("d", "--tenant", "cli-digest")
        assert ok(cli("digest", "--json")) != out

    # --- errors ------------------------------------------------------------------------------

    def test_unknown_task_is_a_clean_error(self, cli: Cli) -> None:
        stderr = failed(cli("task", "999999"), 1)
        assert stderr.startswith("steward: ")
        assert "task 999999 does not exist" in stderr
        assert "404" in stderr

    def test_invalid_submission_is_a_clean_error(self, cli: Cli) -> None:
        stderr = failed(cli("submit", "bad type"), 1)
        assert stderr.startswith("steward: ") and "type must be" in stderr and "400" in stderr
        stderr = failed(cli("submit", "t", "--deadline", "2100-01-01T00:00:00"), 1)
        assert "time zone" in stderr

    def test_usage_errors_exit_2(self, cli: Cli) -> None:
        cases: list[tuple[tuple[str, ...], str]] = [
            (("submit", "t", "--params", "not json"), "not valid JSON"),
            (("submit", "t", "--resource", "cpu"), "NAME=AMOUNT"),
            (("submit", "t", "--count", "0"), "--count"),
            (("task", "abc"), "invalid int value"),
            (("txn", "pause"), "invalid choice"),
            (("frobnicate",), "invalid choice"),
            ((), "required"),
        ]
        # Independent processes: run them at once to keep the test fast.
        with ThreadPoolExecutor(max_workers=len(cases)) as pool:
            results = list(pool.map(lambda case: cli(*case[0]), cases))
        for (args, fragment), result in zip(cases, results, strict=True):
            stderr = failed(result, 2)
            assert fragment in stderr, (args, stderr)
            assert result.stdout == "", args


def test_unreachable_broker_is_a_clean_error() -> None:
    url = f"http://{HOST}:{free_port()}"
    result = run_cli("task", "1", url=url)
    stderr = failed(result, 1)
    assert stderr.startswith(f"steward: no Steward broker at {url} (got connection refused)")
    result = run_cli("submit", "t", "--failover-timeout-s", "1", url=url)
    assert f"no Steward broker at {url} (got connection refused)" in failed(result, 1)


def test_bad_url_is_a_clean_error() -> None:
    stderr = failed(run_cli("cluster", "status", url="not a url"), 1)
    assert stderr.startswith("steward: ")


# --- broker lifecycle ----------------------------------------------------------------------


def test_sigterm_restart_and_data_dir_lock(tmp_path: Path) -> None:
    data_dir = tmp_path / "data"
    with BrokerProcess(data_dir, log_path=tmp_path / "broker.log") as proc:
        proc.start(START_TIMEOUT_S)
        # Set up and compare over HTTP (the commands are covered above: fewer processes).
        with httpx.Client(base_url=proc.url, timeout=CLI_TIMEOUT_S) as http:
            body = {"tasks": [{"type": "keep"}] * 3 + [{"type": "gone"}]}
            ids = [t["id"] for t in http.post("/api/v1/tasks", json=body).json()["tasks"]]
            cancelled = ids.pop()
            assert http.post(f"/api/v1/tasks/{cancelled}/cancel").status_code == 200
            assert http.put("/api/v1/tenants/kept", json={"max_waiting": 7}).status_code == 200
            before = get_digest(http)

            # A second broker on the same data dir refuses to start, with a clear message.
            second = run_cli(
                "standalone",
                "--data-dir",
                str(data_dir),
                "--http",
                f"{HOST}:{free_port()}",
                url=None,
                timeout_s=START_TIMEOUT_S,
            )
            stderr = failed(second, 2)
            assert "in use" in stderr
            assert str(data_dir) in stderr
            assert proc.running()
            assert get_digest(http) == before

        log_offset = len(proc.log_text())
        started = time.monotonic()
        assert proc.terminate(STOP_TIMEOUT_S) == 0, proc.log_tail()
        assert time.monotonic() - started < STOP_TIMEOUT_S
        shutdown_log = proc.log_text()[log_offset:]
        assert "Traceback" not in shutdown_log, shutdown_log

        proc.start(START_TIMEOUT_S)
        cli = Cli(proc.url)
        tasks = {t["id"]: t for t in cli.tasks_json()["tasks"]}
        assert sorted(tasks) == [*ids, cancelled]
        assert {tasks[i]["state"] for i in ids} == {"waiting"}
        assert tasks[cancelled]["state"] == "cancelled"
        with httpx.Client(base_url=proc.url, timeout=CLI_TIMEOUT_S) as http:
            assert get_digest(http)["digest"] == before["digest"]
            assert http.get("/api/v1/tenants/kept").json()["max_waiting"] == 7
            # Ids keep increasing after the restart.
            assert http.post("/api/v1/tasks", json={"type": "new"}).json()["id"] > cancelled
        assert proc.terminate(STOP_TIMEOUT_S) == 0, proc.log_tail()
