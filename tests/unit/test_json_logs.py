"""Structured logs (broker/observability/logs.py): the JSON and text formatters, the
--log-format option, and that every task-related line of the broker
(broker/observability/task_log.py) and the worker carries task_id and tenant."""

from __future__ import annotations

import io
import json
import logging
import re
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from broker.core import entries as e
from broker.observability.logs import JsonFormatter, TextFormatter, setup_logging, task_fields
from broker.observability.node_observer import observe_node
from broker.replication.node import Node, NodeConfig, Stamp
from clients import cli
from clients.worker import __main__ as worker_main
from clients.worker.runtime.task_runtime import make_task_logger
from log.memory import MemoryLedgerListStore, MemoryLedgerStore
from snapshot.store import SnapshotStore

TS_RE = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z$")


def record(
    message: str, *args: object, extra: dict[str, Any] | None = None, exc: bool = False
) -> logging.LogRecord:
    logger = logging.Logger("steward.test")
    exc_info = None
    if exc:
        try:
            raise ValueError("boom")
        except ValueError:
            exc_info = sys.exc_info()
    return logger.makeRecord(
        "steward.test", logging.WARNING, __file__, 1, message, args, exc_info, extra=extra
    )


def test_json_formatter_writes_one_object_per_line_with_the_fields() -> None:
    formatter = JsonFormatter({"broker": "b1"})
    line = formatter.format(
        record(
            "task %d failed\nsecond line",
            12,
            extra={**task_fields(12, "acme", attempt=2), "path": Path("/x")},
            exc=True,
        )
    )
    assert "\n" not in line
    body = json.loads(line)
    assert TS_RE.match(body["ts"]), body["ts"]
    assert body["level"] == "WARNING"
    assert body["logger"] == "steward.test"
    assert body["message"] == "task 12 failed\nsecond line"
    assert body["task_id"] == 12 and body["tenant"] == "acme" and body["attempt"] == 2
    assert body["broker"] == "b1"
    assert body["path"] == "/x"  # not JSON by itself: shown as text
    assert body["exception"].startswith("Traceback") and "ValueError: boom" in body["exception"]


def test_json_formatter_without_extras_has_only_the_standard_keys() -> None:
    body = json.loads(JsonFormatter().format(record("plain %s", "line")))
    assert set(body) == {"ts", "level", "logger", "message"}
    assert body["message"] == "plain line"


def test_text_formatter_shows_task_and_tenant() -> None:
    text = TextFormatter({"broker": "b1"}).format(
        record("task %d failed", 12, extra=task_fields(12, "acme"))
    )
    assert text.endswith("WARNING [b1] steward.test: task 12 failed task=12 tenant=acme"), text
    plain = TextFormatter().format(record("no task here"))
    assert plain.endswith("WARNING steward.test: no task here"), plain


def test_log_format_option_and_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("STEWARD_LOG_FORMAT", raising=False)
    args = cli.build_parser().parse_args(["standalone", "--log-format", "json"])
    assert args.log_format == "json"
    broker = ["broker", "--zookeeper", "zk:2181", "--broker-id", "b1", "--data-dir", "d"]
    assert cli.build_parser().parse_args(broker).log_format == "text"
    assert cli.build_parser().parse_args([*broker, "--log-format", "json"]).log_format == "json"
    assert cli.build_parser().parse_args(["cluster", "up", "--log-format", "json"]).log_format
    assert worker_main.build_parser().parse_args(["--log-format", "json"]).log_format == "json"
    monkeypatch.setenv("STEWARD_LOG_FORMAT", "json")
    assert cli.build_parser().parse_args(["standalone"]).log_format == "json"
    assert worker_main.build_parser().parse_args([]).log_format == "json"


