"""A Spark Connect server per active tenant, each under that tenant's task uid
(docs/SECURITY.md, "Spark"; docs/DESIGN.md §6, "Spark per tenant").

Why: a Spark Connect server writes files as its own uid. One server shared by every
tenant made every tenant's Spark output that one uid's, so tenants could read and overwrite
each other's; a task could not write into a directory its own uid owns. A root worker (with
no ``--spark-user``) therefore runs one server per tenant, as the uid that tenant's task
processes get (``clients/worker/task_identity.py``), so Spark's files are the tenant's.

The pool (:class:`TenantSparkServers`):

- starts a tenant's server on first use: a task's ``ctx.spark`` asks the worker for it
  (a ``SparkWanted`` frame, ``clients/worker/task_processes/pipe_protocol.py``) and waits, bounded,
  for the
  answer (the server's port, token and uid, or the reason there is none);
- holds it for that task until the task's attempt ends (a held server is never stopped);
- keeps it warm after: an idle server stops after ``idle_s`` (``--spark-server-idle-s``);
- runs at most ``max_servers`` (``--spark-max-servers``): a new tenant's server replaces
  the least recently used idle one; when every server is held, the asking task waits for one
  to be released (bounded by ``wait_s``), then fails saying so.

Each server keeps the protections of the shared one (``clients/worker/spark/connect_server.py``):
127.0.0.1, its own token in its environment only, a task checks that the listener on the
port is its tenant's uid before it sends the token, own process group, dies with the worker.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Final, Protocol

from clients.worker.spark.connect_server import (
    ConnectEndpoint,
    SparkConnectError,
    SparkConnectServer,
)
from clients.worker.spark.remote import RemoteSpark
from clients.worker.task_identity import TaskIdentity

if TYPE_CHECKING:
    from clients.worker.config import WorkerConfig

logger = logging.getLogger("clients.worker.spark")

DEFAULT_MAX_SERVERS: Final = 4
DEFAULT_IDLE_S: Final = 300.0
DEFAULT_DRIVER_MEMORY_MB: Final = 1024
#: How long a task waits for a server of this worker to be released when all are held.
DEFAULT_BUSY_WAIT_S: Final = 60.0
_REAP_MAX_S: Final = 5.0  # the idle check runs at least this often


class TenantServer(Protocol):
    """What the pool needs of a server (SparkConnectServer; a fake in unit tests)."""

    @property
    def endpoint(self) -> ConnectEndpoint: ...

    def start(self) -> None: ...

    def stop(self) -> None: ...

    def error(self) -> str | None: ...

    def wait_ready(self, timeout_s: float) -> ConnectEndpoint: ...

    def interrupt(self, session_id: str) -> None: ...


ServerFactory = Callable[[str, TaskIdentity], TenantServer]


@dataclass
class _Slot:
    tenant: str
    identity: TaskIdentity
    server: TenantServer
    holders: int = 0
    last_used: float = field(default=0.0)


class TenantSparkServers:
    """The worker's per-tenant Spark Connect servers (module docstring). Thread-safe."""

    def __init__(
        self,
        factory: ServerFactory,
        *,
        max_servers: int = DEFAULT_MAX_SERVERS,
        idle_s: float = DEFAULT_IDLE_S,
        start_timeout_s: float = 180.0,
        busy_wait_s: float = DEFAULT_BUSY_WAIT_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if max_servers < 1:
            raise ValueError("--spark-max-servers must be at least 1")
        if idle_s <= 0:
            raise ValueError("--spark-server-idle-s must be positive")
        self._factory = factory
        self.max_servers = max_servers
        self.idle_s = idle_s
        self.start_timeout_s = start_timeout_s
        self.busy_wait_s = busy_wait_s
        self._clock = clock
        self._slots: dict[str, _Slot] = {}
        self._changed = threading.Condition()
        self._closed = False
        self._reaper: threading.Thread | None = None

    # -- what a task gets --

    def acquire(self, tenant: str, identity: TaskIdentity, wait_s: float) -> TenantServer:
        """Hold ``tenant``'s server (started now if it has none), waiting up to ``wait_s``
        for a free place when all ``max_servers`` are held; SparkConnectError if none."""
        deadline = self._clock() + wait_s
        evicted: list[TenantServer] = []
        try:
            with self._changed:
                while True:
                    if self._closed:
                        raise SparkConnectError("the worker is stopping")
                    slot = self._slots.get(tenant)
                    if slot is not None and slot.server.error() is not None and not slot.holders:
                        evicted.append(self._slots.pop(tenant).server)  # failed: start anew
                        slot = None
                    if slot is None and len(self._slots) >= self.max_servers:
                        victim = self._least_recent_idle()
                        if victim is not None:
                            logger.info(
                                "stopping tenant %s's Spark Connect server (idle; its place"
                                " goes to tenant %s, --spark-max-servers %d)",
                                victim.tenant,
                                tenant,
                                self.max_servers,
                            )
                            evicted.append(self._slots.pop(victim.tenant).server)
                    if slot is None and len(self._slots) < self.max_servers:
                        slot = _Slot(tenant, identity, self._factory(tenant, identity))
                        self._slots[tenant] = slot
                        slot.server.start()
                    if slot is not None:
                        slot.holders += 1
                        slot.last_used = self._clock()
                        return slot.server
                    left = deadline - self._clock()
                    if left <= 0:
                        busy = ", ".join(sorted(self._slots))
                        raise SparkConnectError(
                            f"all {self.max_servers} Spark Connect servers of this worker are"
                            f" in use by running tasks (tenants {busy}) and none was released"
                            f" within {wait_s:.0f} s; the task may be retried, or the worker"
                            " started with a larger --spark-max-servers"
                        )
                    self._changed.wait(min(left, 1.0))
        finally:
            for server in evicted:
                server.stop()

    def release(self, tenant: str) -> None:
        """A task that held ``tenant``'s server ended."""
        with self._changed:
            slot = self._slots.get(tenant)
            if slot is None or slot.holders == 0:
                return
            slot.holders -= 1
            slot.last_used = self._clock()
            self._changed.notify_all()

    def server_of(self, tenant: str) -> TenantServer | None:
        with self._changed:
            slot = self._slots.get(tenant)
            return slot.server if slot is not None else None

    def tenants(self) -> dict[str, int]:
        """Each tenant with a server and how many tasks hold it (for tests and logs)."""
        with self._changed:
            return {tenant: slot.holders for tenant, slot in self._slots.items()}

    def interrupt(self, tenant: str, session_id: str) -> None:
        server = self.server_of(tenant)
        if server is not None:
            server.interrupt(session_id)

    # -- idle stop --

    def stop_idle(self) -> list[str]:
        """Stop the servers idle for ``idle_s`` or more; the tenants whose server stopped."""
        now = self._clock()
        stopped: list[TenantServer] = []
        names: list[str] = []
        with self._changed:
            for tenant, slot in list(self._slots.items()):
                if slot.holders == 0 and now - slot.last_used >= self.idle_s:
                    stopped.append(self._slots.pop(tenant).server)
                    names.append(tenant)
            if names:
                self._changed.notify_all()
        for tenant, server in zip(names, stopped, strict=True):
            logger.info(
                "stopping tenant %s's Spark Connect server: idle for %.0f s", tenant, self.idle_s
            )
            server.stop()
        return names

    def _least_recent_idle(self) -> _Slot | None:
        idle = [slot for slot in self._slots.values() if slot.holders == 0]
        return min(idle, key=lambda slot: slot.last_used) if idle else None

    # -- the worker's lifecycle (the interface link.py uses for any Spark backend) --

    def start(self) -> None:
        """Start the idle reaper; servers start on first use."""
        with self._changed:
            if self._reaper is not None:
                return
            self._reaper = threading.Thread(
                target=self._reap_loop, name="steward-spark-reaper", daemon=True
            )
        self._reaper.start()

    def stop(self) -> None:
        with self._changed:
            self._closed = True
            servers = [slot.server for slot in self._slots.values()]
            self._slots.clear()
            self._changed.notify_all()
        for server in servers:
            server.stop()

    def _reap_loop(self) -> None:
        period = min(_REAP_MAX_S, max(0.05, self.idle_s / 4))
        while True:
            with self._changed:
                if self._closed:
                    return
                self._changed.wait(period)
                if self._closed:
                    return
            self.stop_idle()

    def set_tenant_weights(self, weights: Mapping[str, float]) -> None:
        return None  # one tenant per server: no pools to weigh (docs/DESIGN.md §6)

    def error(self) -> str | None:
        return None  # each tenant's server answers for itself when asked

    def wait_left_s(self) -> float:
        """How long a task waits for the worker's answer: a place, then the server's start
        (the worker's own waits are these two, so it answers first)."""
        return self.busy_wait_s + self.start_timeout_s + 10.0


def tenant_servers_wanted(config: WorkerConfig, worker_uid: int | None = None) -> bool:
    """Whether this worker runs a Spark Connect server per tenant: its own servers
    (no ``--spark-remote``), as root (it can switch uids), no ``--spark-user`` (one named
    user for every tenant's Spark: the shared server, as asked)."""
    uid = os.geteuid() if worker_uid is None else worker_uid
    return (
        config.spark == "connect"
        and config.spark_remote is None
        and config.spark_user is None
        and uid == 0
    )


def tenant_server_factory(config: WorkerConfig) -> ServerFactory:
    """Makes a tenant's server: the worker's master and conf, its own home (``0700``, the
    tenant uid's, under ``WORK_DIR/spark-tenants``), a bounded heap, no fair pools."""
    parent = Path(config.work_dir) / "spark-tenants"
    conf = {"spark.driver.memory": f"{config.spark_driver_memory_mb}m", **config.spark_conf}

    def make(tenant: str, identity: TaskIdentity) -> TenantServer:
        parent.mkdir(mode=0o711, parents=True, exist_ok=True)
        os.chmod(parent, 0o711)  # each tenant's server reaches its own home, lists nothing
        return SparkConnectServer(
            master=config.spark_master,
            conf=conf,
            identity=identity,
            home=parent / str(identity.uid),
            python=config.task_python,
        )

    return make


def tenant_servers(config: WorkerConfig) -> TenantSparkServers:
    return TenantSparkServers(
        tenant_server_factory(config),
        max_servers=config.spark_max_servers,
        idle_s=config.spark_server_idle_s,
    )


#: Where a worker's Spark Connect sessions are made: its own server (one, or one per tenant)
#: or a remote one.
SparkBackend = SparkConnectServer | RemoteSpark | TenantSparkServers
