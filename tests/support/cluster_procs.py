"""A cluster of real ``steward broker`` subprocesses for integration tests.

:class:`ClusterProcesses` starts N brokers against one ZooKeeper server: free ports, one
shared ledger dir, a data dir and a log file per broker. It kills (-9), freezes
(SIGSTOP), resumes, terminates, restarts and adds brokers, finds the acting leader, and
compares state digests. Every wait is bounded; every process is killed by its pid when
the ``with`` block ends, and on an error the block prints the tails of all logs.

Workers get every broker's URL (``steward worker --brokers``): they find the leader
themselves and reconnect to the next one after a fail-over, keeping their running tasks.

:class:`WriteLoad` is the client side: concurrent HTTP clients that submit tasks with
idempotency keys, follow the leader (307 redirects, retries on 503 and broken
connections) or stay pinned to one broker, and record every answer with its time.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import json
import os
import signal
import ssl
import subprocess
import threading
import time
import uuid
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import IO, TYPE_CHECKING, Any

import httpx

from tests.support.logged_process import (
    kill9,
    log_tail,
    log_text,
    open_log,
    spawn_logged,
    wait_healthy,
)
from tests.support.procs import HOST, free_port, steward_command
from tests.support.worker_procs import wait_until

if TYPE_CHECKING:
    from tests.support.tls_certs import TlsFiles

DEFAULT_SESSION_TIMEOUT_MS = 4_000
START_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 20.0
PROBE_TIMEOUT_S = 1.0  # one status request to one broker (a frozen one never answers)


class ClusterError(AssertionError):
    """A broker did not start, stop or converge in time (log tails are included)."""


@functools.cache
def worker_supports_brokers_flag() -> bool:
    """Whether ``steward worker`` has ``--brokers URL,URL`` (leader discovery) yet."""
    try:
        result = subprocess.run(
            [*steward_command(), "worker", "--help"],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
    except subprocess.TimeoutExpired:
        return False
    return "--brokers" in result.stdout


class BrokerNode:
    """One ``steward broker`` subprocess with fixed ports (kept across restarts)."""

    def __init__(
        self,
        cluster: ClusterProcesses,
        broker_id: str,
        data_dir: Path,
        log_path: Path,
        extra_args: tuple[str, ...],
    ) -> None:
        self.cluster = cluster
        self.broker_id = broker_id
        self.data_dir = data_dir
        self.log_path = log_path
        self.extra_args = extra_args
        self.http_port = free_port()
        self.worker_port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None
        self.stopped = False  # SIGSTOPped: never ask it anything (it would not answer)
        self.starts = 0
        self._log: IO[bytes] | None = None

    def __repr__(self) -> str:
        return f"BrokerNode({self.broker_id}, {self.url})"

    @property
    def url(self) -> str:
        return f"{'https' if self.cluster.tls is not None else 'http'}://{HOST}:{self.http_port}"

    @property
    def worker_address(self) -> str:
        return f"{HOST}:{self.worker_port}"

    @property
    def pid(self) -> int:
        assert self.proc is not None, f"{self.broker_id} was never started"
        return self.proc.pid

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

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
        self.close_log()
        self.starts += 1
        header = (
            f"\n===== start #{self.starts} http {self.http_port} workers {self.worker_port} "
            f"at {time.time():.3f} =====\n"
        )
        self._log = open_log(self.log_path, header)
        self.stopped = False
        env = dict(os.environ, PYTHONUNBUFFERED="1", **self.cluster.extra_env)
        self.proc = spawn_logged(self.command(), self._log, env)

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

    def kill9(self) -> float:
        """SIGKILL and reap (bounded); returns when the signal was sent."""
        sent = time.monotonic()
        if self.proc is not None:
            kill9(self.proc)
        self.stopped = False
        self.close_log()
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
        assert self.proc is not None
        try:
            code = self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.kill9()
            raise ClusterError(
                f"broker {self.broker_id} did not exit within {timeout_s} s\n{self.log_tail()}"
            ) from None
        self.close_log()
        return code

    def close_log(self) -> None:
        if self._log is not None:
            self._log.close()
            self._log = None

    def log_tail(self, max_bytes: int = 6000) -> str:
        return log_tail(self.log_path, max_bytes)

    def log_text(self) -> str:
        return log_text(self.log_path)

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
        admin_token: str | None = None,
        extra_env: dict[str, str] | None = None,
    ) -> None:
        self.zookeeper = zookeeper
        # Added to every broker's environment: secrets (STEWARD_CLUSTER_TOKEN), not argv.
        self.extra_env = extra_env or {}
        # Authentication on (the brokers' extra_args name an admin token): probes send it.
        self.http_headers = {"authorization": f"Bearer {admin_token}"} if admin_token else {}
        # None: the file backend in root/ledgers; else the pulsar backend on pulsar-lite.
        self.pulsar_url = pulsar_url
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
        return [
            "--ledgers",
            "pulsar",
            "--pulsar-url",
            self.pulsar_url,
            "--pulsar-flavor",
            "pulsar-lite",
        ]

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


class ClusterWorker:
    """One ``steward worker`` subprocess (killed by pid at the end of the cluster block)."""

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
        self.worker_id = worker_id
        self.target = target
        self.env = env or {}
        self.log_path = log_path
        self.cache_dir = cache_dir
        self.extra_args = extra_args
        self.proc: subprocess.Popen[bytes] | None = None
        self.stopped = False  # SIGSTOPped
        self._log: IO[bytes] | None = None

    def start(self) -> None:
        self.stopped = False
        self._log = open_log(self.log_path)
        self.proc = spawn_logged(
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
            self._log,
            dict(os.environ, PYTHONUNBUFFERED="1", **self.env),
        )

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    @property
    def pid(self) -> int:
        assert self.proc is not None, f"worker {self.worker_id} was never started"
        return self.proc.pid

    def sigstop(self) -> None:
        """Freeze the worker (its TCP connection stays open, it answers nothing)."""
        assert self.running(), f"worker {self.worker_id} is not running"
        os.kill(self.pid, signal.SIGSTOP)
        self.stopped = True

    def sigcont(self) -> None:
        assert self.running(), f"worker {self.worker_id} is not running"
        os.kill(self.pid, signal.SIGCONT)
        self.stopped = False

    def kill9(self) -> None:
        self.stopped = False
        if self.proc is not None and self.proc.poll() is None:
            kill9(self.proc)
        if self._log is not None:
            self._log.close()
            self._log = None

    def log_tail(self, max_bytes: int = 3000) -> str:
        return log_tail(self.log_path, max_bytes)

    def log_text(self) -> str:
        return log_text(self.log_path)


# -- client load ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Ack:
    """A 2xx answer to a submission."""

    key: str
    task_id: int
    params: dict[str, Any]
    broker_url: str  # who answered
    sent_at: float  # monotonic, when the answered request was sent
    at: float  # monotonic, when the answer arrived
    replayed: bool


@dataclass(frozen=True)
class Answer:
    """Any answer (or a transport error: status 0) to one request."""

    broker_url: str
    status: int
    sent_at: float
    at: float
    retryable: bool | None  # from the error body; None for 2xx and transport errors


@dataclass
class LoadRecord:
    attempted: dict[str, dict[str, Any]] = field(default_factory=dict)  # key -> params
    acked: dict[str, Ack] = field(default_factory=dict)
    answers: list[Answer] = field(default_factory=list)
    statuses: Counter[int] = field(default_factory=Counter)
    unexpected: list[str] = field(default_factory=list)  # 4xx other than 307 and the like


class WriteLoad:
    """``clients`` concurrent submitters on an asyncio loop in a background thread.

    ``follow=True``: start at ``targets[0]``, follow 307 redirects to ``leader_url``,
    move to the next broker on 503 or a broken connection, and retry the same
    submission with the same ``Idempotency-Key`` until it is acknowledged (when
    ``idempotent``; otherwise a submission whose fate is unknown is abandoned, so a
    retry can never create a second task). ``follow=False``: every request goes to
    ``targets[0]`` and each submission is tried once.
    """

    def __init__(
        self,
        targets: list[str],
        *,
        clients: int = 32,
        tag: str | None = None,
        task_type: str = "load.job",
        tenant: str = "load",
        follow: bool = True,
        idempotent: bool = True,
        request_timeout_s: float = 5.0,
        pause_s: float = 0.0,
    ) -> None:
        assert targets
        self.targets = list(targets)
        self.clients = clients
        self.tag = tag or uuid.uuid4().hex[:6]
        self.task_type = task_type
        self.tenant = tenant
        self.follow = follow
        self.idempotent = idempotent
        self.request_timeout_s = request_timeout_s
        self.pause_s = pause_s
        self.record = LoadRecord()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    # -- control ----------------------------------------------------------------------------

    def start(self) -> WriteLoad:
        self._thread = threading.Thread(target=self._run, name=f"load-{self.tag}", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout_s: float = 20.0) -> LoadRecord:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
            assert not self._thread.is_alive(), f"load {self.tag} did not stop in {timeout_s} s"
        if self._error is not None:
            raise AssertionError(f"load {self.tag} failed: {self._error!r}") from self._error
        return self.record

    def acked_count(self) -> int:
        with self._lock:
            return len(self.record.acked)

    def first_ack(self, after: float, excluding_url: str | None = None) -> Ack | None:
        """The earliest acknowledgement sent by a broker other than ``excluding_url``
        that arrived after ``after`` (monotonic)."""
        with self._lock:
            acks = [
                a
                for a in self.record.acked.values()
                if a.at > after and a.broker_url != excluding_url
            ]
        return min(acks, key=lambda a: a.at) if acks else None

    def answers(self) -> list[Answer]:
        with self._lock:
            return list(self.record.answers)

    def acks(self) -> list[Ack]:
        with self._lock:
            return list(self.record.acked.values())

    # -- the clients ----------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            asyncio.run(self._main())
        except BaseException as exc:  # surfaced by stop()
            self._error = exc

    async def _main(self) -> None:
        limits = httpx.Limits(max_connections=self.clients * 2, max_keepalive_connections=0)
        async with httpx.AsyncClient(timeout=self.request_timeout_s, limits=limits) as http:
            await asyncio.gather(*(self._client(http, c) for c in range(self.clients)))

    async def _client(self, http: httpx.AsyncClient, client_no: int) -> None:
        rotation = itertools.cycle(range(len(self.targets)))
        target = self.targets[client_no % len(self.targets)] if self.follow else self.targets[0]
        for seq in itertools.count():
            if self._stop.is_set():
                return
            key = f"{self.tag}-{client_no}-{seq}"
            params = {"load": self.tag, "client": client_no, "seq": seq}
            with self._lock:
                self.record.attempted[key] = params
            target = await self._submit(http, target, key, params, rotation)
            if self.pause_s:
                await asyncio.sleep(self.pause_s)

    async def _submit(
        self,
        http: httpx.AsyncClient,
        target: str,
        key: str,
        params: dict[str, Any],
        rotation: itertools.cycle[int],
    ) -> str:
        """Send one submission until acknowledged (or given up); returns the next target."""
        body = {"type": self.task_type, "tenant": self.tenant, "params": params}
        headers = {"Idempotency-Key": key} if self.idempotent else {}
        while not self._stop.is_set():
            sent_at = time.monotonic()
            try:
                response = await http.post(target + "/api/v1/tasks", json=body, headers=headers)
            except httpx.TransportError:
                self._answer(Answer(target, 0, sent_at, time.monotonic(), None))
                if not self.follow or not self.idempotent:
                    # The fate of this submission is unknown: never retry it blind.
                    await asyncio.sleep(0.02)
                    return target if not self.follow else self._next(rotation, target)
                target = self._next(rotation, target)
                await asyncio.sleep(0.02)
                continue
            at = time.monotonic()
            status = response.status_code
            if 200 <= status < 300:
                answer = response.json()
                ack = Ack(
                    key,
                    int(answer["id"]),
                    params,
                    target,
                    sent_at,
                    at,
                    bool(answer.get("replayed", False)),
                )
                with self._lock:
                    self.record.acked[key] = ack
                    self.record.answers.append(Answer(target, status, sent_at, at, None))
                    self.record.statuses[status] += 1
                return target
            error = _error_of(response)
            retryable = error.get("retryable") if error is not None else None
            self._answer(Answer(target, status, sent_at, at, retryable))
            if status not in (307, 503):
                with self._lock:
                    self.record.unexpected.append(f"{status} from {target}: {response.text[:300]}")
                return target
            if not self.follow:
                await asyncio.sleep(0.02)
                return target
            leader_url = error.get("leader_url") if error is not None else None
            if status == 307 and isinstance(leader_url, str) and leader_url != target:
                target = leader_url
            else:
                target = self._next(rotation, target)
                await asyncio.sleep(0.02)
        return target

    def _next(self, rotation: itertools.cycle[int], current: str | None = None) -> str:
        """The next broker in this client's rotation, never the one that just failed."""
        for _ in range(len(self.targets)):
            candidate = self.targets[next(rotation)]
            if candidate != current:
                return candidate
        return self.targets[0]

    def _answer(self, answer: Answer) -> None:
        with self._lock:
            self.record.answers.append(answer)
            self.record.statuses[answer.status] += 1


