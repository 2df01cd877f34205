"""ZooKeeper, brokers and workers of a Jepsen run, each in its own network namespace
(tests/jepsen/netns.py), bound to its namespace's address.

Runs in the driver, itself inside the control namespace (``sj-ctl``): its requests reach
the nodes over the bridge like any client's. Every process is started with ``ip netns exec``
(which execs the command: the pid is the server's own, so kill -9 and SIGSTOP hit it);
the network's teardown kills whatever is left in the namespaces.

The file ledger's directory is shared by every broker through the one filesystem: a
partition never cuts a broker from its ledger, only from ZooKeeper, its peers and clients.
With ``--ledger pulsar`` the ledger is pulsar-lite in the ``pl`` namespace; with
``--ledger apache-pulsar`` a real Apache Pulsar cluster (:class:`NamespacedPulsarCluster`):
the Pulsar broker in ``pl``, three bookies in ``bk1``..``bk3``.

Brokers run under tests/jepsen/clock_shift.py: the nemesis jumps a broker's wall clock
(only; the monotonic clock never jumps) by writing an offset to its control file.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import httpx

from clients.dev.engine_jvm import FreePort, HeldPort, find_java_or_fail
from clients.dev.pulsar_lite import PulsarLiteServer, accepts_connections
from clients.dev.pulsar_standalone import engines_lib, pulsar_version
from clients.dev.zk import ZooKeeperServer, four_letter_word
from tests.jepsen.netns import Network
from tests.support.logged_process import LoggedProcess
from tests.support.procs import steward_command
from tests.support.pulsar_cluster import (
    DEFAULT_QUORUMS,
    Bookie,
    ClusterMember,
    PulsarCluster,
    PulsarClusterError,
)
from tests.support.pulsar_cluster import (
    Broker as PulsarBroker,
)

ZK_PORT = 2181
PULSAR_PORT = 6650
PULSAR_ADMIN_PORT = 8080
BOOKIE_PORT = 3181
#: The bookies' namespaces (--ledger apache-pulsar); the Pulsar broker's is ``pl``.
BOOKIE_NODES = ("bk1", "bk2", "bk3")
PULSAR_BROKER_NODE = "pl"
#: The Pulsar broker's bound of a write to a bookie (Pulsar's default: 30): a bookie cut off
#: or paused longer is replaced in the ledger's ensemble while the fault holds.
BOOKIE_WRITE_TIMEOUT_S = 4
HTTP_PORT = 8080
WORKER_PORT = 7070
PROBE_TIMEOUT_S = 1.0
# A worker silent this long is declared dead (its tasks reassigned): short, so a paused
# worker's attempt is reassigned while it still runs (a zombie).
HEARTBEAT_TIMEOUT_MS = 6000
LEDGER_ROLL_AGE_S = 2.0
LEDGER_RETENTION_S = 1.0
# Snapshots keep the newest 3 (snapshot/store.py): ledgers older than ~3 intervals go, so a
# broker away for a few seconds must download a snapshot from a peer.
SNAPSHOT_INTERVAL_S = 1.0


class NamespacedZooKeeper(ZooKeeperServer):
    """The development ZooKeeper, in the ``zk`` namespace on its address."""

    def __init__(self, net: Network, directory: Path) -> None:
        super().__init__(directory, port=ZK_PORT, max_session_timeout_ms=60_000)
        self.net = net
        self.ip = net.address["zk"]

    @property
    def connect_string(self) -> str:
        return f"{self.ip}:{ZK_PORT}"

    @property
    def address(self) -> str:
        return self.connect_string

    def _write_config(self) -> None:
        super()._write_config()
        text = self.config_path.read_text().replace("127.0.0.1", self.ip)
        self.config_path.write_text(text)

    def _command(self) -> list[str]:
        return [*self.net.exec_prefix("zk"), *super()._command()]

    def _ready(self) -> bool:
        try:
            return "Mode:" in four_letter_word(self.ip, ZK_PORT, "srvr", timeout_s=1.0)
        except OSError:
            return False


class NamespacedPulsarLite(PulsarLiteServer):
    """pulsar-lite, in the ``pl`` namespace on its address (the ``pulsar`` ledger backend)."""

    def __init__(self, net: Network, directory: Path) -> None:
        super().__init__(directory, port=PULSAR_PORT)
        self.net = net
        self.ip = net.address["pl"]

    @property
    def service_url(self) -> str:
        return f"pulsar://{self.ip}:{PULSAR_PORT}"

    @property
    def address(self) -> str:
        return self.service_url

    def _command(self) -> list[str]:
        command = super()._command()
        at = command.index("--addr")
        command[at + 1] = f"{self.ip}:{PULSAR_PORT}"
        return [*self.net.exec_prefix("pl"), *command]

    def _ready(self) -> bool:
        return accepts_connections(self.ip, PULSAR_PORT, timeout_s=0.5)


def fixed_ports(*ports: int) -> Callable[[], HeldPort]:
    """A port source handing out ``ports`` in order: a namespace's ports are its own."""
    remaining = iter(ports)
    return lambda: FreePort(next(remaining))


