"""Docs that run (issue 30): every ``python``, ``sh`` and ``bash`` block of README.md and
docs/*.md runs against a real standalone broker with real workers, unless it is marked an
excerpt (tests/support/doc_blocks.py; tests/unit/test_docs_blocks.py checks the fences and
the markers).

The broker is the README's own: its "By hand" block starts ``steward standalone ...
--workers 2``, then, after ``# in another shell:``, the client lines. The part before the
marker runs in the background in a temporary directory (it uses ./data and
.venv/bin/steward, which there is this environment's), once for the module; the rest is
that block's test. The README's address, ``127.0.0.1:8080`` (``localhost:8080``), is that
broker's free port in every block, and ``$URL`` / ``$STEWARD_URL`` hold its URL. One
deviation: the broker also gets ``--worker-listen`` on a free port, since the default
worker port (7070) may be held by another broker on this host.

Each block is a test named file:line, run as a process of its own (python blocks with this
interpreter, the repository on PYTHONPATH; shell blocks with ``bash -e -o pipefail``), in
file order (the README's lines first: ``steward logs 1`` reads the first task), and fails
with its output when it exits non-zero, times out, or prints an API error answer (curl
exits 0 on an HTTP 4xx).
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests.support.doc_blocks import ROOT, DocBlock, all_blocks
from tests.support.procs import HOST, free_port
from tests.support.worker_procs import wait_until

BLOCK_TIMEOUT_S = 180.0  # the first block waits for the workers' Spark servers to warm up
BROKER_START_TIMEOUT_S = 60.0
BROKER_STOP_TIMEOUT_S = 30.0
DOCS_ADDRESSES = ("127.0.0.1:8080", "localhost:8080")
ANOTHER_SHELL = "# in another shell:"
WORKERS = 2
API_ERROR = re.compile(r'"error"\s*:\s*\{\s*"code"')

BLOCKS = [block for block in all_blocks() if block.runs]


def _by_hand_block() -> DocBlock:
    found = [
        block
        for block in BLOCKS
        if block.path == "README.md" and ANOTHER_SHELL in block.text.splitlines()
    ]
    assert len(found) == 1, f"README.md has {len(found)} runnable blocks with {ANOTHER_SHELL!r}"
    return found[0]


def _split_by_hand(block: DocBlock) -> tuple[str, str]:
    """The README's "By hand" block: the broker's line, and what runs in another shell."""
    lines = block.text.splitlines()
    marker = lines.index(ANOTHER_SHELL)
    server = [line for line in lines[:marker] if line.strip()]
    assert len(server) == 1, server
    return server[0], "\n".join(lines[marker + 1 :]) + "\n"


@dataclass(frozen=True)
class DocsBroker:
    url: str
    port: int
    cwd: Path
    env: dict[str, str]

    def substitute(self, text: str) -> str:
        for address in DOCS_ADDRESSES:
            text = text.replace(address, f"{HOST}:{self.port}")
        return text


def _venv_in(cwd: Path) -> None:
    """``.venv/bin/steward`` in ``cwd`` is the steward of this interpreter's environment."""
    steward = Path(sys.executable).parent / "steward"
    if steward.is_file():
        (cwd / ".venv").symlink_to(Path(sys.executable).parent.parent)
        return
    bin_dir = cwd / ".venv" / "bin"
    bin_dir.mkdir(parents=True)
    (bin_dir / "steward").write_text(f'#!/bin/sh\nexec {sys.executable} -m clients.cli "$@"\n')
    (bin_dir / "steward").chmod(0o755)


def _cluster_ready(url: str) -> bool:
    try:
        answer = httpx.get(f"{url}/api/v1/cluster", timeout=2.0)
    except httpx.HTTPError:
        return False
    if answer.status_code != 200:
        return False
    workers = answer.json().get("workers") or []
    return sum(worker.get("state") == "connected" for worker in workers) >= WORKERS


