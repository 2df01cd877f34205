"""TLS contexts (broker/security/tls.py) and their users, with a CA and certificate made at test
time: a real TLS handshake, the HTTP API served over HTTPS by the broker's own uvicorn
setup, the Python clients and the CLI (with and without the CA), the worker's options."""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
import trustme

from broker.api.http_api import ApiApp, ApiConfig
from broker.core import StateMachine
from broker.observability.node_observer import observe_node
from broker.replication.node import BrokerStartupError, Node, NodeConfig
from broker.security.tls import (
    TlsConfig,
    TlsConfigError,
    certificate_error,
    client_context,
    describe_certificate_error,
    server_context,
)
from broker.server.standalone import start_http_server, stop_http_server
from clients import cli
from clients.client import AsyncStewardClient, CertificateVerifyError, StewardClient
from clients.dev.local_server import free_port
from clients.worker.__main__ import build_parser, config_from_args
from clients.worker.config import WorkerConfig
from log.memory import MemoryLedgerListStore, MemoryLedgerStore
from snapshot.peer import download_latest_snapshot
from snapshot.store import SnapshotStore
from tests.support.tls_certs import TlsFiles, make_tls_files

HANDSHAKE_TIMEOUT_S = 10.0


@pytest.fixture
def tls(tmp_path: Path) -> TlsFiles:
    return make_tls_files(tmp_path / "tls")


def _config(tls: TlsFiles) -> TlsConfig:
    return TlsConfig(tls.cert_path, tls.key_path, tls.ca_path)


# -- configuration ---------------------------------------------------------------------------


def test_from_options_is_off_without_certificate_and_needs_both(tls: TlsFiles) -> None:
    assert TlsConfig.from_options(None, None, tls.ca_path) is None
    with pytest.raises(TlsConfigError, match="both --tls-cert and --tls-key"):
        TlsConfig.from_options(tls.cert_path, None)
    with pytest.raises(TlsConfigError, match="both --tls-cert and --tls-key"):
        TlsConfig.from_options(None, tls.key_path)
    config = TlsConfig.from_options(str(tls.cert_path), str(tls.key_path), str(tls.ca_path))
    assert config == TlsConfig(tls.cert_path, tls.key_path, tls.ca_path)


def test_server_context_names_the_unusable_file(tls: TlsFiles, tmp_path: Path) -> None:
    missing = tmp_path / "nope.pem"
    with pytest.raises(TlsConfigError, match=r"TLS certificate '.*nope.pem' does not exist"):
        server_context(TlsConfig(missing, tls.key_path))
    with pytest.raises(TlsConfigError, match=r"TLS key '.*nope.pem' does not exist"):
        server_context(TlsConfig(tls.cert_path, missing))
    # A key that does not belong to the certificate.
    other_key = tmp_path / "other-key.pem"
    trustme.CA().issue_cert("127.0.0.1").private_key_pem.write_to_path(str(other_key))
    with pytest.raises(TlsConfigError, match="cannot use TLS certificate"):
        server_context(TlsConfig(tls.cert_path, other_key))
    garbage = tmp_path / "garbage.pem"
    garbage.write_text("not a certificate\n")
    with pytest.raises(TlsConfigError, match="cannot use TLS certificate"):
        server_context(TlsConfig(garbage, tls.key_path))
    context = server_context(_config(tls))
    assert context.minimum_version == ssl.TLSVersion.TLSv1_2


def test_client_context_always_verifies(tls: TlsFiles, tmp_path: Path) -> None:
    for context in (client_context(tls.ca_path), client_context(None)):
        assert context.verify_mode == ssl.CERT_REQUIRED
        assert context.check_hostname is True
    with pytest.raises(TlsConfigError, match=r"CA bundle '.*missing.pem' does not exist"):
        client_context(tmp_path / "missing.pem")
    garbage = tmp_path / "garbage.pem"
    garbage.write_text("not a certificate\n")
    with pytest.raises(TlsConfigError, match="cannot use CA bundle"):
        client_context(garbage)


async def _handshake(server: ssl.SSLContext, client: ssl.SSLContext, server_hostname: str) -> bytes:
    """Connect to a TLS echo server on 127.0.0.1 as ``server_hostname``; the echo."""

    async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(ConnectionError, ssl.SSLError):
            writer.write(await reader.readexactly(4))
            await writer.drain()
        writer.close()

    listener = await asyncio.start_server(echo, "127.0.0.1", 0, ssl=server)
    port = listener.sockets[0].getsockname()[1]
    try:
        async with asyncio.timeout(HANDSHAKE_TIMEOUT_S):
            reader, writer = await asyncio.open_connection(
                "127.0.0.1", port, ssl=client, server_hostname=server_hostname
            )
            writer.write(b"ping")
            answer = await reader.readexactly(4)
            writer.close()
            return answer
    finally:
        listener.close()


