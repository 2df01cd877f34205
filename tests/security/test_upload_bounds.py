"""Hostile code artifacts: bounded on upload (a real served broker) and on the worker.

- a pathological ``.py`` (1 MiB of ``a+a+a+...``: ``ast.parse`` of it took +630 MB and
  seconds inside the broker) is refused or accepted, while the broker's RSS grows by
  less than 64 MB and ``/healthz`` answers within 1 s throughout;
- a ``.py`` over the size bound gets 413;
- zip bombs (100 MB of zeros compressed; 100k entries) get 413 without being inflated
  (same RSS and ``/healthz`` bounds), and the worker refuses them too;
- a cached artifact or unpacked tree changed while no process ran is verified and
  fetched (or unpacked) again, on the worker and in the broker's code store.
"""

from __future__ import annotations

import hashlib
import io
import os
import threading
import time
import zipfile
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from broker.artifacts.artifact_check import ArtifactLimits
from clients.worker.artifacts import ArtifactCache, ArtifactError
from tests.support.edge_probes import AttackWatch
from tests.support.procs import BrokerProcess

REPO_ROOT = Path(__file__).resolve().parents[2]
MIB = 1024 * 1024
UPLOAD_WAIT_S = 120.0  # a bound on each upload's answer, not a performance target


def pathological_py(size_bytes: int = MIB) -> bytes:
    """Valid Python of ``size_bytes`` whose syntax tree is one 500k-deep chain."""
    head, tail = b"x = ", b"a\n"
    return head + b"a+" * ((size_bytes - len(head) - len(tail)) // 2) + tail


def zeros_bomb(size_bytes: int = 100 * MIB) -> bytes:
    """One member of ``size_bytes`` zeros, deflated to about 100 KB (written in chunks)."""
    buf = io.BytesIO()
    with (
        zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as archive,
        archive.open("zeros.bin", "w", force_zip64=False) as member,
    ):
        chunk = bytes(MIB)
        for _ in range(size_bytes // MIB):
            member.write(chunk)
    return buf.getvalue()


def entries_bomb(entries: int = 100_000) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_STORED) as archive:
        for index in range(entries):
            archive.writestr(f"m{index}.py", b"")
    return buf.getvalue()


@pytest.fixture(scope="module")
def bombs() -> dict[str, bytes]:
    return {"zeros.zip": zeros_bomb(), "entries.zip": entries_bomb()}


def broker_env() -> dict[str, str]:
    # The broker subprocess runs this checkout's code.
    return {**os.environ, "PYTHONPATH": str(REPO_ROOT)}


@pytest.fixture(scope="module")
def broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BrokerProcess]:
    root = tmp_path_factory.mktemp("upload-bounds")
    with BrokerProcess(root / "data", log_path=root / "broker.log", env=broker_env()) as proc:
        proc.start()
        yield proc


def upload_while_probing(
    broker: BrokerProcess, uploads: list[tuple[str, bytes]]
) -> list[httpx.Response]:
    """Send ``uploads`` at once; meanwhile /healthz must answer within 1 s, every time,
    and the broker's RSS (sampled, and its high-water mark) may grow < 64 MB."""
    answers: list[httpx.Response | BaseException | None] = [None] * len(uploads)

    def send(index: int, name: str, data: bytes) -> None:
        try:
            with httpx.Client(base_url=broker.url, timeout=UPLOAD_WAIT_S) as http:
                answers[index] = http.post("/api/v1/code", params={"name": name}, content=data)
        except BaseException as exc:  # reported below
            answers[index] = exc

    threads = [
        threading.Thread(target=send, args=(i, name, data), daemon=True)
        for i, (name, data) in enumerate(uploads)
    ]
    deadline = time.monotonic() + UPLOAD_WAIT_S
    with AttackWatch(broker.url, broker.pid, interval_s=0.02) as watch:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=max(0.0, deadline - time.monotonic()))
            assert not thread.is_alive(), "an upload got no answer in time"
    watch.check()
    responses = []
    for answer in answers:
        assert isinstance(answer, httpx.Response), f"upload failed: {answer!r}"
        responses.append(answer)
    return responses


