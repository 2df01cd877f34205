"""Tasks in task processes (clients/worker/task_processes/pool.py) through the real TaskRuntime.

Real processes, real signals; code artifacts are placed in the worker's cache as the
download would leave them (the cache verifies their hash before use). CI runs as root, so
tenants get uids of their own from the dynamic range; the tests that need root say so in
their asserts, not with skips. Every wait is bounded.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from clients.worker import WorkerConfig
from clients.worker.task_identity import DEFAULT_TASK_UID_RANGE, TaskIdentities, TaskUserError
from clients.worker.task_processes.pool import check_task_processes
from tests.support.task_runtime import WAIT_S, Runtime, work_root

IS_ROOT = os.geteuid() == 0

JOB = textwrap.dedent(
    """
    import ctypes, os, signal, sys, time

    def whoami(params, ctx):
        return {"pid": os.getpid(), "ppid": os.getppid(), "uid": os.getuid(),
                "gid": os.getgid(), "groups": os.getgroups(), "cwd": os.getcwd(),
                "env": dict(os.environ), "tenant": ctx.tenant}

    def _ready(params):
        open(params["ready"], "w").close()

    def spin(params, ctx):
        _ready(params)
        while True:
            pass

    def stubborn(params, ctx):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        _ready(params)
        while True:
            time.sleep(0.01)

    def segfault(params, ctx):
        ctypes.string_at(0)

    def exit3(params, ctx):
        os._exit(3)

    def hog(params, ctx):
        blocks = []
        for _ in range(64):
            blocks.append(bytearray(64 * 1024 * 1024))
        return len(blocks)

    def chatty(params, ctx):
        print("to stdout", params)
        print("to stderr", params, file=sys.stderr)
        ctx.logger.warning("through ctx.logger %s", params)
        return params

    def read_file(params, ctx):
        with open(params) as f:
            return f.read()

    def write_cwd(params, ctx):
        with open("left-behind.txt", "w") as f:
            f.write("x")
        os.mkdir("left-dir")
        os.symlink("/etc", "left-dir/etc")
        return os.getcwd()

    def list_cwd(params, ctx):
        return {"cwd": os.getcwd(), "files": os.listdir("."), "pid": os.getpid()}

    def echo(params, ctx):
        print("task", ctx.task_id)
        return os.getpid()

    def gate(params, ctx):
        # Quick unless told to wait for a file (bounded) or to exit.
        wait = (params or {}).get("wait")
        deadline = time.monotonic() + 20
        while wait and not os.path.exists(wait) and time.monotonic() < deadline:
            time.sleep(0.01)
        if (params or {}).get("exit"):
            os._exit(3)
        return os.getpid()

    def nap(params, ctx):
        time.sleep(0.05)
        return os.getpid()
    """
)


@pytest.fixture
def rt(tmp_path: Path) -> Iterator[Runtime]:
    runtime = Runtime(tmp_path, JOB)
    yield runtime
    runtime.close()


def test_builtins_and_artifacts_run_in_a_task_process_not_the_worker(rt: Runtime) -> None:
    rt.start(1, "noop")
    rt.start(2, "sleep", {"seconds": 0.01})
    rt.start(3, "fail", {"message": "boom"})
    rt.start(4, "job:whoami")
    assert rt.result(1) is None
    assert rt.result(2) == {"slept": 0.01}
    failed = rt.wait(3)
    assert not failed.ok and failed.error is not None
    assert failed.error.startswith("RuntimeError: boom\n")
    seen = rt.result(4)
    assert seen["pid"] != os.getpid()
    assert seen["ppid"] == os.getpid()  # started by the worker itself, by exec
    assert seen["tenant"] == "alice"


def test_a_task_process_serves_one_tenant_and_is_reused_warm(rt: Runtime) -> None:
    rt.start(1, "job:whoami", tenant="alice")
    first = rt.result(1)
    rt.start(2, "job:whoami", tenant="alice")
    again = rt.result(2)
    rt.start(3, "job:whoami", tenant="bob")
    bob = rt.result(3)
    assert again["pid"] == first["pid"]  # warm: the same process
    assert bob["pid"] != first["pid"]
    assert rt.runtime.processes is not None and rt.runtime.processes.started == 2
    if IS_ROOT:  # CI: tenants get uids of their own, never root
        low, high = DEFAULT_TASK_UID_RANGE
        assert low <= first["uid"] <= high and low <= bob["uid"] <= high
        assert first["uid"] != bob["uid"]
        assert first["gid"] == first["uid"] and first["groups"] in ([], [first["gid"]])
    else:
        assert first["uid"] == bob["uid"] == os.getuid()


def test_concurrent_tenants_run_in_different_processes(rt: Runtime) -> None:
    for task_id, tenant in ((1, "alice"), (2, "bob"), (3, "alice"), (4, "bob")):
        rt.start(task_id, "sleep", {"seconds": 0.5}, tenant=tenant)
    for task_id in range(1, 5):
        assert rt.result(task_id) == {"slept": 0.5}
    assert rt.runtime.processes is not None
    assert rt.runtime.processes.started == 4  # 4 at once: one process each


def test_the_environment_is_scrubbed_and_the_worker_token_is_not_passed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("STEWARD_WORKER_TOKEN", "s3cret-worker-token")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "s3cret-aws")
    rt = Runtime(tmp_path, JOB, token="s3cret-worker-token")
    try:
        rt.start(1, "job:whoami")
        env = rt.result(1)["env"]
    finally:
        rt.close()
    assert "s3cret" not in json.dumps(env)
    assert set(env) <= {
        "PATH", "LANG", "LC_ALL", "TZ", "JAVA_HOME", "SPARK_HOME", "HOME", "TMPDIR",
        "PYTHONPATH", "PYTHONUNBUFFERED", "SPARK_LOCAL_IP",
        # a uid without a passwd entry gets one of its own (clients/worker/task_env.py)
        "LD_PRELOAD", "NSS_WRAPPER_PASSWD", "NSS_WRAPPER_GROUP", "USER", "LOGNAME",
        "HADOOP_USER_NAME",
    }  # fmt: skip


def test_each_attempt_starts_in_a_clean_private_working_directory(rt: Runtime) -> None:
    rt.start(1, "job:write_cwd")
    rt.start(2, "job:whoami")  # at the same time: another process, another directory
    cwd = rt.result(1)
    seen = rt.result(2)
    assert cwd != seen["cwd"]
    assert Path(cwd).parent == rt.config.work_dir / "attempts"
    info = os.stat(cwd)
    assert stat.S_IMODE(info.st_mode) == 0o700
    assert info.st_uid == seen["uid"]
    assert seen["env"]["TMPDIR"] == seen["cwd"]
    # The next attempts, whichever process runs them, find nothing an earlier one left.
    for task_id in (3, 4, 5):
        rt.start(task_id, "job:list_cwd")
        assert rt.result(task_id)["files"] == []
    # Emptied off the dispatcher's thread, before that process takes another task.
    deadline = time.monotonic() + WAIT_S
    while os.path.exists(os.path.join(cwd, "left-behind.txt")) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert os.listdir(cwd) == []
    assert os.path.exists("/etc/passwd")  # the symlink was removed, not followed
    # A retired process's directory goes with it.
    rt.runtime.shutdown()
    assert not Path(cwd).exists()


def test_hard_cancel_ends_a_spinning_task_within_the_grace(rt: Runtime) -> None:
    rt.start(1, "job:spin", {"ready": rt.ready_path(1)})
    _wait_running(rt, 1)
    started = time.monotonic()
    rt.runtime.cancel((1, 1), "by test")
    report = rt.wait(1)
    elapsed_s = time.monotonic() - started
    assert report.error is not None and report.error.startswith("cancelled: by test")
    assert elapsed_s < rt.config.cancel_grace_s + 1.0
    _wait_no_busy_process(rt)


def test_a_task_ignoring_sigterm_is_killed_after_the_grace(rt: Runtime) -> None:
    rt.start(1, "job:stubborn", {"ready": rt.ready_path(1)})
    _wait_running(rt, 1)  # its SIG_IGN installed
    started = time.monotonic()
    rt.runtime.cancel((1, 1), "by test")
    report = rt.wait(1)
    elapsed_s = time.monotonic() - started
    assert report.error is not None and "its process was killed" in report.error
    assert rt.config.cancel_grace_s - 0.2 < elapsed_s < rt.config.cancel_grace_s + 1.0
    _wait_no_busy_process(rt)
    rt.start(2, "noop")  # the slot works again
    assert rt.result(2) is None


def test_a_segfault_or_exit_fails_only_its_task(rt: Runtime) -> None:
    rt.start(1, "sleep", {"seconds": 1.0})
    rt.start(2, "job:segfault")
    rt.start(3, "job:exit3")
    segv = rt.wait(2)
    assert segv.error == "the task's process exited with signal 11 (SIGSEGV)"
    exited = rt.wait(3)
    assert exited.error == "the task's process exited with code 3"
    assert rt.result(1) == {"slept": 1.0}  # the neighbour lives on


def test_a_task_over_its_memory_limit_fails_alone_with_the_limit_named(rt: Runtime) -> None:
    rt.start(1, "job:hog", resources={"memory_mb": 300})
    report = rt.wait(1)
    assert report.error is not None
    assert report.error.startswith("killed: memory limit 300 MB"), report.error[:300]
    rt.start(2, "job:hog")  # no limit by default: the same code succeeds
    assert rt.result(2) == 64


def test_stdout_stderr_and_the_task_logger_are_captured_per_attempt(rt: Runtime) -> None:
    rt.start(1, "job:chatty", "first")
    rt.start(2, "job:chatty", "second")
    assert rt.result(1) == "first" and rt.result(2) == "second"
    first = rt.runtime.output((1, 1))
    second = rt.runtime.output((2, 1))
    assert first is not None and second is not None
    for text, word in ((first.decode(), "first"), (second.decode(), "second")):
        assert f"to stdout {word}" in text
        assert f"to stderr {word}" in text
        assert f"through ctx.logger {word}" in text
    assert "second" not in first.decode() and "first" not in second.decode()


def test_output_is_bounded_to_its_last_bytes(tmp_path: Path) -> None:
    rt = Runtime(tmp_path, JOB, max_output_bytes=1000)
    try:
        rt.start(1, "job:chatty", "x" * 50_000)
        rt.result(1)
        output = rt.runtime.output((1, 1))
    finally:
        rt.close()
    assert output is not None
    assert len(output) < 1200 and b"earlier bytes of output dropped" in output


def test_a_process_is_recycled_after_max_tasks(tmp_path: Path) -> None:
    rt = Runtime(tmp_path, JOB, task_process_max_tasks=2, task_types={"*": 1})
    try:
        pids = []
        for task_id in range(1, 6):
            rt.start(task_id, "job:whoami")
            pids.append(rt.result(task_id)["pid"])
    finally:
        rt.close()
    assert pids[0] == pids[1] and pids[2] == pids[3] and pids[4] not in pids[:4]
    assert len(set(pids)) == 3


def test_idle_processes_are_ended_after_the_idle_timeout(tmp_path: Path) -> None:
    rt = Runtime(tmp_path, JOB, task_process_idle_s=0.5)
    try:
        rt.start(1, "job:whoami")
        pid = rt.result(1)["pid"]
        assert rt.runtime.processes is not None
        deadline = time.monotonic() + 5.0
        while rt.runtime.processes.live() or Path(f"/proc/{pid}").exists():
            if time.monotonic() > deadline:
                break
            time.sleep(0.05)
        assert rt.runtime.processes.live() == 0
        assert not Path(f"/proc/{pid}").exists()
    finally:
        rt.close()


def test_other_tenants_files_and_the_worker_are_out_of_reach(rt: Runtime) -> None:
    secret = rt.config.work_dir.parent / "worker-secret"
    secret.write_text("s3cret")
    os.chmod(secret, 0o600)
    rt.start(1, "job:read_file", str(secret))
    rt.start(2, "job:read_file", f"/proc/{os.getpid()}/environ")
    report, environ = rt.wait(1), rt.wait(2)
    if IS_ROOT:
        assert report.error is not None and "PermissionError" in report.error
        assert environ.error is not None and "PermissionError" in environ.error
    else:  # the same uid: only the worker's non-dumpable flag protects /proc
        assert report.ok


def test_task_users_root_needs_an_explicit_opt_in() -> None:
    with pytest.raises(TaskUserError, match="allow-root-tasks"):
        TaskIdentities(task_user="root", worker_uid=0)
    identity = TaskIdentities(task_user="root", worker_uid=0, allow_root=True).for_tenant("a")
    assert identity.uid == 0 and not identity.switch
    with pytest.raises(TaskUserError, match="only a worker running as root"):
        TaskIdentities(task_user="nobody", worker_uid=1000)


def test_dynamic_uids_are_distinct_per_tenant_and_stable() -> None:
    identities = TaskIdentities(worker_uid=0, uid_range=(70000, 70002))
    uids = [identities.for_tenant(t).uid for t in ("a", "b", "c")]
    assert sorted(uids) == [70000, 70001, 70002]
    assert identities.for_tenant("b").uid == uids[1]
    with pytest.raises(TaskUserError, match="used up"):
        identities.for_tenant("d")
    mapped = TaskIdentities(worker_uid=0, tenant_users={"a": "65534"}, task_user="1234")
    assert mapped.for_tenant("a").uid == 65534 and mapped.for_tenant("z").uid == 1234


def _wait_running(rt: Runtime, task_id: int) -> None:
    """Until the task's code says it runs (it creates its ready file)."""
    deadline = time.monotonic() + WAIT_S
    while not Path(rt.ready_path(task_id)).exists():
        assert time.monotonic() < deadline, f"task {task_id} did not start running"
        time.sleep(0.02)


