"""A cluster of real ``steward broker`` subprocesses for integration tests.

:class:`ClusterProcesses` starts N brokers against one ZooKeeper server: free ports, one
shared ledger dir, a data dir and a log file per broker. It kills (-9), freezes
(SIGSTOP), resumes, terminates, restarts and adds brokers, finds the acting leader, and
compares state digests. Every wait is bounded; every process is killed by its pid when
the ``with`` block ends, and on an error the block prints the tails of all logs.

Workers get every broker's URL (``steward worker --brokers``): they find the leader
themselves and reconnect to the next one after a fail-over, keeping their running tasks.

The client side (a write load and the checks on what it recorded) is in
tests/support/write_load.py.
"""

from __future__ import annotations

import json
import os
import signal
import ssl
import time
import uuid
from collections.abc import Iterable
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any

import httpx

from tests.support.logged_process import (
    LoggedProcess,
    wait_healthy,
)
from tests.support.procs import HOST, free_port, steward_command, steward_help
from tests.support.worker_procs import wait_until

if TYPE_CHECKING:
    from tests.support.tls_certs import TlsFiles

DEFAULT_SESSION_TIMEOUT_MS = 4_000
START_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 20.0
PROBE_TIMEOUT_S = 1.0  # one status request to one broker (a frozen one never answers)


class ClusterError(AssertionError):
    """A broker did not start, stop or converge in time (log tails are included)."""


def worker_supports_brokers_flag() -> bool:
    """Whether ``steward worker`` has ``--brokers URL,URL`` (leader discovery) yet."""
    return "--brokers" in steward_help("worker")


class BrokerNode(LoggedProcess):
    """One ``steward broker`` subprocess with fixed ports (kept across restarts)."""

    tail_bytes = 6000

    def __init__(
        self,
        cluster: ClusterProcesses,
        broker_id: str,
        data_dir: Path,
        log_path: Path,
        extra_args: tuple[str, ...],
    ) -> None:
        super().__init__(f"broker {broker_id}", log_path)
        self.cluster = cluster
        self.broker_id = broker_id
        self.data_dir = data_dir
        self.extra_args = extra_args
        self.http_port = free_port()
        self.worker_port = free_port()
        self.stopped = False  # SIGSTOPped: never ask it anything (it would not answer)
        self.starts = 0

    def __repr__(self) -> str:
        return f"BrokerNode({self.broker_id}, {self.url})"

    @property
    def url(self) -> str:
        return f"{'https' if self.cluster.tls is not None else 'http'}://{HOST}:{self.http_port}"

    @property
    def worker_address(self) -> str:
        return f"{HOST}:{self.worker_port}"

    def live(self) -> bool:
        """Running and not frozen: it can answer requests."""
        return self.running() and not self.stopped

    def command(self) -> list[str]:
        c = self.cluster
        return [
            *steward_command(),
            "broker",
            "--zookeeper",
            c.zookeeper,
            "--cluster",
            c.name,
            "--broker-id",
            self.broker_id,
            "--data-dir",
            str(self.data_dir),
            *c.ledger_args(),
            "--http",
            f"{HOST}:{self.http_port}",
            "--worker-listen",
            self.worker_address,
            "--session-timeout-ms",
            str(c.session_timeout_ms),
            "--heartbeat-interval-ms",
            str(c.heartbeat_interval_ms),
            "--heartbeat-timeout-ms",
            str(c.heartbeat_timeout_ms),
            "--log-level",
            "INFO",
            *(c.tls.broker_args() if c.tls is not None else ()),
            *c.extra_args,
            *self.extra_args,
        ]

    def spawn(self) -> None:
        assert not self.running(), f"{self.broker_id} is already running"
        self.starts += 1
        header = (
            f"\n===== start #{self.starts} http {self.http_port} workers {self.worker_port} "
            f"at {time.time():.3f} =====\n"
        )
        self.stopped = False
        env = dict(os.environ, PYTHONUNBUFFERED="1", **self.cluster.extra_env)
        self.spawn_logged(self.command(), env, header)

    def wait_serving(self, timeout_s: float = START_TIMEOUT_S) -> dict[str, Any]:
        """Poll ``/healthz`` until 200 (a follower answers 200 too); fail if it exits."""
        return wait_healthy(
            self.url,
            lambda: self.proc,
            name=f"broker {self.broker_id}",
            verify=self.cluster.verify,
            timeout_s=timeout_s,
            probe_timeout_s=PROBE_TIMEOUT_S,
            tail=self.log_tail,
            error=ClusterError,
        )

    def signal(self, signum: signal.Signals) -> float:
        """Send ``signum`` to the broker; returns when it was sent (monotonic)."""
        assert self.running(), f"{self.broker_id} is not running"
        sent = time.monotonic()
        os.kill(self.pid, signum)
        return sent

    def kill9(self, timeout_s: float = 10.0) -> float:  # type: ignore[override]
        """SIGKILL and reap (bounded); returns when the signal was sent."""
        sent = time.monotonic()
        self.stopped = False
        super().kill9(timeout_s)
        return sent

    def sigstop(self) -> float:
        """SIGSTOP; returns once every thread of the broker is stopped (bounded)."""
        self.stopped = True
        sent = self.signal(signal.SIGSTOP)
        tasks = Path(f"/proc/{self.pid}/task")

        def all_stopped() -> bool:
            # Field 3 of /proc/<pid>/task/<tid>/stat is the state; the name before it
            # is in parentheses and may hold spaces.
            states = [
                (t / "stat").read_text().rsplit(")", 1)[1].split()[0] for t in tasks.iterdir()
            ]
            return all(state in ("T", "t") for state in states)

        wait_until(all_stopped, 5.0, f"{self.broker_id} to stop", pause_s=0.001)
        return sent

    def sigcont(self) -> float:
        sent = self.signal(signal.SIGCONT)
        self.stopped = False
        return sent

    def sigterm(self) -> float:
        return self.signal(signal.SIGTERM)

    def wait_exit(self, timeout_s: float = STOP_TIMEOUT_S) -> int:
        return self.wait_for_exit(timeout_s, ClusterError)

    # -- HTTP ---------------------------------------------------------------------------

    def get_json(self, path: str, timeout_s: float = PROBE_TIMEOUT_S) -> Any:
        """GET ``path`` on this broker (raises on a transport error or a non-2xx)."""
        response = httpx.get(
            self.url + path,
            timeout=timeout_s,
            headers=self.cluster.http_headers,
            verify=self.cluster.verify,
        )
        response.raise_for_status()
        return response.json()

    def health(self) -> dict[str, Any] | None:
        """``/healthz`` body (200 or 503), or None when the broker does not answer."""
        if not self.live():
            return None
        try:
            body: dict[str, Any] = httpx.get(
                self.url + "/healthz", timeout=PROBE_TIMEOUT_S, verify=self.cluster.verify
            ).json()
            return body
        except (httpx.TransportError, ValueError):
            return None

    def own_summary(self) -> dict[str, Any] | None:
        """This broker's own entry of ``/api/v1/cluster`` (role, digest, position)."""
        if not self.live():
            return None
        try:
            body = self.get_json("/api/v1/cluster")
        except (httpx.TransportError, httpx.HTTPStatusError, ValueError):
            return None
        for broker in body["brokers"]:
            if broker["id"] == self.broker_id:
                own: dict[str, Any] = broker
                return own
        return None


