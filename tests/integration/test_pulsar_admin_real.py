"""The Pulsar admin API for real, and token authentication and TLS to Pulsar (issue 31, item
4; docs/OPERATIONS.md, "Ledgers: Pulsar on BookKeeper"; docs/TESTING.md, "Real Apache Pulsar").

ONE Apache Pulsar standalone for the module (clients/dev/pulsar_standalone.py), with token
authentication and authorization on and TLS ports (tests/support/pulsar_security.py): each
standalone costs about 20 s, so every test here shares this one. Steward always reaches it
over ``pulsar+ssl://`` and an ``https://`` admin URL with the test CA
(``--pulsar-tls-ca-file``), its token in ``STEWARD_PULSAR_TOKEN``; ZooKeeper is the suite's.

- A new namespace, made without retention: a real ``steward broker`` start sets infinite
  retention and no inactive-topic deletion (read back through the admin API); a second start
  changes nothing.
- A real ``steward broker`` with ledgers that roll and snapshots that cover them: once
  retention drops ledger 1 from the ledger list, its topic is gone from the admin API's
  topic list, and the live ledger's topic is there; every write reads back.
- A broker start without a token, with a token of another secret, with a token of a role
  without admin rights, without the CA or with another CA: exit 2 and one line saying what
  to do, no traceback. The binary protocol alone (no admin URL: only the start-up fencing
  check talks to Pulsar) refuses the same credentials, within the operation timeout.
"""

from __future__ import annotations

import os
import subprocess
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from clients.dev.pulsar_standalone import PulsarStandalone
from clients.dev.zk import ZooKeeperServer
from log.api import LedgerError
from log.pulsar import PulsarConfig, PulsarLedgerStore
from tests.support.cluster_procs import ClusterProcesses
from tests.support.ledger_backends import MemoryLedgerIds
from tests.support.procs import HOST, free_port, steward_command
from tests.support.pulsar_fixture import reserved_standalone
from tests.support.pulsar_security import PulsarTokenAuth, hs256_token
from tests.support.tls_certs import TlsFiles, make_tls_files
from tests.support.worker_procs import wait_until

# The first test's set-up starts the standalone (bounded by FIRST_START_TIMEOUT_S, 180 s).
pytestmark = pytest.mark.timeout(400)

TENANT = "public"
#: A refused broker start: its exit, bounded (it needs ZooKeeper, then one admin request).
REFUSED_START_TIMEOUT_S = 60.0
#: The in-process stores' bound of each client operation.
OPERATION_TIMEOUT_S = 5.0
RETENTION_WAIT_S = 60.0
TOPIC_DELETION_WAIT_S = 30.0


@dataclass(frozen=True)
class SecuredPulsar:
    server: PulsarStandalone
    auth: PulsarTokenAuth
    tls: TlsFiles
    #: A CA that did not sign the standalone's certificate.
    other_ca: Path


@pytest.fixture(scope="module")
def secured(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SecuredPulsar]:
    root = tmp_path_factory.mktemp("pulsar-secured")
    tls = make_tls_files(root / "tls", for_java=True)
    other = make_tls_files(root / "other-tls", for_java=True)
    auth = PulsarTokenAuth.generate()
    with reserved_standalone(root / "pulsar", token_auth=auth, tls=tls) as server:
        yield SecuredPulsar(server, auth, tls, other.ca_path)


def admin(secured: SecuredPulsar, method: str, path: str) -> httpx.Response:
    """The admin API over HTTPS, as the super user."""
    return httpx.request(
        method,
        secured.server.tls_admin_url + path,
        headers=secured.server.admin_headers,
        verify=secured.tls.client_context(),
        timeout=10.0,
    )


def new_namespace(secured: SecuredPulsar) -> str:
    """A fresh namespace of the tenant, with the broker's default policies."""
    namespace = f"ns{uuid.uuid4().hex[:10]}"
    created = admin(secured, "PUT", f"/admin/v2/namespaces/{TENANT}/{namespace}")
    assert created.status_code == 204, created.text
    return namespace


def policies(secured: SecuredPulsar, namespace: str) -> dict[str, Any]:
    response = admin(secured, "GET", f"/admin/v2/namespaces/{TENANT}/{namespace}")
    assert response.status_code == 200, response.text
    result: dict[str, Any] = response.json()
    return result


def topics(secured: SecuredPulsar, namespace: str) -> set[str]:
    response = admin(secured, "GET", f"/admin/v2/persistent/{TENANT}/{namespace}")
    assert response.status_code == 200, response.text
    return set(response.json())


def ledger_topic(cluster: ClusterProcesses, namespace: str, ledger_id: int) -> str:
    return f"persistent://{TENANT}/{namespace}/{cluster.name}-ledger-{ledger_id:012d}"