def error_of(response: httpx.Response) -> dict[str, str]:
    assert response.headers["content-type"].startswith("application/json"), response.headers
    error: dict[str, str] = response.json()["error"]
    assert error["message"], error
    return error


def test_pathological_py_is_checked_in_bounded_time_and_memory(broker: BrokerProcess) -> None:
    source = pathological_py()
    assert len(source) <= MIB  # within the size bound: it is the parse that is hostile
    responses = upload_while_probing(broker, [(f"deep{i}.py", source) for i in range(4)])
    for response in responses:
        assert response.status_code in (201, 400), response.text
        if response.status_code == 400:
            assert error_of(response)["code"] == "invalid_artifact"


def test_oversized_py_gets_413(broker: BrokerProcess) -> None:
    source = b"# a comment line of valid Python, repeated past the bound\n" * (MIB // 50)
    assert len(source) > MIB
    with httpx.Client(base_url=broker.url, timeout=30) as http:
        response = http.post("/api/v1/code", params={"name": "big.py"}, content=source)
        assert response.status_code == 413, response.text
        error = error_of(response)
        assert error["code"] == "too_large" and str(MIB) in error["message"], error
        # A small one still goes through.
        ok = http.post("/api/v1/code", params={"name": "ok.py"}, content=b"X = 1\n")
        assert ok.status_code == 201, ok.text
    deadline = time.monotonic() + 10
    while "big.py" not in broker.log_text() and time.monotonic() < deadline:
        time.sleep(0.05)
    refusal = [line for line in broker.log_text().splitlines() if "'big.py'" in line]
    assert refusal and "refused" in refusal[0] and "127.0.0.1:" in refusal[0], refusal


def test_zip_bombs_are_refused_without_inflating_them(
    broker: BrokerProcess, bombs: dict[str, bytes]
) -> None:
    responses = upload_while_probing(broker, list(bombs.items()))
    for (name, _), response in zip(bombs.items(), responses, strict=True):
        assert response.status_code == 413, f"{name}: {response.text}"
        assert error_of(response)["code"] == "too_large"
    zeros, entries = (r.json()["error"]["message"] for r in responses)
    assert "zip bomb" in zeros and "100 times" in zeros, zeros
    assert "more than 10000 entries" in entries, entries


# -- the worker ----------------------------------------------------------------------------


class Served:
    """An ``httpx.MockTransport`` serving artifacts by sha256, counting requests."""

    def __init__(self, *artifacts: bytes) -> None:
        self.files = {hashlib.sha256(a).hexdigest(): a for a in artifacts}
        self.requests = 0
        self.transport = httpx.MockTransport(self._handle)

    def _handle(self, request: httpx.Request) -> httpx.Response:
        self.requests += 1
        body = self.files.get(request.url.path.rsplit("/", 1)[-1])
        return httpx.Response(404) if body is None else httpx.Response(200, content=body)

    def cache(self, directory: Path) -> ArtifactCache:
        """A worker's cache on ``directory`` (a new one models a restarted worker)."""
        return ArtifactCache(directory, "http://broker.test", transport=self.transport)


def bytes_under(root: Path) -> int:
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file() and not p.is_symlink())


@pytest.mark.parametrize("name", ["zeros.zip", "entries.zip"])
def test_the_worker_refuses_zip_bombs(tmp_path: Path, bombs: dict[str, bytes], name: str) -> None:
    bomb = bombs[name]
    served = Served(bomb)
    sha = hashlib.sha256(bomb).hexdigest()
    cache = served.cache(tmp_path / "cache")
    try:
        with pytest.raises(ArtifactError, match=r"zip bomb|more than"):
            cache.load(sha)
    finally:
        cache.close()
    assert not (tmp_path / "cache" / sha).exists()
    # The archive itself, and nothing close to its inflated size.
    assert bytes_under(tmp_path / "cache") < len(bomb) + 2 * MIB


