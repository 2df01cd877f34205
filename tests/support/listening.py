"""Which addresses a process listens on, read from /proc (Linux): tests that hold a server
to 127.0.0.1 only."""

from __future__ import annotations

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
                    if len(address_hex) == 8:
                        octets = bytes.fromhex(address_hex)[::-1]
                        address = ".".join(str(octet) for octet in octets)
                    else:
                        address = address_hex
                    found.append(f"{address}:{int(port_hex, 16)}")
    return found
