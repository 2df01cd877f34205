"""A Spark Connect server of the worker's, for its task processes (docs/SECURITY.md, "Spark").

Why: a classic SparkSession in every tenant's task process costs a JVM start (seconds) on
each tenant's first PySpark task and a JVM of memory per process. The worker instead runs a
Spark Connect server (``SparkConnectServer``, from the jar the pyspark wheel ships), started
in the background and warmed with one trivial query; a task's ``ctx.spark`` is then a Spark
Connect session of its own (its temp views and conf are its own), made in about 0.1 s
(:func:`connect_session`). A root worker runs one per tenant, under the tenant's task uid
(``clients/worker/spark/tenant_servers.py``); otherwise (not root, or ``--spark-user``) one,
shared by every tenant, started with the worker. What follows holds for each.

The server:

- listens on 127.0.0.1 on a port the worker picks, and requires a random token made for
  it, passed to it only through its environment
  (``SPARK_CONNECT_AUTHENTICATE_TOKEN``), never its command line; the worker's
  ``--spark-conf`` pairs go in a ``0600`` properties file, not on the command line either;
- runs under the identity it is given, never root: a tenant's task uid (per-tenant
  servers), else ``--spark-user``, else (:func:`spark_identity`, a root worker) the last
  uid of ``--task-uid-range``, which no tenant is then given; a worker that is not root
  runs it under its own uid. Its Python UDF workers run under that uid too
  (``spark.python.worker.reuse=false``: one per task, not kept between sessions);
- is in its own process group, dies with the worker (``PR_SET_PDEATHSIG`` set by a small
  launcher before it execs ``spark-submit``) and is stopped (its whole group) on shutdown.

Fairness: a shared server runs Spark's FAIR scheduler with a pool per tenant, weighted like
the tenant (``clients/worker/spark/pools.py``, docs/DESIGN.md §6).

A task process gets the port, the token and its session id in the Run frame, or for a
tenant's own server in the worker's SparkGranted answer
(``clients/worker/task_processes/pipe_protocol.py``).
Before it sends the token anywhere it checks that the listening socket on that port belongs
to the server's uid (``/proc/net/tcp``), so a process of another uid that binds the port
first (the server was not up yet, or died) gets nothing.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

from clients.worker import sandbox
from clients.worker.spark.pools import allocation_xml
from clients.worker.spark_remote_url import USER_ID
from clients.worker.task_env import _passwd_view, has_passwd_entry, scrubbed_env
from clients.worker.task_identity import TaskIdentity, TaskUserError, resolve_user

if TYPE_CHECKING:
    from clients.worker.config import WorkerConfig

logger = logging.getLogger("clients.worker.spark")

#: ``--spark``: a Connect server per worker, a classic session per task process, or none.
SPARK_MODES: Final = ("connect", "classic", "off")
TOKEN_ENV: Final = "SPARK_CONNECT_AUTHENTICATE_TOKEN"
SERVER_CLASS: Final = "org.apache.spark.sql.connect.service.SparkConnectServer"
DEFAULT_START_TIMEOUT_S: Final = 180.0
#: How long the server's start waits for the broker's tenant weights (its first Welcome).
DEFAULT_WEIGHTS_WAIT_S: Final = 10.0
ALLOCATION_FILE: Final = "fairscheduler.xml"
_STOP_GRACE_S: Final = 5.0
_POLL_S: Final = 0.1
_LOG_TAIL_BYTES: Final = 4000
SERVER_LOG_MAX_BYTES: Final = 16 * 1024 * 1024  # rotated to server.log.1 at start past this
# The server's answer about a session its client released (pyspark's error condition).
SESSION_CLOSED: Final = "INVALID_HANDLE.SESSION_CLOSED"

CLASSIC_FLAG_HINT: Final = (
    "start the worker with --allow-classic-spark (it starts a Spark JVM in each tenant's"
    " task process, seconds per process), or use ctx.spark's DataFrame API"
)


class SparkConnectError(RuntimeError):
    """The worker's Spark Connect server is not available (and why)."""


