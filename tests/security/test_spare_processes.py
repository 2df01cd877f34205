"""Spare task processes (clients/worker/task_processes/pool.py, "Spares"): one per tenant, started
ahead of need, given its memory limit only when a task of its tenant takes it.

Real processes through the real TaskRuntime (tests/support/task_runtime.py); spares are
turned on in its pool as a worker with per-tenant Spark servers does (the path from a Spark
grant to a spare: tests/integration/test_spark_tenant_servers.py).
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from clients.worker.task_processes import pipe_protocol
from clients.worker.task_processes.pool import TaskProcessPool
from tests.support.task_runtime import Runtime

WAIT_S = 20.0

LIMITS_JOB = textwrap.dedent(
    """
    import os, resource

    def limits(params, ctx):
        return {"pid": os.getpid(), "uid": os.getuid(),
                "as": list(resource.getrlimit(resource.RLIMIT_AS))}
    """
)


def _with_spares(rt: Runtime, max_spares: int = 4, spare_idle_s: float = 30.0) -> TaskProcessPool:
    pool = rt.runtime.processes
    assert pool is not None
    pool.limits = dataclasses.replace(pool.limits, max_spares=max_spares, spare_idle_s=spare_idle_s)
    return pool


def _spare(rt: Runtime, tenant: str) -> int:
    """Keep a spare for ``tenant`` (as a Spark grant does) and return its pid."""
    pool = rt.runtime.processes
    identities = rt.runtime.identities
    assert pool is not None and identities is not None
    pool.keep_spare(tenant, identities.for_tenant(tenant))  # starts it on a thread
    deadline = time.monotonic() + WAIT_S
    while (pid := pool.spare_pid(tenant)) is None and time.monotonic() < deadline:
        time.sleep(0.02)
    assert pid is not None, f"no spare for {tenant} within {WAIT_S} s"
    return pid


def _gone(pid: int) -> bool:
    deadline = time.monotonic() + WAIT_S
    while Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:
        time.sleep(0.02)
    return not Path(f"/proc/{pid}").exists()


@pytest.fixture
def rt(tmp_path: Path) -> Iterator[Runtime]:
    runtime = Runtime(tmp_path, LIMITS_JOB)
    yield runtime
    runtime.close()


def test_a_spare_takes_its_tenants_task_with_that_tasks_memory_limit(rt: Runtime) -> None:
    pool = _with_spares(rt)
    spare_pid = _spare(rt, "alice")
    assert pool.started == 1
    rt.start(1, "job:limits", tenant="alice", resources={"memory_mb": 700})
    result = rt.result(1)
    assert result["pid"] == spare_pid  # no process started for it
    assert result["as"] == [700 * 1024 * 1024] * 2  # applied, hard, before the task ran
    assert pool.started == 1
    # The spare became a process of its key: the next task of that limit finds it idle.
    rt.start(2, "job:limits", tenant="alice", resources={"memory_mb": 700})
    assert rt.result(2)["pid"] == spare_pid


def test_a_spare_taken_without_a_limit_gets_none(rt: Runtime) -> None:
    _with_spares(rt)
    spare_pid = _spare(rt, "alice")
    rt.start(1, "job:limits", tenant="alice")
    result = rt.result(1)
    assert result["pid"] == spare_pid
    assert result["as"][1] == -1  # RLIM_INFINITY: the worker's default of no limit


def test_a_spare_serves_only_its_own_tenant(rt: Runtime) -> None:
    pool = _with_spares(rt)
    spare_pid = _spare(rt, "alice")
    rt.start(1, "job:limits", tenant="bob")
    bob = rt.result(1)
    assert bob["pid"] != spare_pid
    assert pool.spare_pid("alice") == spare_pid  # still alice's, untouched
    rt.start(2, "job:limits", tenant="alice")
    alice = rt.result(2)
    assert alice["pid"] == spare_pid
    assert os.geteuid() != 0 or alice["uid"] != bob["uid"]


def test_a_spare_over_a_tasks_limit_is_left_for_another_task(rt: Runtime) -> None:
    pool = _with_spares(rt)
    spare_pid = _spare(rt, "alice")
    # 1 MB: less address space than any started Python uses, so the spare cannot honour it
    # as a process started with that limit would have.
    assert pool.idle_process("alice", 1) is None
    assert pool.spare_pid("alice") == spare_pid


def test_spares_take_no_slot(tmp_path: Path) -> None:
    rt = Runtime(tmp_path, LIMITS_JOB, task_types={"*": 1})
    try:
        pool = _with_spares(rt)
        spare_pid = _spare(rt, "alice")
        rt.start(1, "job:limits", tenant="bob")  # the one slot: no room is made for it
        assert rt.result(1)["pid"] != spare_pid
        assert pool.spare_pid("alice") == spare_pid
        assert pool.live() == 1  # bob's; the spare counts apart
    finally:
        rt.close()


def test_spares_are_bounded_the_least_recently_used_retired(rt: Runtime) -> None:
    pool = _with_spares(rt, max_spares=2)
    alice, bob = _spare(rt, "alice"), _spare(rt, "bob")
    identities = rt.runtime.identities
    assert identities is not None
    pool.keep_spare("alice", identities.for_tenant("alice"))  # used again: bob's is older
    carol = _spare(rt, "carol")
    assert _gone(bob)
    assert pool.spare_pid("bob") is None
    assert (pool.spare_pid("alice"), pool.spare_pid("carol")) == (alice, carol)


def test_a_spare_is_ended_after_its_idle_time(tmp_path: Path) -> None:
    rt = Runtime(tmp_path, LIMITS_JOB)
    try:
        pool = _with_spares(rt, spare_idle_s=0.5)
        spare_pid = _spare(rt, "alice")
        assert _gone(spare_pid)
        assert pool.spare_pid("alice") is None
    finally:
        rt.close()


def test_a_spare_refuses_a_run_before_its_limit() -> None:
    """The host side: a spare runs nothing until it has applied its limit."""
    control_r, control_w = os.pipe()
    events_r, events_w = os.pipe()
    args = [
        sys.executable,
        "-m",
        "clients.worker.task_processes.child",
        *("--control", str(control_r), "--events", str(events_w)),
        *("--max-frame-bytes", "65536", "--parent-pid", str(os.getpid())),
        *("--output-marker", "end", "--spare"),
    ]
    host = subprocess.Popen(
        args, pass_fds=(control_r, events_w), stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )
    os.close(control_r)
    os.close(events_w)
    try:
        run = pipe_protocol.Run(
            task_id=1, attempt=1, tenant="t", type="noop", params=b"null", workdir="/nonexistent",
            max_result_bytes=1024,
        )  # fmt: skip
        pipe_protocol.write_frame(control_w, run)
        output, _ = host.communicate(timeout=WAIT_S)
    finally:
        host.kill()
        os.close(control_w)
        os.close(events_r)
    assert host.returncode == 0
    assert b"a Run came before the spare's Limit" in output, output
