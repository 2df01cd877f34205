"""The worker (clients/worker) against a fake broker over real TCP, in one event loop.

The fake broker speaks wire.worker_protocol on 127.0.0.1:0 and lets each test decide what
to answer; artifacts come from a real HTTP server on 127.0.0.1:0. No Spark here (see
tests/integration/test_worker_spark.py). Every wait is bounded.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import socket
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import msgspec
import pytest

from broker.api.api_models import ClusterSummary
from clients.worker import TaskContext, WorkerConfig
from clients.worker.config import parse_host_port
from clients.worker.link.worker_link import LeaderUnknownError, find_leader
from clients.worker.runtime.task_runtime import encode_result, error_text
from tests.support.worker_harness import (
    WAIT_S,
    Env,
    FakeBroker,
    HttpServer,
    QuietHandler,
    result_of,
    task,
    until,
    worker_env,
    zip_bytes,
)
from wire.worker_protocol import (
    AssignedTask,
    Cancel,
    Error,
    Finish,
    FinishAck,
    SpawnRequest,
    TaskAttempt,
)


@pytest.fixture
async def env(tmp_path: Path) -> AsyncIterator[Env]:
    async with worker_env(tmp_path, stop_timeout_s=0.5, stop_wait_s=WAIT_S + 5) as environment:
        yield environment


# -- handshake and plain tasks --


async def test_hello_carries_the_workers_identity_and_capacity(env: Env) -> None:
    worker = env.worker(tenants=["acme", "globex"], token="s3cret")
    conn = await env.broker.accept()
    hello = conn.hello
    assert hello is not None
    assert hello.worker_id == "w1"
    assert hello.process_id == worker.process_id and len(hello.process_id) == 32
    assert hello.version
    assert hello.task_types == {"*": 4}
    assert hello.resources == {"cpu": 4.0, "memory_mb": 1024.0}
    assert hello.tenants == ("acme", "globex")
    assert hello.running == ()
    assert hello.token == "s3cret"
    conn.welcome()
    await asyncio.wait_for(worker.wait_connected(), WAIT_S)
    # The worker heartbeats at the Welcome's interval (100 ms).
    await until(lambda: conn.heartbeats >= 3, 2.0)


async def test_noop_sleep_and_fail_report_results_and_tracebacks(env: Env) -> None:
    _, conn = await env.started()
    conn.assign(
        task(1, "noop"),
        task(2, "sleep", {"seconds": 0.05}),
        task(3, "fail", {"message": "boom"}),
        task(4, "fail"),
    )
    reports = await conn.reports(4)
    assert result_of(reports[1, 1]) is None
    assert result_of(reports[2, 1]) == {"slept": 0.05}
    failed = reports[3, 1]
    assert not failed.ok and failed.result is None
    assert failed.error is not None
    assert failed.error.startswith("RuntimeError: boom\n")  # the message first
    assert "Traceback (most recent call last)" in failed.error
    assert "task_fail" in failed.error  # the frame that raised
    assert reports[4, 1].error is not None
    assert reports[4, 1].error.startswith("RuntimeError: task failed")


async def test_reports_finishing_together_share_one_finish_frame(env: Env) -> None:
    # A window wide enough for 20 noops' reports to reach the link within it on a loaded
    # machine (each ends when its thread gets the CPU: over 50 ms apart at load 8).
    _, conn = await env.started(finish_batch_ms=2000.0)
    conn.assign(*(task(i) for i in range(1, 21)))
    finish = await conn.next(Finish)
    assert len(finish.reports) == 20


async def test_unknown_type_bad_params_and_missing_code_are_task_errors(env: Env) -> None:
    worker, conn = await env.started()
    conn.assign(
        task(1, "no.such.type"),
        AssignedTask(task_id=2, attempt=1, type="sleep", tenant="t", params=b"{not json"),
        task(3, "jobs.main:run"),  # module:function without an artifact
        task(4, "sleep", {"seconds": "soon"}),
    )
    reports = await conn.reports(4)
    assert "unknown task type 'no.such.type'" in (reports[1, 1].error or "")
    assert "params are not valid JSON" in (reports[2, 1].error or "")
    assert "needs a code artifact" in (reports[3, 1].error or "")
    assert "sleep needs params" in (reports[4, 1].error or "")
    assert worker.runtime.running() == []


async def test_result_over_max_result_bytes_is_a_task_error(env: Env) -> None:
    worker, conn = await env.started(max_result_bytes=1000)
    worker.runtime.register("big", lambda params, ctx: "x" * params["n"])
    conn.assign(task(1, "big", {"n": 990}), task(2, "big", {"n": 1001}))
    reports = await conn.reports(2)
    assert result_of(reports[1, 1]) == "x" * 990  # 992 bytes with the quotes
    assert not reports[2, 1].ok
    assert "max_result_bytes limit of 1000" in (reports[2, 1].error or "")


async def test_non_json_result_is_a_task_error(env: Env) -> None:
    worker, conn = await env.started()
    worker.runtime.register("set", lambda params, ctx: {1, 2})
    worker.runtime.register("nan", lambda params, ctx: float("nan"))
    worker.runtime.register("obj", lambda params, ctx: {"when": object()})
    conn.assign(task(1, "set"), task(2, "nan"), task(3, "obj"))
    reports = await conn.reports(3)
    for key in ((1, 1), (2, 1), (3, 1)):
        assert not reports[key].ok
        assert "not JSON-serializable" in (reports[key].error or "")


async def test_task_logger_records_carry_task_id_and_tenant(
    env: Env, caplog: pytest.LogCaptureFixture
) -> None:
    worker, conn = await env.started()

    def chatty(params: Any, ctx: TaskContext) -> int:
        ctx.logger.warning("hello from %s", ctx.type)
        return ctx.task_id

    worker.runtime.register("chatty", chatty)
    with caplog.at_level(logging.INFO):
        conn.assign(task(7, "chatty", tenant="globex", attempt=2))
        assert result_of(await conn.report()) == 7
    (record,) = [r for r in caplog.records if r.getMessage() == "hello from chatty"]
    assert record.task_id == 7  # type: ignore[attr-defined]
    assert record.attempt == 2  # type: ignore[attr-defined]
    assert record.tenant == "globex"  # type: ignore[attr-defined]
    assert record.name == "steward.task.7"


# -- acknowledgements and duplicates --


async def test_finish_is_resent_until_acknowledged(env: Env) -> None:
    worker, conn = await env.started(finish_resend_s=0.2)
    conn.assign(task(1, "noop"))
    started = time.monotonic()
    first = await conn.next(Finish)  # "lost": not acknowledged
    again = await conn.next(Finish, 2.0)
    assert time.monotonic() - started >= 0.15
    assert first.reports == again.reports
    assert worker.unacked.keys() == {(1, 1)}
    conn.send(FinishAck(tasks=(TaskAttempt(1, 1),)))
    await until(lambda: not worker.unacked)
    await conn.expect_silence(0.5)


async def test_duplicate_assign_of_a_running_task_is_ignored(env: Env) -> None:
    worker, conn = await env.started(finish_resend_s=30.0)
    runs: list[int] = []

    def counted(params: Any, ctx: TaskContext) -> int:
        runs.append(ctx.task_id)
        ctx.cancelled.wait(0.3)
        return len(runs)

    worker.runtime.register("counted", counted)
    conn.assign(task(1, "counted"))
    await until(lambda: runs == [1])
    conn.assign(task(1, "counted"))  # same attempt, still running
    finish = await conn.next(Finish)
    assert [r.task_id for r in finish.reports] == [1]
    # Repeated once more after it finished but before the ack: the report goes out
    # again, the task does not run again.
    conn.assign(task(1, "counted"))
    again = await conn.next(Finish)
    assert again.reports == finish.reports
    assert runs == [1]
    conn.send(FinishAck(tasks=(TaskAttempt(1, 1),)))
    await until(lambda: not worker.unacked)


async def test_a_newer_attempt_supersedes_the_running_one(env: Env) -> None:
    _, conn = await env.started()
    conn.assign(task(1, "sleep", {"seconds": 30}, attempt=1))
    await asyncio.sleep(0.05)
    conn.assign(task(1, "sleep", {"seconds": 0.01}, attempt=2))
    reports = await conn.reports(2)
    assert reports[1, 1].error == "cancelled: superseded by attempt 2"
    assert result_of(reports[1, 2]) == {"slept": 0.01}


# -- cancels and deadlines --


async def test_cancel_stops_a_sleep_task_quickly(env: Env) -> None:
    worker, conn = await env.started()
    conn.assign(task(1, "sleep", {"seconds": 30}))
    await until(lambda: worker.runtime.busy_threads() == 1)
    started = time.monotonic()
    conn.send(Cancel(tasks=(TaskAttempt(1, 1),), reason="cancelled by user"))
    report = await conn.report(2.0)
    assert time.monotonic() - started < 1.0
    assert not report.ok
    assert report.error == "cancelled: cancelled by user"
    assert worker.runtime.running() == []


async def test_cancel_of_unknown_or_finished_tasks_is_harmless(env: Env) -> None:
    _, conn = await env.started()
    conn.send(Cancel(tasks=(TaskAttempt(99, 1),)))
    conn.assign(task(1))
    await conn.report()
    conn.send(Cancel(tasks=(TaskAttempt(1, 1),)))
    await conn.expect_silence(0.2)


async def test_deadline_in_the_past_cancels_at_once(env: Env) -> None:
    _, conn = await env.started()
    past_ms = int(time.time() * 1000) - 1000
    conn.assign(task(1, "sleep", {"seconds": 30}, deadline_ms=past_ms))
    report = await conn.report(2.0)
    assert report.error == "cancelled: deadline exceeded"


async def test_deadline_in_the_near_future_cancels_at_the_deadline(env: Env) -> None:
    _, conn = await env.started()
    started = time.monotonic()
    deadline_ms = int(time.time() * 1000) + 400
    conn.assign(
        task(1, "sleep", {"seconds": 30}, deadline_ms=deadline_ms),
        task(2, "sleep", {"seconds": 0.05}, deadline_ms=deadline_ms),  # finishes in time
    )
    reports = await conn.reports(2)
    elapsed_s = time.monotonic() - started
    assert reports[1, 1].error == "cancelled: deadline exceeded"
    assert 0.3 <= elapsed_s < 2.0
    assert result_of(reports[2, 1]) == {"slept": 0.05}


async def test_a_task_ignoring_its_cancel_is_reported_after_the_grace(env: Env) -> None:
    worker, conn = await env.started(cancel_grace_s=0.3)
    release = threading.Event()
    worker.runtime.register("stubborn", lambda params, ctx: release.wait(10))
    conn.assign(task(1, "stubborn"))
    await until(lambda: worker.runtime.busy_threads() == 1)
    conn.send(Cancel(tasks=(TaskAttempt(1, 1),), reason="stop"))
    report = await conn.report(2.0)
    assert report.error is not None
    assert report.error.startswith("cancelled: stop (the task did not stop within 0.3 s)")
    assert worker.runtime.running() == []  # no longer reported as running
    assert worker.runtime.busy_threads() == 0  # forgotten, though its thread still runs
    release.set()
    await conn.expect_silence(0.2)  # and its late end reports nothing


# -- connection failures --


async def test_reconnect_lists_running_task_and_delivers_its_finish(env: Env) -> None:
    worker, conn = await env.started()
    conn.assign(task(1, "sleep", {"seconds": 0.6}))
    await until(lambda: worker.runtime.busy_threads() == 1)
    await conn.close()  # the broker drops the connection
    conn2 = await env.broker.accept()
    assert conn2.hello is not None
    assert conn2.hello.running == (TaskAttempt(1, 1),)
    assert conn2.hello.process_id == worker.process_id
    # Finish while disconnected (not yet welcomed): kept, sent after the Welcome.
    await until(lambda: (1, 1) in worker.unacked, 3.0)
    conn2.welcome(keep=(TaskAttempt(1, 1),))
    report = await conn2.report()
    assert result_of(report) == {"slept": 0.6}
    assert worker.sessions == 2


async def test_reconnect_lists_a_task_finished_while_disconnected(env: Env) -> None:
    # Finished while the broker was away, report not acknowledged: the next broker (a new
    # leader) must keep it running on this worker, so the resent report finishes it
    # instead of the task being re-queued and run twice.
    worker, conn = await env.started(finish_resend_s=30.0)
    conn.assign(task(1, "noop"))
    await conn.next(Finish)  # lost with the connection: never acknowledged
    assert worker.runtime.running() == []
    await conn.close()
    conn2 = await env.broker.accept()
    assert conn2.hello is not None
    assert conn2.hello.running == (TaskAttempt(1, 1),)
    # It says so: an attempt it does not list never reached it (docs/DESIGN.md §6).
    assert conn2.hello.lists_unacked
    conn2.welcome(keep=(TaskAttempt(1, 1),))
    report = await conn2.report()
    assert report.task_id == 1 and report.attempt == 1


async def test_reconnect_backs_off_while_the_broker_is_down(env: Env) -> None:
    broker = FakeBroker()
    await broker.start()
    port = broker.port
    await broker.close()  # nothing listens on port now
    worker = env.worker(broker=f"127.0.0.1:{port}", reconnect_backoff_max_s=0.1)
    await asyncio.sleep(0.5)  # a few refused connects
    assert not worker.connected
    # A broker comes back on the same port: the worker connects without help.
    revived = FakeBroker()
    revived._server = await asyncio.start_server(revived._accept, "127.0.0.1", port)
    try:
        conn = await revived.connect()
        await asyncio.wait_for(worker.wait_connected(), WAIT_S)
        conn.assign(task(1))
        await conn.report()
    finally:
        await revived.close()


async def test_welcome_drop_stops_the_dropped_task(env: Env) -> None:
    worker, conn = await env.started()
    conn.assign(task(1, "sleep", {"seconds": 30}), task(2, "sleep", {"seconds": 0.5}))
    await until(lambda: worker.runtime.busy_threads() == 2)
    await conn.close()
    conn2 = await env.broker.accept()
    assert conn2.hello is not None
    assert set(conn2.hello.running) == {TaskAttempt(1, 1), TaskAttempt(2, 1)}
    conn2.welcome(keep=(TaskAttempt(2, 1),), drop=(TaskAttempt(1, 1),))
    await until(lambda: worker.runtime.busy_threads() == 1, 2.0)
    ctx = worker.runtime.context((1, 1))
    assert ctx is None or ctx.cancelled.is_set()
    # Only the kept task reports; the dropped one is silent (the broker moved on).
    report = await conn2.report()
    assert (report.task_id, report.attempt) == (2, 1)
    await conn2.expect_silence(0.3)
    assert worker.runtime.running() == []


async def test_silent_broker_past_heartbeat_timeout_means_reconnect(env: Env) -> None:
    worker = env.worker()
    conn = await env.broker.connect(
        heartbeat_interval_ms=100, heartbeat_timeout_ms=300, heartbeats=False
    )
    started = time.monotonic()
    conn2 = await env.broker.accept(3.0)  # the fake broker went silent
    assert 0.25 <= time.monotonic() - started < 2.0
    await asyncio.wait_for(conn.closed.wait(), WAIT_S)
    conn2.welcome()
    await asyncio.wait_for(worker.wait_connected(), WAIT_S)


async def test_broker_heartbeats_keep_the_connection(env: Env) -> None:
    worker = env.worker()
    conn = await env.broker.connect(heartbeat_interval_ms=50, heartbeat_timeout_ms=300)
    await asyncio.sleep(1.0)  # over three timeouts, with the broker's heartbeats
    assert not conn.closed.is_set()
    assert env.broker.conns.empty()
    assert worker.sessions == 1


async def test_error_frame_from_broker_means_reconnect(env: Env) -> None:
    worker, conn = await env.started()
    conn.send(Error(code="overloaded", message="try again"))
    await asyncio.wait_for(conn.closed.wait(), WAIT_S)
    await env.broker.connect()
    await until(lambda: worker.sessions == 2)


async def test_garbage_from_broker_is_answered_with_error_then_reconnect(env: Env) -> None:
    worker, conn = await env.started()
    conn.writer.write(b"\x00\x00\x00\x01\xc1")  # 0xc1: never valid msgpack
    error = await conn.next(Error)
    assert error.code == "bad_frame"
    await asyncio.wait_for(conn.closed.wait(), WAIT_S)
    await env.broker.connect()
    await until(lambda: worker.sessions == 2)


async def test_error_before_welcome_means_reconnect(env: Env) -> None:
    worker = env.worker()
    conn = await env.broker.accept()
    conn.send(Error(code="bad_handshake", message="unknown token"))
    await asyncio.wait_for(conn.closed.wait(), WAIT_S)
    await env.broker.connect()
    await asyncio.wait_for(worker.wait_connected(), WAIT_S)


async def test_graceful_stop_finishes_running_tasks_and_delivers_reports(env: Env) -> None:
    worker, conn = await env.started()
    conn.assign(task(1, "sleep", {"seconds": 0.2}))
    await until(lambda: worker.runtime.busy_threads() == 1)
    stopping = asyncio.ensure_future(worker.stop(wait=True, timeout_s=5))
    await asyncio.sleep(0.05)
    conn.assign(task(2, "sleep", {"seconds": 30}))  # refused while stopping
    reports = await conn.reports(2)
    assert result_of(reports[1, 1]) == {"slept": 0.2}
    # Given back, not failed: the broker queues it again without counting the attempt.
    assert (reports[2, 1].error, reports[2, 1].released) == ("given back: worker stopping", True)
    assert not reports[1, 1].released
    await asyncio.wait_for(stopping, WAIT_S)
    await asyncio.wait_for(conn.closed.wait(), WAIT_S)
    # run() returns promptly, though the broker still heartbeats.
    await asyncio.wait_for(env.workers[-1][1], 1.0)


async def test_hurried_stop_cancels_running_tasks(env: Env) -> None:
    worker, conn = await env.started()
    conn.assign(task(1, "sleep", {"seconds": 30}))
    await until(lambda: worker.runtime.busy_threads() == 1)
    started = time.monotonic()
    stopping = asyncio.ensure_future(worker.stop(wait=False, timeout_s=5))
    report = await conn.report()
    assert (report.error, report.released) == ("given back: worker stopping", True)
    await asyncio.wait_for(stopping, WAIT_S)
    await asyncio.wait_for(env.workers[-1][1], 1.0)
    assert time.monotonic() - started < 2.0


async def test_stop_gives_back_what_outlasts_the_grace(env: Env) -> None:
    # docs/DESIGN.md §6, "Stopping": a task still running when the grace ends is given
    # back; one that is already cancelled (here: by the broker) ends as that cancel says.
    worker, conn = await env.started()
    conn.assign(task(1, "sleep", {"seconds": 30}), task(2, "sleep", {"seconds": 30}))
    await until(lambda: worker.runtime.busy_threads() == 2)
    conn.send(Cancel(tasks=(TaskAttempt(2, 1),), reason="by the user"))
    cancelled = await conn.report()
    assert (cancelled.task_id, cancelled.released) == (2, False)
    started = time.monotonic()
    stopping = asyncio.ensure_future(worker.stop(wait=True, timeout_s=0.5))
    report = await conn.report()
    await asyncio.wait_for(stopping, WAIT_S)
    assert (report.task_id, report.error, report.released) == (
        1,
        "given back: worker stopping",
        True,
    )
    assert time.monotonic() - started < 4.0


# -- code artifacts --

PY_ARTIFACT = """
import os