def _error_of(response: httpx.Response) -> dict[str, Any] | None:
    try:
        body = response.json()
    except ValueError:
        return None
    error = body.get("error") if isinstance(body, dict) else None
    return error if isinstance(error, dict) else None


# -- checks ---------------------------------------------------------------------------------------


def fetch_tasks(node: BrokerNode, *, tenant: str | None = None) -> dict[int, dict[str, Any]]:
    """Every task on ``node`` (paged), by id; asserts no id is listed twice."""
    tasks: dict[int, dict[str, Any]] = {}
    after = 0
    with httpx.Client(base_url=node.url, timeout=30, verify=node.cluster.verify) as http:
        for _ in range(10_000):
            query: dict[str, Any] = {"limit": 1000, "after": after}
            if tenant is not None:
                query["tenant"] = tenant
            response = http.get("/api/v1/tasks", params=query)
            response.raise_for_status()
            body = response.json()
            for task in body["tasks"]:
                assert task["id"] not in tasks, f"task {task['id']} listed twice"
                tasks[task["id"]] = task
            if body.get("next_after") is None:
                return tasks
            after = body["next_after"]
    raise AssertionError("too many pages of tasks")


def check_acknowledged(
    node: BrokerNode, load: WriteLoad, *, where: str, expect_unique: bool = True
) -> dict[int, dict[str, Any]]:
    """Every acknowledged submission of ``load`` is on ``node`` with its data; no task
    appears that nobody sent; with idempotency keys no submission appears twice."""
    tasks = fetch_tasks(node, tenant=load.tenant)
    record = load.record
    mine = {
        tid: t
        for tid, t in tasks.items()
        if isinstance(t["params"], dict) and t["params"].get("load") == load.tag
    }
    problems: list[str] = []
    for key, ack in record.acked.items():
        task = mine.get(ack.task_id)
        if task is None:
            problems.append(f"acknowledged task {ack.task_id} ({key}) is lost")
        elif (task["type"], task["tenant"], task["params"]) != (
            load.task_type,
            load.tenant,
            ack.params,
        ):
            problems.append(f"task {ack.task_id} is {task}, was submitted as {ack.params}")
    by_params = Counter(_params_key(t["params"]) for t in mine.values())
    attempted = {_params_key(p) for p in record.attempted.values()}
    for tid, task in mine.items():
        if _params_key(task["params"]) not in attempted:
            problems.append(f"task {tid} {task['params']} was never submitted")
    if expect_unique:
        twice = [k for k, n in by_params.items() if n > 1]
        problems += [f"submission {k} appears {by_params[k]} times" for k in twice[:10]]
    assert not problems, (
        f"{len(problems)} problems {where} ({len(record.acked)} acknowledged):\n"
        + "\n".join(problems[:20])
    )
    return mine