def _wait_no_busy_process(rt: Runtime) -> None:
    processes = rt.runtime.processes
    assert processes is not None
    deadline = time.monotonic() + 2.0
    while processes.live() > len(processes.idle_pids()):
        assert time.monotonic() < deadline, "the cancelled task's process still holds its slot"
        time.sleep(0.02)


def test_the_worker_says_at_start_when_task_users_cannot_run_its_python(tmp_path: Path) -> None:
    closed = tmp_path / "closed"
    closed.mkdir(mode=0o700)
    python = closed / "python3"
    python.symlink_to(sys.executable)
    config = WorkerConfig(
        broker="127.0.0.1:1",
        http_url="http://127.0.0.1:1",
        work_dir=work_root(tmp_path),
        task_python=str(python),
    )
    try:
        if IS_ROOT:  # CI: the task user (a dynamic uid) cannot pass the 0700 directory
            with pytest.raises(ValueError, match=r"cannot run .* Install Steward in a virtualenv"):
                check_task_processes(config)
        else:  # tasks run as the worker, which can
            check_task_processes(config)
    finally:
        shutil.rmtree(config.work_dir.parent, ignore_errors=True)


def _learn(rt: Runtime, task_id: int, fn: str, params: Any = None) -> None:
    """Run a type until the worker's mean of its run time settles (a first run is slower:
    its code is cold), at most 50 times; task ids from task_id * 1000."""
    pool = rt.runtime.processes
    assert pool is not None
    previous = None
    for n in range(50):
        rt.start(task_id * 1000 + n, fn, params)
        rt.result(task_id * 1000 + n)
        mean = pool.mean_run_us("alice", fn)
        if previous is not None and mean is not None and abs(mean - previous) < 0.1 * previous:
            return
        previous = mean