class NamespacedBookie(Bookie):
    """A bookie of the real cluster in namespace ``name``, on its ``eth0`` address (its
    bookie id ``10.77.0.N:3181``)."""

    def __init__(self, net: Network, name: str, directory: Path, zookeeper_connect: str) -> None:
        # Not stopped with the thread that started it (bookies start in parallel threads):
        # the network's teardown kills whatever is left in the namespace.
        super().__init__(
            directory, name=name, zookeeper_connect=zookeeper_connect,
            host=net.address[name], interface="eth0",
            port_source=fixed_ports(BOOKIE_PORT), stop_with_parent=False,
        )  # fmt: skip
        self.net = net

    def _command(self) -> list[str]:
        return [*self.net.exec_prefix(self.name), *super()._command()]


class NamespacedPulsarBroker(PulsarBroker):
    """The real cluster's Pulsar broker in namespace ``name`` on its address."""

    def __init__(self, net: Network, name: str, directory: Path, zookeeper_connect: str) -> None:
        super().__init__(
            directory, name=name, zookeeper_connect=zookeeper_connect, quorums=DEFAULT_QUORUMS,
            host=net.address[name], port_source=fixed_ports(PULSAR_PORT, PULSAR_ADMIN_PORT),
            stop_with_parent=False,
            extra_settings=[f"bookkeeperClientTimeoutInSeconds={BOOKIE_WRITE_TIMEOUT_S}"],
        )  # fmt: skip
        self.net = net

    def _command(self) -> list[str]:
        return [*self.net.exec_prefix(self.name), *super()._command()]


