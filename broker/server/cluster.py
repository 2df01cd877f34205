"""A broker of a highly available cluster (docs/DESIGN.md §4): ZooKeeper election, follower
tailing, take-over, step-down, and the HTTP and worker endpoints around one Node.
Following (and the snapshot download a history gap needs) is
:class:`~broker.server.following.LogFollower`.

Roles are driven by one task (:meth:`ClusterBroker._manage`), woken whenever the
elector's view changes or the node finds itself deposed:

- follower: tail the log (``Node.follow``); a history gap (the ledgers after our
  snapshot were deleted) downloads a snapshot from a peer and follows again;
- elected: ``Node.recover_log`` (fence and recover the previous leader's ledger, apply
  to its end), check that every code artifact a live task needs is here (otherwise
  give the leadership back, fetch them and queue again), ``Node.open_for_writes``, then
  start the term's leader duties (broker/leader: the worker endpoint first); only then
  are writes and workers accepted;
- no longer elected (SUSPENDED, LOST, someone else lowest) or deposed (the ZooKeeper
  check after a group commit failed, or the ledger was fenced): ``Node.step_down`` at
  once, stop the leader duties in reverse, leave and re-join the queue (to its back), follow.

Graceful shutdown of the leader drains in-flight writes, closes its ledger cleanly
(so the next leader has nothing to recover), then leaves the queue: hand-over is one
ZooKeeper watch plus opening a ledger.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import gc
import logging
import signal
import socket
import ssl
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kazoo.client import KazooClient  # type: ignore[import-untyped]

from broker.api import api_models as m
from broker.api.handlers_cluster import catch_up_position
from broker.api.http_api import ApiApp, ApiConfig
from broker.api.output_store import OutputStore
from broker.api.webhooks import WebhookSender
from broker.artifacts.code_store import CodeStore
from broker.core import LIVE_STATES
from broker.ha.code_replication import WAIT_FOREVER, CodeReplicator
from broker.ha.election import (
    ElectionError,
    LeaderElector,
    LeadershipStatus,
    default_client_factory,
)
from broker.ha.zk_session import ClientReturn
from broker.leader.code_replicas import CodeReplicaMonitor
from broker.leader.duties import LeaderDuties, broker_duties
from broker.observability.node_observer import observe_node
from broker.replication.common import NewerFormatError
from broker.replication.node import (
    VERSION,
    BrokerStartupError,
    BrokerUnavailableError,
    DataDirLock,
    HistoryGapError,
    Node,
    NodeConfig,
    Role,
)
from broker.security.auth import kazoo_auth_options
from broker.security.tls import TlsConfig, TlsConfigError, peer_ssl_context
from broker.server.following import (
    DEFAULT_SNAPSHOT_SOURCE_WAIT_S,
    RETRY_DELAY_S,
    LogFollower,
)
from broker.server.peer_view import PeerView
from broker.server.standalone import (
    HTTP_PORT,
    WORKER_PORT,
    check_port_free,
    http_scheme,
    start_http_server,
    stop_http_server,
)
from broker.workers.worker_link import WorkerLink, WorkerLinkConfig
from log.api import LedgerError, LedgerStore
from log.file import FileLedgerStore
from log.pulsar import PulsarConfig, PulsarLedgerStore
from log.zk_list import (
    ZK_ROOT,
    ZooKeeperLedgerIdAllocator,
    ZooKeeperLedgerListStore,
    cluster_path,
    ledger_list_path,
)
from snapshot.store import SnapshotStore

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class BrokerConfig:
    node: NodeConfig  # data_dir is this broker's own; cluster_id is the cluster name
    zookeeper: str  # connect string "host:port,..."
    # The file backend's directory, shared by the brokers (one host); unused with pulsar.
    ledger_dir: Path | None = None
    api: ApiConfig = field(default_factory=ApiConfig)
    workers: WorkerLinkConfig = field(default_factory=WorkerLinkConfig)
    session_timeout_ms: int = 4_000
    # Brokers that must hold an uploaded artifact before tasks use it (--min-replication).
    min_code_replicas: int = 1
    max_replication_wait_ms: int = 60_000  # -1: wait forever
    # How long to keep trying peers for a snapshot / artifacts before retrying later.
    peer_timeout_s: float = 60.0
    # A broker that needs a snapshot (a history gap) and finds none, locally or at a peer,
    # for this long exits non-zero instead of retrying forever (Storm's rule for a boot).
    snapshot_source_wait_s: float = DEFAULT_SNAPSHOT_SOURCE_WAIT_S
    # "file" (ledger_dir) or "pulsar" (pulsar: where and how).
    ledgers: str = "file"
    pulsar: PulsarConfig | None = None
    # HTTPS, TLS on the worker endpoint, https:// URLs in ZooKeeper, and the CA bundle
    # this broker verifies its peers with (snapshot and code downloads).
    tls: TlsConfig | None = None
    # The host name peers, workers and clients reach this broker by (its URL and worker
    # address in ZooKeeper); None: the HTTP listen host (wrong for 0.0.0.0).
    advertise_host: str | None = None
    # The brokers' shared secret for snapshot and code downloads between them.
    cluster_token: str | None = None
    # "user:password": Steward's znodes get a digest ACL that only these credentials open.
    zookeeper_auth: str | None = None
    # Code artifacts no task needed for this long are deleted (docs/DESIGN.md §7); 0: never.
    code_retention_ms: int = 0

    def __post_init__(self) -> None:
        if self.ledgers == "file" and self.ledger_dir is None:
            raise ValueError("the file ledger backend needs a ledger directory")
        if self.ledgers == "pulsar" and self.pulsar is None:
            raise ValueError("the pulsar ledger backend needs a Pulsar configuration")
        if self.ledgers not in ("file", "pulsar"):
            raise ValueError(f"unknown ledger backend {self.ledgers!r}")
        if self.max_replication_wait_ms < WAIT_FOREVER:
            # Checked here, not at the take-over the monitor starts in (it crashed there).
            raise ValueError(
                f"max_replication_wait_ms must be >= 0, or -1 to wait forever "
                f"(got {self.max_replication_wait_ms})"
            )
        if not self.snapshot_source_wait_s > 0:
            raise ValueError(
                f"snapshot_source_wait_s must be positive (got {self.snapshot_source_wait_s})"
            )


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        port: int = sock.getsockname()[1]
        return port


def _summary_from_info(info: dict[str, Any], *, is_leader: bool) -> m.BrokerSummary:
    url = str(info.get("url", ""))
    host, _, port = url.removeprefix("http://").removeprefix("https://").partition(":")
    return m.BrokerSummary(
        id=str(info.get("broker_id", "")),
        host=host,
        port=int(port) if port.isdigit() else 0,
        uptime_secs=None,
        worker_tls=bool(info.get("worker_tls", False)),
        is_leader=is_leader,
        version=str(info.get("version", "")),
        position=None,
        lag_entries=None,
        reachable=False,
        last_seen_secs_ago=None,
        started_at=None,
        member=True,
        # Where it is, not how it is doing: that is the peer view's (broker_summaries).
        unknown_reason="from its ZooKeeper advertisement only",
        role="leader" if is_leader else "broker",
        url=url or None,
        worker_address=info.get("worker_address"),
    )


def _protect_znodes(zk: Any, cluster_id: str) -> None:
    """Create ``/steward`` open (other clusters, with other credentials, share it) and
    this cluster's root with the digest ACL its sessions set by default; everything
    below inherits that default. A root these credentials cannot open stops the start."""
    from kazoo.exceptions import NoAuthError  # type: ignore[import-untyped]
    from kazoo.security import OPEN_ACL_UNSAFE  # type: ignore[import-untyped]

    root = cluster_path(cluster_id)
    zk.ensure_path(ZK_ROOT, acl=OPEN_ACL_UNSAFE)
    try:
        zk.ensure_path(root)
        zk.get_children(root)
    except NoAuthError:
        raise BrokerStartupError(
            f"ZooKeeper refuses {root} to these credentials (--zookeeper-auth)"
        ) from None


class ClusterBroker:
    """One broker process's moving parts; also the API's :class:`ClusterView`."""

    def __init__(self, config: BrokerConfig) -> None:
        self.config = config
        node_config = config.node
        host = config.advertise_host or config.api.host
        self._url = f"{http_scheme(config.tls)}://{host}:{config.api.port}"
        worker_port = config.workers.port or _free_port(config.workers.host)
        self._workers_config = WorkerLinkConfig(
            **{**config.workers.__dict__, "port": worker_port, "tls": config.tls}
        )
        worker_host = config.advertise_host or config.workers.host
        self._worker_address = f"{worker_host}:{worker_port}"
        zk_auth = kazoo_auth_options(config.zookeeper_auth)
        self.zk = KazooClient(
            hosts=config.zookeeper,
            timeout=config.session_timeout_ms / 1000,
            connection_retry={"max_tries": -1, "max_delay": 1.0},
            command_retry={"max_tries": 0},
            **zk_auth,
        )
        self.node = Node(
            node_config,
            ledgers=self._ledger_store(),
            ledger_list=ZooKeeperLedgerListStore(self.zk, ledger_list_path(node_config.cluster_id)),
            snapshots=SnapshotStore(
                node_config.data_dir / "snapshots", keep=node_config.snapshot_keep
            ),
        )
        self.metrics = observe_node(self.node)
        self.code_store = CodeStore(node_config.data_dir / "code")
        self.metrics.bind_code_store(self.code_store.usage)
        # Task output while this broker leads (every leadership's link feeds the same one).
        self.outputs = OutputStore(max_total_bytes=config.workers.max_output_total_bytes)
        # Every leadership's webhook deliveries (its failures are the API's to show).
        self.webhooks = WebhookSender(self.node)
        try:
            # Built up front: a bad certificate, key or CA bundle stops the broker at start.
            self._peer_ssl = config.tls.client_context() if config.tls is not None else None
            if config.tls is not None:
                config.tls.server_context()
        except TlsConfigError as exc:
            raise BrokerStartupError(str(exc)) from None
        advertised: dict[str, Any] = {
            "url": self._url,
            "worker_address": self._worker_address,
            "version": VERSION,
        }
        if config.tls is not None:
            advertised["worker_tls"] = True  # workers connect with TLS
        self.elector = LeaderElector(
            default_client_factory(config.zookeeper, config.session_timeout_ms / 1000, **zk_auth),
            node_config.cluster_id,
            node_config.broker_id,
            advertised,
            session_timeout_s=config.session_timeout_ms / 1000,
            on_change=self._on_status_change,
        )
        self.node.leadership_check = self.elector.is_leader
        self.zk_back = ClientReturn(self.zk, self.elector.session_timeout_s, self.elector.is_leader)
        self.node.on_deposed = self._on_deposed
        self.replicator = CodeReplicator(
            self.code_store,
            self.zk,
            node_config.cluster_id,
            node_config.broker_id,
            ssl_context=self._peer_ssl,
            peer_urls=self._peer_urls,
            known_artifacts=lambda: list(self.node.state.artifacts),
            peer_token=config.cluster_token,
        )
        # A deleted artifact's file goes from every broker (docs/DESIGN.md §7).
        self.node.listeners.append(self.code_store.on_applied)
        self.node.listeners.append(self.replicator.on_applied)
        self.duties: LeaderDuties | None = None  # this term's, worker link first (§4)
        self.leader_changes = 0
        self._leader_node: str | None = None  # the leadership term last seen
        self._changed = asyncio.Event()
        self._deposed: str | None = None
        self._stopping = False
        self.follower = LogFollower(
            self.node,
            peer_urls=self._peer_urls,
            peer_ssl=self._peer_ssl,
            peer_timeout_s=config.peer_timeout_s,
            cluster_token=config.cluster_token,
            on_end=self._changed.set,
            snapshot_source_wait_s=config.snapshot_source_wait_s,
        )
        self._manager: asyncio.Task[None] | None = None
        self.peers = PeerView(
            node_config.broker_id,
            members=self.elector.brokers,
            leader_id=self._leader_id,
            own_position=self._own_position,
            ledger_list=self.node.ledger_list.get,
            ssl_context=self._peer_ssl or peer_ssl_context(),
        )

    def _ledger_store(self) -> LedgerStore:
        config = self.config
        if config.ledgers == "pulsar":
            assert config.pulsar is not None
            # Ids from ZooKeeper: brokers share no disk with this backend.
            allocator = ZooKeeperLedgerIdAllocator(self.zk, config.node.cluster_id)
            return PulsarLedgerStore(config.pulsar, allocator)
        assert config.ledger_dir is not None
        return FileLedgerStore(config.ledger_dir)

    # --- ClusterView --------------------------------------------------------------------

    @property
    def url(self) -> str:
        return self._url

    @property
    def worker_address(self) -> str | None:
        return self._worker_address

    @property
    def worker_tls(self) -> bool:
        return self.config.tls is not None

    @property
    def peer_ssl_context(self) -> ssl.SSLContext | None:
        return self._peer_ssl

    def leader(self) -> m.BrokerSummary | None:
        info = self.elector.leader_info()
        if info is None:
            return None
        return _summary_from_info(info, is_leader=True)

    def brokers(self) -> list[m.BrokerSummary]:
        leader = self.elector.leader_info()
        leader_id = leader.get("broker_id") if leader is not None else None
        return [
            _summary_from_info(info, is_leader=info.get("broker_id") == leader_id)
            for info in self.elector.brokers()
        ]

    def broker_summaries(self, own: m.BrokerSummary) -> list[m.BrokerSummary]:
        return self.peers.summaries(own, catch_up_position(self.node))

    def coordination_problem(self) -> str | None:
        return None if self._stopping else self.elector.connection_problem()

    def _own_position(self) -> m.Position:
        return m.Position(*self.node.position)

    def _leader_id(self) -> str | None:
        leader = self.elector.leader_info()
        return str(leader.get("broker_id")) if leader is not None else None

    # --- lifecycle ------------------------------------------------------------------------

    async def start(self) -> None:
        """Connect, boot from the local snapshot, advertise, and join the election."""
        try:
            await asyncio.wait_for(
                asyncio.to_thread(self.zk.start, self.config.session_timeout_ms / 1000 * 5),
                timeout=self.config.session_timeout_ms / 1000 * 5 + 5,
            )
        except Exception as exc:
            raise BrokerStartupError(
                f"cannot reach ZooKeeper at {self.config.zookeeper}: {exc}"
            ) from None
        if self.config.zookeeper_auth is not None:
            await asyncio.to_thread(_protect_znodes, self.zk, self.node.config.cluster_id)
        ledgers = self.node.ledgers
        if isinstance(ledgers, PulsarLedgerStore):
            try:
                await ledgers.ensure_namespace_retention()
                if ledgers.can_fence:
                    # Refuse a "fencing" setting the broker does not honour (pulsar-lite).
                    await ledgers.verify_fencing(self.node.config.broker_id)
            except LedgerError as exc:
                raise BrokerStartupError(f"Pulsar not usable: {exc}") from None
        await self.node.boot()
        await self.replicator.start()
        try:
            await self.elector.start()
        except ElectionError as exc:
            raise BrokerStartupError(str(exc)) from None
        self._manager = asyncio.create_task(self._manage(), name="steward-roles")
        await self.elector.join()
        self.peers.start()

    async def stop(self) -> None:
        """Graceful: a leader drains, closes its ledger, then hands leadership over."""
        self._stopping = True
        started = time.monotonic()
        if self._manager is not None:
            self._manager.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._manager
        await self.peers.stop()
        await self.follower.stop()
        await self._stop_leader_services()
        was_leader = self.node.role == Role.LEADER
        # Close the ledger before leaving the queue: the next leader then finds it
        # closed and has nothing to fence or recover.
        await self.node.stop(snapshot=False)
        with contextlib.suppress(ElectionError):
            await self.elector.leave()
        if was_leader:
            logger.info("leadership handed over after %.3f s", time.monotonic() - started)
        if self.follower.fatal is None:  # else the state may be one it could not continue
            with contextlib.suppress(Exception):
                await self.node.take_snapshot()
        await self.elector.stop()
        await self.replicator.stop()
        await self.node.ledgers.close()
        await asyncio.to_thread(self._close_zk)

    def _close_zk(self) -> None:
        with contextlib.suppress(Exception):
            self.zk.stop()
            self.zk.close()

    # --- role changes ---------------------------------------------------------------------

    def _on_status_change(self, status: LeadershipStatus) -> None:
        if status.leader_node is not None and status.leader_node != self._leader_node:
            self._leader_node = status.leader_node
            self.metrics.leader_changes.inc()
        if not status.is_leader and self.node.role in (Role.LEADER, Role.CANDIDATE):
            # Stop acknowledging at once, before the manager task gets to run.
            self.node.depose(self.elector.connection_problem() or "lost the election")
        self._changed.set()

    def _on_deposed(self, reason: str) -> None:
        # Deposed while the elector still says "leader": someone else wrote the ledger
        # list or fenced our ledger, so our view is stale: re-queue behind the others.
        # (Deposed because the elector said so: just step down; the elector re-queues
        # by itself when the session is lost.)
        if self.elector.is_leader():
            self._deposed = reason
        self._changed.set()

    async def _manage(self) -> None:
        while not self._stopping:
            self._changed.clear()
            try:
                await self._step()
            except asyncio.CancelledError:
                raise
            except Exception:
                logger.exception("role change failed; retrying")
                await asyncio.sleep(RETRY_DELAY_S)
                self._changed.set()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(1.0):
                    await self._changed.wait()

    async def _step(self) -> None:
        node = self.node
        if self._deposed is not None:
            reason, self._deposed = self._deposed, None
            await self._stop_leading(reason)
            await self._retry_or_requeue()
        elif node.role in (Role.LEADER, Role.CANDIDATE) and node.deposed_reason is not None:
            # Deposed by a blip the elector already got over ("not leader", then "leader"
            # again before this ran): step down fully, then take over afresh below.
            await self._stop_leading(node.deposed_reason)
        if self.elector.is_leader() and node.role not in (Role.LEADER, Role.CANDIDATE):
            await self._take_over()
        elif not self.elector.is_leader() and node.role in (Role.LEADER, Role.CANDIDATE):
            await self._stop_leading("lost the election or the ZooKeeper connection")
        if node.role in (Role.FOLLOWER, Role.IDLE):
            await self.follower.ensure()

    async def _take_over(self) -> None:
        await self.follower.stop()
        node = self.node
        if self._deposed is not None:
            return
        logger.info("broker %s elected; taking over", node.config.broker_id)
        try:
            await node.recover_log()
        except NewerFormatError as exc:
            # Written by a newer release: this broker can neither lead nor follow.
            await node.step_down("log of a newer release")
            with contextlib.suppress(ElectionError):
                await self.elector.leave()
            self.follower.give_up(str(exc))
            return
        except HistoryGapError as exc:
            logger.warning("cannot take over before downloading a snapshot: %s", exc)
            await node.step_down("history gap")
            # Out of the queue while looking for one (others may lead meanwhile); this
            # counts towards --snapshot-source-wait-s like the follower's search.
            with contextlib.suppress(ElectionError):
                await self.elector.leave()
            await self.follower.find_snapshot(exc)
            if self.follower.fatal is None:
                with contextlib.suppress(ElectionError):
                    await self.elector.join()
            return
        except (LedgerError, BrokerUnavailableError) as exc:
            await node.step_down(f"take-over failed: {exc}")
            await self._retry_or_requeue()
            return
        if not self.elector.is_leader():
            await node.step_down("lost the election while taking over")
            return
        missing = self._missing_artifacts()
        if missing:
            # Storm's rule, always re-queueing: give the lock back, sync, queue again.
            logger.warning(
                "elected without code artifacts %s; giving leadership back to sync them",
                sorted(missing),
            )
            await node.step_down("missing code artifacts")
            with contextlib.suppress(ElectionError):
                await self.elector.leave()
            await self._fetch_artifacts(missing)
            with contextlib.suppress(ElectionError):
                await self.elector.join()
            return
        try:
            await node.open_for_writes()
        except (LedgerError, BrokerUnavailableError) as exc:
            await node.step_down(f"could not open a ledger: {exc}")
            await self._retry_or_requeue()
            return
        link = WorkerLink(node, self._workers_config, self.outputs)
        code_replicas = None
        if self.config.min_code_replicas > 1:
            code_replicas = CodeReplicaMonitor(
                node,
                self.zk,
                node.config.cluster_id,
                min_code_replicas=self.config.min_code_replicas,
                max_replication_wait_ms=self.config.max_replication_wait_ms,
            )
        duties = broker_duties(
            node,
            link,
            code_retention_ms=self.config.code_retention_ms,
            webhooks=self.webhooks,
            code_replicas=code_replicas,
        )
        try:
            await duties.start()  # a failed start stops those started
        except BrokerStartupError as exc:
            await node.step_down(str(exc))
            await self._requeue()
            return
        self.duties = duties
        self.leader_changes += 1
        self.metrics.leaderships.inc()
        logger.info("broker %s is the acting leader at %s", node.config.broker_id, node.position)

    async def _stop_leading(self, reason: str) -> None:
        await self.node.step_down(reason)
        await self._stop_leader_services()

    async def _stop_leader_services(self) -> None:
        duties, self.duties = self.duties, None
        if duties is not None:
            await duties.stop()

    async def _retry_or_requeue(self) -> None:
        # The ledger list's ZooKeeper client was down and is back: keep our place (§4).
        # Safe after a deposition too: a take-over fences whoever else wrote.
        if await self.zk_back.reconnected():
            self._changed.set()
        else:
            await self._requeue()

    async def _requeue(self) -> None:
        # Back of the queue: a broker that just failed to lead lets the others try.
        with contextlib.suppress(ElectionError):
            await self.elector.leave()
        with contextlib.suppress(ElectionError):
            await self.elector.join()

    # --- code artifacts -------------------------------------------------------------------

    def _peer_urls(self) -> list[str]:
        return [b.url for b in self.brokers() if b.url and b.url != self._url]

    def _missing_artifacts(self) -> set[str]:
        state = self.node.state
        needed = {
            task.code
            for task in state.tasks.values()
            if task.code is not None and task.state in LIVE_STATES
        }
        return self.replicator.missing(needed)

    async def _fetch_artifacts(self, missing: set[str]) -> None:
        logger.info("fetching code artifacts %s before leading", sorted(missing))
        still = await self.replicator.fetch_missing(missing, self.config.peer_timeout_s)
        if still:
            logger.error("could not fetch code artifacts %s; queueing again", sorted(still))


async def serve_broker(config: BrokerConfig, *, ready: asyncio.Event | None = None) -> None:
    """Run one cluster broker until SIGINT/SIGTERM, then hand over and stop cleanly."""
    # A taken port fails at start in one line naming the flag (the worker port is bound
    # only while leading: then a clash would only be logged, the broker never leading).
    check_port_free(config.api.host, config.api.port, HTTP_PORT)
    check_port_free(config.workers.host, config.workers.port, WORKER_PORT)
    lock = DataDirLock(config.node.data_dir)
    lock.acquire()
    broker = ClusterBroker(config)
    try:
        await broker.start()
        gc.collect()
        gc.freeze()
        api_config = dataclasses.replace(config.api, min_code_replicas=config.min_code_replicas)
        app = ApiApp(
            broker.node,
            api_config,
            broker.code_store,
            cluster=broker,
            outputs=broker.outputs,
            webhooks=broker.webhooks,
        )
        server, server_task = await start_http_server(app, config.api, tls=config.tls)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        print(
            f"steward broker {config.node.broker_id} ready on {broker.url} "
            f"(workers connect to the leader; this broker's worker endpoint "
            f"{broker.worker_address}; data dir {config.node.data_dir})",
            flush=True,
        )
        if ready is not None:
            ready.set()
        await asyncio.wait(
            [
                asyncio.create_task(stop.wait()),
                asyncio.create_task(broker.follower.gave_up.wait()),
                server_task,
            ],
            return_when=asyncio.FIRST_COMPLETED,
        )
        logger.info("shutting down")
        await broker.stop()
        await stop_http_server(server, server_task, app)
        if broker.follower.fatal is not None:
            raise BrokerStartupError(broker.follower.fatal)
    finally:
        lock.release()