async def test_handshake_checks_the_ca_and_the_host_name(tls: TlsFiles) -> None:
    server = server_context(_config(tls))
    assert await _handshake(server, client_context(tls.ca_path), "127.0.0.1") == b"ping"
    assert await _handshake(server, client_context(tls.ca_path), "localhost") == b"ping"
    with pytest.raises(ssl.SSLCertVerificationError) as wrong_host:
        await _handshake(server, client_context(tls.ca_path), "broker.example")
    assert "broker.example" in describe_certificate_error(wrong_host.value)
    # The system trust store does not know the test CA.
    with pytest.raises(ssl.SSLCertVerificationError) as unknown_ca:
        await _handshake(server, client_context(None), "127.0.0.1")
    assert describe_certificate_error(unknown_ca.value).startswith("certificate verify failed: ")
    assert "_ssl.c" not in describe_certificate_error(unknown_ca.value)


def test_certificate_error_finds_the_cause_in_a_chain() -> None:
    cause = ssl.SSLCertVerificationError(1, "certificate verify failed")
    try:
        try:
            raise cause
        except ssl.SSLError as exc:
            raise httpx.ConnectError("wrapped") from exc
    except httpx.ConnectError as wrapped:
        assert certificate_error(wrapped) is cause
    assert certificate_error(httpx.ConnectError("refused")) is None


# -- HTTPS: the broker's HTTP server, clients, CLI --------------------------------------------


def _node(data_dir: Path) -> Node:
    node = Node(
        NodeConfig(data_dir=data_dir, timer_poll_interval_s=0.01),
        ledgers=MemoryLedgerStore(),
        ledger_list=MemoryLedgerListStore(),
        snapshots=SnapshotStore(data_dir / "snapshots"),
    )
    observe_node(node)
    return node


@pytest.fixture
async def https_node(tls: TlsFiles, tmp_path: Path) -> AsyncIterator[tuple[Node, str]]:
    """A node's API served over HTTPS by the broker's own server setup; (node, URL)."""
    node = _node(tmp_path)
    await node.start()
    api = ApiConfig(host="127.0.0.1", port=free_port())
    server, task = await start_http_server(ApiApp(node, api), api, tls=_config(tls))
    try:
        yield node, f"https://127.0.0.1:{api.port}"
    finally:
        await stop_http_server(server, task)
        await node.stop(snapshot=False)


@pytest.fixture
def https_url(https_node: tuple[Node, str]) -> str:
    return https_node[1]


async def test_http_server_refuses_to_start_with_a_bad_key(tls: TlsFiles, tmp_path: Path) -> None:
    api = ApiConfig(host="127.0.0.1", port=free_port())
    app = ApiApp(_node(tmp_path), api)
    bad = TlsConfig(tls.cert_path, tmp_path / "missing.pem")
    with pytest.raises(BrokerStartupError, match=r"TLS key '.*missing.pem' does not exist"):
        await start_http_server(app, api, tls=bad)


async def test_clients_with_the_ca_use_https(https_url: str, tls: TlsFiles) -> None:
    def sync_calls() -> tuple[int, str]:
        with StewardClient(https_url, ca_file=tls.ca_path) as client:
            handle = client.submit("noop", tenant="acme")
            return handle.id, client.task(handle.id)["state"]

    task_id, state = await asyncio.to_thread(sync_calls)
    assert state == "waiting"
    async with AsyncStewardClient(https_url, ca_file=tls.client_context()) as client:
        assert (await client.task(task_id))["tenant"] == "acme"


async def test_clients_without_the_ca_are_refused_at_once(https_url: str) -> None:
    def sync_submit() -> None:
        # A write would retry for the whole failover time on a connection error; a
        # certificate that does not verify is final.
        with StewardClient(https_url, failover_timeout_s=300) as client:
            client.submit("noop")

    with pytest.raises(CertificateVerifyError, match="certificate verify failed") as refused:
        await asyncio.to_thread(sync_submit)
    assert refused.value.code == "certificate_verify_failed"
    async with AsyncStewardClient(https_url, failover_timeout_s=300) as client:
        with pytest.raises(CertificateVerifyError, match="certificate verify failed"):
            await client.submit("noop")


