"""Handlers of the cluster and this broker: summary, settings, digest, snapshot,
health, metrics and the OpenAPI document."""

from __future__ import annotations

import asyncio
import logging
import math
from typing import Final

import msgspec

from broker.api import api_models as m
from broker.api.common import (
    Binary,
    HttpError,
    Request,
    decode,
    iso_ms,
    json_encoder,
    no_query,
    rejected_error,
)
from broker.api.context import ApiContext
from broker.core import (
    NAME_RE,
    Rejected,
)
from broker.core import entries as e
from broker.observability.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from broker.observability.metrics import BrokerMetrics
from broker.replication.node import VERSION, Node, Role
from snapshot.peer import POSITION_HEADER, format_position, read_latest_snapshot

logger = logging.getLogger(__name__)

_config_decoder: Final = msgspec.json.Decoder(m.ClusterConfigPatch)


async def cluster(api: ApiContext, request: Request) -> tuple[int, bytes]:
    # Workers find the leader here; tenants follow redirects and need not see it.
    node = api.node
    state = node.state
    view = api.cluster_view
    broker = own_summary(api)
    broker.digest = api.state_digest()
    leader = view.leader() if view is not None else broker
    if leader is not None and leader.id == broker.id:
        leader = broker
    workers = [
        m.WorkerSummary(
            id=w.id,
            state=w.state,
            address=w.address,
            running_tasks=len(state.running_by_worker.get(w.id, ())),
            resources=w.resources,
            task_types=w.task_types,
            tenants=w.tenants,
        )
        for w in state.workers.values()
    ]
    # Every broker known, the unreachable ones too, from this one's polls of its peers.
    brokers = view.broker_summaries(broker) if view is not None else [broker]
    summary = m.ClusterSummary(
        cluster_id=node.config.cluster_id,
        leader=leader.id if leader is not None else None,
        brokers=brokers,
        workers=workers,
        tasks=state.count_by_state(),
        tenants=len(state.tenants),
        leader_url=leader.url if leader is not None else None,
        leader_worker_address=leader.worker_address if leader is not None else None,
        leader_worker_tls=leader.worker_tls if leader is not None else False,
    )
    return 200, json_encoder.encode(summary)


def catch_up_position(node: Node) -> m.Position | None:
    """A leader's last entry that followers can apply: its position less a trailing
    Confirm marker (an idle leader's marker is confirmed by no later entry, so followers
    stop one short of it and are still in sync; docs/DESIGN.md §4). None when not leading."""
    leader = node.leader
    if leader is None:
        return None
    ledger_id, entry_id = node.position
    if node.position != leader.last_real_position and entry_id >= 0:
        entry_id -= 1  # the last entry is a marker: at most one trails (the marker loop)
    return m.Position(ledger_id, entry_id)


def uptime_secs(api: ApiContext) -> float:
    node = api.node
    return round((node.clock_ms() - node.stats.started_ms) / 1000, 3)


def own_summary(api: ApiContext) -> m.BrokerSummary:
    """The broker answering, as it knows itself (lag: 0 when it leads, else filled in
    against the leader's position by the cluster view)."""
    node = api.node
    view = api.cluster_view
    leads = node.role in (Role.STANDALONE, Role.LEADER)
    uptime = uptime_secs(api)
    return m.BrokerSummary(
        id=node.config.broker_id,
        host=api.config.host,
        port=api.config.port,
        uptime_secs=uptime,
        is_leader=leads,
        version=VERSION,
        position=api.position(),
        lag_entries=0 if leads else None,
        reachable=True,
        last_seen_secs_ago=0.0,
        started_at=iso_ms(node.stats.started_ms),
        member=True,
        # `steward status` prints it: why a broker cut off from ZooKeeper takes no writes.
        unknown_reason=view.coordination_problem() if view is not None else None,
        role=str(node.role),
        url=view.url if view is not None else None,
        worker_address=view.worker_address if view is not None else None,
        worker_tls=view.worker_tls if view is not None else False,
    )


