"""The Pulsar standalone harness's files and command, without starting it (the real start:
tests/integration/test_pulsar_real.py): all on 127.0.0.1 on reserved ports, one bookie's
quorums, small memory, no functions worker or stream storage, the metadata choice fixed;
a missing cache named with what to run; token authentication and TLS off by default, and
complete when on (the real start with both: tests/integration/test_pulsar_admin_real.py)."""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
from pathlib import Path

import pytest

import clients.dev.engine_jvm as engine_jvm
import clients.dev.pulsar_standalone as harness
from clients.dev.pulsar_standalone import PulsarStandalone, PulsarStandaloneError
from tests.support.pulsar_fixture import reserved_standalone
from tests.support.pulsar_security import PulsarTokenAuth, hs256_token
from tests.support.reserved_ports import reservable_ports
from tests.support.tls_certs import make_tls_files


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
    assert server.start_timeout_s == engine_jvm.FIRST_START_TIMEOUT_S
    server.first_start_s = 30.0
    assert server.start_timeout_s == engine_jvm.LATER_START_FACTOR * 30.0
    server.first_start_s = 1.0
    assert server.start_timeout_s == engine_jvm.LATER_START_MIN_TIMEOUT_S


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


def test_token_auth_and_tls_are_off_by_default_and_complete_when_on(
    tmp_path: Path, fake_lib: Path
) -> None:
    plain = reserved_standalone(tmp_path / "plain")
    try:
        plain._write_config()
        assert not {"authenticationEnabled", "brokerServicePortTls"} & set(config_of(plain))
        assert plain.admin_headers == {} and plain.tls_port is None
    finally:
        plain.close()
    tls = make_tls_files(tmp_path / "tls", for_java=True)
    auth = PulsarTokenAuth.generate()
    server = reserved_standalone(tmp_path / "secured", token_auth=auth, tls=tls)
    try:
        server._write_config()
        config = config_of(server)
    finally:
        server.close()
    ports = {server.port, server.web_port, server.bookie_port, server.tls_port, server.tls_web_port}
    assert len(ports) == 5 and all(port in reservable_ports() for port in ports)
    assert config["authenticationEnabled"] == config["authorizationEnabled"] == "true"
    assert config["authenticationProviders"].endswith("AuthenticationProviderToken")
    assert config["superUserRoles"] == auth.super_user_role
    secret = config["tokenSecretKey"].removeprefix("data:;base64,")
    assert base64.b64decode(secret) == auth.secret
    # The standalone's own client talks to itself as the super user.
    assert config["brokerClientAuthenticationParameters"] == f"token:{auth.token()}"
    assert server.admin_headers == {"Authorization": f"Bearer {auth.token()}"}
    assert config["brokerServicePortTls"] == str(server.tls_port)
    assert config["webServicePortTls"] == str(server.tls_web_port)
    assert config["tlsCertificateFilePath"] == str(tls.cert_path)
    assert config["tlsKeyFilePath"] == str(tls.key_path)
    assert config["tlsTrustCertsFilePath"] == str(tls.ca_path)
    assert tls.key_path.read_text().startswith("-----BEGIN PRIVATE KEY-----")  # PKCS#8
    assert server.tls_service_url == f"pulsar+ssl://127.0.0.1:{server.tls_port}"
    assert server.tls_admin_url == f"https://127.0.0.1:{server.tls_web_port}"


def test_tokens_are_hs256_jwts_of_their_role() -> None:
    token = hs256_token(b"secret", "role-a")
    header, claims, signature = token.split(".")

    def decoded(part: str) -> bytes:
        return base64.urlsafe_b64decode(part + "=" * (-len(part) % 4))

    assert json.loads(decoded(header)) == {"alg": "HS256"}
    assert json.loads(decoded(claims)) == {"sub": "role-a"}
    expected = hmac.new(b"secret", f"{header}.{claims}".encode(), hashlib.sha256).digest()
    assert decoded(signature) == expected
    assert hs256_token(b"other", "role-a") != token


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
