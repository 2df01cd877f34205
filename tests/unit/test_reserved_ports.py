"""Ports reserved for the ZooKeeper ensemble's members (tests/support/reserved_ports.py,
issue 30): outside the range the kernel hands out for ``bind(port 0)``, and locked against
every other test process while held."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

from clients.dev.local_server import HOST, free_port
from tests.support.reserved_ports import ephemeral_port_range, reservable_ports, reserve_port
from tests.support.zk_ensemble import SIZE, ZooKeeperEnsemble

_HOLD_A_PORT = """\
import sys
from tests.support.reserved_ports import reserve_port
reservation = reserve_port()
print(reservation.port, flush=True)
sys.stdin.read()  # held until the test closes our stdin
"""


def _outside_the_ephemeral_range(port: int) -> bool:
    low, high = ephemeral_port_range()
    return not low <= port <= high


def test_a_reserved_port_is_outside_the_range_port_zero_binds_come_from() -> None:
    reservation = reserve_port()
    try:
        assert _outside_the_ephemeral_range(reservation.port), reservation
        # What another process's server on port 0 gets: never a reservable port.
        handed_out = {free_port() for _ in range(500)}
        assert not handed_out & set(reservable_ports())
    finally:
        reservation.release()


def test_a_port_another_process_holds_is_not_reserved_again() -> None:
    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLD_A_PORT],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=Path(__file__).resolve().parents[2],
    )
    try:
        assert holder.stdout is not None and holder.stdin is not None
        held = int(holder.stdout.readline())
        mine = reserve_port(prefer=held)
        assert mine.port != held
        mine.release()
    finally:
        assert holder.stdin is not None
        holder.stdin.close()
        holder.wait(timeout=30)
    # The lock went with the process.
    again = reserve_port(prefer=held)
    assert again.port == held
    again.release()


def test_a_port_something_listens_on_is_skipped() -> None:
    probe = reserve_port()
    probe.release()
    with socket.socket() as listener:
        listener.bind((HOST, probe.port))
        listener.listen()
        reservation = reserve_port(prefer=probe.port)
        assert reservation.port != probe.port
        reservation.release()


def test_the_ensembles_ports_are_reserved_until_it_is_closed(tmp_path: Path) -> None:
    ensemble = ZooKeeperEnsemble(tmp_path)  # not started: its ports are chosen at once
    try:
        ports = ensemble.ports
        assert len(set(ports)) == 3 * SIZE
        assert all(_outside_the_ephemeral_range(p) for p in ports), ports
        for port in ports:
            other = reserve_port(prefer=port)
            assert other.port != port, f"port {port} of a live ensemble reserved again"
            other.release()
    finally:
        ensemble.close()
    after = reserve_port(prefer=ports[0])
    assert after.port == ports[0]
    after.release()