def _start_batch(rt: Runtime, tasks: list[tuple[int, str, Any]]) -> None:
    """Start several tasks as one assignment frame does (Runs held and written together)."""
    with rt.runtime.batched():
        for task_id, fn, params in tasks:
            rt.start(task_id, fn, params)


def test_quick_tasks_are_pipelined_and_each_keeps_its_own_output(tmp_path: Path) -> None:
    rt = Runtime(tmp_path, JOB, task_types={"*": 16})
    try:
        _learn(rt, 1, "job:echo")
        ids = list(range(2, 14))
        _start_batch(rt, [(task_id, "job:echo", None) for task_id in ids])
        pids = {rt.result(task_id) for task_id in ids}
        # Twelve slots free, yet one process ran them all (one per task without pipelining).
        assert len(pids) == 1, pids
        for task_id in ids:
            assert rt.runtime.output((task_id, 1)) == f"task {task_id}\n".encode()
    finally:
        rt.close()


def test_slow_task_types_are_not_pipelined(rt: Runtime) -> None:
    _learn(rt, 1, "job:nap")
    _start_batch(rt, [(task_id, "job:nap", None) for task_id in (2, 3, 4, 5)])
    pids = [rt.result(task_id) for task_id in (2, 3, 4, 5)]
    assert len(set(pids)) == 4, pids  # one process each, at once