def spark_home() -> str:
    """The pyspark package directory: the wheel ships Spark's jars and ``bin/``."""
    import pyspark

    return os.path.dirname(os.path.abspath(pyspark.__file__))


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def listener_uid(
    port: int, tables: Sequence[str] = ("/proc/net/tcp", "/proc/net/tcp6")
) -> int | None:
    """The uid owning the socket listening on loopback or any address at ``port``; None if none.

    The JVM listens on an IPv6 socket (127.0.0.1 shows as ``::ffff:127.0.0.1`` in tcp6).
    """
    hex_port = f"{port:04X}"
    wanted = {
        f"{address}:{hex_port}"
        for address in (
            "0100007F",
            "00000000",
            "0000000000000000FFFF00000100007F",
            "0000000000000000FFFF000000000000",
            "00000000000000000000000000000000",
            "00000000000000000000000001000000",
        )
    }
    for path in tables:
        try:
            with open(path) as table:
                next(table, None)
                for line in table:
                    fields = line.split()
                    # local_address, state 0A = LISTEN, uid.
                    if len(fields) > 7 and fields[1] in wanted and fields[3] == "0A":
                        return int(fields[7])
        except (OSError, ValueError):
            continue
    return None


@dataclass(frozen=True)
class ConnectEndpoint:
    """Where task processes reach the server and how they prove they may."""

    port: int
    token: str
    uid: int  # the server's uid: the listener on ``port`` must be this uid's

    def url(self, session_id: str) -> str:
        # Host "localhost": the only host pyspark sends a token to without TLS.
        return (
            f"sc://localhost:{self.port}/;token={self.token};user_id={USER_ID}"
            f";session_id={session_id}"
        )


