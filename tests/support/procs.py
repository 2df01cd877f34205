"""Process helpers for integration tests: free ports, a standalone broker subprocess.

Every wait here is bounded, and :class:`BrokerProcess` is a context manager that
always kills its subprocess (by pid, never by name) when the block ends.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import re
import shutil
import signal
import ssl
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any

import httpx

from clients.dev.local_server import HOST as HOST
from clients.dev.local_server import free_port as free_port
from tests.support.logged_process import (
    LoggedProcess,
    wait_healthy,
)

if TYPE_CHECKING:
    from tests.support.tls_certs import TlsFiles

DEFAULT_START_TIMEOUT_S = 30.0
DEFAULT_STOP_TIMEOUT_S = 30.0


def steward_command() -> list[str]:
    """How to run the ``steward`` CLI of the environment running the tests."""
    script = Path(sys.executable).parent / "steward"
    if script.is_file() and os.access(script, os.X_OK):
        return [str(script)]
    found = shutil.which("steward")
    if found is not None and Path(found).parent == Path(sys.executable).parent:
        return [found]
    return [sys.executable, "-m", "clients.cli"]


def steward_output(url: str, *args: str, timeout_s: float = 60) -> str:
    """Run the ``steward`` CLI against ``url`` (comma-separated for a cluster); its stdout,
    asserting it exited 0."""
    result = subprocess.run(
        [*steward_command(), "--url", url, *args],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        stdin=subprocess.DEVNULL,
    )
    assert result.returncode == 0, (result.stdout, result.stderr)
    return result.stdout


@functools.cache
def steward_help(command: str) -> str:
    """What ``steward <command> --help`` prints ("" when it does not answer within 60 s)."""
    try:
        result = subprocess.run(
            [*steward_command(), command, "--help"],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
    except subprocess.TimeoutExpired:
        return ""
    return result.stdout


@functools.cache
def standalone_listen_options() -> tuple[str, ...]:
    """Options of ``steward standalone`` besides ``--http`` that take a HOST:PORT to listen on.

    Each broker a test starts gets a free port for every one of them, so brokers of
    concurrent test runs never fight over a fixed default port.
    """
    found = re.findall(r"(--[a-z][a-z0-9-]*)[ =]HOST:PORT", steward_help("standalone"))
    return tuple(sorted(set(found) - {"--http"}))


class BrokerStartError(RuntimeError):
    """The broker subprocess did not become healthy in time (its log tail is included)."""


class BrokerProcess(LoggedProcess):
    """One ``steward standalone`` subprocess on ``data_dir``; output goes to ``log_path``.

    ``start()`` picks a fresh port each time (so a restart never waits for the old
    socket), waits for ``/healthz`` to answer 200 and retries on a lost port race.
    """

    def __init__(
        self,
        data_dir: Path,
        *,
        log_path: Path,
        snapshot_interval_s: float | None = None,
        ledger_roll_mb: float | None = None,
        extra_args: tuple[str, ...] = (),
        env: dict[str, str] | None = None,
        tls: TlsFiles | None = None,
    ) -> None:
        super().__init__("broker", log_path)
        self.data_dir = data_dir
        # Serve HTTPS and a TLS worker endpoint with this certificate (url is https://).
        self.tls = tls
        self.snapshot_interval_s = snapshot_interval_s
        self.ledger_roll_mb = ledger_roll_mb
        self.extra_args = extra_args
        self.env = env
        self.port = 0
        self.starts = 0

    # -- lifecycle -------------------------------------------------------------------------

    @property
    def url(self) -> str:
        return f"{'https' if self.tls is not None else 'http'}://{HOST}:{self.port}"

    @property
    def verify(self) -> ssl.SSLContext | bool:
        """httpx's ``verify=`` for this broker (its CA when it serves TLS)."""
        return self.tls.client_context() if self.tls is not None else True

    def _command(self, port: int) -> list[str]:
        cmd = [
            *steward_command(),
            "standalone",
            "--data-dir",
            str(self.data_dir),
            "--http",
            f"{HOST}:{port}",
            "--log-level",
            "INFO",
        ]
        if self.snapshot_interval_s is not None:
            cmd += ["--snapshot-interval-s", str(self.snapshot_interval_s)]
        if self.ledger_roll_mb is not None:
            cmd += ["--ledger-roll-mb", str(self.ledger_roll_mb)]
        for option in standalone_listen_options():
            if option not in self.extra_args:
                cmd += [option, f"{HOST}:{free_port()}"]
        if self.tls is not None:
            cmd += self.tls.broker_args()
        return cmd + list(self.extra_args)

    def start(
        self, timeout_s: float = DEFAULT_START_TIMEOUT_S, *, busy_port_wait_s: float = 60.0
    ) -> None:
        """Start the broker and wait until it is healthy (at most ``timeout_s`` per attempt).

        A start that fails only because a port is taken is retried with a new HTTP port:
        the free port may have been grabbed meanwhile, and the broker may also listen on
        fixed ports (the workers' one) that other brokers on this host hold for a while.
        Such retries go on for at most ``busy_port_wait_s``.
        """
        assert not self.running(), "broker already running"
        give_up = time.monotonic() + busy_port_wait_s
        pause_s = 0.1
        while True:
            self._spawn(free_port())
            try:
                self.wait_healthy(timeout_s)
                return
            except BrokerStartError:
                self.kill9()
                output = self.start_output()
                port_taken = "could not serve HTTP" in output or "address already in use" in output
                if not port_taken or time.monotonic() + pause_s > give_up:
                    raise
            time.sleep(pause_s)
            pause_s = min(pause_s * 2, 2.0)

    def start_output(self) -> str:
        """What the broker printed since its latest start."""
        try:
            with open(self.log_path, "rb") as log_file:
                log_file.seek(self.log_offset)
                return log_file.read().decode(errors="replace")
        except FileNotFoundError:
            return ""

    def _spawn(self, port: int) -> None:
        self.port = port
        self.starts += 1
        header = f"\n===== start #{self.starts} on port {port} at {time.time():.3f} =====\n"
        env = dict(os.environ if self.env is None else self.env)
        env["PYTHONUNBUFFERED"] = "1"
        self.spawn_logged(self._command(port), env, header)

    def wait_healthy(self, timeout_s: float = DEFAULT_START_TIMEOUT_S) -> dict[str, Any]:
        """Poll ``/healthz`` until it answers 200; raise if the process dies or time runs out."""
        return wait_healthy(
            self.url,
            lambda: self.proc,
            name="broker",
            verify=self.verify,
            timeout_s=timeout_s,
            probe_timeout_s=2.0,
            tail=self.log_tail,
            error=BrokerStartError,
        )

    kill = LoggedProcess.kill9

    def terminate(self, timeout_s: float = DEFAULT_STOP_TIMEOUT_S) -> int:
        """SIGTERM (clean shutdown) and wait for the exit code; SIGKILL if it hangs."""
        assert self.proc is not None, "broker not started"
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.proc.pid, signal.SIGTERM)
        return self.wait_for_exit(timeout_s, AssertionError, " of SIGTERM")

    def __enter__(self) -> BrokerProcess:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.kill9()