class ClusterProcesses:
    """N brokers of one cluster on one host (see the module docstring)."""

    def __init__(
        self,
        zookeeper: str,
        root: Path,
        *,
        brokers: int = 3,
        name: str | None = None,
        session_timeout_ms: int = DEFAULT_SESSION_TIMEOUT_MS,
        heartbeat_interval_ms: int = 500,
        # Generous: a worker reconnecting with backoff after a fail-over must not be
        # declared dead by the new leader (that would re-run its tasks).
        heartbeat_timeout_ms: int = 15_000,
        tls: TlsFiles | None = None,
        extra_args: tuple[str, ...] = (),
        pulsar_url: str | None = None,
        pulsar_admin_url: str | None = None,
        admin_token: str | None = None,
        extra_env: dict[str, str] | None = None,
    ) -> None:
        self.zookeeper = zookeeper
        # Added to every broker's environment: secrets (STEWARD_CLUSTER_TOKEN), not argv.
        self.extra_env = extra_env or {}
        # Authentication on (the brokers' extra_args name an admin token): probes send it.
        self.http_headers = {"authorization": f"Bearer {admin_token}"} if admin_token else {}
        # None: the file backend in root/ledgers; else the pulsar backend: on real Apache
        # Pulsar (--pulsar-flavor pulsar) with its admin URL, on pulsar-lite without one.
        self.pulsar_url = pulsar_url
        self.pulsar_admin_url = pulsar_admin_url
        self.root = root
        self.name = name or f"c{uuid.uuid4().hex[:8]}"
        self.session_timeout_ms = session_timeout_ms
        self.heartbeat_interval_ms = heartbeat_interval_ms
        self.heartbeat_timeout_ms = heartbeat_timeout_ms
        self.extra_args = extra_args
        # Brokers serve HTTPS and TLS to workers with this certificate; workers get its CA.
        self.tls = tls
        self.verify: ssl.SSLContext | bool = tls.client_context() if tls is not None else True
        self.ledger_dir = root / "ledgers"
        self.ledger_dir.mkdir(parents=True, exist_ok=True)
        self.nodes: dict[str, BrokerNode] = {}
        self.workers: list[ClusterWorker] = []
        self._initial = brokers

    def ledger_args(self) -> list[str]:
        if self.pulsar_url is None:
            return ["--ledger-dir", str(self.ledger_dir)]
        pulsar = ["--ledgers", "pulsar", "--pulsar-url", self.pulsar_url]
        if self.pulsar_admin_url is None:
            return [*pulsar, "--pulsar-flavor", "pulsar-lite"]
        return [*pulsar, "--pulsar-flavor", "pulsar", "--pulsar-admin-url", self.pulsar_admin_url]

    def ledger_ids(self) -> list[int]:
        """The ledger ids in the cluster's ledger list (read from ZooKeeper)."""
        from kazoo.client import KazooClient  # type: ignore[import-untyped]

        client = KazooClient(hosts=self.zookeeper)
        client.start(timeout=15)
        try:
            data, _ = client.get(f"/steward/{self.name}/ledgers")
        finally:
            client.stop()
            client.close()
        return sorted(int(info["ledger_id"]) for info in json.loads(data)["ledgers"])

    # -- lifecycle --------------------------------------------------------------------------

    def __enter__(self) -> ClusterProcesses:
        try:
            for _ in range(self._initial):
                self.add_broker(wait=False)
            for node in self.nodes.values():
                self.start(node.broker_id)
        except BaseException:
            self.print_logs()
            self.close()
            raise
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc is not None:
            self.print_logs()
        self.close()

    def close(self) -> None:
        for worker in self.workers:
            worker.kill9()
        for node in self.nodes.values():
            node.kill9()

    def print_logs(self, max_bytes: int = 5000) -> None:
        for node in self.nodes.values():
            print(f"\n----- broker {node.broker_id} log tail ({node.log_path}) -----")
            print(node.log_tail(max_bytes))
        for worker in self.workers:
            print(f"\n----- worker {worker.worker_id} log tail -----")
            print(worker.log_tail(max_bytes // 2))

    # -- brokers ---------------------------------------------------------------------------

    def node(self, broker_id: str) -> BrokerNode:
        return self.nodes[broker_id]

    def add_broker(self, *extra_args: str, wait: bool = True) -> BrokerNode:
        """A brand-new broker with an empty data dir (started unless ``wait`` is False)."""
        broker_id = f"b{len(self.nodes)}"
        node = BrokerNode(
            self,
            broker_id,
            self.root / broker_id / "data",
            self.root / "logs" / f"{broker_id}.log",
            tuple(extra_args),
        )
        self.nodes[broker_id] = node
        if wait:
            self.start(broker_id)
        return node

    def start(self, broker_id: str, timeout_s: float = START_TIMEOUT_S) -> BrokerNode:
        """Start (or restart, same data dir) a broker; wait until it serves HTTP.

        Ports are kept when free; a port taken meanwhile gets a fresh one (bounded).
        """
        node = self.nodes[broker_id]
        for attempt in range(5):
            node.spawn()
            try:
                node.wait_serving(timeout_s)
                return node
            except ClusterError:
                node.kill9()
                text = node.log_tail(3000).lower()
                if "address already in use" not in text and "cannot listen" not in text:
                    raise
                if attempt == 4:
                    raise
                node.http_port, node.worker_port = free_port(), free_port()
        raise AssertionError("unreachable")

    restart = start

    def kill9(self, broker_id: str) -> float:
        return self.nodes[broker_id].kill9()

    def sigstop(self, broker_id: str) -> float:
        return self.nodes[broker_id].sigstop()

    def sigcont(self, broker_id: str) -> float:
        return self.nodes[broker_id].sigcont()

    def sigterm(self, broker_id: str) -> float:
        return self.nodes[broker_id].sigterm()

    def stop(self, broker_id: str, timeout_s: float = STOP_TIMEOUT_S) -> int:
        """Graceful: SIGTERM and wait for the exit code."""
        node = self.nodes[broker_id]
        node.sigterm()
        return node.wait_exit(timeout_s)

    def live(self) -> list[BrokerNode]:
        return [node for node in self.nodes.values() if node.live()]

    def urls(self) -> list[str]:
        return [node.url for node in self.nodes.values()]

    # -- leadership and state ----------------------------------------------------------------

    def leaders(self, excluding: Iterable[str] = ()) -> list[BrokerNode]:
        """Live brokers whose own role is "leader" and that take writes."""
        skip = set(excluding)
        found = []
        for node in self.live():
            if node.broker_id in skip:
                continue
            own = node.own_summary()
            if own is None or own.get("role") != "leader":
                continue
            health = node.health()
            if health is not None and health.get("writable") is True:
                found.append(node)
        return found

    def leader(self, excluding: Iterable[str] = ()) -> BrokerNode | None:
        """The acting leader, or None (none yet, or two claim it: not settled)."""
        found = self.leaders(excluding)
        return found[0] if len(found) == 1 else None

    def wait_for_leader(self, timeout_s: float = 30.0, excluding: Iterable[str] = ()) -> BrokerNode:
        skip = tuple(excluding)
        leader: BrokerNode = wait_until(
            lambda: self.leader(skip), timeout_s, f"a leader (excluding {skip})", pause_s=0.02
        )
        return leader

    def digests(self) -> dict[str, dict[str, Any]]:
        """``/api/v1/state/digest`` of every live broker that answers."""
        found: dict[str, dict[str, Any]] = {}
        for node in self.live():
            try:
                found[node.broker_id] = node.get_json("/api/v1/state/digest")
            except (httpx.TransportError, httpx.HTTPStatusError, ValueError):
                continue
        return found

    def wait_for_equal_digests(self, timeout_s: float = 30.0) -> str:
        """Wait until every live broker answers with the same digest; returns it."""
        last: dict[str, dict[str, Any]] = {}

        def equal() -> str | None:
            nonlocal last
            live = {node.broker_id for node in self.live()}
            last = self.digests()
            values = {str(d["digest"]) for d in last.values()}
            if set(last) == live and len(values) == 1:
                return values.pop()
            return None

        try:
            digest: str = wait_until(equal, timeout_s, "equal digests", pause_s=0.1)
        except AssertionError:
            raise ClusterError(f"digests did not converge within {timeout_s} s: {last}") from None
        return digest

    # -- workers -------------------------------------------------------------------------------

    def start_worker(
        self, worker_id: str, *args: str, env: dict[str, str] | None = None
    ) -> ClusterWorker:
        """A worker that finds the leader itself (``--brokers`` with every broker's URL);
        ``env`` is added to its environment (a token: STEWARD_WORKER_TOKEN, never argv)."""
        assert worker_supports_brokers_flag(), "steward worker has no --brokers option"
        tls_args = ["--tls-ca", str(self.tls.ca_path)] if self.tls is not None else []
        worker = ClusterWorker(
            worker_id,
            ["--brokers", ",".join(self.urls()), *tls_args],
            log_path=self.root / "logs" / f"{worker_id}.log",
            cache_dir=self.root / "cache" / worker_id,
            extra_args=args,
            env=env,
        )
        self.workers.append(worker)
        worker.start()
        return worker

    def connected_workers(self, leader: BrokerNode) -> set[str]:
        body = leader.get_json("/api/v1/cluster", timeout_s=5)
        return {w["id"] for w in body["workers"] if w["state"] == "connected"}

    def wait_workers_connected(
        self, worker_ids: Iterable[str], timeout_s: float = 30.0
    ) -> BrokerNode:
        wanted = set(worker_ids)

        def connected() -> BrokerNode | None:
            for worker in self.workers:
                assert worker.running(), f"worker {worker.worker_id} died\n{worker.log_tail()}"
            leader = self.leader()
            if leader is None:
                return None
            try:
                return leader if wanted <= self.connected_workers(leader) else None
            except (httpx.TransportError, httpx.HTTPStatusError):
                return None

        leader: BrokerNode = wait_until(connected, timeout_s, f"workers {sorted(wanted)}")
        return leader


class ClusterWorker(LoggedProcess):
    """One ``steward worker`` subprocess (killed by pid at the end of the cluster block)."""

    tail_bytes = 3000

    def __init__(
        self,
        worker_id: str,
        target: list[str],
        *,
        log_path: Path,
        cache_dir: Path,
        extra_args: tuple[str, ...],
        env: dict[str, str] | None = None,
    ) -> None:
        super().__init__(f"worker {worker_id}", log_path)
        self.worker_id = worker_id
        self.target = target
        self.env = env or {}
        self.cache_dir = cache_dir
        self.extra_args = extra_args
        self.stopped = False  # SIGSTOPped

    def start(self) -> None:
        self.stopped = False
        self.spawn_logged(
            [
                *steward_command(),
                "worker",
                *self.target,
                "--worker-id",
                self.worker_id,
                "--cache-dir",
                str(self.cache_dir),
                "--spark",  # these workers run load tasks, never Spark: no JVM
                "off",
                *self.extra_args,
            ],
            dict(os.environ, PYTHONUNBUFFERED="1", **self.env),
        )

    def sigstop(self) -> None:
        """Freeze the worker (its TCP connection stays open, it answers nothing)."""
        assert self.running(), f"worker {self.worker_id} is not running"
        os.kill(self.pid, signal.SIGSTOP)
        self.stopped = True

    def sigcont(self) -> None:
        assert self.running(), f"worker {self.worker_id} is not running"
        os.kill(self.pid, signal.SIGCONT)
        self.stopped = False

    def kill9(self, timeout_s: float = 10.0) -> None:
        self.stopped = False
        super().kill9(timeout_s)


# -- client load ----------------------------------------------------------------------------------