class NamespacedPulsarCluster(PulsarCluster):
    """Real Apache Pulsar on real BookKeeper for ``--ledger apache-pulsar``: the harness's
    cluster (tests/support/pulsar_cluster.py: bookies with ``journalSyncData=true``, ledgers
    of ensemble 2, write and ack quorum 2 on three bookies, one spare for an ensemble change)
    with every member in a namespace of its own: the bookies in ``bk1``..``bk3``, one Pulsar
    broker in ``pl``.

    Its metadata (Pulsar's and BookKeeper's ``/ledgers``) is in the run's own ZooKeeper in
    ``zk``, beside Steward's ``/steward`` (one JVM less to start): a fault of that ZooKeeper
    (``kill-zookeeper``, ``zk-down-at-broker-start``) is one of Pulsar's metadata store too,
    and a partition of Steward's leader from ZooKeeper is not one of Pulsar's. The metadata is
    set up from the driver's namespace (``ctl``), over the bridge.

    Steward's brokers talk to the Pulsar broker only; only the Pulsar broker talks to the
    bookies (and ZooKeeper does).
    """

    def __init__(self, net: Network, directory: Path, zookeeper: ZooKeeperServer) -> None:
        # Not PulsarCluster.__init__: that one makes a ZooKeeper of its own and members on
        # 127.0.0.1 on reserved ports; the methods used here need only these attributes.
        self._directory = directory.resolve()
        self._directory.mkdir(parents=True, exist_ok=True)
        self.version = pulsar_version()
        self._lib = engines_lib()
        self._java = find_java_or_fail(PulsarClusterError)
        self.quorums = DEFAULT_QUORUMS
        self.zookeeper = zookeeper
        connect = zookeeper.connect_string
        self.bookies = [
            NamespacedBookie(net, name, self._directory / name, connect) for name in BOOKIE_NODES
        ]
        self.brokers = [
            NamespacedPulsarBroker(
                net, PULSAR_BROKER_NODE, self._directory / PULSAR_BROKER_NODE, connect
            )
        ]
        self.start_s: float | None = None
        self.server_name = "Apache Pulsar cluster"

    @property
    def broker(self) -> PulsarBroker:
        """The one Pulsar broker (``kill-pulsar`` and ``stop-pulsar`` hit it)."""
        return self.brokers[0]

    def setup_args(self) -> list[str]:
        args = super().setup_args()
        at = args.index("--web-service-url")
        args[at + 1] = f"http://{self.broker.host}:{self.broker.web_port}"
        return args

    def start(self) -> None:
        """The metadata, then the bookies and the broker together (the broker's JVM starts
        while the bookies do; it is ready once its health check's write went to them); the
        run's ZooKeeper must be up. Bounded by each member's start bound."""
        started = time.monotonic()
        try:
            self._set_up_metadata()
            start_together(self.members())
        except BaseException:
            self.close()
            raise
        self.start_s = time.monotonic() - started

    def close(self) -> None:
        """Kill every member (the ZooKeeper is the run's, stopped by the run)."""
        for member in reversed(self.members()):
            member.close()

    def rss_mb(self) -> dict[str, float]:
        """Each running bookie's and Pulsar broker's resident memory now, MB (the ZooKeeper
        is the run's, not one of this cluster's members)."""
        return {member.name: member.rss_mb() for member in self.members() if member.is_running()}

    def bookie_named(self, bookie_id: str) -> Bookie | None:
        return next((b for b in self.bookies if b.bookie_id == bookie_id), None)

    def newest_ensemble(self, cluster_name: str) -> list[Bookie]:
        """The bookies holding the newest ledger of Steward's newest ledger topic (Pulsar's
        admin API, bounded); empty when it does not answer."""
        try:
            answer = httpx.get(
                f"{self.broker.admin_url}/admin/v2/persistent/public/default", timeout=5.0
            )
            answer.raise_for_status()
            topics = sorted(t for t in answer.json() if f"/{cluster_name}-ledger-" in t)
            ensembles = self.ledger_ensembles(topics[-1]) if topics else []
        except (httpx.HTTPError, ValueError):
            return []
        found = (self.bookie_named(b) for b in ensembles[-1]) if ensembles else ()
        return [bookie for bookie in found if bookie is not None]

    def log_tail(self) -> str:
        return "\n".join(
            f"-- {member.name} ({member.log_path}) --\n{member.log_tail()}"
            for member in self.members()
        )

    @property
    def log_path(self) -> Path:
        return self._directory


def start_together(members: Iterable[ClusterMember]) -> None:
    """Start ``members`` in parallel threads; raises the first failure after all ended."""
    errors: list[BaseException] = []

    def start(member: ClusterMember) -> None:
        try:
            member.start()
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=start, args=(m,), daemon=True) for m in members]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()  # each start is bounded
    if errors:
        raise errors[0]


class Node(LoggedProcess):
    """A steward broker or worker process in namespace ``name``."""

    def __init__(
        self,
        net: Network,
        name: str,
        root: Path,
        args: list[str],
        env: dict[str, str] | None = None,
    ) -> None:
        super().__init__(name, root / "logs" / f"{name}.log")
        self.env = env or {}
        self.net = net
        self.name = name
        self.ip = net.address[name]
        self.args = args
        self.stopped = False
        self.starts = 0

    def start(self) -> None:
        self.starts += 1
        self.stopped = False
        header = f"\n===== start #{self.starts} at monotonic {time.monotonic():.3f} =====\n"
        env = dict(os.environ, PYTHONUNBUFFERED="1", **self.env)
        self.spawn_logged([*self.net.exec_prefix(self.name), *self.args], env, header)

    def signal(self, signum: signal.Signals) -> None:
        if self.running():
            os.kill(self.pid, signum)
            self.stopped = signum == signal.SIGSTOP

    def kill9(self, timeout_s: float = 10.0) -> None:
        if self.running() and self.stopped:
            os.kill(self.pid, signal.SIGCONT)
        self.stopped = False
        super().kill9(timeout_s)


