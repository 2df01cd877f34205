"""The Pulsar cluster harness's files and commands, without starting anything (the real
start: tests/integration/test_pulsar_cluster_faults.py): every member on 127.0.0.1 on its
own reserved ports, the metadata store a 3-server ZooKeeper ensemble on the engines' jars
(every member named to the bookies and brokers), the bookies' durability and loopback
settings, the brokers' quorums, the shared JVM flags, and a missing cache or Java named with
what to do."""

from __future__ import annotations

from pathlib import Path

import pytest

import clients.dev.pulsar_standalone as standalone_harness
import tests.support.pulsar_cluster as cluster_harness
import tests.support.pulsar_cluster_members as member_harness
from clients.dev.pulsar_standalone import PulsarStandaloneError
from tests.support.pulsar_cluster import (
    BOOKIES,
    CLUSTER_NAME,
    DEFAULT_QUORUMS,
    PulsarCluster,
    PulsarClusterError,
    Quorums,
)
from tests.support.reserved_ports import reservable_ports


def config_of(path: Path) -> dict[str, str]:
    lines = path.read_text().splitlines()
    pairs = (line.split("=", 1) for line in lines if line and not line.startswith("#"))
    return dict(pairs)


@pytest.fixture
def fake_lib(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    lib = tmp_path / "lib"
    lib.mkdir()
    monkeypatch.setattr(cluster_harness, "engines_lib", lambda: lib)
    monkeypatch.setattr(member_harness, "engines_lib", lambda: lib)
    return lib


@pytest.fixture
def cluster(tmp_path: Path, fake_lib: Path) -> PulsarCluster:
    made = PulsarCluster(tmp_path / "cluster", brokers=2)
    made.close()  # nothing was started; the ports are read below, not used
    return made


def test_every_member_has_its_own_reserved_ports(cluster: PulsarCluster) -> None:
    assert cluster.zookeeper is not None
    ports = list(cluster.zookeeper.ports)  # each member's client, peer and election port
    for bookie in cluster.bookies:
        ports.append(bookie.port)
    for broker in cluster.brokers:
        ports.extend((broker.port, broker.web_port))
    assert len(cluster.bookies) == BOOKIES and len(cluster.brokers) == 2
    assert len(set(ports)) == len(ports) == 3 * 3 + BOOKIES + 2 * 2
    assert all(port in reservable_ports() for port in ports)
    assert cluster.service_url == (
        f"pulsar://127.0.0.1:{cluster.brokers[0].port},127.0.0.1:{cluster.brokers[1].port}"
    )


def test_close_gives_every_port_back(cluster: PulsarCluster) -> None:
    for member in cluster.members():
        assert all(not reservation.held for reservation in member._reservations)
    assert cluster.zookeeper is not None
    assert all(not reservation.held for reservation in cluster.zookeeper._reservations)


def test_the_metadata_store_is_a_three_server_ensemble_on_the_engines_jars(
    cluster: PulsarCluster, fake_lib: Path
) -> None:
    assert cluster.zookeeper is not None
    members = list(cluster.zookeeper.members.values())
    assert len(members) == 3
    connect = cluster.zookeeper.connect_string
    assert connect.split(",") == [member.connect_string for member in members]
    for member in members:
        member._write_config()
        config = config_of(member.config_path)
        command = member._command()
        assert command[command.index("-cp") + 1] == str(fake_lib / "*")
        assert "org.apache.zookeeper.server.quorum.QuorumPeerMain" in command
        assert [key for key in config if key.startswith("server.")] == [
            "server.1",
            "server.2",
            "server.3",
        ]
        assert config["maxSessionTimeout"] == str(4 * member_harness.SESSION_TIMEOUT_MS)


def test_bookie_config_and_command(cluster: PulsarCluster, fake_lib: Path) -> None:
    assert cluster.zookeeper is not None
    bookie = cluster.bookies[0]
    bookie._write_config()
    config = config_of(bookie.config_path)
    command = bookie._command()
    assert config["bookiePort"] == str(bookie.port)
    assert bookie.bookie_id == f"127.0.0.1:{bookie.port}"
    assert config["listeningInterface"] == "lo" and config["allowLoopback"] == "true"
    assert config["journalSyncData"] == "true"
    # Every ensemble member, separated as BookKeeper's URIs want.
    servers = cluster.zookeeper.connect_string.split(",")
    assert len(servers) == 3
    assert config["metadataServiceUri"] == f"zk+hierarchical://{';'.join(servers)}/ledgers"
    assert int(config["dbStorage_writeCacheMaxSizeMb"]) <= 64
    assert Path(config["journalDirectories"]).is_relative_to(bookie.directory)
    assert command[command.index("-cp") + 1] == str(fake_lib / "*")
    assert f"-Xmx{member_harness.BOOKIE_HEAP_MB}m" in command
    assert "--add-opens=java.base/java.nio=ALL-UNNAMED" in command  # the shared JVM flags
    assert command[-3:] == ["org.apache.bookkeeper.server.Main", "--conf", str(bookie.config_path)]


def test_broker_config_and_command(cluster: PulsarCluster) -> None:
    assert cluster.zookeeper is not None
    broker = cluster.brokers[1]
    broker._write_config()
    config = config_of(broker.config_path)
    command = broker._command()
    store = f"zk:{cluster.zookeeper.connect_string}"
    assert config["metadataStoreUrl"] == config["configurationMetadataStoreUrl"] == store
    assert config["clusterName"] == CLUSTER_NAME
    assert config["bindAddress"] == config["advertisedAddress"] == "127.0.0.1"
    assert config["brokerServicePort"] == str(broker.port)
    assert config["webServicePort"] == str(broker.web_port)
    assert config["managedLedgerDefaultEnsembleSize"] == str(DEFAULT_QUORUMS.ensemble)
    assert config["managedLedgerDefaultWriteQuorum"] == str(DEFAULT_QUORUMS.write)
    assert config["managedLedgerDefaultAckQuorum"] == str(DEFAULT_QUORUMS.ack)
    # A spare bookie for an ensemble change, and entries acknowledged by two bookies.
    assert DEFAULT_QUORUMS.ensemble < BOOKIES and DEFAULT_QUORUMS.ack == 2
    assert config["loadBalancerSheddingEnabled"] == "false"
    assert f"-Xmx{member_harness.BROKER_HEAP_MB}m" in command
    assert command[-3:] == [
        "org.apache.pulsar.PulsarBrokerStarter",
        "--broker-conf",
        str(broker.config_path),
    ]


def test_metadata_setup_names_the_cluster_and_every_broker(cluster: PulsarCluster) -> None:
    assert cluster.zookeeper is not None
    args = cluster.setup_args()
    store = f"zk:{cluster.zookeeper.connect_string}"
    assert args[args.index("--cluster") + 1] == CLUSTER_NAME
    assert args[args.index("--metadata-store") + 1] == store
    assert args[args.index("--configuration-metadata-store") + 1] == store
    assert args[args.index("--broker-service-url") + 1] == cluster.service_url
    web = args[args.index("--web-service-url") + 1]
    assert all(str(broker.web_port) in web for broker in cluster.brokers)


def test_quorums_and_sizes_are_checked(tmp_path: Path, fake_lib: Path) -> None:
    with pytest.raises(ValueError, match="ack <= write <= ensemble"):
        Quorums(ensemble=2, write=3, ack=2)
    with pytest.raises(ValueError, match="needs that many bookies"):
        PulsarCluster(tmp_path / "c", quorums=Quorums(ensemble=BOOKIES + 1, write=2, ack=2))
    with pytest.raises(ValueError, match="one or two brokers"):
        PulsarCluster(tmp_path / "c", brokers=3)


def test_ensembles_are_read_from_ledger_metadata() -> None:
    metadata = (
        "LedgerMetadata{formatVersion=3, ensembleSize=2, writeQuorumSize=2, ackQuorumSize=2, "
        "state=OPEN, digestType=CRC32C, password=base64:, "
        "ensembles={0=[127.0.0.1:20001, 127.0.0.1:20002], 57=[127.0.0.1:20001, 127.0.0.1:20003]}, "
        "customMetadata={component=base64:bWFuYWdlZC1sZWRnZXI=}}"
    )
    assert cluster_harness._ensembles_of(metadata) == [
        ["127.0.0.1:20001", "127.0.0.1:20002"],
        ["127.0.0.1:20001", "127.0.0.1:20003"],
    ]
    assert cluster_harness._ensembles_of("") == []


def test_a_missing_java_fails_loudly(
    tmp_path: Path, fake_lib: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("JAVA_HOME", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    with pytest.raises(PulsarClusterError, match="java not found"):
        PulsarCluster(tmp_path / "c")


def test_a_missing_cache_names_the_fetch_command(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "tests" / "engines").mkdir(parents=True)
    pom = tmp_path / "tests" / "engines" / "pom.xml"
    pom.write_text("<properties><pulsar.version>9.9.9</pulsar.version></properties>")
    monkeypatch.setattr(standalone_harness, "ROOT", tmp_path)
    monkeypatch.setattr(standalone_harness, "ENGINES_POM", pom)
    with pytest.raises(PulsarStandaloneError, match=r"run \./scripts/fetch-engines"):
        PulsarCluster(tmp_path / "c")
