"""Issue 30 ("Silence and lost messages"), through the real ``steward`` command against a
real standalone broker with a real worker: every silence a newcomer met gets its line.

The worker serves ``noop`` and one code type only, so a ``sleep`` task waits for ever:
what ``submit --wait`` and ``logs --follow`` must say about it, and what Ctrl-C must.
Every CLI call runs with a timeout; waits on output are bounded.
"""

from __future__ import annotations

import os
import selectors
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.support.cli_runs import Run, steward
from tests.support.procs import BrokerProcess, steward_command
from tests.support.webhook_receiver import Receiver, webhook_receiver
from tests.support.worker_procs import broker_with_worker, wait_until

CODE_TYPE = "silence_job:parse_error"
# A task that raises what a Spark Connect session raises for bad SQL: its text starts
# with a newline, the message on the next line.
JOB = """
from pyspark.errors.exceptions.connect import ParseException


def parse_error(params, ctx):
    raise ParseException(
        message="\\n[PARSE_SYNTAX_ERROR] Syntax error at or near 'SELEC'. SQLSTATE: 42601"
        " (line 1, pos 0)\\n\\n== SQL ==\\nSELEC 1\\n^^^\\n",
        errorClass="PARSE_SYNTAX_ERROR",
    )
"""
OUTPUT_WAIT_S = 30.0


@pytest.fixture(scope="module")
def broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BrokerProcess]:
    root = tmp_path_factory.mktemp("silence-cli")
    types = ("--task-type", "noop=1", "--task-type", f"{CODE_TYPE}=1")
    with broker_with_worker(root, "silence-worker", types) as (broker, _worker):
        yield broker


def submit_id(url: str, *args: str) -> int:
    run = steward("--url", url, "submit", *args)
    assert run.code == 0, run
    return int(run.out.strip())


def stderr_until(proc: subprocess.Popen[str], word: str, timeout_s: float) -> str:
    """What ``proc`` wrote on stderr until a line holding ``word`` (bounded)."""
    assert proc.stderr is not None
    seen = ""
    deadline = time.monotonic() + timeout_s
    with selectors.DefaultSelector() as selector:
        selector.register(proc.stderr, selectors.EVENT_READ)
        while word not in seen:
            left = deadline - time.monotonic()
            assert left > 0, f"no {word!r} on stderr within {timeout_s} s: {seen!r}"
            if selector.select(left):
                line = proc.stderr.readline()
                assert line, f"stderr closed before {word!r}: {seen!r}"
                seen += line
    return seen


# --- 1: a wait says what it waits for --------------------------------------------------------


def test_submit_wait_says_what_it_waits_for_and_how_to_stop(broker: BrokerProcess) -> None:
    run = steward(
        "--url", broker.url, "submit", "sleep", "--wait", "--timeout-s", "8", timeout_s=30
    )
    assert run.code == 1, run  # the timeout, as before
    notice = [line for line in run.err.splitlines() if "waiting for task" in line]
    assert len(notice) == 1, run
    assert "to start (no connected worker serves type 'sleep'" in notice[0], run
    assert "Ctrl-C stops waiting, the task stays queued" in notice[0], run


def test_logs_follow_says_it_waits_for_the_task_to_start(broker: BrokerProcess) -> None:
    task_id = submit_id(broker.url, "sleep")
    with subprocess.Popen(
        [*steward_command(), "--url", broker.url, "logs", str(task_id), "--follow"],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    ) as proc:
        try:
            said = stderr_until(proc, "waiting for task", OUTPUT_WAIT_S)
        finally:
            proc.kill()
    assert f"waiting for task {task_id} to start (no connected worker serves type" in said


# --- 2: Ctrl-C of a wait names the tasks that go on ------------------------------------------


def test_ctrl_c_of_submit_wait_names_the_live_tasks_and_how_to_cancel(
    broker: BrokerProcess,
) -> None:
    with subprocess.Popen(
        [*steward_command(), "--url", broker.url, "submit", "sleep", "--count", "3", "--wait"],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    ) as proc:
        try:
            stderr_until(proc, "waiting for task", OUTPUT_WAIT_S)
            os.kill(proc.pid, signal.SIGINT)
            out, err = proc.communicate(timeout=OUTPUT_WAIT_S)
        finally:
            proc.kill()
    assert proc.returncode == 130, (out, err)
    assert "Traceback" not in err
    line = err.strip().splitlines()[-1]
    assert line.startswith("steward: stopped waiting; tasks "), err
    assert " go on " in line and "steward cancel" in line, err