def main(params, ctx):
    return {"module": __name__, "x": params["x"] * 2, "tenant": ctx.tenant}
"""


def jobs_zip(version: str) -> bytes:
    return zip_bytes(
        {
            "jobs/__init__.py": "",
            "jobs/util.py": f"VERSION = {version!r}\n",
            "jobs/helpers/__init__.py": "from jobs.util import VERSION as V\n",
            "jobs/main.py": (
                "import threading\n"
                "import jobs.util\n"
                "from jobs import util\n"
                "from jobs.helpers import V\n"
                "from . import util as rel\n"
                "\n"
                "def run(params, ctx):\n"
                "    ctx.cancelled.wait((params or {}).get('hold_s', 0))\n"
                "    import jobs.util as late  # an import inside a function\n"
                "    assert jobs.util is util is rel is late\n"
                "    return {'version': util.VERSION, 'v': V, 'module': util.__name__}\n"
            ),
        }
    )


async def test_py_artifact_runs_as_its_own_module(env: Env) -> None:
    worker, conn = await env.started()
    sha = env.http.add(PY_ARTIFACT.encode())
    conn.assign(task(1, "wordy:main", {"x": 21}, code=sha))
    result = result_of(await conn.report())
    assert result == {"module": f"steward_artifact_{sha[:12]}", "x": 42, "tenant": "acme"}
    assert (env.tmp / "cache" / f"{sha}.py").read_bytes() == PY_ARTIFACT.encode()
    assert worker.runtime.artifacts.downloads == 1


async def test_two_versions_of_one_package_run_side_by_side(env: Env) -> None:
    _, conn = await env.started()
    sha1 = env.http.add(jobs_zip("v1"))
    sha2 = env.http.add(jobs_zip("v2"))
    # Both versions run at the same time, twice each.
    conn.assign(
        task(1, "jobs.main:run", {"hold_s": 0.2}, code=sha1),
        task(2, "jobs.main:run", {"hold_s": 0.2}, code=sha2),
        task(3, "jobs.main:run", code=sha1),
        task(4, "jobs.main:run", code=sha2),
    )
    reports = await conn.reports(4)
    for key, sha, version in (((1, 1), sha1, "v1"), ((2, 1), sha2, "v2")):
        assert result_of(reports[key]) == {
            "version": version,
            "v": version,
            "module": f"steward_artifact_{sha[:12]}.jobs.util",
        }
    assert result_of(reports[3, 1])["version"] == "v1"
    assert result_of(reports[4, 1])["version"] == "v2"
    assert "jobs" not in sys.modules and "jobs.util" not in sys.modules
    assert (env.tmp / "cache" / sha1 / "jobs" / "main.py").is_file()
    assert env.http.requests == {sha1: 1, sha2: 1}


async def test_concurrent_tasks_download_an_artifact_once(env: Env) -> None:
    _, conn = await env.started()
    env.http.delay_s = 0.3
    sha = env.http.add(jobs_zip("v3"))
    conn.assign(*(task(i, "jobs.main:run", code=sha) for i in range(1, 5)))
    reports = await conn.reports(4)
    assert {result_of(r)["version"] for r in reports.values()} == {"v3"}
    assert env.http.requests == {sha: 1}


async def test_artifact_errors_are_task_errors(env: Env) -> None:
    _, conn = await env.started()
    good = jobs_zip("v4")
    sha = hashlib.sha256(good).hexdigest()
    env.http.files[sha] = good + b"tampered"  # the bytes do not match their hash
    missing = hashlib.sha256(b"nothing").hexdigest()
    ok_sha = env.http.add(jobs_zip("v5"))
    conn.assign(
        task(1, "jobs.main:run", code=sha),
        task(2, "jobs.main:run", code=missing),
        task(3, "jobs.main:nope", code=ok_sha),
        task(4, "other.main:run", code=ok_sha),
        task(5, "jobs.main:run", code="../../etc/passwd"),
        task(6, "evil:run", code=env.http.add(zip_bytes({"../evil.py": "X = 1\n"}))),
        task(7, "jobs.main:run", code=env.http.add(b"PK\x03\x04 not really a zip")),
        task(8, "broken:run", code=env.http.add(zip_bytes({"broken.py": "def run(:\n"}))),
    )
    reports = await conn.reports(8)
    assert "artifact sha256 mismatch" in (reports[1, 1].error or "")
    assert not (env.tmp / "cache" / f"{sha}.zip").exists()
    assert "not found" in (reports[2, 1].error or "")
    assert "has no attribute 'nope'" in (reports[3, 1].error or "")
    assert "has no top-level module 'other'" in (reports[4, 1].error or "")
    assert "not a sha256 hex digest" in (reports[5, 1].error or "")
    assert "unsafe path '../evil.py'" in (reports[6, 1].error or "")
    assert not (env.tmp / "evil.py").exists()
    assert "not a valid zip" in (reports[7, 1].error or "")
    assert (reports[8, 1].error or "").startswith("SyntaxError: ")


async def test_cached_artifact_is_used_by_a_new_worker_without_download(env: Env) -> None:
    _, conn = await env.started()
    sha = env.http.add(PY_ARTIFACT.encode())
    conn.assign(task(1, "m:main", {"x": 1}, code=sha))
    await conn.report()
    del env.http.files[sha]  # the broker no longer serves it
    _, conn2 = await env.started(worker_id="w2")
    conn2.assign(task(2, "m:main", {"x": 2}, code=sha))
    assert result_of(await conn2.report())["x"] == 4
    assert env.http.requests == {sha: 1}


# -- pure helpers --


def test_encode_result_and_error_text() -> None:
    assert encode_result({"a": [1, 2.5, None, "é"]}, 100) == '{"a":[1,2.5,null,"é"]}'.encode()
    with pytest.raises(ValueError, match="over the max_result_bytes limit of 3"):
        encode_result("abcd", 3)
    try:
        raise KeyError("k" * 200_000)
    except KeyError as exc:
        text = error_text(exc, max_chars=1000)
    assert text.startswith("KeyError: 'kkk")
    assert "characters cut" in text and len(text) < 1100


def test_config_validation_and_addresses() -> None:
    assert parse_host_port("127.0.0.1:7070") == ("127.0.0.1", 7070)
    assert parse_host_port("[::1]:7070") == ("::1", 7070)
    with pytest.raises(ValueError):
        parse_host_port("localhost")
    config = WorkerConfig(broker="127.0.0.1:1", http_url="http://127.0.0.1:2")
    assert config.task_types["*"] >= 1 and config.resources["cpu"] >= 1
    assert config.resources["memory_mb"] > 0
    assert config.capacity() == config.task_types["*"]
    with pytest.raises(ValueError):
        WorkerConfig(broker="127.0.0.1:1", http_url="", task_types={"*": 0})


# -- finding the leader (--brokers) --


class ClusterServer(HttpServer):
    """Serves ``GET /api/v1/cluster``: a ClusterSummary naming ``leader`` ("host:port")."""

    def __init__(self) -> None:
        self.leader: str | None = None
        self.requests = 0
        server = self

        class Handler(QuietHandler):
            def do_GET(self) -> None:
                server.requests += 1
                address = server.leader
                summary = ClusterSummary(
                    cluster_id="c",
                    leader="b1" if address else None,
                    brokers=[],
                    workers=[],
                    tasks={},
                    tenants=0,
                    leader_url=server.url if address else None,
                    leader_worker_address=address,
                )
                body = msgspec.json.encode(summary)
                status = 200 if self.path == "/api/v1/cluster" else 404
                self.reply(status, body, "application/json")

        super().__init__(Handler)
        self.start()


async def test_worker_connects_to_the_leader_the_brokers_name(env: Env) -> None:
    cluster = ClusterServer()
    second = FakeBroker()
    await second.start()
    try:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            dead_url = f"http://127.0.0.1:{sock.getsockname()[1]}"  # nothing listens
        worker = env.worker(
            broker="",
            brokers=[dead_url, cluster.url],
            download_from_leader=True,
            discovery_timeout_s=0.5,
        )
        # No leader yet: the worker keeps asking (with backoff), connecting nowhere.
        await until(lambda: cluster.requests >= 2)
        assert not env.broker.all and not worker.connected
        cluster.leader = f"127.0.0.1:{env.broker.port}"
        conn = await env.broker.connect()
        await asyncio.wait_for(worker.wait_connected(), WAIT_S)
        assert worker.broker_address == cluster.leader
        assert worker.runtime.artifacts.http_url == cluster.url
        conn.assign(task(1, "sleep", {"seconds": 30}))
        await until(lambda: bool(worker.runtime.running()))
        # The leader changes: its endpoint closes, the brokers name another one.
        cluster.leader = f"127.0.0.1:{second.port}"
        await conn.close()
        new_conn = await second.connect(keep=(TaskAttempt(1, 1),))
        assert new_conn.hello is not None
        assert new_conn.hello.running == (TaskAttempt(1, 1),)  # reconcile as usual
        await until(lambda: worker.sessions == 2)
        assert worker.broker_address == cluster.leader
        assert len(env.broker.all) == 1  # never back to the old endpoint
    finally:
        await second.close()
        cluster.stop()


async def test_find_leader_asks_each_broker_in_turn() -> None:
    cluster = ClusterServer()
    try:
        with pytest.raises(LeaderUnknownError, match="no leader known"):
            await find_leader([cluster.url], timeout_s=1.0)
        cluster.leader = "127.0.0.1:7070"
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            dead_url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        leader = await find_leader([dead_url, cluster.url], timeout_s=1.0)
        assert leader == ("127.0.0.1:7070", cluster.url, 1, False)
        cluster.leader = "no port"
        with pytest.raises(LeaderUnknownError, match="bad leader_worker_address"):
            await find_leader([cluster.url], timeout_s=1.0)
    finally:
        cluster.stop()


def test_brokers_option_and_config() -> None:
    from clients.worker.__main__ import build_parser, config_from_args

    args = build_parser().parse_args(["--brokers", "http://a:1, http://b:2/"])
    config = config_from_args(args)
    assert config.brokers == ["http://a:1", "http://b:2"]
    assert config.download_from_leader and config.http_url == "http://a:1"
    args = build_parser().parse_args(["--brokers", "http://a:1", "--http-url", "http://c:3"])
    assert not config_from_args(args).download_from_leader
    args = build_parser().parse_args(["--broker", "127.0.0.1:7071"])
    config = config_from_args(args)
    assert config.brokers == [] and config.broker_address() == ("127.0.0.1", 7071)
    for bad in (
        ["--brokers", "a:1"],
        ["--brokers", ","],
        ["--broker", "h:1", "--brokers", "http://a:1"],
    ):
        with pytest.raises(SystemExit):
            build_parser().parse_args(bad)
    with pytest.raises(ValueError, match="http"):
        WorkerConfig(broker="", http_url="", brokers=["ftp://x"])


# -- task trees: ctx.spawn --


def _spawner(params: Any, ctx: TaskContext) -> str:
    ctx.spawn("child", {"i": 0})
    ctx.spawn("child", {"i": 1}, anchors=[ctx.task_id, 3], tenant="other", max_attempts=2)
    ctx.spawn("side", [1, 2], tracked=False, resources={"cpu": 1.0})
    if params and params.get("crash"):
        raise RuntimeError("crashed after spawning")
    return "ok"


async def test_spawned_children_travel_with_the_finish_report(env: Env) -> None:
    worker, conn = await env.started()
    worker.runtime.register("spawner", _spawner)
    conn.assign(task(7, "spawner", code="ab" * 32))
    reports = await conn.reports(1)
    report = reports[7, 1]
    assert result_of(report) == "ok"
    assert report.spawn == (
        SpawnRequest(type="child", params=b'{"i":0}'),
        SpawnRequest(type="child", params=b'{"i":1}', tenant="other", anchors=(3,), max_attempts=2),
        SpawnRequest(
            type="side", params=b"[1,2]", tracked=False, anchor_self=False, resources={"cpu": 1.0}
        ),
    )


async def test_a_task_that_fails_or_is_cancelled_spawns_nothing(env: Env) -> None:
    worker, conn = await env.started()
    worker.runtime.register("spawner", _spawner)

    def spawn_then_wait(params: Any, ctx: TaskContext) -> None:
        ctx.spawn("child")
        ctx.cancelled.wait(WAIT_S)
        ctx.check_cancelled()

    worker.runtime.register("spawn_then_wait", spawn_then_wait)
    conn.assign(task(1, "spawner", {"crash": True}), task(2, "spawn_then_wait"))
    await until(lambda: worker.runtime.context((2, 1)) is not None)
    conn.send(Cancel(tasks=(TaskAttempt(2, 1),), reason="stop"))
    reports = await conn.reports(2)
    assert not reports[1, 1].ok and "crashed after spawning" in (reports[1, 1].error or "")
    assert not reports[2, 1].ok
    assert reports[1, 1].spawn == () and reports[2, 1].spawn == ()


async def test_bad_spawn_calls_raise_in_the_task(env: Env) -> None:
    worker, conn = await env.started()
    calls: dict[str, Callable[[TaskContext], None]] = {
        "untracked_anchors": lambda ctx: ctx.spawn("x", tracked=False, anchors=[1]),
        "empty_anchors": lambda ctx: ctx.spawn("x", anchors=[]),
        "not_json": lambda ctx: ctx.spawn("x", {1, 2}),
    }
    for name, call in calls.items():
        worker.runtime.register(name, lambda params, ctx, call=call: call(ctx))
    conn.assign(*(task(i, name) for i, name in enumerate(calls, 1)))
    reports = await conn.reports(3)
    assert "untracked child takes no anchors" in (reports[1, 1].error or "")
    assert "say tracked=False" in (reports[2, 1].error or "")
    assert "spawn 'x': params: " in (reports[3, 1].error or "")
