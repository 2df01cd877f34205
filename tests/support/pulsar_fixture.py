"""A real pulsar-lite broker for tests (the ``pulsar`` ledger backend's Pulsar).

tests/conftest.py loads these fixtures for every test.

- ``pulsar_lite`` (session scope): a started :class:`~clients.dev.pulsar_lite.PulsarLiteServer` on a
  free loopback port in a temporary directory, stopped after the session. Tests sharing it
  use their own topic prefix (``PulsarConfig.cluster``) and ledger ids.
- ``pulsar_lite_factory``: starts private brokers for tests that kill or restart one.

Real Apache Pulsar is no session fixture here: a module that needs it starts one standalone
for the module (:func:`started_standalone` in a module-scoped fixture), so its JVM is stopped
when the module ends rather than held through the session. Its ports are reserved
(tests/support/reserved_ports.py: :func:`reserved_standalone`) for the server's life.

There is no skip: without the pulsar-lite wheel (or pulsar-client) the fixtures fail with the
reason.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from clients.dev.pulsar_lite import PulsarLiteServer
from clients.dev.pulsar_standalone import PulsarStandalone
from tests.support.reserved_ports import reserve_port
from tests.support.server_fixtures import in_temp_dir, one_server, server_factory


@pytest.fixture(scope="session")
def pulsar_lite(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PulsarLiteServer]:
    yield from one_server(in_temp_dir(PulsarLiteServer, tmp_path_factory, "pulsar-lite"))


@pytest.fixture
def pulsar_lite_factory(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Callable[[], PulsarLiteServer]]:
    """Call it to get another started server; every one is stopped after the test."""
    yield from server_factory(in_temp_dir(PulsarLiteServer, tmp_path_factory, "pulsar-lite"))


def reserved_standalone(directory: Path, **options: Any) -> PulsarStandalone:
    """A Pulsar standalone (not started) whose ports are reserved until it is closed;
    ``options`` are the harness's own (``token_auth=``, ``tls=``)."""
    return PulsarStandalone(directory, port_source=reserve_port, **options)


def started_standalone(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PulsarStandalone]:
    """A fixture body: a started standalone, closed (process group killed, ports given back)
    when the fixture ends, whatever happened."""
    with reserved_standalone(tmp_path_factory.mktemp("pulsar-standalone")) as server:
        yield server