def test_a_cancelled_queued_task_is_skipped_at_once_and_the_process_kept(rt: Runtime) -> None:
    _learn(rt, 1, "job:gate")
    _learn(rt, 2, "job:echo")
    release = Path(rt.ready_path(3))
    _start_batch(rt, [(3, "job:gate", {"wait": str(release)}), (4, "job:echo", None)])
    started = time.monotonic()
    rt.runtime.cancel((4, 1), "by test")
    report = rt.wait(4)
    assert report.error == "cancelled: by test"
    assert time.monotonic() - started < 1.0  # not held up by the task running before it
    assert (3, 1) not in rt.reports  # which runs on, untouched
    release.touch()
    pid = rt.result(3)
    rt.start(5, "job:echo")
    assert rt.result(5) == pid  # the process was not retired
    assert not rt.runtime.output((4, 1))  # it never ran: no output


def test_tasks_queued_behind_a_crash_run_elsewhere(rt: Runtime) -> None:
    _learn(rt, 1, "job:gate")
    _learn(rt, 2, "job:echo")
    _start_batch(
        rt,
        [(3, "job:gate", {"exit": True})] + [(task_id, "job:echo", None) for task_id in (4, 5, 6)],
    )
    crashed = rt.wait(3, timeout_s=40)
    assert crashed.error is not None and "exited with code 3" in crashed.error
    for task_id in (4, 5, 6):  # queued behind it in the same process: never started there
        rt.result(task_id)
        assert rt.runtime.output((task_id, 1)) == f"task {task_id}\n".encode()


