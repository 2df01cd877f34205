"""Worker configuration: one dataclass, defaults measured from the machine."""

from __future__ import annotations

import os
import re
import socket
import ssl
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

from broker.security.tls import TlsConfigError, client_context
from clients.worker.spark_remote_url import parse_remote
from clients.worker.task_identity import DEFAULT_TASK_UID_RANGE
from wire.worker_protocol import DEFAULT_MAX_FRAME_BYTES

DEFAULT_MAX_RESULT_BYTES = 1024 * 1024


def default_worker_id() -> str:
    """``<hostname>-<pid>``: unique per process on a host.

    Pass a fixed ``--worker-id`` to keep one name across restarts; the broker tells
    restarts apart by the Hello's ``process_id`` either way.
    """
    return f"{socket.gethostname()}-{os.getpid()}"


def cpu_count() -> int:
    try:
        # Honours taskset/cgroup CPU affinity, unlike os.cpu_count().
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def memory_mb(meminfo: Path = Path("/proc/meminfo")) -> float:
    """Total memory in MiB from /proc/meminfo; 0 where that file does not exist."""
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemTotal:"):
                return float(int(line.split()[1]) // 1024)  # the file counts kB
    except (OSError, ValueError, IndexError):
        pass
    return 0.0


def default_task_types() -> dict[str, int]:
    return {"*": cpu_count()}


def default_resources() -> dict[str, float]:
    return {"cpu": float(cpu_count()), "memory_mb": memory_mb()}


# A worker's artifact cache beyond this evicts its least recently used artifacts.
DEFAULT_MAX_CACHE_BYTES: Final = 4 * 1024 * 1024 * 1024


def default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "steward" / "artifacts"


#: Set by the process that starts a worker and stays its parent (a standalone broker's
#: ``--workers``, the demo): the worker's default work dir carries that pid, and the worker
#: stops with it.
PARENT_PID_ENV: Final = "STEWARD_WORKER_PARENT_PID"


def default_work_dir(worker_id: str | None = None) -> Path:
    """Where task processes get their directories: outside any home, so task users reach it.

    One per worker (its id in the name): two workers on a host must not share one (their
    Spark servers, code copies and attempt directories would collide). Without a worker id:
    the base name, which a worker's config turns into its own.
    """
    base = f"steward-worker-{os.geteuid()}"
    if worker_id is not None:
        base += "-" + re.sub(r"[^A-Za-z0-9._-]", "_", worker_id)
    return Path(tempfile.gettempdir()) / base


def parse_host_port(text: str) -> tuple[str, int]:
    """``host:port`` or ``[v6]:port`` -> (host, port); ValueError when malformed."""
    scheme, has_scheme, rest = text.partition("://")
    if has_scheme:
        # A URL where a worker endpoint was expected: say what to write instead.
        raise ValueError(
            f"expected HOST:PORT of a worker endpoint, got the URL {text!r}: write "
            f"{rest.rstrip('/')!r} without {scheme}://, or give the broker's HTTP URL to "
            "steward worker --broker, which finds the worker endpoint itself"
        )
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or not 0 < int(port) <= 65535:
        raise ValueError(f"expected HOST:PORT, got {text!r}")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    return host or "127.0.0.1", int(port)


def parse_http_urls(text: str | list[str]) -> list[str]:
    """``URL[,URL...]`` (or a list of them) -> broker HTTP base URLs; ValueError when bad."""
    parts = text.split(",") if isinstance(text, str) else [p for t in text for p in t.split(",")]
    urls = list(dict.fromkeys(p.strip().rstrip("/") for p in parts if p.strip()))
    if not urls:
        raise ValueError("expected URL[,URL...], got none")
    for url in urls:
        if not url.startswith(("http://", "https://")):
            hint = f": write http://{url}" if "://" not in url else ""
            raise ValueError(f"expected an http:// or https:// URL, got {url!r}{hint}")
    return urls


def parse_broker_option(text: str) -> tuple[str, list[str]]:
    """``--broker``'s value -> (worker endpoint ``host:port``, "") or ("", HTTP URLs).

    An ``http(s)://`` URL, or a comma-separated list of them (any brokers of a cluster),
    means "find the leader's worker endpoint there"; ``HOST:PORT`` names a worker endpoint
    to connect to directly. ValueError, saying what to write, otherwise.
    """
    if "://" in text:
        return "", parse_http_urls(text)
    if "," in text:
        raise ValueError(
            f"expected one HOST:PORT or http(s):// URLs, got {text!r}: a list must be of "
            "the brokers' HTTP URLs (http://HOST:PORT,http://HOST:PORT)"
        )
    try:
        parse_host_port(text)
    except ValueError:
        raise ValueError(
            f"expected the broker's HTTP URL (http://HOST:PORT) or a worker endpoint "
            f"HOST:PORT, got {text!r}"
        ) from None
    return text, []


@dataclass
class WorkerConfig:
    broker: str  # host:port of the broker's worker endpoint (unused when brokers is set)
    http_url: str  # broker HTTP base URL, for code artifact downloads
    worker_id: str = field(default_factory=default_worker_id)
    # Concurrent tasks per task type; "*" covers any type not listed.
    task_types: dict[str, int] = field(default_factory=default_task_types)
    resources: dict[str, float] = field(default_factory=default_resources)
    tenants: list[str] = field(default_factory=list)  # empty: serve every tenant
    spark_master: str = "local[*]"
    spark_conf: dict[str, str] = field(default_factory=dict)
    # "connect": one Spark Connect server per worker, a session per task attempt;
    # "classic": a SparkSession (a JVM) in each task process; "off": no Spark. With
    # task_isolation "thread", ctx.spark is the worker process's classic session.
    spark: str = "connect"
    spark_user: str | None = None  # who runs the Connect server (default: spark/connect_server.py)
    allow_classic_spark: bool = False  # ctx.classic_spark in task processes (connect mode)
    # sc://HOST:PORT[/;token=...]: sessions on that server, no server of the worker's own.
    spark_remote: str | None = None
    # A root worker's Spark Connect server per tenant (clients/worker/spark/tenant_servers.py).
    spark_max_servers: int = 4
    spark_server_idle_s: float = 300.0
    spark_driver_memory_mb: int = 1024  # each server's JVM heap (spark.driver.memory)
    cache_dir: Path = field(default_factory=default_cache_dir)
    # Past this the cache evicts its least recently used artifacts (0: unbounded).
    max_cache_bytes: int = DEFAULT_MAX_CACHE_BYTES
    max_result_bytes: int = DEFAULT_MAX_RESULT_BYTES
    # Reports finishing within this window share one Finish frame.
    finish_batch_ms: float = 0.0  # 0: next loop turn (batches what arrives together)
    # Unacknowledged reports are sent again this often while connected.
    finish_resend_s: float = 5.0
    reconnect_backoff_min_s: float = 0.1
    reconnect_backoff_max_s: float = 5.0
    connect_timeout_s: float = 5.0
    # Waiting for Welcome, before the broker has told its heartbeat timeout.
    handshake_timeout_s: float = 10.0
    # A cancelled task whose code ignores the cancel is reported after this long anyway
    # (its thread keeps running, unreported: Python cannot kill a thread).
    cancel_grace_s: float = 10.0
    download_timeout_s: float = 60.0
    # On SIGTERM: how long running tasks may take to finish before they are cancelled.
    stop_timeout_s: float = 15.0
    max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES
    token: str | None = None
    version: str = "0.1.0"
    # Broker HTTP URLs: when set, the worker asks them (GET /api/v1/cluster, in turn)
    # for the leader's worker endpoint before each connection, instead of ``broker``.
    brokers: list[str] = field(default_factory=list)
    discovery_timeout_s: float = 2.0  # per broker asked
    # A misconfiguration retrying cannot heal (wrong port or protocol, wrong token) ends
    # the worker after failing for this long with nothing else in between (connected,
    # or a failure that can heal); the user gets one line saying what to pass instead.
    give_up_after_s: float = 10.0
    # A failure repeating (broker down, no leader yet) is logged once, then at most this
    # often, with what the worker waits for.
    problem_log_interval_s: float = 10.0
    # With brokers: download code from the leader found (it has every artifact a live
    # task uses) instead of http_url.
    download_from_leader: bool = False
    # Connect to the worker endpoint with TLS (with brokers: also whenever the leader
    # announces it). https:// URLs and TLS connections are verified against tls_ca
    # (a PEM CA bundle) or else the system trust store.
    tls: bool = False
    tls_ca: Path | None = None
    # Where tasks run (docs/SECURITY.md): "process" (tenant code in task processes, one
    # tenant each, under task users) or "thread" (in this process: trusted tenants only).
    task_isolation: str = "process"
    task_user: str | None = None  # one user for every tenant's task processes
    tenant_users: dict[str, str] = field(default_factory=dict)  # tenant -> user
    task_uid_range: tuple[int, int] = DEFAULT_TASK_UID_RANGE  # a uid per tenant (as root)
    allow_root_tasks: bool = False
    task_memory_mb: int = 0  # RLIMIT_AS of a task process; 0: none (resources.memory_mb wins)
    work_dir: Path = field(default_factory=default_work_dir)
    task_python: str = sys.executable
    task_process_idle_s: float = 60.0  # an idle task process is ended after this long
    task_process_max_tasks: int = 1000  # ... and a process after this many tasks
    task_process_max_rss_mb: float = 0.0  # ... or once its resident memory passes this
    max_output_bytes: int = 1024 * 1024  # captured output kept per attempt (the last bytes)
    # Set from work_dir: it is the default (this worker's own; the CLI removes it on a
    # clean exit), not a directory the user named (never removed).
    work_dir_is_default: bool = field(default=False, init=False)
    _ssl_context: ssl.SSLContext | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.tls_ca is not None:
            self.tls_ca = Path(self.tls_ca)
            if not self.tls_ca.is_file():
                raise ValueError(f"CA bundle {str(self.tls_ca)!r} does not exist or is not a file")
        if self.brokers:
            self.brokers = parse_http_urls(self.brokers)
        else:
            parse_host_port(self.broker)
        if not self.discovery_timeout_s > 0:
            raise ValueError("discovery_timeout_s must be > 0")
        if not (self.give_up_after_s > 0 and self.problem_log_interval_s >= 0):
            raise ValueError("need give_up_after_s > 0 and problem_log_interval_s >= 0")
        if not self.task_types or any(n < 0 for n in self.task_types.values()):
            raise ValueError("task_types needs at least one type with a capacity >= 0")
        if self.capacity() < 1:
            raise ValueError("task_types must allow at least one concurrent task")
        if not 0 < self.max_result_bytes <= self.max_frame_bytes // 2:
            # Each report must fit in one Finish frame with room to spare.
            raise ValueError("max_result_bytes must be positive and at most max_frame_bytes / 2")
        if not 0 < self.reconnect_backoff_min_s <= self.reconnect_backoff_max_s:
            raise ValueError("need 0 < reconnect_backoff_min_s <= reconnect_backoff_max_s")
        self.cache_dir = Path(self.cache_dir)
        if self.max_cache_bytes < 0:
            raise ValueError("max_cache_bytes must be >= 0 (0: unbounded)")
        self.work_dir = Path(self.work_dir)
        self.work_dir_is_default = self.work_dir == default_work_dir()
        if self.work_dir_is_default:  # this worker's own
            self.work_dir = default_work_dir(self.worker_id)
        if self.task_isolation not in ("process", "thread"):
            raise ValueError("task_isolation must be 'process' or 'thread'")
        if self.spark not in ("connect", "classic", "off"):
            raise ValueError("spark must be 'connect', 'classic' or 'off'")
        if self.spark_max_servers < 1:
            raise ValueError("--spark-max-servers must be at least 1")
        if not self.spark_server_idle_s > 0:
            raise ValueError("--spark-server-idle-s must be positive")
        if self.spark_driver_memory_mb < 256:
            raise ValueError("--spark-driver-memory-mb must be at least 256 (a Spark driver)")
        if self.spark_remote is not None:
            parse_remote(self.spark_remote)  # ValueError saying what is wrong
            if self.spark != "connect" or self.task_isolation != "process":
                raise ValueError(
                    "--spark-remote needs --spark connect and --task-isolation process"
                )
        if self.task_memory_mb < 0 or self.task_process_max_tasks < 1:
            raise ValueError("need task_memory_mb >= 0 and task_process_max_tasks >= 1")

    def capacity(self) -> int:
        """Tasks this worker may run at once: the sum of its task-type capacities."""
        return sum(self.task_types.values())

    def may_run_spark(self) -> bool:
        """Whether a task here can reach Spark: ``spark.sql``, a code artifact's type
        (``module:function``) or ``*``. Of the other built-ins (noop, sleep, fail) none does,
        so a worker serving only those starts no Spark Connect server (no JVM)."""
        return any(name == "*" or name == "spark.sql" or ":" in name for name in self.task_types)

    def broker_address(self) -> tuple[str, int]:
        return parse_host_port(self.broker)

    def ssl_context(self) -> ssl.SSLContext:
        """The client context for brokers (built once: loading a CA bundle takes ms)."""
        if self._ssl_context is None:
            try:
                self._ssl_context = client_context(self.tls_ca)
            except TlsConfigError as exc:
                raise ValueError(str(exc)) from None
        return self._ssl_context