class Broker(Node):
    def __init__(self, net: Network, name: str, root: Path, args: list[str]) -> None:
        self.clock_file = root / name / "clock-offset"
        # Under tests/jepsen/clock_shift.py: its wall clock follows the control file.
        command = [sys.executable, "-m", "tests.jepsen.clock_shift", str(self.clock_file)]
        super().__init__(net, name, root, [*command, "clients.cli", *args])
        self.clock_offset_s = 0.0
        self.set_clock(0.0)

    def set_clock(self, offset_s: float) -> None:
        """Jump the broker's wall clock to ``offset_s`` from the true time (at once: the
        file is replaced whole, never read half-written)."""
        self.clock_file.parent.mkdir(parents=True, exist_ok=True)
        temporary = self.clock_file.with_suffix(".tmp")
        temporary.write_text(f"{offset_s:+.3f}\n")
        os.replace(temporary, self.clock_file)
        self.clock_offset_s = offset_s

    @property
    def url(self) -> str:
        return f"http://{self.ip}:{HTTP_PORT}"

    def get(self, path: str, timeout_s: float = PROBE_TIMEOUT_S) -> Any:
        response = httpx.get(self.url + path, timeout=timeout_s)
        response.raise_for_status()
        return response.json()

    def health(self) -> dict[str, Any] | None:
        if not self.running() or self.stopped:
            return None
        try:
            body: dict[str, Any] = httpx.get(self.url + "/healthz", timeout=PROBE_TIMEOUT_S).json()
            return body
        except (httpx.HTTPError, ValueError):
            return None


