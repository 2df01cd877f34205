"""Issue 31: the kill -9 of the leader under load (tests/support/leader_failover.py) with
real ``steward broker`` processes on real Apache Pulsar: ``--pulsar-flavor pulsar`` and the
admin URL, so the brokers write with ``ExclusiveWithFencing`` producers and the new leader
fences the old one's ledger in the engine (docs/DESIGN.md §4).

One Pulsar standalone for the module (clients/dev/pulsar_standalone.py, a JVM: tens of
seconds to start) and the suite's ZooKeeper. Clients write with idempotency keys and two
workers run sleep tasks across the fail-over: nothing acknowledged is lost, every task
finishes exactly once, every broker ends on one digest. The test prints the fail-over time
(kill to the first write the new leader acknowledged) for docs/BENCHMARKS.md.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from clients.dev.pulsar_standalone import PulsarStandalone
from clients.dev.zk import ZooKeeperServer
from tests.support.cluster_procs import ClusterProcesses
from tests.support.leader_failover import kill9_leader_under_load, seeded_rng
from tests.support.pulsar_fixture import started_standalone

# The standalone's first start (FIRST_START_TIMEOUT_S, 180 s) plus the test (about 60 s).
pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]

#: Steward's default Pulsar namespace (``--pulsar-namespace``), created as an admin would.
NAMESPACE = "public/steward"


@pytest.fixture(scope="module")
def standalone(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PulsarStandalone]:
    for server in started_standalone(tmp_path_factory):
        server.create_namespace(NAMESPACE)
        yield server


def test_kill9_leader_under_load_on_apache_pulsar(
    zookeeper: ZooKeeperServer, standalone: PulsarStandalone, tmp_path: Path
) -> None:
    rng = seeded_rng("kill9 on Apache Pulsar")
    with ClusterProcesses(
        zookeeper.connect_string,
        tmp_path,
        pulsar_url=standalone.service_url,
        pulsar_admin_url=standalone.admin_url,
    ) as cluster:
        failover_s = kill9_leader_under_load(cluster, rng)
    print(f"Apache Pulsar {standalone.version}: fail-over {failover_s:.3f} s after the kill -9")