def _python_that_crashes_once(root: Path) -> tuple[Path, Path]:
    """A task python whose first start dies before it is ready (as a gRPC abort in the
    background Spark import can), and every later one is the real python."""
    root.mkdir(mode=0o755)
    shared = root / "shared"
    shared.mkdir()
    os.chmod(shared, 0o1777)  # task users (dynamic uids under root) leave the marker
    marker = shared / "crashed"
    python = root / "python3"
    python.write_text(
        f'#!/bin/sh\nif [ ! -e "{marker}" ]; then : > "{marker}"; echo "crash at start" >&2;'
        f' exit 7; fi\nexec "{sys.executable}" "$@"\n'
    )
    python.chmod(0o755)
    return python, marker


def test_a_task_process_that_dies_while_starting_is_replaced_once(tmp_path: Path) -> None:
    work_dir = work_root(tmp_path)
    python, marker = _python_that_crashes_once(work_dir.parent / "bin")
    rt = Runtime(tmp_path, JOB, work_dir=work_dir, task_python=str(python))
    try:
        rt.start(1, "job:whoami")
        assert rt.result(1)["tenant"] == "alice"
        assert marker.exists()  # the first process did die
        assert rt.runtime.processes is not None and rt.runtime.processes.started == 1
    finally:
        rt.close()
