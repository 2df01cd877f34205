"""What the ZooKeeper and pulsar-lite fixtures share: start local servers, stop them after."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TypeVar

import pytest

from clients.dev.local_server import LocalServerProcess

S = TypeVar("S", bound=LocalServerProcess)


def one_server(make: Callable[[], S]) -> Iterator[S]:
    """A fixture body: one started server, stopped when the fixture ends."""
    server = make()
    server.start()
    try:
        yield server
    finally:
        server.stop()


def server_factory(make: Callable[[], S]) -> Iterator[Callable[[], S]]:
    """A fixture body: a function starting more servers, all stopped when it ends."""
    servers: list[S] = []

    def start() -> S:
        server = make()
        servers.append(server)
        server.start()
        return server

    try:
        yield start
    finally:
        for server in servers:
            server.stop()


def in_temp_dir(
    server_class: Callable[..., S], tmp_path_factory: pytest.TempPathFactory, name: str
) -> Callable[[], S]:
    """``make`` for the two above: a server in a fresh temporary directory, stopped with
    the test process if it dies."""

    def make() -> S:
        return server_class(tmp_path_factory.mktemp(name), stop_with_parent=True)

    return make