class Cluster:
    """ZooKeeper, ``brokers`` brokers and ``workers`` workers of one run."""

    def __init__(
        self,
        net: Network,
        root: Path,
        *,
        brokers: list[str],
        workers: list[str],
        session_timeout_ms: int,
        ledger: str = "file",
    ) -> None:
        self.net = net
        self.root = root
        self.name = "jepsen"
        (root / "logs").mkdir(parents=True, exist_ok=True)
        self.ledger_dir = root / "ledgers"
        self.ledger_dir.mkdir(exist_ok=True)
        self.zookeeper = NamespacedZooKeeper(net, root / "zookeeper")
        self.ledger = ledger
        self.pulsar: NamespacedPulsarLite | NamespacedPulsarCluster | None = None
        if ledger == "pulsar":
            self.pulsar = NamespacedPulsarLite(net, root / "pulsar")
        elif ledger == "apache-pulsar":
            self.pulsar = NamespacedPulsarCluster(net, root / "pulsar", self.zookeeper)
        self.session_timeout_ms = session_timeout_ms
        self.brokers = {name: Broker(net, name, root, self._broker_args(name)) for name in brokers}
        urls = ",".join(b.url for b in self.brokers.values())
        self.workers = {
            name: Node(net, name, root, self._worker_args(name, urls)) for name in workers
        }

    def _worker_args(self, name: str, urls: str) -> list[str]:
        return [
            *steward_command(), "worker", "--brokers", urls, "--worker-id", name,
            "--cache-dir", str(self.root / "cache" / name), "--spark", "off",
            # In the run's directory: the default (/tmp/steward-worker-<uid>-<id>) is one per
            # host and worker id, which a developer's own worker "w1" would hold.
            "--work-dir", str(self.root / "work" / name),
            "--task-type", "*=2",
        ]  # fmt: skip

    def _ledger_args(self) -> list[str]:
        if self.pulsar is None:
            return ["--ledger-dir", str(self.ledger_dir)]
        if isinstance(self.pulsar, NamespacedPulsarCluster):
            # The namespace the metadata setup made (Steward's topics under its cluster name).
            return [
                "--ledgers", "pulsar", "--pulsar-url", self.pulsar.service_url,
                "--pulsar-admin-url", self.pulsar.broker.admin_url, "--pulsar-flavor", "pulsar",
                "--pulsar-tenant", "public", "--pulsar-namespace", "default",
            ]  # fmt: skip
        return [
            "--ledgers", "pulsar", "--pulsar-url", self.pulsar.service_url,
            "--pulsar-flavor", "pulsar-lite",
        ]  # fmt: skip

    def _broker_args(self, name: str) -> list[str]:
        ip = self.net.address[name]
        return [
            "broker",
            "--zookeeper", f"{self.net.address['zk']}:{ZK_PORT}",
            "--cluster", self.name, "--broker-id", name,
            "--data-dir", str(self.root / name / "data"),
            *self._ledger_args(),
            "--http", f"{ip}:{HTTP_PORT}", "--worker-listen", f"{ip}:{WORKER_PORT}",
            "--session-timeout-ms", str(self.session_timeout_ms),
            "--heartbeat-interval-ms", "500", "--heartbeat-timeout-ms", str(HEARTBEAT_TIMEOUT_MS),
            "--log-level", "INFO",
            # Small: ledgers roll and are deleted, and a broker that was away downloads a
            # snapshot from a peer, within every run.
            "--ledger-roll-age-s", str(LEDGER_ROLL_AGE_S), "--ledger-retention-h",
            str(LEDGER_RETENTION_S / 3600), "--snapshot-interval-s", str(SNAPSHOT_INTERVAL_S),
        ]  # fmt: skip

    @property
    def urls(self) -> list[str]:
        return [b.url for b in self.brokers.values()]

    @property
    def pulsar_server(self) -> NamespacedPulsarLite | PulsarBroker:
        """What ``kill-pulsar`` and ``stop-pulsar`` hit: pulsar-lite, or the Pulsar broker."""
        assert self.pulsar is not None, "a pulsar ledger only"
        if isinstance(self.pulsar, NamespacedPulsarCluster):
            return self.pulsar.broker
        return self.pulsar

    def start(self) -> None:
        self.zookeeper.start()  # first: the real Pulsar cluster's metadata is there too
        if self.pulsar is not None:
            self.pulsar.start()
        for broker in self.brokers.values():
            broker.start()

    def start_workers(self) -> None:
        for worker in self.workers.values():
            worker.start()

    def leaders(self) -> list[Broker]:
        """Brokers that answer as writable leaders right now."""
        found = []
        for broker in self.brokers.values():
            health = broker.health()
            if health and health.get("role") == "leader" and health.get("writable"):
                found.append(broker)
        return found

    def stop(self) -> None:
        for node in [*self.workers.values(), *self.brokers.values()]:
            node.kill9()
        if isinstance(self.pulsar, NamespacedPulsarCluster):
            self.pulsar.close()
        elif self.pulsar is not None:
            self.pulsar.kill()
        self.zookeeper.kill9()

    def ledger_writer(self, client: Any) -> tuple[str, int] | None:
        """Who writes the ledger list and its newest ledger id (read with ``client``, a
        started KazooClient), or None while it is unknown."""
        try:
            data, _ = client.get(f"/steward/{self.name}/ledgers")
        except Exception:  # ZooKeeper unreachable or the list not made yet
            return None
        body = json.loads(data)
        ledgers = body.get("ledgers") or []
        if not ledgers or not body.get("writer"):
            return None
        return str(body["writer"]), max(int(info["ledger_id"]) for info in ledgers)

    def log_counts(self) -> dict[str, int]:
        """Ledger rolls, retention deletions and snapshot downloads, from the brokers' logs;
        with the real Pulsar cluster, its ensemble changes (a bookie replaced in a ledger's
        ensemble), from the Pulsar broker's log."""
        text = "".join(b.log_text() for b in self.brokers.values())
        engine: dict[str, int] = {}
        if isinstance(self.pulsar, NamespacedPulsarCluster):
            # BookKeeper's LedgerHandle logs "New Ensemble: [...] for ledger: N" per change.
            pulsar_log = self.pulsar.broker.log_path.read_text(errors="replace")
            engine["ensemble changes"] = pulsar_log.count("New Ensemble: [")
        return {
            **engine,
            "ledger rolls": text.count("rolled from ledger"),
            "retention deletions": text.count("retention deleted ledgers"),
            "snapshot downloads": text.count("downloading a snapshot from")
            - text.count("no peer had a usable snapshot"),
            # A late report of an attempt that now runs elsewhere (a zombie's), refused.
            "stale reports refused": text.count("refused a report for task"),
            "stale output refused": text.count("refused output for task"),
        }

    def log_tails(self, max_bytes: int = 3000) -> str:
        parts = []
        if self.pulsar is not None:
            parts.append(f"----- {self.pulsar.server_name} ({self.pulsar.log_path}) -----\n"
                         f"{self.pulsar.log_tail()}")  # fmt: skip
        for node in [*self.brokers.values(), *self.workers.values()]:
            parts.append(f"----- {node.name} ({node.log_path}) -----\n{node.log_tail(max_bytes)}")
        return "\n".join(parts)
