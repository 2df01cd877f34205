"""``steward cluster up``: a highly available cluster on one machine, for trying HA.

A real ZooKeeper server (from the jars pyspark ships), N ``steward broker`` processes
sharing one file-ledger directory (or, with ``--ledgers pulsar``, writing their ledgers to an
Apache Pulsar standalone started from the engines cache, clients/dev/pulsar_standalone.py, or
to pulsar-lite with ``--pulsar-flavor pulsar-lite``), and M workers that find the leader
through the brokers' HTTP API. Everything binds to 127.0.0.1 and lives under ``--data-dir``; a
second ``cluster up`` on the same directory resumes the same cluster. Ctrl-C or
SIGTERM stops the workers, then the followers, then the leader (a clean hand-over
each time), then ZooKeeper.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import ssl
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import httpx

from broker.security.auth import bearer_headers, read_secret
from broker.security.tls import TlsConfig
from clients.dev.local_server import free_port
from clients.dev.pulsar_lite import PulsarLiteServer
from clients.dev.pulsar_standalone import (
    PulsarStandalone,
    PulsarStandaloneError,
    kept_ports,
)
from clients.dev.zk import ZooKeeperServer

HOST = "127.0.0.1"
_READY_TIMEOUT_S = 90.0
# What a broker prints when it cannot listen on its HTTP port (broker/server/standalone.py).
_PORT_TAKEN_MARKER = "could not serve HTTP on"
_MAX_RESPAWNS = 5
_LOG_SCAN_BYTES = 1 << 20
#: The brokers' Pulsar namespace (their ``--pulsar-namespace`` default), made at start.
PULSAR_NAMESPACE = "public/steward"


@dataclass(frozen=True)
class LocalClusterConfig:
    data_dir: Path
    brokers: int = 3
    workers: int = 2
    session_timeout_ms: int = 4_000
    first_http_port: int = 0  # 0: free ports; else brokers use this port and the next ones
    cluster: str = "local"
    zookeeper_port: int | None = None
    min_code_replicas: int = 1  # passed as --min-replication
    log_level: str = "INFO"
    # Of brokers and workers: "text" or "json" (broker/observability/logs.py).
    log_format: str = "text"
    ledgers: str = "file"  # "file" (a shared directory) or "pulsar"
    # With ledgers "pulsar": "pulsar" (an Apache Pulsar standalone) or "pulsar-lite".
    pulsar_flavor: str = "pulsar"
    # Brokers serve HTTPS and TLS to workers with this certificate (it must name
    # 127.0.0.1); workers, the brokers' peer calls and this launcher verify with its CA.
    tls: TlsConfig | None = None
    # Authentication on: the token in this file is the admin one; the worker and cluster
    # tokens are made up here and handed to the children in their environment.
    admin_token_file: Path | None = None


@dataclass
class _Child:
    name: str
    proc: subprocess.Popen[bytes]
    log: IO[bytes]
    url: str | None = None
    log_offset: int = 0  # where this start's lines begin in the log file


def _steward() -> list[str]:
    return [sys.executable, "-m", "clients.cli"]


class LocalCluster:
    def __init__(self, config: LocalClusterConfig) -> None:
        if config.brokers < 1:
            raise ValueError("--broker-count must be >= 1")
        if config.workers < 0:
            raise ValueError("--workers must be >= 0")
        self.config = config
        self.data_dir = config.data_dir.resolve()
        self.zookeeper = ZooKeeperServer(
            self.data_dir / "zookeeper",
            port=config.zookeeper_port,
            max_session_timeout_ms=max(10_000, config.session_timeout_ms * 2),
        )
        self.pulsar: PulsarLiteServer | PulsarStandalone | None = None
        if config.ledgers == "pulsar":
            self.pulsar = self._pulsar_server()
        self.brokers: list[_Child] = []
        self.workers: list[_Child] = []
        tls = config.tls
        self._verify: ssl.SSLContext | bool = tls.client_context() if tls is not None else True
        self._admin_headers: dict[str, str] = {}
        self._broker_env: dict[str, str] = {}
        self._worker_env: dict[str, str] = {}
        if config.admin_token_file is not None:
            admin_token = read_secret(config.admin_token_file)  # ValueError: a clear message
            worker_token = secrets.token_urlsafe(32)
            self._admin_headers = bearer_headers(admin_token)
            self._worker_env = {"STEWARD_WORKER_TOKEN": worker_token}
            self._broker_env = {
                **self._worker_env,
                "STEWARD_CLUSTER_TOKEN": secrets.token_urlsafe(32),
            }

    def _pulsar_server(self) -> PulsarLiteServer | PulsarStandalone:
        if self.config.pulsar_flavor == "pulsar-lite":
            return PulsarLiteServer(self.data_dir / "pulsar")
        directory = self.data_dir / "apache-pulsar"
        try:
            return PulsarStandalone(
                directory, port_source=kept_ports(directory), stop_with_parent=False
            )
        except PulsarStandaloneError as exc:
            raise PulsarStandaloneError(
                f"{exc}; or run the light one: --pulsar-flavor pulsar-lite"
            ) from None

    def _auth_args(self) -> list[str]:
        file = self.config.admin_token_file
        return ["--admin-token-file", str(file)] if file is not None else []

    def _tls_args(self, broker: bool) -> list[str]:
        tls = self.config.tls
        if tls is None:
            return []
        args = ["--tls-cert", str(tls.cert_path), "--tls-key", str(tls.key_path)] if broker else []
        return args + (["--tls-ca", str(tls.ca_path)] if tls.ca_path is not None else [])

    def _ledger_args(self) -> list[str]:
        if self.pulsar is None:
            return ["--ledger-dir", str(self.data_dir / "ledgers")]
        pulsar = ["--ledgers", "pulsar", "--pulsar-url", self.pulsar.service_url]
        if isinstance(self.pulsar, PulsarLiteServer):
            return [*pulsar, "--pulsar-flavor", "pulsar-lite"]
        return [*pulsar, "--pulsar-flavor", "pulsar", "--pulsar-admin-url", self.pulsar.admin_url]

    def _spawn(self, name: str, args: list[str], env: dict[str, str] | None = None) -> _Child:
        log_path = self._log_path(name)
        log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(log_path, "ab")  # noqa: SIM115 - closed in stop()
        log_offset = log.seek(0, os.SEEK_END)
        proc = subprocess.Popen(
            [*_steward(), *args],
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            # Secrets travel in the environment, not on command lines others can read.
            env={**os.environ, **(env or {})},
        )
        return _Child(name, proc, log, log_offset=log_offset)

    def _log_path(self, name: str) -> Path:
        return self.data_dir / "logs" / f"{name}.log"

    def _log_since_start(self, child: _Child) -> str:
        with open(self._log_path(child.name), "rb") as log:
            log.seek(child.log_offset)
            return log.read(_LOG_SCAN_BYTES).decode(errors="replace")

    def start(self) -> None:
        config = self.config
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.zookeeper.start()
        if isinstance(self.pulsar, PulsarStandalone):
            print(
                f"starting Apache Pulsar {self.pulsar.version} (a JVM: tens of seconds, "
                f"at most {self.pulsar.start_timeout_s:g} s); its log: {self.pulsar.log_path}",
                flush=True,
            )
            self.pulsar.start()
            self.pulsar.create_namespace(PULSAR_NAMESPACE)
        elif self.pulsar is not None:
            self.pulsar.start()
        for n in range(1, config.brokers + 1):
            port = config.first_http_port + n - 1 if config.first_http_port else free_port()
            self.brokers.append(self._spawn_broker(f"broker-{n}", port))
        leader = self._wait_until_serving()
        urls = ",".join(b.url for b in self.brokers if b.url)
        for n in range(1, config.workers + 1):
            self.workers.append(
                self._spawn(
                    f"worker-{n}",
                    [
                        "worker",
                        "--brokers",
                        urls,
                        "--worker-id",
                        f"worker-{n}",
                        "--log-format",
                        config.log_format,
                        "--cache-dir",
                        str(self.data_dir / f"worker-{n}-cache"),
                        *self._tls_args(broker=False),
                    ],
                    self._worker_env,
                )
            )
        self._print_processes(leader, urls)

    def _print_processes(self, leader: str, urls: str) -> None:
        """Every process with its role and pid, and the commands to use the cluster: a
        failover is tried by killing the leader's pid, so it is printed (issue 17)."""
        rows = [("zookeeper", "zookeeper", self.zookeeper.pid, self.zookeeper.connect_string)]
        if isinstance(self.pulsar, PulsarStandalone):
            rows.append(("pulsar", "ledgers", self.pulsar.pid, self.pulsar.service_url))
            rows.append(("pulsar", "admin", self.pulsar.pid, self.pulsar.admin_url))
        elif self.pulsar is not None:
            rows.append(("pulsar-lite", "ledgers", self.pulsar.pid, self.pulsar.service_url))
        for broker in self.brokers:
            role = "leader" if broker.name == leader else "follower"
            rows.append((broker.name, role, broker.proc.pid, broker.url or "-"))
        for worker in self.workers:
            rows.append((worker.name, "worker", worker.proc.pid, "finds the leader itself"))
        print(f"{'NAME':<11} {'ROLE':<9} {'PID':<8} ADDRESS")
        for name, role, pid, address in rows:
            print(f"{name:<11} {role:<9} {pid or '-':<8} {address}")
        print(f"logs        {self.data_dir / 'logs'}")
        ca = self._tls_args(broker=False)
        ca_option = f" --ca-file {ca[1]}" if ca else ""
        file = self.config.admin_token_file
        token_option = f' --token "$(cat {file})"' if file is not None else ""
        print(f"client      steward --url {urls}{ca_option}{token_option} status")
        pid = next(b.proc.pid for b in self.brokers if b.name == leader)
        timeout_s = self.config.session_timeout_ms / 1000
        print(
            f"failover    kill -9 {pid}    # the leader, {leader}: a follower takes over "
            f"within the {timeout_s:g} s session timeout",
            flush=True,
        )

    def _spawn_broker(self, name: str, port: int) -> _Child:
        config = self.config
        child = self._spawn(
            name,
            [
                "broker",
                "--zookeeper",
                self.zookeeper.connect_string,
                "--cluster",
                config.cluster,
                "--broker-id",
                name,
                "--data-dir",
                str(self.data_dir / name),
                *self._ledger_args(),
                "--http",
                f"{HOST}:{port}",
                "--worker-listen",
                f"{HOST}:0",
                "--session-timeout-ms",
                str(config.session_timeout_ms),
                "--min-replication",
                str(config.min_code_replicas),
                "--log-format",
                config.log_format,
                "--log-level",
                config.log_level,
                *self._tls_args(broker=True),
                *self._auth_args(),
            ],
            self._broker_env,
        )
        child.url = f"{'https' if config.tls is not None else 'http'}://{HOST}:{port}"
        return child

    def _wait_until_serving(self) -> str:
        """Return the leader's name once every broker answers HTTP and one of them names
        it: each URL printed after this takes requests (a follower redirects writes)."""
        deadline = time.monotonic() + _READY_TIMEOUT_S
        serving: set[str] = set()
        respawns = 0
        while time.monotonic() < deadline:
            for n, broker in enumerate(self.brokers):
                if broker.proc.poll() is None:
                    continue
                port_taken = _PORT_TAKEN_MARKER in self._log_since_start(broker)
                if port_taken and not self.config.first_http_port and respawns < _MAX_RESPAWNS:
                    # The free port picked for it was taken before it could listen.
                    respawns += 1
                    broker.log.close()
                    self.brokers[n] = self._spawn_broker(broker.name, free_port())
                    continue
                raise RuntimeError(
                    f"{broker.name} exited with {broker.proc.returncode}; "
                    f"see {self._log_path(broker.name)}"
                )
            for broker in self.brokers:
                if broker.name not in serving and self._get_json(broker, "/healthz") is not None:
                    serving.add(broker.name)
            if len(serving) == len(self.brokers):
                for broker in self.brokers:
                    summary = self._get_json(broker, "/api/v1/cluster")
                    if summary is not None and summary.get("leader"):
                        print(f"leader      {summary['leader']} {summary.get('leader_url')}")
                        return str(summary["leader"])
            time.sleep(0.2)
        waiting = [b.name for b in self.brokers if b.name not in serving]
        problem = f"{', '.join(waiting)} not serving" if waiting else "no leader elected"
        raise RuntimeError(f"{problem} within {_READY_TIMEOUT_S:g} s")

    def _get_json(self, broker: _Child, path: str) -> dict[str, Any] | None:
        """The broker's JSON answer to a GET, or None if it does not answer (yet) with 200."""
        try:
            response = httpx.get(
                f"{broker.url}{path}",
                timeout=1.0,
                verify=self._verify,
                headers=self._admin_headers,
            )
            body = response.json() if response.status_code == 200 else None
        except (httpx.HTTPError, ValueError):
            return None
        return body if isinstance(body, dict) else None

    def watch(self, stop: threading.Event) -> None:
        """Report children that exit until ``stop`` is set."""
        reported: set[str] = set()
        while not stop.wait(1.0):
            for child in [*self.brokers, *self.workers]:
                code = child.proc.poll()
                if code is not None and child.name not in reported:
                    reported.add(child.name)
                    print(f"{child.name} exited with {code}", flush=True)

    def _leader_last(self) -> list[_Child]:
        def is_leader(child: _Child) -> bool:
            health = self._get_json(child, "/healthz")
            return health is not None and health.get("role") == "leader"

        return sorted(self.brokers, key=is_leader)

    def stop(self) -> None:
        for child in self.workers:
            _terminate(child)
        for child in self._leader_last():
            _terminate(child)
        for child in [*self.workers, *self.brokers]:
            child.log.close()
        if self.pulsar is not None:
            self.pulsar.stop()
        self.zookeeper.stop()


def _terminate(child: _Child, timeout_s: float = 30.0) -> None:
    if child.proc.poll() is None:
        child.proc.send_signal(signal.SIGTERM)
        try:
            child.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            child.proc.kill()
            child.proc.wait(timeout=5)


def run_local_cluster(config: LocalClusterConfig) -> int:
    cluster = LocalCluster(config)
    stop = threading.Event()
    previous = signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        cluster.start()
        print("cluster up; Ctrl-C stops it", flush=True)
        with contextlib.suppress(KeyboardInterrupt):
            cluster.watch(stop)
        print("stopping...", flush=True)
        return 0
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not cut the stop
        cluster.stop()
        signal.signal(signal.SIGTERM, previous)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        os.sync()