def pulsar_args(secured: SecuredPulsar, namespace: str, ca: Path | None) -> list[str]:
    """``steward broker``'s Pulsar flags: TLS for both URLs, the CA when given."""
    args = [
        "--ledgers",
        "pulsar",
        "--pulsar-url",
        secured.server.tls_service_url,
        "--pulsar-admin-url",
        secured.server.tls_admin_url,
        "--pulsar-tenant",
        TENANT,
        "--pulsar-namespace",
        namespace,
    ]
    if ca is not None:
        args += ["--pulsar-tls-ca-file", str(ca)]
    return args


class PulsarBroker(ClusterProcesses):
    """One ``steward broker`` on the secured standalone, its token in its environment."""

    def __init__(
        self,
        zookeeper: str,
        root: Path,
        secured: SecuredPulsar,
        namespace: str,
        extra_args: tuple[str, ...] = (),
    ) -> None:
        super().__init__(
            zookeeper,
            root,
            brokers=1,
            extra_args=extra_args,
            extra_env={"STEWARD_PULSAR_TOKEN": secured.auth.token()},
        )
        self._pulsar_args = pulsar_args(secured, namespace, secured.tls.ca_path)

    def ledger_args(self) -> list[str]:
        return self._pulsar_args


def test_broker_start_applies_the_namespace_policy_once(
    secured: SecuredPulsar, zookeeper: ZooKeeperServer, tmp_path: Path
) -> None:
    namespace = new_namespace(secured)
    before = policies(secured, namespace)
    assert before.get("retention_policies") is None, before
    assert before.get("inactive_topic_policies") is None, before
    with PulsarBroker(zookeeper.connect_string, tmp_path, secured, namespace) as cluster:
        node = cluster.node("b0")
        applied = policies(secured, namespace)
        assert applied["retention_policies"] == {
            "retentionTimeInMinutes": -1,
            "retentionSizeInMB": -1,
        }
        assert applied["inactive_topic_policies"]["deleteWhileInactive"] is False
        first_start = node.log_text()
        assert "retention set to infinite" in first_start, node.log_tail()
        assert "inactive-topic deletion disabled" in first_start, node.log_tail()
        assert cluster.stop("b0") == 0
        cluster.start("b0")
        second_start = node.log_text()[len(first_start) :]
        assert "===== start #2" in second_start
        assert "retention set" not in second_start, second_start[-3000:]
        assert "inactive-topic deletion disabled" not in second_start, second_start[-3000:]
        assert policies(secured, namespace) == applied


def test_a_ledger_a_snapshot_covers_loses_its_topic(
    secured: SecuredPulsar, zookeeper: ZooKeeperServer, tmp_path: Path
) -> None:
    namespace = new_namespace(secured)
    # Ledgers roll every 0.3 s of writes, a snapshot every 0.3 s, and a retention of 1 s:
    # ledger 1 is deleted while the writes go on (docs/DESIGN.md §3).
    args = (
        "--ledger-roll-age-s",
        "0.3",
        "--snapshot-interval-s",
        "0.3",
        "--ledger-retention-h",
        str(1.0 / 3600),
    )
    with PulsarBroker(
        zookeeper.connect_string, tmp_path, secured, namespace, extra_args=args
    ) as cluster:
        leader = cluster.wait_for_leader(30)
        assert ledger_topic(cluster, namespace, 1) in topics(secured, namespace)
        submitted: list[int] = []

        def write_until_ledger_one_is_dropped() -> bool:
            response = httpx.post(
                leader.url + "/api/v1/tasks",
                json={"type": "demo.job", "tenant": "t", "params": {"n": len(submitted)}},
                timeout=10,
            )
            assert response.status_code == 201, response.text
            submitted.append(int(response.json()["id"]))
            return 1 not in cluster.ledger_ids()

        wait_until(
            write_until_ledger_one_is_dropped,
            RETENTION_WAIT_S,
            "retention to drop ledger 1 from the ledger list",
            pause_s=0.1,
        )
        wait_until(
            lambda: ledger_topic(cluster, namespace, 1) not in topics(secured, namespace),
            TOPIC_DELETION_WAIT_S,
            "ledger 1's topic to be deleted",
            pause_s=0.2,
        )
        live = max(cluster.ledger_ids())
        assert live > 1
        assert ledger_topic(cluster, namespace, live) in topics(secured, namespace)
        for task_id in submitted:
            read = httpx.get(f"{leader.url}/api/v1/tasks/{task_id}", timeout=10)
            assert read.status_code == 200, read.text
            assert read.json()["id"] == task_id


REFUSALS = {
    # case: (token, CA, what the one line says)
    "no token": (None, "tls", "Pulsar wants an auth token: give one (--pulsar-token"),
    "another secret's token": ("forged", "tls", "(401: "),
    "a role without admin rights": ("other-role", "tls", "admin rights on tenant public"),
    "no CA": ("admin", None, "TLS certificate is not trusted"),
    "another CA": ("admin", "other", "TLS certificate is not trusted"),
}