def test_the_worker_bounds_follow_its_limits(tmp_path: Path) -> None:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as archive:
        for index in range(3):
            archive.writestr(f"m{index}.py", f"X = {index}\n")
    served = Served(buf.getvalue())
    (sha,) = served.files
    limits = ArtifactLimits(max_zip_entries=2)
    cache = ArtifactCache(
        tmp_path / "cache", "http://broker.test", transport=served.transport, limits=limits
    )
    try:
        with pytest.raises(ArtifactError, match="more than 2 entries"):
            cache.load(sha)
    finally:
        cache.close()


def jobs_zip() -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as archive:
        archive.writestr("tampered_jobs/__init__.py", "")
        archive.writestr("tampered_jobs/main.py", "def run(params, ctx):\n    return 'good'\n")
    return buf.getvalue()


def test_tampered_cached_artifacts_are_verified_and_fetched_again_after_a_restart(
    tmp_path: Path,
) -> None:
    plain = b"def run(params, ctx):\n    return 'good'\n"
    archive = jobs_zip()
    served = Served(plain, archive)
    plain_sha, zip_sha = (hashlib.sha256(b).hexdigest() for b in (plain, archive))
    cache_dir = tmp_path / "cache"
    first = served.cache(cache_dir)
    try:
        first.fetch(plain_sha)
        first.load(zip_sha)
    finally:
        first.close()
    assert served.requests == 2
    tree = cache_dir / zip_sha
    main = tree / "tampered_jobs" / "main.py"
    good_main = main.read_bytes()

    # While no worker runs: change the cached .py, the unpacked tree (a changed module,
    # an extra module and a planted .pyc), then start "again".
    (cache_dir / f"{plain_sha}.py").write_bytes(b"def run(params, ctx):\n    return 'evil'\n")
    main.write_bytes(b"def run(params, ctx):\n    return 'evil'\n")
    (tree / "tampered_jobs" / "extra.py").write_bytes(b"EVIL = 1\n")
    (tree / "tampered_jobs" / "__pycache__").mkdir()
    (tree / "tampered_jobs" / "__pycache__" / "main.cpython-311.pyc").write_bytes(b"evil")
    second = served.cache(cache_dir)
    try:
        path = second.fetch(plain_sha)
        assert path.read_bytes() == plain  # downloaded again
        assert second.downloads == 1
        second.load(zip_sha)  # the archive is intact: the tree is unpacked from it again
    finally:
        second.close()
    assert main.read_bytes() == good_main
    assert sorted(p.name for p in (tree / "tampered_jobs").iterdir()) == ["__init__.py", "main.py"]

    # A truncated archive is downloaded again, and an intact tree is used as it is.
    (cache_dir / f"{zip_sha}.zip").write_bytes(archive[:100])
    third = served.cache(cache_dir)
    try:
        third.load(zip_sha)
        assert third.downloads == 1
    finally:
        third.close()
    assert (cache_dir / f"{zip_sha}.zip").read_bytes() == archive


def test_a_tampered_code_store_file_is_not_served_after_a_restart(tmp_path: Path) -> None:
    source = b"def run(params, ctx):\n    return 'good'\n"
    with BrokerProcess(
        tmp_path / "data", log_path=tmp_path / "broker.log", env=broker_env()
    ) as proc:
        proc.start()
        with httpx.Client(base_url=proc.url, timeout=30) as http:
            created = http.post("/api/v1/code", params={"name": "job.py"}, content=source)
            assert created.status_code == 201, created.text
        sha = created.json()["sha256"]
        assert proc.terminate() == 0
        stored = tmp_path / "data" / "code" / sha
        stored.write_bytes(b"def run(params, ctx):\n    return 'evil'\n")
        proc.start()
        with httpx.Client(base_url=proc.url, timeout=30) as http:
            response = http.get(f"/api/v1/code/{sha}")
        assert response.status_code == 404, response.content
        assert error_of(response)["code"] == "not_found"
        assert not stored.exists()  # dropped, to be fetched again (cluster) or re-uploaded
        assert f"code artifact {sha}: the stored file hashes to" in proc.log_text()