def _config_view(api: ApiContext) -> m.ClusterConfigView:
    config = api.node.state.config
    return m.ClusterConfigView(
        global_limits=dict(config.global_limits),
        finished_task_retention_s=config.finished_task_retention_ms / 1000,
    )


async def get_config(api: ApiContext, request: Request) -> tuple[int, bytes]:
    return 200, json_encoder.encode(_config_view(api))


async def put_config(api: ApiContext, request: Request) -> tuple[int, bytes]:
    patch = decode(_config_decoder, request.body)
    retention_ms: int | None = None
    if patch.finished_task_retention_s is not None:
        seconds = patch.finished_task_retention_s
        if not (math.isfinite(seconds) and 1 <= seconds <= m.MAX_RETENTION_S):
            raise HttpError(
                400, "invalid_request", "finished_task_retention_s must be in [1, 10 years]"
            )
        retention_ms = int(seconds * 1000)
    if patch.global_limits is not None:
        for name, amount in patch.global_limits.items():
            if not NAME_RE.match(name) or not (math.isfinite(amount) and amount >= 0):
                raise HttpError(
                    400, "invalid_request", f"global limit {name!r} must be a number >= 0"
                )
    result = await api.node.propose(
        lambda stamp: e.SetConfig(
            time_ms=stamp.now_ms,
            finished_task_retention_ms=retention_ms,
            global_limits=patch.global_limits,
        )
    )
    if isinstance(result, Rejected):
        raise rejected_error(result)
    return 200, json_encoder.encode(_config_view(api))


async def latest_snapshot(api: ApiContext, request: Request) -> tuple[int, bytes]:
    """The newest intact local snapshot file, for a peer that has none (docs/DESIGN.md §5)."""
    no_query(request)
    found = await asyncio.to_thread(read_latest_snapshot, api.node.snapshots)
    if found is None:
        raise HttpError(404, "not_found", "this broker has no snapshot yet")
    header, data = found
    body = Binary(data)
    body.headers = ((POSITION_HEADER.lower().encode(), format_position(header.position).encode()),)
    return 200, body


async def digest(api: ApiContext, request: Request) -> tuple[int, bytes]:
    body = m.DigestBody(position=api.position(), digest=api.state_digest())
    return 200, json_encoder.encode(body)


def _unavailable_reason(api: ApiContext) -> str:
    view = api.cluster_view
    problem = view.coordination_problem() if view is not None else None
    return (
        problem if problem is not None and not api.node.closing else api.node.unavailable_reason()
    )


async def health(api: ApiContext, request: Request) -> tuple[int, bytes]:
    node = api.node
    writable = node.writable
    reason = None if writable else _unavailable_reason(api)
    # A cluster broker is healthy while it serves reads (any role but idle); whether
    # it takes writes is the "writable" field. A standalone one must take writes.
    serving = writable or (
        api.cluster_view is not None and node.role in (Role.FOLLOWER, Role.CANDIDATE)
    )
    body = m.Health(
        status="ok" if serving else "unavailable",
        writable=writable,
        position=api.position(),
        reason=reason,
        role=str(node.role),
        uptime_secs=uptime_secs(api),
        version=VERSION,
        catch_up_position=catch_up_position(node),
    )
    return (200 if serving else 503), json_encoder.encode(body)


async def metrics(api: ApiContext, request: Request) -> tuple[int, bytes]:
    """Prometheus text exposition of this broker's metrics
    (broker/observability/metrics.py): tenants' names and counts, so admins (and peer
    brokers) only when authentication is on."""
    metrics = api.node.metrics  # given by observe_node (broker.observability.node_observer)
    assert isinstance(metrics, BrokerMetrics), "the node has no metrics: call observe_node"
    body = Binary(metrics.render())
    body.content_type = METRICS_CONTENT_TYPE
    return 200, body


async def openapi(api: ApiContext, request: Request) -> tuple[int, bytes]:
    return 200, api.openapi_bytes()