@pytest.fixture(scope="module")
def docs_broker() -> Iterator[DocsBroker]:
    port = free_port()
    # Not under pytest's 0700 temporary root: task processes run under other uids.
    cwd = Path(tempfile.mkdtemp(prefix="steward-docs-"))
    cwd.chmod(0o755)
    _venv_in(cwd)
    url = f"http://{HOST}:{port}"
    env = {k: v for k, v in os.environ.items() if k not in ("STEWARD_TOKEN", "VIRTUAL_ENV")}
    env.update(
        URL=url,
        STEWARD_URL=url,
        PATH=os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")]),
        PYTHONPATH=str(ROOT),
        PYTHONUNBUFFERED="1",
    )
    broker = DocsBroker(url, port, cwd, env)
    server_line, _ = _split_by_hand(_by_hand_block())
    command = f"{broker.substitute(server_line)} --worker-listen {HOST}:{free_port()}"
    log_path = cwd / "broker.log"
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            ["bash", "-c", f"exec {command}"],
            cwd=cwd,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:

        def ready() -> bool:
            if process.poll() is not None:
                raise AssertionError(f"{command!r} exited: {log_path.read_text()[-4000:]}")
            return _cluster_ready(url)

        wait_until(ready, BROKER_START_TIMEOUT_S, f"{command!r} with {WORKERS} workers", 0.2)
        yield broker
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(BROKER_STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait(BROKER_STOP_TIMEOUT_S)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)  # worker processes the broker left
        shutil.rmtree(cwd, ignore_errors=True)


def _command(block: DocBlock, broker: DocsBroker) -> list[str]:
    text = block.text
    if block == _by_hand_block():
        _, text = _split_by_hand(block)
    text = broker.substitute(text)
    if block.language == "python":
        script = broker.cwd / f"block_{block.path.replace('/', '_')}_{block.line}.py"
        script.write_text(text)
        return [sys.executable, str(script)]
    return ["bash", "-e", "-o", "pipefail", "-c", text]


def _run(command: list[str], broker: DocsBroker) -> tuple[int | None, str]:
    """Its exit code (None: killed, with every process it started, at the timeout) and
    its output."""
    with tempfile.TemporaryFile() as output:
        process = subprocess.Popen(
            command,
            cwd=broker.cwd,
            env=broker.env,
            stdin=subprocess.DEVNULL,
            stdout=output,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            code: int | None = process.wait(BLOCK_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            code = None
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)  # what it left behind, or all of it
        process.wait()
        output.seek(0)
        return code, output.read().decode(errors="replace")


@pytest.mark.parametrize("block", BLOCKS, ids=[block.id for block in BLOCKS])
def test_the_docs_block_runs(block: DocBlock, docs_broker: DocsBroker) -> None:
    code, output = _run(_command(block, docs_broker), docs_broker)
    print(f"{block.id} printed:\n{output}")  # shown with -s or -rP
    tail = output[-4000:]
    assert code is not None, f"{block.id} did not end within {BLOCK_TIMEOUT_S} s:\n{tail}"
    assert code == 0, f"{block.id} exited {code}:\n{tail}"
    assert not API_ERROR.search(output), f"{block.id} printed an API error answer:\n{tail}"


def _all_pages(url: str, path: str, field: str, query: dict[str, str]) -> list[dict[str, object]]:
    found: list[dict[str, object]] = []
    after = 0
    while True:
        answer = httpx.get(f"{url}{path}", params={**query, "after": str(after)}, timeout=10.0)
        answer.raise_for_status()
        page = answer.json()
        found += page[field]
        if page.get("next_after") is None:
            return found
        after = int(page["next_after"])


def test_what_the_blocks_ran_failed_only_where_they_show_a_failure(docs_broker: DocsBroker) -> None:
    # A block can exit 0 while its task fails (curl prints the task's id either way): the
    # docs' failures are the `fail` task's, on purpose; no tree of theirs failed.
    failed = _all_pages(docs_broker.url, "/api/v1/tasks", "tasks", {"state": "error"})
    unexpected = [
        (task["id"], task["type"], task["error"]) for task in failed if task["type"] != "fail"
    ]
    assert not unexpected, unexpected
    for state in ("failed", "timed_out"):
        trees = _all_pages(docs_broker.url, "/api/v1/trees", "trees", {"state": state})
        assert not trees, trees