# -- HTTP helpers ------------------------------------------------------------------------------


def fetch_all_tasks(
    client: httpx.Client, *, page: int = 1000, max_pages: int = 10_000
) -> list[dict[str, Any]]:
    """Every task, by paging ``GET /api/v1/tasks`` (ascending ids)."""
    tasks: list[dict[str, Any]] = []
    after = 0
    for _ in range(max_pages):
        response = client.get("/api/v1/tasks", params={"limit": page, "after": after})
        response.raise_for_status()
        body = response.json()
        tasks.extend(body["tasks"])
        next_after = body.get("next_after")
        if next_after is None:
            return tasks
        assert next_after > after, f"paging does not advance: {after} -> {next_after}"
        after = next_after
    raise AssertionError(f"more than {max_pages} pages of tasks")


def get_digest(client: httpx.Client) -> dict[str, Any]:
    response = client.get("/api/v1/state/digest")
    response.raise_for_status()
    body: dict[str, Any] = response.json()
    return body


@dataclasses.dataclass
class AuthenticatedBroker:
    """A started ``steward standalone`` with authentication on (:func:`authenticated_broker`)."""

    broker: BrokerProcess
    worker_port: int
    worker_token_file: Path  # the shared worker token, as workers read it (0600)
    http: httpx.Client  # as the admin


@contextlib.contextmanager
def authenticated_broker(
    root: Path, *, admin_token: str, worker_token: str
) -> Iterator[AuthenticatedBroker]:
    """A standalone broker whose admin token comes from the environment and whose shared
    worker token from a file (secrets never on a command line); stopped on exit."""
    token_file = root / "worker-token"
    token_file.write_text(worker_token + "\n")
    os.chmod(token_file, 0o600)
    worker_port = free_port()
    with BrokerProcess(
        root / "data",
        log_path=root / "broker.log",
        extra_args=(
            "--worker-listen",
            f"{HOST}:{worker_port}",
            "--worker-token-file",
            str(token_file),
        ),
        env={**os.environ, "STEWARD_ADMIN_TOKEN": admin_token},
    ) as broker:
        broker.start()
        http = httpx.Client(
            base_url=broker.url, headers={"authorization": f"Bearer {admin_token}"}, timeout=30
        )
        try:
            yield AuthenticatedBroker(broker, worker_port, token_file, http)
        finally:
            http.close()
