"""What the edge tests (tests/security/test_*_edges.py) watch while they attack a broker:
its resident memory and whether ``GET /healthz`` keeps answering within a second.

:class:`AttackWatch` samples both in a thread every ``interval_s`` over one kept-alive
connection (opened before the attack, so a connection cap does not refuse it).
"""

from __future__ import annotations

import re
import socket
import threading
import time
from pathlib import Path
from types import TracebackType

import httpx

HOST = "127.0.0.1"
# The bounds issue 14 asks for during each attack.
MAX_RSS_GROWTH_BYTES = 64 * 1024 * 1024
MAX_HEALTHZ_S = 1.0
# Bounds of a probe that does not answer at all (beyond MAX_HEALTHZ_S it failed anyway).
_PROBE_TIMEOUT_S = 5.0
_JOIN_TIMEOUT_S = 15.0


def rss_bytes(pid: int, field: str = "VmRSS") -> int:
    """The process's resident set size (or another ``/proc/PID/status`` size, e.g. its
    high-water mark ``VmHWM``)."""
    status = Path(f"/proc/{pid}/status").read_text()
    match = re.search(rf"^{field}:\s+(\d+) kB$", status, re.MULTILINE)
    assert match is not None, status
    return int(match.group(1)) * 1024


class AttackWatch:
    """Context manager: memory and /healthz latency of the broker while the block runs."""

    def __init__(self, url: str, pid: int, *, interval_s: float = 0.1) -> None:
        self.url = url
        self.pid = pid
        self.interval_s = interval_s
        self.baseline_rss = 0
        self.peak_rss = 0
        self.probes = 0
        self.slowest_s = 0.0
        self.failures: list[str] = []
        self._hwm_before = 0
        self._stop = threading.Event()
        self._client = httpx.Client(base_url=url, timeout=_PROBE_TIMEOUT_S)
        self._thread = threading.Thread(target=self._run, name="attack-watch", daemon=True)

    def __enter__(self) -> AttackWatch:
        self._probe()  # opens the kept-alive connection before the attack
        self.baseline_rss = self.peak_rss = rss_bytes(self.pid)
        self._hwm_before = rss_bytes(self.pid, "VmHWM")
        self._thread.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._stop.set()
        self._thread.join(_JOIN_TIMEOUT_S)
        self._client.close()

    def _probe(self) -> None:
        started = time.monotonic()
        try:
            response = self._client.get("/healthz")
        except httpx.HTTPError as exc:
            self.failures.append(f"/healthz: {exc!r}")
            return
        elapsed = time.monotonic() - started
        self.probes += 1
        self.slowest_s = max(self.slowest_s, elapsed)
        if response.status_code != 200:
            self.failures.append(f"/healthz: HTTP {response.status_code} {response.text}")

    def _run(self) -> None:
        while not self._stop.is_set():
            self._probe()
            self.peak_rss = max(self.peak_rss, rss_bytes(self.pid))
            self._stop.wait(self.interval_s)

    @property
    def rss_growth_bytes(self) -> int:
        return self.peak_rss - self.baseline_rss

    def check(self) -> None:
        """The issue's bounds: memory grew < 64 MB and every /healthz answered within 1 s."""
        self.peak_rss = max(self.peak_rss, rss_bytes(self.pid))
        hwm_after = rss_bytes(self.pid, "VmHWM")
        if hwm_after > self._hwm_before:  # a new high-water mark, maybe between two samples
            self.peak_rss = max(self.peak_rss, hwm_after)
        assert not self._thread.is_alive(), "the watch thread did not stop"
        assert not self.failures, self.failures[:5]
        assert self.probes >= 2, "too few /healthz probes during the attack"
        assert self.slowest_s < MAX_HEALTHZ_S, f"/healthz took {self.slowest_s:.2f} s"
        assert self.rss_growth_bytes < MAX_RSS_GROWTH_BYTES, (
            f"broker RSS grew by {self.rss_growth_bytes / 2**20:.0f} MiB "
            f"({self.baseline_rss / 2**20:.0f} -> {self.peak_rss / 2**20:.0f} MiB)"
        )


def connect(port: int, timeout_s: float = 10.0) -> socket.socket:
    sock = socket.create_connection((HOST, port), timeout=timeout_s)
    sock.settimeout(timeout_s)
    return sock


def read_until_closed(sock: socket.socket, max_bytes: int = 1 << 20) -> bytes:
    """What the peer sends until it closes (or resets) the connection, bounded by the
    socket's timeout per read and by ``max_bytes``."""
    received = bytearray()
    while len(received) < max_bytes:
        try:
            data = sock.recv(65536)
        except ConnectionResetError:
            break
        if not data:
            break
        received += data
    return bytes(received)


def send_ignoring_close(sock: socket.socket, data: bytes, chunk_bytes: int = 1 << 20) -> int:
    """Send ``data`` until done or the peer closes; returns the bytes sent."""
    sent = 0
    view = memoryview(data)
    try:
        while sent < len(data):
            sock.sendall(view[sent : sent + chunk_bytes])
            sent += min(chunk_bytes, len(data) - sent)
    except (BrokenPipeError, ConnectionResetError):
        pass
    return sent
