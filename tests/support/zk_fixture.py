"""A real ZooKeeper server for tests, plus a broker elector in a subprocess.

tests/conftest.py loads these fixtures for every test.

- ``zookeeper`` (module scope): a started :class:`~clients.dev.zk.ZooKeeperServer` in a temporary
  directory, stopped after the module. Tests sharing it use their own cluster names.
- ``zookeeper_factory``: starts private servers for tests that pause, restart or kill one.

There is no skip: without Java or the ZooKeeper jars the fixtures fail with the reason.

``python -m tests.support.zk_fixture CONNECT CLUSTER BROKER_ID SESSION_TIMEOUT_S`` runs one
:class:`~broker.ha.election.LeaderElector` that joins the queue and waits to be killed (a broker
that tests can ``kill -9``); it prints ``JOINED`` once queued.
The ``elector_process`` fixture starts one.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from clients.dev.zk import ZooKeeperServer
from tests.support.server_fixtures import in_temp_dir, one_server, server_factory


@pytest.fixture(scope="module")
def zookeeper(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ZooKeeperServer]:
    yield from one_server(in_temp_dir(ZooKeeperServer, tmp_path_factory, "zookeeper"))


@pytest.fixture
def zookeeper_factory(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Callable[[], ZooKeeperServer]]:
    """Call it to get another started server; every one is stopped after the test."""
    yield from server_factory(in_temp_dir(ZooKeeperServer, tmp_path_factory, "zookeeper"))


REPO_ROOT = Path(__file__).resolve().parents[2]
ElectorProcessFactory = Callable[[str, str, str, float], "subprocess.Popen[bytes]"]


@pytest.fixture
def elector_process(tmp_path: Path) -> Iterator[ElectorProcessFactory]:
    """Call it with (connect string, cluster, broker id, session timeout s) to run an elector
    in its own process (a broker to ``kill -9``); each is killed by pid after the test.

    Its stderr goes to ``elector-<broker id>.err`` in the test's ``tmp_path``.
    """
    processes: list[subprocess.Popen[bytes]] = []

    def start(
        connect_string: str, cluster: str, broker_id: str, session_timeout_s: float
    ) -> subprocess.Popen[bytes]:
        command = [
            sys.executable,
            "-m",
            "tests.support.zk_fixture",
            connect_string,
            cluster,
            broker_id,
            str(session_timeout_s),
        ]
        with open(tmp_path / f"elector-{broker_id}.err", "wb") as stderr:
            process = subprocess.Popen(
                command,
                cwd=REPO_ROOT,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=stderr,
            )
        processes.append(process)
        return process

    try:
        yield start
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
            process.wait(timeout=10)


async def _run_elector(
    connect_string: str, cluster: str, broker_id: str, session_timeout_s: float
) -> None:
    from broker.ha.election import LeaderElector

    elector = LeaderElector(
        connect_string,
        cluster,
        broker_id,
        {"http": f"http://{broker_id}.invalid"},
        session_timeout_s=session_timeout_s,
    )
    await elector.start()
    await elector.join()
    sys.stdout.write("JOINED\n")
    sys.stdout.flush()
    await asyncio.Event().wait()  # until killed


if __name__ == "__main__":
    asyncio.run(_run_elector(sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4])))