# --- 3: a Spark error's first line is its message --------------------------------------------


def test_a_spark_error_shows_its_message_not_an_empty_line(
    broker: BrokerProcess, tmp_path: Path
) -> None:
    job = tmp_path / "silence_job.py"
    job.write_text(JOB)
    upload = steward("--url", broker.url, "code", "upload", str(job))
    assert upload.code == 0, upload
    sha = upload.out.strip()
    run: Run = steward(
        "--url",
        broker.url,
        "submit",
        CODE_TYPE,
        "--code",
        sha,
        "--wait",
        "--timeout-s",
        "60",
        timeout_s=90,
    )
    assert run.code == 1, run
    assert (
        "error: ParseException: [PARSE_SYNTAX_ERROR] Syntax error at or near 'SELEC'" in run.out
    ), run


# --- 4: a bad value is one line, without the usage -------------------------------------------


def test_a_bad_option_value_is_one_line_without_the_usage() -> None:
    bad_json = steward("submit", "sleep", "--params", "{seconds: 1}")
    assert bad_json.code == 2, bad_json
    assert bad_json.err.count("\n") == 1 and "usage:" not in bad_json.err, bad_json
    assert bad_json.err.startswith("steward: --params: not valid JSON"), bad_json
    assert """e.g. '{"seconds": 1}'""" in bad_json.err, bad_json
    bad_number = steward("submit", "sleep", "--count", "two")
    assert bad_number.code == 2 and bad_number.err.count("\n") == 1, bad_number
    assert "--count: invalid int value: 'two'" in bad_number.err, bad_number
    # A misuse of the command still shows how to use it.
    unknown = steward("submit", "sleep", "--bogus")
    assert unknown.code == 2 and "usage:" in unknown.err, unknown


# --- 6: a webhook's GET shows the deliveries that fail ---------------------------------------


def test_a_webhook_shows_its_failing_deliveries(broker: BrokerProcess) -> None:
    receiver = Receiver("silence-secret", refusing=True)
    with webhook_receiver(receiver) as url, httpx.Client(base_url=broker.url, timeout=10) as http:
        path = "/api/v1/tenants/hooked/webhook"
        put = http.put(path, json={"url": url, "secret": "silence-secret"})
        assert put.status_code == 200, put.text
        assert put.json()["failing"] is None and put.json()["pending"] == 0, put.text
        task_id = submit_id(broker.url, "noop", "--tenant", "hooked")

        def failed_twice() -> bool:
            failing = http.get(path).json()["failing"]
            return failing is not None and failing["failures"] >= 2

        wait_until(failed_twice, OUTPUT_WAIT_S, "two failed deliveries shown")
        view = http.get(path).json()
        assert view["pending"] == 1, view
        failing = view["failing"]
        assert failing["last_error"] == "HTTP 503", view
        assert failing["next_retry_at"] > failing["last_failed_at"], view
        with receiver.lock:
            receiver.refusing = False

        def delivered() -> bool:
            shown = http.get(path).json()
            return shown["failing"] is None and shown["pending"] == 0

        wait_until(delivered, OUTPUT_WAIT_S, "the delivery shown as done")
        assert receiver.delivered_ids() == [task_id]
        assert http.delete(path).status_code == 200


# --- 5: a module:function type without code is refused at submit -----------------------------


def test_module_function_without_code_is_refused_at_submit(broker: BrokerProcess) -> None:
    refused = steward("--url", broker.url, "submit", "mymod:run")
    assert refused.code == 1 and refused.err.count("\n") == 1, refused
    assert refused.err.startswith("steward: ") and "400" in refused.err, refused
    assert "steward code upload FILE" in refused.err and "--code" in refused.err, refused
    batch = steward("--url", broker.url, "submit", "mymod:run", "--count", "2")
    assert batch.code == 1 and "code artifact" in batch.err, batch
    # An embedded worker's own name: accepted when the submitter says so.
    task_id = submit_id(broker.url, "mymod:run", "--allow-unknown-type")
    assert steward("--url", broker.url, "cancel", str(task_id)).code == 0
