"""The Pulsar standalone harness's files and command, without starting it (the real start:
tests/integration/test_pulsar_real.py): all on 127.0.0.1 on reserved ports, one bookie's
quorums, small memory, no functions worker or stream storage, the metadata choice fixed;
and a missing cache named with what to run."""

from __future__ import annotations

from pathlib import Path

import pytest

import clients.dev.pulsar_standalone as harness
from clients.dev.pulsar_standalone import PulsarStandalone, PulsarStandaloneError
from tests.support.pulsar_fixture import reserved_standalone
from tests.support.reserved_ports import reservable_ports


def config_of(server: PulsarStandalone) -> dict[str, str]:
    lines = server.config_path.read_text().splitlines()
    pairs = (line.split("=", 1) for line in lines if line and not line.startswith("#"))
    return dict(pairs)  # type: ignore[arg-type]


@pytest.fixture
def fake_lib(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    lib = tmp_path / "lib"
    lib.mkdir()
    monkeypatch.setattr(harness, "engines_lib", lambda: lib)
    return lib


def test_config_and_command(tmp_path: Path, fake_lib: Path) -> None:
    server = reserved_standalone(tmp_path / "pulsar")
    try:
        server._write_config()
        config = config_of(server)
        command = server._command()
    finally:
        server.close()
    ports = {server.port, server.web_port, server.bookie_port}
    assert len(ports) == 3 and all(port in reservable_ports() for port in ports)
    assert config["bindAddress"] == config["advertisedAddress"] == "127.0.0.1"
    assert config["brokerServicePort"] == str(server.port)
    assert config["webServicePort"] == str(server.web_port)
    assert config["clusterName"] == "standalone"
    for quorum in ("EnsembleSize", "WriteQuorum", "AckQuorum"):
        assert config[f"managedLedgerDefault{quorum}"] == "1"
    assert config["journalSyncData"] == "true" and config["allowLoopback"] == "true"
    assert int(config["dbStorage_writeCacheMaxSizeMb"]) <= 64
    assert server.service_url == f"pulsar://127.0.0.1:{server.port}"
    assert server.admin_url == f"http://127.0.0.1:{server.web_port}"
    # The environment variable that would start an in-process ZooKeeper on every interface.
    assert command[:3] == ["env", "-u", "PULSAR_STANDALONE_USE_ZOOKEEPER"]
    assert f"-Xmx{harness.HEAP_MB}m" in command
    assert f"-XX:MaxDirectMemorySize={harness.DIRECT_MEMORY_MB}m" in command
    assert command[command.index("-cp") + 1] == str(fake_lib / "*")
    assert "org.apache.pulsar.PulsarStandaloneStarter" in command
    assert {"-nfw", "-nss"} <= set(command)
    assert command[command.index("--bookkeeper-port") + 1] == str(server.bookie_port)


def test_close_gives_the_ports_back(tmp_path: Path, fake_lib: Path) -> None:
    server = reserved_standalone(tmp_path / "pulsar")
    server.close()
    assert all(not reservation.held for reservation in server._reservations)


def test_start_bound_follows_the_measured_first_start(tmp_path: Path, fake_lib: Path) -> None:
    server = reserved_standalone(tmp_path / "pulsar")
    server.close()
    assert server.start_timeout_s == harness.FIRST_START_TIMEOUT_S
    server.first_start_s = 30.0
    assert server.start_timeout_s == harness.LATER_START_FACTOR * 30.0
    server.first_start_s = 1.0
    assert server.start_timeout_s == harness.LATER_START_MIN_TIMEOUT_S


def test_a_missing_cache_names_the_fetch_command(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "tests" / "engines").mkdir(parents=True)
    pom = tmp_path / "tests" / "engines" / "pom.xml"
    pom.write_text("<properties><pulsar.version>9.9.9</pulsar.version></properties>")
    monkeypatch.setattr(harness, "ROOT", tmp_path)
    monkeypatch.setattr(harness, "ENGINES_POM", pom)
    with pytest.raises(PulsarStandaloneError, match=r"no Apache Pulsar 9\.9\.9 jars in .*"):
        harness.engines_lib()
    with pytest.raises(PulsarStandaloneError, match=r"run \./scripts/fetch-engines"):
        PulsarStandalone(tmp_path / "pulsar")


def test_the_engines_cache_can_be_named_in_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    version = harness.pulsar_version()
    monkeypatch.setenv(harness.ENGINES_DIR_ENV, str(tmp_path))
    with pytest.raises(PulsarStandaloneError, match=harness.ENGINES_DIR_ENV) as missing:
        harness.engines_lib()
    assert str(tmp_path / f"pulsar-{version}" / "lib") in str(missing.value)
    lib = tmp_path / f"pulsar-{version}" / "lib"
    lib.mkdir(parents=True)
    (lib / f"pulsar-broker-{version}.jar").write_bytes(b"")
    assert harness.engines_lib() == lib


def test_a_standalone_on_kept_data_gets_its_ports_again(tmp_path: Path, fake_lib: Path) -> None:
    # The bookie's cookie names its port: `cluster up` on the same DIR must reuse it.
    directory = tmp_path / "pulsar"
    first = PulsarStandalone(directory, port_source=harness.kept_ports(directory))
    first._write_config()
    first.close()
    again = PulsarStandalone(directory, port_source=harness.kept_ports(directory))
    again.close()
    ports = (again.port, again.web_port, again.bookie_port)
    assert ports == (first.port, first.web_port, first.bookie_port)
    assert len(set(ports)) == 3
    fresh = PulsarStandalone(tmp_path / "other", port_source=harness.kept_ports(tmp_path / "other"))
    fresh.close()
    assert len({fresh.port, fresh.web_port, fresh.bookie_port}) == 3