async def test_plain_http_to_the_https_port_fails(https_url: str, tls: TlsFiles) -> None:
    plain = https_url.replace("https://", "http://")
    async with httpx.AsyncClient(timeout=5.0) as http:
        with pytest.raises(httpx.TransportError):
            await http.get(plain + "/healthz")
    # ... and the server still serves TLS clients afterwards.
    async with httpx.AsyncClient(timeout=5.0, verify=tls.client_context()) as http:
        assert (await http.get(https_url + "/healthz")).status_code == 200


async def test_cli_with_and_without_the_ca(
    https_url: str,
    tls: TlsFiles,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("STEWARD_TLS_CA", raising=False)
    code = await asyncio.to_thread(cli.main, ["--url", https_url, "digest"])
    out, err = capsys.readouterr()
    assert code == 1
    assert out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith(f"steward: cannot reach {https_url}: certificate verify failed")
    assert "--ca-file" in lines[0]
    assert "Traceback" not in err

    code = await asyncio.to_thread(
        cli.main, ["--url", https_url, "--ca-file", str(tls.ca_path), "digest"]
    )
    out, err = capsys.readouterr()
    assert (code, err) == (0, "")
    assert out.split()[::2] == ["position:", "digest:"]  # "position: L:E", "digest: HEX"

    monkeypatch.setenv("STEWARD_TLS_CA", str(tls.ca_path))
    code = await asyncio.to_thread(cli.main, ["--url", https_url, "submit", "noop"])
    out, err = capsys.readouterr()
    assert (code, err) == (0, "")
    assert out.strip().isdigit()

    code = await asyncio.to_thread(
        cli.main, ["--url", https_url, "--ca-file", "/nonexistent/ca.pem", "digest"]
    )
    out, err = capsys.readouterr()
    assert code == 2
    assert err == "steward: CA bundle '/nonexistent/ca.pem' does not exist or is not a file\n"


def test_cli_broker_commands_need_certificate_and_key(
    tls: TlsFiles, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = cli.main(
        ["standalone", "--data-dir", str(tmp_path / "d"), "--tls-cert", str(tls.cert_path)]
    )
    assert code == 2
    assert capsys.readouterr().err == "steward: TLS needs both --tls-cert and --tls-key\n"


# -- the worker's options --------------------------------------------------------------------


def test_worker_tls_options(tls: TlsFiles, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("STEWARD_TLS_CA", raising=False)
    args = build_parser().parse_args(["--broker", "127.0.0.1:7070"])
    config = config_from_args(args)
    assert (config.tls, config.tls_ca) == (False, None)
    args = build_parser().parse_args(
        ["--brokers", "https://127.0.0.1:1", "--tls", "--tls-ca", str(tls.ca_path)]
    )
    config = config_from_args(args)
    assert (config.tls, config.tls_ca) == (True, tls.ca_path)
    assert config.ssl_context() is config.ssl_context()  # built once
    assert config.ssl_context().verify_mode == ssl.CERT_REQUIRED
    monkeypatch.setenv("STEWARD_TLS_CA", str(tls.ca_path))
    assert config_from_args(build_parser().parse_args([])).tls_ca == tls.ca_path
    with pytest.raises(ValueError, match=r"CA bundle '/nonexistent.pem' does not exist"):
        WorkerConfig(broker="127.0.0.1:7070", http_url="https://x", tls_ca=Path("/nonexistent.pem"))


# -- broker to broker ----------------------------------------------------------------------------


async def test_snapshot_download_from_an_https_peer_verifies_it(
    https_node: tuple[Node, str], tls: TlsFiles, tmp_path: Path
) -> None:
    node, url = https_node
    async with AsyncStewardClient(url, ca_file=tls.ca_path) as client:
        for n in range(5):
            await client.submit("noop", {"n": n})
    await node.take_snapshot()
    cluster_id = node.config.cluster_id
    store = SnapshotStore(tmp_path / "downloaded", cluster_id=cluster_id)
    # The default trust store does not know the test CA: the peer is skipped.
    assert await download_latest_snapshot([url], store, cluster_id=cluster_id, timeout_s=10) is None
    info = await download_latest_snapshot(
        [url],
        store,
        cluster_id=cluster_id,
        timeout_s=10,
        decode=StateMachine.from_snapshot,
        ssl_context=tls.client_context(),
    )
    assert info is not None
    assert info.position == node.position