def wait_listening(endpoint: ConnectEndpoint, timeout_s: float) -> None:
    """Wait until the server's uid listens on the port; SparkConnectError when not in time.

    Refuses (at once) a port another uid listens on: the token must not go there.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        owner = listener_uid(endpoint.port)
        if owner == endpoint.uid:
            return
        if owner is not None:
            raise SparkConnectError(
                f"port {endpoint.port} is held by uid {owner}, not the worker's Spark Connect"
                f" server (uid {endpoint.uid}); not sending it the token"
            )
        if time.monotonic() >= deadline:
            raise SparkConnectError(
                f"the worker's Spark Connect server did not start within {timeout_s:.0f} s"
                " (see the worker's log)"
            )
        time.sleep(_POLL_S)


def connect_session(
    endpoint: ConnectEndpoint, session_id: str, wait_s: float, pool: str = ""
) -> Any:
    """A new Spark Connect session (``session_id``) on the worker's server, in a task process,
    its jobs in fair-scheduler pool ``pool`` (none: Spark's default pool)."""
    wait_listening(endpoint, wait_s)
    return open_session(endpoint.url(session_id), pool)


def open_session(url: str, pool: str) -> Any:
    from pyspark.sql import SparkSession

    session = SparkSession.builder.remote(url).create()
    if pool:
        # Spark 4 applies a Connect session's spark.scheduler.pool to its jobs.
        session.conf.set("spark.scheduler.pool", pool)
    return session


def preload_spark_client() -> None:
    """Import the Spark Connect client (a task process does it in the background at start)."""
    try:
        import pyspark.sql.connect.session  # noqa: F401
        from pyspark.sql import functions  # noqa: F401
    except Exception:  # the task that uses Spark reports it
        return


def new_session_id() -> str:
    return str(uuid.uuid4())


def spark_identity(config: WorkerConfig, worker_uid: int | None = None) -> TaskIdentity:
    """Who runs the Connect server: never root when the worker is root (module docstring)."""
    uid = os.geteuid() if worker_uid is None else worker_uid
    if config.spark_user is not None:
        spark_uid, gid = resolve_user(config.spark_user)
        if spark_uid == uid and uid != 0:
            return TaskIdentity(spark_uid, gid, switch=False)
        if spark_uid == 0:
            raise TaskUserError("refusing --spark-user root: the Spark server runs tenants' UDFs")
        if uid != 0:
            raise TaskUserError(
                f"--spark-user {config.spark_user}: only a worker running as root can run"
                " Spark as another user; leave it out to use the worker's own uid"
            )
        return TaskIdentity(spark_uid, gid, switch=True)
    if uid != 0:
        return TaskIdentity(uid, os.getegid(), switch=False)
    low, high = config.task_uid_range
    if low == high:
        raise TaskUserError(
            "--task-uid-range has one uid and the Spark Connect server needs one of its own:"
            " widen the range or name a user with --spark-user"
        )
    return TaskIdentity(high, high, switch=True)


def tenant_uid_range(config: WorkerConfig, worker_uid: int | None = None) -> tuple[int, int]:
    """The task uid range left for tenants (a root worker's Spark server takes the last uid)."""
    uid = os.geteuid() if worker_uid is None else worker_uid
    low, high = config.task_uid_range
    # Kept with per-tenant servers too (tenant_servers.py): a shared server made from this
    # config (spark_identity) never shares a uid with a tenant.
    own_server = config.spark == "connect" and config.spark_remote is None
    if own_server and uid == 0 and config.spark_user is None and high > low:
        return low, high - 1
    return low, high


def server_defaults(master: str, home: Path, python: str) -> dict[str, str]:
    from clients.worker.task_api import spark_defaults

    defaults = spark_defaults(master)
    defaults.update(
        {
            # One Python UDF worker per Spark task: none carries state between sessions.
            "spark.python.worker.reuse": "false",
            "spark.pyspark.python": python,
            "spark.pyspark.driver.python": python,
            "spark.sql.warehouse.dir": str(home / "warehouse"),
            "spark.local.dir": str(home / "tmp"),
            "spark.driver.extraJavaOptions": f"-Djava.io.tmpdir={home / 'tmp'}",
            # A pool per tenant (clients/worker/spark/pools.py).
            "spark.scheduler.mode": "FAIR",
            "spark.scheduler.allocation.file": str(home / ALLOCATION_FILE),
        }
    )
    return defaults


def server_command(
    home_of_spark: str, master: str, port: int, properties_file: Path, parent_pid: int
) -> list[str]:
    """The launcher (PDEATHSIG, then exec) and spark-submit's arguments: nothing secret."""
    return [
        sys.executable,
        "-m",
        "clients.worker.spark.connect_server",
        "--parent-pid",
        str(parent_pid),
        "--",
        os.path.join(home_of_spark, "bin", "spark-submit"),
        "--class",
        SERVER_CLASS,
        "--name",
        "steward-spark-connect",
        "--master",
        master,
        "--conf",
        "spark.connect.grpc.binding.address=127.0.0.1",
        "--conf",
        f"spark.connect.grpc.binding.port={port}",
        "--properties-file",
        str(properties_file),
        "spark-internal",
    ]


def _properties_text(conf: Mapping[str, str]) -> str:
    def escape(text: str) -> str:
        return text.replace("\\", "\\\\").replace("\n", "\\n").replace("=", "\\=")

    return "".join(f"{escape(k)}={escape(v)}\n" for k, v in conf.items())


class SparkConnectServer:
    """The worker's Spark Connect server: started in the background, stopped with the worker.

    ``start()`` returns at once; a thread starts the server, waits until it listens, runs a
    warm-up query and then watches the process (the thread lives as long as the server:
    PDEATHSIG follows the thread that started a process). :meth:`endpoint` is usable as soon
    as :meth:`start` returned; :meth:`error` says why the server is unavailable, if it is.
    """

    def __init__(
        self,
        *,
        master: str,
        conf: Mapping[str, str],
        identity: TaskIdentity,
        home: Path,
        python: str = sys.executable,
        start_timeout_s: float = DEFAULT_START_TIMEOUT_S,
        weights_wait_s: float = 0.0,
    ) -> None:
        self.master = master
        self.conf = dict(conf)
        self.identity = identity
        self.home = Path(home)
        self.python = python
        self.start_timeout_s = start_timeout_s
        self._endpoint = ConnectEndpoint(free_port(), secrets.token_urlsafe(32), identity.uid)
        self._lock = threading.Lock()
        self._popen: subprocess.Popen[bytes] | None = None
        self._error: str | None = None
        self._ready = threading.Event()  # listening and warmed up
        self._ended = threading.Event()  # failed or stopped
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._started_at = 0.0
        # The tenants' weights (the broker's Welcome): the allocation file is written from
        # them before the server starts, which waits up to weights_wait_s for them.
        self.weights_wait_s = weights_wait_s
        self._weights: dict[str, float] = {}
        self._weights_known = threading.Event()
        self._weights_written: dict[str, float] | None = None

    @classmethod
    def from_config(cls, config: WorkerConfig) -> SparkConnectServer:
        return cls(
            master=config.spark_master,
            conf=config.spark_conf,
            identity=spark_identity(config),
            home=Path(config.work_dir) / "spark",
            python=config.task_python,
            weights_wait_s=DEFAULT_WEIGHTS_WAIT_S,
        )

    # -- state (any thread) --

    @property
    def endpoint(self) -> ConnectEndpoint:
        return self._endpoint

    def error(self) -> str | None:
        with self._lock:
            return self._error

    def wait_left_s(self) -> float:
        """How long a task may still wait for the server to come up."""
        if self._ready.is_set():
            return 5.0
        elapsed = time.monotonic() - self._started_at if self._started_at else 0.0
        return max(5.0, self.start_timeout_s - elapsed)

    def wait_ready(self, timeout_s: float) -> ConnectEndpoint:
        """The endpoint once the server is up and warm; SparkConnectError otherwise."""
        deadline = time.monotonic() + timeout_s
        while not self._ready.is_set():
            error = self.error()
            if error is not None:
                raise SparkConnectError(error)
            left = deadline - time.monotonic()
            if left <= 0:
                raise SparkConnectError(f"the Spark Connect server is not up after {timeout_s} s")
            self._ready.wait(min(left, 0.5))
        return self._endpoint

    @property
    def pid(self) -> int | None:
        with self._lock:
            return self._popen.pid if self._popen is not None else None

    def set_tenant_weights(self, weights: Mapping[str, float]) -> None:
        """The broker's tenant weights (each Welcome). Spark takes pool weights only at start:
        a change after it says so in the log (docs/DESIGN.md §6)."""
        with self._lock:
            self._weights = dict(weights)
            written = self._weights_written
        self._weights_known.set()
        if written is not None and written != dict(weights):
            logger.warning(
                "tenant weights changed since the Spark Connect server started; its pools keep"
                " the weights they started with until the worker restarts"
            )

    def tenant_weights(self) -> dict[str, float]:
        with self._lock:
            return dict(self._weights)

    # -- lifecycle --

    def start(self) -> None:
        with self._lock:
            if self._thread is not None:
                return
            self._started_at = time.monotonic()
            self._thread = threading.Thread(
                target=self._serve, name="steward-spark-connect", daemon=True
            )
        self._thread.start()

    def stop(self) -> None:
        """Stop the server and its process group (SIGTERM, SIGKILL after a few seconds)."""
        with self._lock:
            self._stopping = True
            popen = self._popen
            if self._error is None:
                self._error = "the worker's Spark Connect server was stopped"
        self._weights_known.set()  # a start still waiting for weights goes on to stop
        if popen is not None and popen.poll() is None:
            _signal_group(popen.pid, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                popen.wait(_STOP_GRACE_S)
            _signal_group(popen.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                popen.wait(_STOP_GRACE_S)
        self._ended.set()

    # -- the server thread --

    def _serve(self) -> None:
        if self.weights_wait_s > 0 and not self._weights_known.wait(self.weights_wait_s):
            logger.warning(
                "no tenant weights from a broker within %.0f s: starting the Spark Connect"
                " server with every tenant's pool at weight 1",
                self.weights_wait_s,
            )
        try:
            popen = self._launch()
        except Exception as exc:
            self._fail(f"the Spark Connect server could not be started: {exc}")
            return
        try:
            self._wait_started(popen)
            self._warm_up()
        except Exception as exc:
            self._fail(f"{exc}{self._log_tail()}")
            self.stop()
            return
        logger.info(
            "Spark Connect server up on 127.0.0.1:%d (uid %d, master %s) in %.1f s",
            self._endpoint.port,
            self.identity.uid,
            self.master,
            time.monotonic() - self._started_at,
        )
        self._ready.set()
        returncode = popen.wait()
        with self._lock:
            stopping = self._stopping
        if not stopping:
            self._fail(
                f"the Spark Connect server exited ({returncode}); Spark tasks fail on this"
                f" worker until it restarts{self._log_tail()}"
            )

    def _fail(self, message: str) -> None:
        with self._lock:
            stopping = self._stopping
            if self._error is None:
                self._error = message
        if not stopping:
            logger.error("%s", message)
        self._ended.set()

    def _launch(self) -> subprocess.Popen[bytes]:
        home = self.home
        home.mkdir(mode=0o700, exist_ok=True)
        for sub in ("tmp", "warehouse"):
            (home / sub).mkdir(mode=0o700, exist_ok=True)
        env = scrubbed_env(home, None)
        if self.identity.switch and not has_passwd_entry(self.identity.uid):
            env.update(_passwd_view(home, self.identity))
        env.update(
            {
                "SPARK_HOME": spark_home(),
                TOKEN_ENV: self._endpoint.token,
                "PYSPARK_PYTHON": self.python,
                "SPARK_LOG_DIR": str(home),
            }
        )
        conf = {**server_defaults(self.master, home, self.python), **self.conf}
        properties = home / "spark-connect.properties"
        fd = os.open(properties, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as out:
            out.write(_properties_text(conf))
        with self._lock:
            weights = self._weights_written = dict(self._weights)
        allocation = home / ALLOCATION_FILE
        fd = os.open(allocation, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as out:
            out.write(allocation_xml(weights))
        if self.identity.switch:
            for path in (home, home / "tmp", home / "warehouse", properties, allocation):
                os.chown(path, self.identity.uid, self.identity.gid)
        rotate_log(home / "server.log", SERVER_LOG_MAX_BYTES)
        log = open(home / "server.log", "ab")  # noqa: SIM115 - handed to the child
        try:
            with self._lock:
                if self._stopping:
                    raise SparkConnectError("the worker is stopping")
                self._popen = subprocess.Popen(
                    server_command(
                        spark_home(), self.master, self._endpoint.port, properties, os.getpid()
                    ),
                    env=env,
                    cwd=home,
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                    umask=0o077,
                    user=self.identity.uid if self.identity.switch else None,
                    group=self.identity.gid if self.identity.switch else None,
                    extra_groups=[] if self.identity.switch else None,
                )
                return self._popen
        finally:
            log.close()

    def _wait_started(self, popen: subprocess.Popen[bytes]) -> None:
        deadline = self._started_at + self.start_timeout_s
        while listener_uid(self._endpoint.port) != self.identity.uid:
            returncode = popen.poll()
            if returncode is not None:
                raise SparkConnectError(f"the Spark Connect server exited ({returncode}) at start")
            if self._stopping:
                raise SparkConnectError("the worker is stopping")
            if time.monotonic() > deadline:
                raise SparkConnectError(
                    f"the Spark Connect server did not listen within {self.start_timeout_s:.0f} s"
                )
            time.sleep(_POLL_S)

    def _warm_up(self) -> None:
        # The first query of a fresh server takes seconds (code generation, class loading):
        # paid here, not by the first tenant's task.
        session = self.attach(new_session_id())
        try:
            # The shape of the spark.sql task type's query (clients/worker/task_api.py).
            session.sql(
                "SELECT to_json(struct(*), map('ignoreNullFields', 'false')) AS j"
                " FROM (SELECT 1 AS one) LIMIT 2"
            ).collect()
        finally:
            with contextlib.suppress(Exception):
                session.stop()

    def _log_tail(self) -> str:
        try:
            with open(self.home / "server.log", "rb") as log:
                log.seek(0, os.SEEK_END)
                log.seek(max(0, log.tell() - _LOG_TAIL_BYTES))
                tail = log.read().decode(errors="replace").strip()
        except OSError:
            return ""
        return f"\n--- server log tail ({self.home / 'server.log'}) ---\n{tail}" if tail else ""

    # -- sessions from the worker --

    def attach(self, session_id: str) -> Any:
        """A client of session ``session_id`` in the worker (not registered as default)."""
        from pyspark.sql.connect.session import SparkSession as RemoteSparkSession

        return RemoteSparkSession(connection=self._endpoint.url(session_id))

    def interrupt(self, session_id: str) -> None:
        """Interrupt every operation of a task's session and release it (its process is gone:
        the server would otherwise run its queries to the end)."""
        if not self._ready.is_set():
            return
        interrupt_session(self.attach(session_id))


def interrupt_session(session: Any) -> None:
    """Interrupt every operation of a task's session, then release it. A closed session (the
    task released it on its way out, as a cancelled attempt does) runs nothing: done."""
    try:
        session.interruptAll()
    except Exception as exc:
        if SESSION_CLOSED not in str(exc):
            raise
        session.release_session_on_close = False  # released already: stop() only closes
        logger.debug("Spark session %s was closed already: not interrupted", session.session_id)
    finally:
        session.stop()  # releases the session on the server


def rotate_log(path: Path, max_bytes: int) -> None:
    """Move a log past ``max_bytes`` to ``<name>.1`` (replacing the older one): each server
    start appends to it, so a work dir kept across runs would grow it without end."""
    with contextlib.suppress(FileNotFoundError):
        if path.stat().st_size > max_bytes:
            os.replace(path, path.with_name(path.name + ".1"))


def _signal_group(pid: int, sig: signal.Signals) -> None:
    try:
        os.killpg(pid, sig)
    except ProcessLookupError:
        pass
    except PermissionError:  # pragma: no cover - the leader left its group
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


def main(argv: Sequence[str] | None = None) -> int:
    """The launcher: die with the worker, then become spark-submit (the same pid)."""
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) < 4 or args[0] != "--parent-pid" or args[2] != "--":
        print("usage: python -m clients.worker.spark.connect_server --parent-pid PID -- COMMAND...")
        return 2
    sandbox.die_with_parent(int(args[1]))
    command = args[3:]
    os.execv(command[0], command)


if __name__ == "__main__":
    sys.exit(main())
