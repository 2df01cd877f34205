"""Ports reserved for servers that stop and start again on the same port (the ZooKeeper
ensemble of tests/support/zk_ensemble.py: every member's config names the others' ports).

A port from :func:`clients.dev.local_server.free_port` (bind to port 0) lies in the
kernel's ephemeral range (``/proc/sys/net/ipv4/ip_local_port_range``). While its server is
not running (between the pick and the server's first bind, or after a kill) any process's
``bind(port 0)`` may be handed the same port: the other xdist process's in-process servers
do that all the time. A ZooKeeper member whose election port is taken retries the bind three
times, one second apart, then gives up its election listener and exits (exit status 14):
the ensemble silently loses a voter (docs/TESTING.md, findings table).

A reserved port is chosen outside the ephemeral range, which the kernel never hands out for
``bind(port 0)`` or an outgoing connection, and it is held by an exclusive ``flock`` on a
file in a directory every test process on this machine shares (other xdist processes, other
checkouts' runs), so two reservations never share a port while both are held; a port that
something can't bind next to (a listener, a connection on it) is skipped. The lock goes with
:meth:`PortReservation.release` or with the process.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import random
import socket
from pathlib import Path
from typing import IO

from clients.dev.local_server import HOST
from tests.support.tmp_dirs import shared_tmpdir

#: Where the lock files live (one per reserved port), shared by every test process here.
LOCK_DIR = shared_tmpdir() / "steward-test-ports"
#: Used when the ephemeral range leaves no room below it (and above it, none either).
_LOWEST_PORT = 20000
_EPHEMERAL_RANGE_PATH = Path("/proc/sys/net/ipv4/ip_local_port_range")
# Linux's default, for a system without /proc (the range is then only a guess).
_DEFAULT_EPHEMERAL_RANGE = (32768, 60999)


class PortReservationError(RuntimeError):
    """No port outside the ephemeral range could be reserved (the message says why)."""


def ephemeral_port_range() -> tuple[int, int]:
    """The kernel's range for ``bind(port 0)`` and outgoing connections (inclusive)."""
    try:
        low, high = (int(part) for part in _EPHEMERAL_RANGE_PATH.read_text().split())
    except (OSError, ValueError):
        return _DEFAULT_EPHEMERAL_RANGE
    return low, high


def reservable_ports() -> range:
    """The ports :func:`reserve_port` chooses from: below the ephemeral range (from port
    20000 up, clear of the well-known services' ports), or above it when there is no room
    below."""
    low, high = ephemeral_port_range()
    if low - _LOWEST_PORT >= 1000:
        return range(_LOWEST_PORT, low)
    if 65535 - high >= 1000:
        return range(high + 1, 65536)
    raise PortReservationError(
        f"the ephemeral port range {low}-{high} leaves fewer than 1,000 ports outside it"
    )


class PortReservation:
    """One reserved port: the lock is held until :meth:`release` (or the process ends)."""

    def __init__(self, port: int, lock_file: IO[bytes]) -> None:
        self.port = port
        self._lock_file: IO[bytes] | None = lock_file

    def release(self) -> None:
        """Give the port back (idempotent)."""
        if self._lock_file is not None:
            self._lock_file.close()  # closing drops the flock
            self._lock_file = None

    @property
    def held(self) -> bool:
        return self._lock_file is not None

    def __repr__(self) -> str:
        return f"PortReservation({self.port}, held={self.held})"


def reserve_port(*, prefer: int | None = None) -> PortReservation:
    """Reserve a port outside the ephemeral range that nobody else holds and that a server
    (binding with ``SO_REUSEADDR``, as ZooKeeper does) can bind now. ``prefer``: try that
    port first (tests of the reservation itself)."""
    candidates = reservable_ports()
    LOCK_DIR.mkdir(parents=True, exist_ok=True)
    start = random.randrange(len(candidates))
    order = [candidates[(start + i) % len(candidates)] for i in range(len(candidates))]
    if prefer is not None:
        order.insert(0, prefer)
    for port in order:
        reservation = _try_reserve(port)
        if reservation is not None:
            return reservation
    raise PortReservationError(
        f"every port in {candidates.start}-{candidates.stop - 1} is reserved or in use"
    )


def _try_reserve(port: int) -> PortReservation | None:
    lock_file = open(LOCK_DIR / f"{port}.lock", "ab")  # noqa: SIM115 (held by the reservation)
    try:
        fcntl.flock(lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock_file.close()
        return None
    if not _bindable(port):
        lock_file.close()
        return None
    with contextlib.suppress(OSError):
        os.utime(lock_file.fileno())  # when it was last reserved, for someone looking
    return PortReservation(port, lock_file)


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((HOST, port))
        except OSError as exc:
            if exc.errno in (errno.EADDRINUSE, errno.EACCES):
                return False
            raise
    return True
