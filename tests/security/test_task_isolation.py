"""Issue 14, items 1 and 3 end to end: tenant code in task processes, out of reach.

A real ``steward standalone`` with authentication on and a real ``steward worker``
(token in a file), as CI runs them: as root, so each tenant's task processes get a uid of
their own. Tenant code (a code artifact) then tries what a hostile tenant would:

- search everything it can reach for the worker token (its environment, every process's
  ``/proc/<pid>/environ`` and ``cmdline`` it can open, the worker's memory, its own
  memory, the files it can read where the worker keeps its things);
- read another tenant's running task process (its environment, memory, descriptors) while
  that task holds a secret in its params;
- two tenants run at once in different processes under different uids; with
  ``--task-user nobody`` tasks run as uid 65534.

Every wait is bounded; processes are stopped when the test ends.
"""

from __future__ import annotations

import hashlib
import os
import pwd
import secrets
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.procs import HOST, BrokerProcess, authenticated_broker
from tests.support.worker_procs import WorkerProcess, wait_until

ADMIN = "admin-secret-for-the-isolation-test"
# Made per run: a copy of this file anywhere a task can read must not count as a find.
WORKER_TOKEN = f"worker-token-the-tasks-hunt-for-{secrets.token_hex(12)}"
PARAMS_SECRET = f"tenant-a-params-secret-{secrets.token_hex(12)}"

JOB = b'''\
import gc, hashlib, json, os, re, time

# The task is told only a prefix, the length and the sha256 of the worker token, so any
# match is the token itself, never the search's own params.
NEEDLE = None


def _contains(data):
    prefix, length, digest = NEEDLE
    start = data.find(prefix)
    while start >= 0:
        if hashlib.sha256(data[start:start + length]).hexdigest() == digest:
            return True
        start = data.find(prefix, start + 1)
    return False


def _readable(path, limit=4 << 20):
    try:
        with open(path, "rb") as f:
            return f.read(limit)
    except OSError as exc:
        return exc


def _own_memory():
    \"\"\"Every str/bytes object of this process, and its raw mappings where /proc lets it
    (a non-dumpable process may not read even its own mem).\"\"\"
    for obj in gc.get_objects():
        if isinstance(obj, dict):
            values = obj.values()
        else:
            values = obj if isinstance(obj, (list, tuple)) else ()
        for item in values:
            if isinstance(item, str) and _contains(item.encode(errors="replace")):
                return True
            if isinstance(item, bytes) and _contains(item):
                return True
    try:
        maps = open("/proc/self/maps")
        mem = open("/proc/self/mem", "rb", 0)
    except OSError:
        return False
    with maps, mem:
        for line in maps:
            span, perms = line.split()[:2]
            start, end = (int(x, 16) for x in span.split("-"))
            if "r" not in perms or end - start > 256 << 20:
                continue
            try:
                mem.seek(start)
                if _contains(mem.read(end - start)):
                    return True
            except (OSError, ValueError, OverflowError):
                continue
    return False


def hunt(params, ctx):
    global NEEDLE
    NEEDLE = (params["prefix"].encode(), params["length"], params["digest"])
    found, refused = [], []
    if _contains(json.dumps(dict(os.environ)).encode()):
        found.append("environ")
    for pid in filter(str.isdigit, os.listdir("/proc")):
        for name in ("environ", "cmdline", "mem"):
            data = _readable(f"/proc/{pid}/{name}")
            if isinstance(data, bytes) and _contains(data):
                found.append(f"/proc/{pid}/{name}")
            elif isinstance(data, OSError) and int(pid) == params["worker_pid"]:
                refused.append(name)
    if isinstance(_readable(f"/proc/{params['worker_pid']}/maps"), bytes):
        found.append("worker maps readable")
    if _own_memory():
        found.append("own memory")
    files = 0
    for root in params["roots"]:
        for dirpath, dirnames, filenames in os.walk(root):
            for name in filenames:
                files += 1
                data = _readable(os.path.join(dirpath, name))
                if isinstance(data, bytes) and _contains(data):
                    found.append(os.path.join(dirpath, name))
                if files > 5000:
                    break
    if isinstance(_readable(params["token_file"]), bytes):
        found.append("token file")
    return {"found": found, "refused": sorted(set(refused)), "uid": os.getuid()}


def hold(params, ctx):
    """Hold a secret in memory and in params while the other tenant looks."""
    secret = params["secret"] * 1
    with open(os.path.join(os.getcwd(), "pid"), "w") as f:
        f.write(str(os.getpid()))
    print("holding", flush=True)
    ctx.cancelled.wait(params["seconds"])
    return {"pid": os.getpid(), "uid": os.getuid(), "len": len(secret),
            "start": params["t0"], "end": time.time()}


def peek(params, ctx):
    """Try every route into another tenant's process."""
    pid = params["pid"]
    results = {}
    for name in ("environ", "mem", "maps", "fd", "cwd", "root", "status"):
        path = f"/proc/{pid}/{name}"
        try:
            if name in ("fd",):
                results[name] = os.listdir(path)
            elif name in ("cwd", "root"):
                results[name] = os.listdir(path)
            else:
                data = open(path, "rb").read(1 << 20)
                results[name] = params["secret"].encode() in data and "SECRET" or "read"
        except OSError as exc:
            results[name] = type(exc).__name__
    return {"peek": results, "pid": os.getpid(), "uid": os.getuid(), "end": time.time()}


def whoami(params, ctx):
    return {"uid": os.getuid(), "gid": os.getgid(), "pid": os.getpid()}
'''


