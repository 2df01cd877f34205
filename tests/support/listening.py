"""Which addresses a process listens on, read from /proc (Linux): tests that hold a server
to 127.0.0.1 only."""

from __future__ import annotations

import ipaddress
import os


def listening_addresses(pid: int) -> list[str]:
    """``address:port`` of every TCP socket the process listens on (from /proc)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except FileNotFoundError:
            continue  # closed meanwhile (RocksDB opens and closes files all the time)
        if target.startswith("socket:["):
            inodes.add(target[len("socket:[") : -1])
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as rows:
            next(rows)
            for row in rows:
                fields = row.split()
                local, state, inode = fields[1], fields[3], fields[9]
                if state == "0A" and inode in inodes:  # 0A: LISTEN
                    address_hex, port_hex = local.split(":")
                    found.append(f"{_address(address_hex)}:{int(port_hex, 16)}")
    return found


def _address(address_hex: str) -> str:
    """An address of /proc/net/tcp(6): 32-bit words in host (little-endian) order. An IPv6
    socket bound to an IPv4 address (``::ffff:127.0.0.1``, as Java binds) reads as that IPv4
    address; ``::`` is every interface, as ``0.0.0.0`` is."""
    raw = b"".join(
        bytes.fromhex(address_hex[i : i + 8])[::-1] for i in range(0, len(address_hex), 8)
    )
    if len(raw) == 4:
        return str(ipaddress.IPv4Address(raw))
    address = ipaddress.IPv6Address(raw)
    return str(address.ipv4_mapped or address)