def test_a_bad_log_format_is_a_clear_usage_error(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        cli.build_parser().parse_args(["standalone", "--log-format", "xml"])
    assert exited.value.code == 2
    assert "log format must be one of text, json, not 'xml'" in capsys.readouterr().err
    monkeypatch.setenv("STEWARD_LOG_FORMAT", "yaml")
    with pytest.raises(SystemExit):
        worker_main.build_parser().parse_args([])
    err = capsys.readouterr().err
    assert "'yaml'" in err and "Traceback" not in err


@pytest.fixture
def json_log() -> Iterator[io.StringIO]:
    """Root logging to a buffer in JSON at DEBUG (restored afterwards)."""
    root = logging.getLogger()
    saved = (root.handlers[:], root.level)
    stream = io.StringIO()
    setup_logging("DEBUG", "json", static_fields={"broker": "unit"}, stream=stream)
    try:
        yield stream
    finally:
        root.handlers[:] = saved[0]
        root.setLevel(saved[1])


def lines_of(stream: io.StringIO) -> list[dict[str, Any]]:
    return [json.loads(line) for line in stream.getvalue().splitlines()]


@pytest.fixture
async def node(tmp_path: Path) -> AsyncIterator[Node]:
    node = Node(
        NodeConfig(data_dir=tmp_path, timer_poll_interval_s=3600.0),
        ledgers=MemoryLedgerStore(),
        ledger_list=MemoryLedgerListStore(),
        snapshots=SnapshotStore(tmp_path / "snapshots"),
    )
    observe_node(node)
    await node.start()
    try:
        yield node
    finally:
        await node.stop(snapshot=False)
        await node.ledgers.close()


async def test_every_task_line_of_the_leader_carries_task_id_and_tenant(
    node: Node, json_log: io.StringIO
) -> None:
    def submit(tenant: str, max_attempts: int = 1, track_tree: bool = False) -> Any:
        def build(stamp: Stamp) -> e.Entry:
            [task_id] = stamp.task_ids(1)
            spec = e.TaskSpec(
                id=task_id,
                type="noop",
                tenant=tenant,
                max_attempts=max_attempts,
                track_tree=track_tree,
            )
            return e.SubmitTasks(time_ms=stamp.now_ms, tasks=(spec,))

        return node.propose(build)

    async def finish(task_id: int, ok: bool, attempt: int = 1) -> None:
        outcome = e.TaskOutcome(
            task_id=task_id,
            worker_id="w",
            attempt=attempt,
            ok=ok,
            result=b"null" if ok else None,
            error=None if ok else "ValueError: boom\n\nTraceback (most recent call last): ...",
        )
        await node.propose(lambda s: e.FinishTasks(time_ms=s.now_ms, outcomes=(outcome,)))

    async def assign(*ids: int) -> None:
        batch = tuple(e.Assignment(i, "w") for i in ids)
        await node.propose(lambda s: e.AssignTasks(time_ms=s.now_ms, assignments=batch))

    ok, failing, retried, cancelled, root = range(1, 6)
    await submit("acme")
    await submit("acme")
    await submit("beta", max_attempts=2)
    await submit("acme")
    await submit("gamma", track_tree=True)
    await node.propose(
        lambda s: e.RegisterWorker(time_ms=s.now_ms, worker_id="w", task_types={"*": 10})
    )
    await assign(ok, failing, retried, root, 999)  # 999: refused, no such task
    await finish(ok, True)
    await finish(failing, False)
    await finish(retried, False)
    await finish(ok, True)  # stale: refused
    await node.propose(lambda s: e.CancelTask(time_ms=s.now_ms, task_id=cancelled, reason="no"))
    await finish(root, True)  # its tree completes

    task_lines = [line for line in lines_of(json_log) if line["logger"] == "steward.tasks"]
    for line in task_lines:
        assert isinstance(line["task_id"], int) and isinstance(line["tenant"], str), line
        assert line["broker"] == "unit"
    events = {(line["task_id"], line["message"].split(":")[0]) for line in task_lines}
    expected = {
        (ok, f"task {ok} assigned to worker w"),
        (ok, f"task {ok} finished on worker w"),
        (ok, f"report of task {ok} refused"),
        (failing, f"task {failing} failed for good after 1 attempts"),
        (retried, f"task {retried} attempt 1 failed on worker w, retrying (2 attempts allowed)"),
        (cancelled, f"task {cancelled} cancelled"),
        (999, "assignment of task 999 refused"),
        (root, f"task tree of root {root} completed (run 1)"),
    }
    assert expected <= events, sorted(events)
    tenants = {line["task_id"]: line["tenant"] for line in task_lines}
    assert tenants[retried] == "beta" and tenants[root] == "gamma" and tenants[ok] == "acme"
    failed = next(line for line in task_lines if "failed for good" in line["message"])
    assert failed["level"] == "INFO" and "Traceback" not in failed["message"]


async def test_a_given_back_attempt_is_logged_as_such_not_as_a_failure(
    node: Node, json_log: io.StringIO
) -> None:
    def build(stamp: Stamp) -> e.Entry:
        [task_id] = stamp.task_ids(1)
        spec = e.TaskSpec(id=task_id, type="noop", tenant="acme", max_attempts=1)
        return e.SubmitTasks(time_ms=stamp.now_ms, tasks=(spec,))

    await node.propose(build)
    await node.propose(
        lambda s: e.RegisterWorker(time_ms=s.now_ms, worker_id="w", task_types={"*": 1})
    )
    await node.propose(
        lambda s: e.AssignTasks(time_ms=s.now_ms, assignments=(e.Assignment(1, "w"),))
    )
    outcome = e.TaskOutcome(
        task_id=1,
        worker_id="w",
        attempt=1,
        ok=False,
        error="given back: worker stopping",
        released=True,
    )
    await node.propose(lambda s: e.finish_tasks(s.now_ms, (outcome,)))

    task_lines = [line for line in lines_of(json_log) if line["logger"] == "steward.tasks"]
    [given_back] = [line for line in task_lines if line["level"] == "INFO"]
    assert given_back["message"] == (
        "task 1 attempt 1 given back by worker w (not counted against the 1 attempts "
        "allowed); queued again: worker stopping"
    )
    assert (given_back["task_id"], given_back["tenant"], given_back["attempt"]) == (1, "acme", 1)
    assert given_back["broker"] == "unit"
    assert not [line for line in task_lines if "failed" in line["message"]]


async def test_an_attempt_lost_with_its_worker_is_logged_as_not_counted(
    node: Node, json_log: io.StringIO
) -> None:
    def build(stamp: Stamp) -> e.Entry:
        [task_id] = stamp.task_ids(1)
        return e.SubmitTasks(
            time_ms=stamp.now_ms, tasks=(e.TaskSpec(id=task_id, type="noop", tenant="acme"),)
        )

    await node.propose(build)
    await node.propose(
        lambda s: e.RegisterWorker(time_ms=s.now_ms, worker_id="w", task_types={"*": 1})
    )
    await node.propose(
        lambda s: e.AssignTasks(time_ms=s.now_ms, assignments=(e.Assignment(1, "w"),))
    )
    await node.propose(lambda s: e.WorkerDead(time_ms=s.now_ms, worker_id="w", reason="gone", v=5))

    task_lines = [line for line in lines_of(json_log) if line["logger"] == "steward.tasks"]
    [lost] = [line for line in task_lines if line["level"] == "INFO"]
    assert lost["message"] == (
        "task 1 attempt 1 lost with worker w (lost 1 of max_lost 3, not counted against the "
        "1 attempts allowed); queued again: worker w died: gone"
    )
    assert (lost["task_id"], lost["tenant"], lost["attempt"]) == (1, "acme", 1)


async def test_a_retry_delayed_by_its_backoff_is_logged_with_its_delay(
    node: Node, json_log: io.StringIO
) -> None:
    def build(stamp: Stamp) -> e.Entry:
        [task_id] = stamp.task_ids(1)
        spec = e.TaskSpec(
            id=task_id, type="noop", tenant="acme", max_attempts=3, retry_backoff_ms=4000
        )
        return e.SubmitTasks(time_ms=stamp.now_ms, tasks=(spec,), v=e.submit_version((spec,)))

    await node.propose(build)
    await node.propose(
        lambda s: e.RegisterWorker(time_ms=s.now_ms, worker_id="w", task_types={"*": 1})
    )
    await node.propose(
        lambda s: e.AssignTasks(time_ms=s.now_ms, assignments=(e.Assignment(1, "w"),))
    )
    outcome = e.TaskOutcome(task_id=1, worker_id="w", attempt=1, ok=False, error="boom")
    await node.propose(lambda s: e.finish_tasks(s.now_ms, (outcome,)))

    assert node.state.tasks[1].state == "delayed"
    task_lines = [line for line in lines_of(json_log) if line["logger"] == "steward.tasks"]
    [retry] = [line for line in task_lines if line["level"] == "INFO"]
    # 4 s for retry 1, with up to +-25 % jitter (broker/core/backoff.py).
    prefix = "task 1 attempt 1 failed on worker w, retrying in "
    assert retry["message"].startswith(prefix), retry["message"]
    delay_s = float(retry["message"][len(prefix) :].split(" s ")[0])
    assert 3.0 <= delay_s <= 5.0
    assert retry["message"].endswith("(backoff; 3 attempts allowed): boom")
    assert (retry["task_id"], retry["tenant"], retry["attempt"]) == (1, "acme", 1)


async def test_task_lines_are_quiet_at_info_level(node: Node, json_log: io.StringIO) -> None:
    logging.getLogger().setLevel(logging.INFO)

    def build(stamp: Stamp) -> e.Entry:
        [task_id] = stamp.task_ids(1)
        return e.SubmitTasks(
            time_ms=stamp.now_ms, tasks=(e.TaskSpec(id=task_id, type="noop", tenant="t"),)
        )

    await node.propose(build)
    await node.propose(
        lambda s: e.RegisterWorker(time_ms=s.now_ms, worker_id="w", task_types={"*": 1})
    )
    await node.propose(
        lambda s: e.AssignTasks(time_ms=s.now_ms, assignments=(e.Assignment(1, "w"),))
    )
    assert not [line for line in lines_of(json_log) if line["logger"] == "steward.tasks"]


def test_worker_task_logger_lines_carry_task_id_and_tenant(json_log: io.StringIO) -> None:
    make_task_logger(41, 3, "acme").info("running step %d", 2)
    [line] = [line for line in lines_of(json_log) if line["logger"] == "steward.task.41"]
    assert line["message"] == "running step 2"
    assert (line["task_id"], line["tenant"], line["attempt"]) == (41, "acme", 3)
