"""``steward demo`` on a machine not set up for it (issue 30, friction 1): each cause is said
in its first second, in one line saying what to do, with nothing left behind; another
worker on the host is no clash; a process that dies while starting is reported with the
cause it logged, at once, not after a minute's wait."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from clients.demo.run import ClusterStartError, local_cluster, preflight_problem
from clients.worker.config import default_work_dir
from clients.worker.task_env import lock_work_dir

ROOT = Path(__file__).resolve().parents[2]
IS_ROOT = os.geteuid() == 0


def test_a_python_task_users_cannot_reach_stops_the_demo_at_once_leaving_nothing(
    tmp_path: Path,
) -> None:
    # The interpreter behind a directory other users cannot pass (pyenv under a 0700 /root):
    # the demo's task processes, under uids of their own, cannot run it.
    closed = tmp_path / "closed"
    closed.mkdir(mode=0o700)
    python = closed / "python3"
    python.symlink_to(sys.executable)
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    # The symlink is no virtualenv's: the test's packages come by PYTHONPATH.
    site_packages = [path for path in sys.path if path.endswith("site-packages")]
    env = {
        **os.environ,
        "TMPDIR": str(scratch),
        "PYTHONPATH": os.pathsep.join([str(ROOT), *site_packages]),
    }
    result = subprocess.run(
        [str(python), "-m", "clients.cli", "demo"],
        capture_output=True,
        text=True,
        env=env,
        stdin=subprocess.DEVNULL,
        timeout=60,
    )
    if not IS_ROOT:  # tasks run under the caller's own uid, which can run it
        assert preflight_problem() is None
        return
    assert result.returncode == 2, result.stdout + result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("steward demo: its task processes, under uids of their own")
    # Every closed directory on the way, named (pytest's own 0700 tmp root among them).
    assert "; run ./scripts/demo" in lines[0] and " or chmod o+x " in lines[0]
    assert f" {closed} (traversal only)" in lines[0]
    assert "--task-user" not in lines[0]  # the demo takes no such flag
    assert "Traceback" not in result.stderr
    assert list(scratch.iterdir()) == [], "the demo left a directory behind"


def test_the_demo_s_worker_does_not_clash_with_a_worker_of_the_same_id(tmp_path: Path) -> None:
    # Another demo's (or a worker's) default work dir for the same worker id, held.
    held = default_work_dir("demo-worker-1")
    lock = lock_work_dir(held)
    try:
        with local_cluster(tmp_path / "data", log=tmp_path / "demo.log") as url:
            assert url.startswith("http://127.0.0.1:")
    finally:
        os.close(lock)


def test_a_worker_that_exits_while_starting_is_reported_with_its_cause(tmp_path: Path) -> None:
    log = tmp_path / "demo.log"
    with (
        pytest.raises(ClusterStartError) as raised,
        local_cluster(
            tmp_path / "data", log=log, worker_args=["--spark-user", "no-such-user-here"]
        ),
    ):
        pass
    message = str(raised.value)
    assert message.startswith("the worker did not connect: the worker demo-worker-1 exited")
    assert "no-such-user-here" in message, message  # the cause, from the worker's log


def test_the_demo_says_at_once_that_spark_would_have_no_user_name(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Before: a warning, 181 s of "waiting for Spark", then a traceback (the JVM, under a
    # uid with no passwd entry and no libnss-wrapper, had no home: "?/.ivy2.5.2/local").
    from clients.worker import task_env

    monkeypatch.setattr(task_env, "nss_wrapper_library", lambda: None)
    monkeypatch.setattr(task_env, "has_passwd_entry", lambda uid: False)
    problem = preflight_problem()
    if not IS_ROOT:  # Spark runs under the caller's own uid, which has a name
        assert problem is None
        return
    assert problem is not None
    assert "no passwd entry" in problem and "apt-get install libnss-wrapper" in problem