def _params_key(params: Any) -> str:
    return json.dumps(params, sort_keys=True, separators=(",", ":"))


def probe_idempotency(node: BrokerNode, tenant: str) -> bool:
    """Whether the leader honours ``Idempotency-Key`` (the same key twice: one task)."""
    key = f"probe-{uuid.uuid4().hex}"
    body = {"type": "probe.noop", "tenant": tenant, "params": {"probe": key}}
    with httpx.Client(base_url=node.url, timeout=10) as http:
        ids: list[int] = []
        for _ in range(2):
            response = http.post("/api/v1/tasks", json=body, headers={"Idempotency-Key": key})
            assert response.status_code == 201, response.text
            ids.append(int(response.json()["id"]))
    return ids[0] == ids[1]


def flocks_held(pid: int, directory: Path) -> list[str]:
    """Names of the files in ``directory`` on which process ``pid`` holds a flock."""
    inodes = {path.stat().st_ino: path.name for path in directory.iterdir() if path.is_file()}
    held = []
    for line in Path("/proc/locks").read_text().splitlines():
        # "1: FLOCK  ADVISORY  WRITE <pid> <major>:<minor>:<inode> 0 EOF"; waiters
        # ("1: -> FLOCK ...") hold nothing.
        fields = line.split()
        if len(fields) < 6 or fields[1] != "FLOCK" or int(fields[4]) != pid:
            continue
        name = inodes.get(int(fields[5].rsplit(":", 1)[1]))
        if name is not None:
            held.append(name)
    return held
