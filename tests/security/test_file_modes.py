"""Steward's files are private: data files 0600, directories 0700, even with umask 022.

Ledgers, the ledger list, snapshots, the broker's code store, the data-dir lock and the
worker's artifact cache (downloaded files and unpacked trees), each created under
directories that did not exist yet; and a real ``steward standalone`` run, whose whole
data dir is walked after a clean shutdown.
"""

from __future__ import annotations

import hashlib
import io
import os
import stat
import zipfile
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from broker.artifacts.code_store import CodeStore
from broker.replication.node import DataDirLock
from clients.worker.artifacts import ArtifactCache
from log.api import LedgerInfo, LedgerList, LedgerState
from log.file import FileLedgerListStore, FileLedgerStore
from snapshot.store import SnapshotStore
from tests.support.procs import BrokerProcess

REPO_ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def umask_022() -> Iterator[None]:
    old = os.umask(0o022)
    try:
        yield
    finally:
        os.umask(old)


def modes_under(root: Path, *, include_root: bool = True) -> dict[str, int]:
    """Every path under ``root`` (not following symlinks) -> its permission bits."""
    found: dict[str, int] = {}
    if include_root:
        found["."] = stat.S_IMODE(root.lstat().st_mode)
    for dirpath, dirnames, filenames in os.walk(root):
        for name in [*dirnames, *filenames]:
            path = Path(dirpath, name)
            found[str(path.relative_to(root))] = stat.S_IMODE(path.lstat().st_mode)
    return found


def assert_private(root: Path) -> None:
    """Directories 0700 and files 0600, ``root`` included."""
    wrong = {}
    for relative, mode in modes_under(root).items():
        path = root / relative
        wanted = 0o700 if path.is_dir() and not path.is_symlink() else 0o600
        if mode != wanted:
            wrong[relative] = f"{mode:o} (want {wanted:o})"
    assert not wrong, f"not private under {root}: {wrong}"


async def test_ledger_files_and_list_are_private(tmp_path: Path) -> None:
    data = tmp_path / "new-data"  # neither it nor its subdirectories exist yet
    store = FileLedgerStore(data / "ledgers")
    writer = await store.create_ledger()
    await writer.append(b"entry")
    await writer.close()
    reader = await store.open_ledger(writer.ledger_id, recovery=True)  # writes fencing files
    await reader.close()
    second = await store.create_ledger()  # a second segment, and the next-id file again
    await second.close()
    lists = FileLedgerListStore(data / "lists" / "ledgers.list")
    closed = LedgerInfo(writer.ledger_id, 0, LedgerState.CLOSED, 0)
    await lists.compare_and_set(LedgerList((closed,)), -1)
    assert_private(data)
    assert len(os.listdir(data / "ledgers")) >= 3


def test_snapshot_files_are_private(tmp_path: Path) -> None:
    store = SnapshotStore(tmp_path / "new-data" / "snapshots", keep=2, cluster_id="c")
    for entry_id in range(3):  # a prune too
        store.write(ledger_id=1, entry_id=entry_id, digest="d", body=b"state" * 1000)
    assert_private(tmp_path / "new-data")
    assert len(store.list()) == 2


def test_code_store_and_data_dir_lock_are_private(tmp_path: Path) -> None:
    data = tmp_path / "new-data"
    lock = DataDirLock(data)
    lock.acquire()
    store = CodeStore(data / "code")
    sha = store.put(b"def run(params, ctx):\n    return 1\n")
    assert store.read(sha).startswith(b"def run")
    assert_private(data)
    assert (data / "broker.lock").is_file() and (data / "code" / sha).is_file()


def test_worker_cache_files_and_unpacked_trees_are_private(tmp_path: Path) -> None:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as archive:
        archive.writestr("jobs/__init__.py", "")
        archive.writestr("jobs/sub/__init__.py", "")
        archive.writestr("jobs/sub/main.py", "def run(params, ctx):\n    return 2\n")
        archive.writestr("data/", "")  # an explicit directory entry
    zipped = buf.getvalue()
    plain = b"def run(params, ctx):\n    return 3\n"
    served = {hashlib.sha256(b).hexdigest(): b for b in (zipped, plain)}

    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, content=served[request.url.path.rsplit("/", 1)[-1]])

    cache_dir = tmp_path / "new-home" / ".cache" / "steward"
    cache = ArtifactCache(cache_dir, "http://broker.test", transport=httpx.MockTransport(handler))
    try:
        for sha in served:
            cache.load(sha)
    finally:
        cache.close()
    assert_private(tmp_path / "new-home")
    zip_sha = hashlib.sha256(zipped).hexdigest()
    assert (cache_dir / zip_sha / "jobs" / "sub" / "main.py").is_file()
    assert (cache_dir / zip_sha / "data").is_dir()


def test_a_standalone_brokers_whole_data_dir_is_private(tmp_path: Path) -> None:
    data = tmp_path / "fresh" / "data"
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    with BrokerProcess(data, log_path=tmp_path / "broker.log", env=env) as broker:
        broker.start()
        with httpx.Client(base_url=broker.url, timeout=10) as http:
            response = http.post(
                "/api/v1/code", params={"name": "job.py"}, content=b"def run(p, c):\n    pass\n"
            )
            assert response.status_code == 201, response.text
            submitted = http.post("/api/v1/tasks", json={"type": "noop", "params": {}})
            assert submitted.status_code in (200, 201), submitted.text
        assert broker.terminate() == 0  # a clean shutdown writes a snapshot
    assert_private(tmp_path / "fresh")
    names = set(os.listdir(data))
    assert {"ledgers", "snapshots", "code", "broker.lock"} <= names, names
    assert os.listdir(data / "snapshots"), "no snapshot was written"