def _token(secured: SecuredPulsar, kind: str | None) -> str | None:
    if kind is None:
        return None
    if kind == "forged":
        return hs256_token(b"not the standalone's secret", secured.auth.super_user_role)
    if kind == "other-role":
        return secured.auth.token("reader-only")
    return secured.auth.token()


def _ca(secured: SecuredPulsar, kind: str | None) -> Path | None:
    return {None: None, "tls": secured.tls.ca_path, "other": secured.other_ca}[kind]


@pytest.mark.parametrize("case", sorted(REFUSALS))
def test_a_broker_start_refuses_bad_credentials_in_one_line(
    secured: SecuredPulsar, zookeeper: ZooKeeperServer, tmp_path: Path, case: str
) -> None:
    token_kind, ca_kind, says = REFUSALS[case]
    env = {k: v for k, v in os.environ.items() if k != "STEWARD_PULSAR_TOKEN"}
    token = _token(secured, token_kind)
    if token is not None:
        env["STEWARD_PULSAR_TOKEN"] = token
    namespace = new_namespace(secured)
    command = [
        *steward_command(),
        "broker",
        "--zookeeper",
        zookeeper.connect_string,
        "--cluster",
        f"c{uuid.uuid4().hex[:8]}",
        "--broker-id",
        "b0",
        "--data-dir",
        str(tmp_path / "data"),
        *pulsar_args(secured, namespace, _ca(secured, ca_kind)),
        "--http",
        f"{HOST}:{free_port()}",
        "--worker-listen",
        f"{HOST}:{free_port()}",
        "--log-level",
        "WARNING",
    ]
    done = subprocess.run(
        command,
        env=env,
        capture_output=True,
        text=True,
        timeout=REFUSED_START_TIMEOUT_S,
        check=False,
    )
    output = done.stdout + done.stderr
    assert done.returncode == 2, output
    assert "Traceback" not in output, output
    refusals = [line for line in done.stderr.splitlines() if line.startswith("steward: ")]
    assert len(refusals) == 1, output
    assert refusals[0].startswith("steward: cannot start: Pulsar not usable: "), output
    assert says in refusals[0], refusals[0]
    # Nothing was applied with credentials Pulsar refused.
    assert policies(secured, namespace).get("retention_policies") is None


BINARY_REFUSALS = {
    # case: (token, CA, what the error says)
    "no token": (None, "tls", "Timeout"),
    "another secret's token": ("forged", "tls", "Timeout"),
    "a role without admin rights": ("other-role", "tls", "AuthorizationError"),
    "no CA": ("admin", None, "ConnectError"),
    "another CA": ("admin", "other", "ConnectError"),
}


@pytest.mark.parametrize("case", sorted(BINARY_REFUSALS))
async def test_the_binary_protocol_refuses_bad_credentials(
    secured: SecuredPulsar, case: str
) -> None:
    token_kind, ca_kind, says = BINARY_REFUSALS[case]
    ca = _ca(secured, ca_kind)
    config = PulsarConfig.for_apache_pulsar(
        secured.server.tls_service_url,
        None,
        namespace="default",
        cluster=f"t{uuid.uuid4().hex[:12]}",
        auth_token=_token(secured, token_kind),
        tls_trust_certs_file=str(ca) if ca is not None else None,
        operation_timeout_s=OPERATION_TIMEOUT_S,
        send_timeout_ms=int(OPERATION_TIMEOUT_S * 1000),
    )
    store = PulsarLedgerStore(config, MemoryLedgerIds())
    try:
        with pytest.raises(LedgerError) as refused:
            await store.verify_fencing("test")
    finally:
        await store.close()
    message = str(refused.value)
    assert says in message, message
    assert "--pulsar-token" in message and "--pulsar-tls-ca-file" in message, message


async def test_the_right_token_and_ca_append_and_read_over_tls(secured: SecuredPulsar) -> None:
    config = PulsarConfig.for_apache_pulsar(
        secured.server.tls_service_url,
        secured.server.tls_admin_url,
        namespace="default",
        cluster=f"t{uuid.uuid4().hex[:12]}",
        auth_token=secured.auth.token(),
        tls_trust_certs_file=str(secured.tls.ca_path),
        operation_timeout_s=OPERATION_TIMEOUT_S,
        send_timeout_ms=int(OPERATION_TIMEOUT_S * 1000),
    )
    store = PulsarLedgerStore(config, MemoryLedgerIds())
    try:
        assert await store.verify_fencing("test")
        writer = await store.create_ledger()
        for n in range(3):
            await writer.append(b"entry %d" % n)
        await writer.close()
        reader = await store.open_ledger(writer.ledger_id, recovery=False)
        entries = await reader.read(0, 10)
    finally:
        await store.close()
    assert [entry.data for entry in entries] == [b"entry 0", b"entry 1", b"entry 2"]