@dataclass
class Cluster:
    broker: BrokerProcess
    worker: WorkerProcess
    http: httpx.Client
    sha: str
    token_file: Path
    cache_dir: Path

    def submit(self, fn: str, tenant: str, params: dict[str, Any]) -> int:
        task = {"type": f"job:{fn}", "tenant": tenant, "code": self.sha, "params": params}
        response = self.http.post("/api/v1/tasks", json=task)
        assert response.status_code == 201, response.text
        task_id: int = response.json()["id"]
        return task_id

    def result(self, task_id: int) -> Any:
        done = self.http.get(f"/api/v1/tasks/{task_id}", params={"wait_s": 60}, timeout=90)
        body = done.json()
        assert body["state"] == "finished", (body, self.worker.log_tail())
        return body["result"]


def _cluster(tmp_path: Path, *worker_args: str) -> Iterator[Cluster]:
    with authenticated_broker(tmp_path, admin_token=ADMIN, worker_token=WORKER_TOKEN) as auth:
        broker, http, token_file = auth.broker, auth.http, auth.worker_token_file
        worker = WorkerProcess(
            broker=f"{HOST}:{auth.worker_port}",
            http_url=broker.url,
            worker_id="w-isolation",
            log_dir=tmp_path / "logs",
            cache_dir=tmp_path / "cache",
            extra_args=("--token-file", str(token_file), "--task-type", "*=4", *worker_args),
        ).start()
        try:
            worker.wait_connected(http)
            uploaded = http.post("/api/v1/code", params={"name": "job.py"}, content=JOB)
            assert uploaded.status_code == 201, uploaded.text
            yield Cluster(
                broker, worker, http, uploaded.json()["sha256"], token_file, tmp_path / "cache"
            )
        except BaseException:
            print(worker.log_tail())
            print(broker.log_tail())
            raise
        finally:
            worker.stop()


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    yield from _cluster(tmp_path)


def test_a_task_searching_everything_it_can_reach_finds_no_worker_token(cluster: Cluster) -> None:
    assert cluster.worker.proc is not None
    worker_pid = cluster.worker.proc.pid
    roots = [str(cluster.cache_dir), "/tmp", str(Path.home())]
    task_id = cluster.submit(
        "hunt",
        "mallory",
        {
            "prefix": WORKER_TOKEN[:12],
            "length": len(WORKER_TOKEN),
            "digest": hashlib.sha256(WORKER_TOKEN.encode()).hexdigest(),
            "worker_pid": worker_pid,
            "roots": roots,
            "token_file": str(cluster.token_file),
        },
    )
    seen = cluster.result(task_id)
    assert seen["found"] == [], seen
    assert os.geteuid() == 0, "CI runs as root: this test checks tasks run under other uids"
    assert seen["uid"] != 0
    # The worker's environment and memory were refused, not merely empty.
    assert {"environ", "mem"} <= set(seen["refused"]), seen
    assert WORKER_TOKEN.encode() not in Path(f"/proc/{worker_pid}/cmdline").read_bytes()


def test_another_tenants_running_task_is_out_of_reach(cluster: Cluster) -> None:
    t0 = time.time()
    holder = cluster.submit("hold", "alice", {"secret": PARAMS_SECRET, "seconds": 30, "t0": t0})
    pid = wait_until(lambda: _holder_pid(cluster, t0), 30, "alice's task to start")
    peeker = cluster.submit("peek", "bob", {"pid": pid, "secret": PARAMS_SECRET})
    peeked = cluster.result(peeker)
    cluster.http.post(f"/api/v1/tasks/{holder}/cancel")
    for route, outcome in peeked["peek"].items():
        if route == "status":  # world-readable by design (state, uids); no secrets
            continue
        assert outcome == "PermissionError", (route, peeked)
    assert peeked["uid"] != 0 and peeked["pid"] != pid


def _holder_pid(cluster: Cluster, t0: float) -> int | None:
    # The holder writes its pid into its working directory; the worker's default work dir
    # is $TMPDIR/steward-worker-<uid>-<worker id>/attempts/<uid>-<random>/pid (root can
    # read; the worker inherits this test process's TMPDIR: tests/support/tmp_dirs.py).
    # Other tests' workers left theirs: only a file written since t0 counts.
    work_dirs = Path(tempfile.gettempdir()).glob(f"steward-worker-{os.geteuid()}-*")
    for path in (pid for work_dir in work_dirs for pid in work_dir.glob("attempts/*/pid")):
        try:
            if path.stat().st_mtime < t0 - 1:
                continue
            return int(path.read_text())
        except (OSError, ValueError):
            continue
    return None


def test_two_tenants_run_at_once_in_different_processes_under_different_uids(
    cluster: Cluster,
) -> None:
    t0 = time.time()
    ids = [
        cluster.submit("hold", tenant, {"secret": "x", "seconds": 1.5, "t0": t0})
        for tenant in ("alice", "bob")
    ]
    alice, bob = (cluster.result(task_id) for task_id in ids)
    assert alice["pid"] != bob["pid"]
    assert alice["uid"] != bob["uid"] and 0 not in (alice["uid"], bob["uid"])
    # They overlapped: one after the other, their ends would be 1.5 s apart or more.
    assert abs(alice["end"] - bob["end"]) < 1.4


def test_with_task_user_nobody_tasks_run_as_uid_65534(tmp_path: Path) -> None:
    nobody = pwd.getpwnam("nobody")
    for cluster in _cluster(tmp_path, "--task-user", "nobody"):
        task_id = cluster.submit("whoami", "alice", {})
        seen = cluster.result(task_id)
        assert seen["uid"] == nobody.pw_uid == 65534
        assert seen["gid"] == nobody.pw_gid
