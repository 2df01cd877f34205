"""Handlers of the web dashboard: its static files and its read-only views (brokers,
workers, throughput)."""

from __future__ import annotations

import heapq
import logging

from broker.api import api_models as m
from broker.api.common import (
    Binary,
    HttpError,
    Request,
    iso_ms,
    json_encoder,
    no_query,
)
from broker.api.context import ApiContext
from broker.observability import dashboard
from broker.replication.node import Role

logger = logging.getLogger(__name__)


def _asset(name: str) -> Binary:
    data = dashboard.read_asset(name)
    if data is None:
        raise HttpError(404, "not_found", f"no such dashboard file: {name}")
    body = Binary(data)
    body.content_type = dashboard.ASSET_TYPES[name]
    body.headers = dashboard.SECURITY_HEADERS
    return body


async def dashboard_page(api: ApiContext, request: Request) -> tuple[int, bytes]:
    return 200, _asset("index.html")


async def dashboard_asset(api: ApiContext, request: Request) -> tuple[int, bytes]:
    return 200, _asset(request.params[0])


async def broker_statuses(api: ApiContext, request: Request) -> tuple[int, bytes]:
    """Every live broker's own role and log position (peers answer at /healthz), and
    how far each is behind the leader."""
    no_query(request)
    node = api.node
    view = api.cluster_view
    own = m.BrokerStatus(
        id=node.config.broker_id,
        url=view.url if view is not None else None,
        role=str(node.role),
        is_leader=node.role in (Role.STANDALONE, Role.LEADER),
        reachable=True,
        writable=node.writable,
        position=api.position(),
        uptime_secs=round((node.clock_ms() - node.stats.started_ms) / 1000, 3),
    )
    leader_id: str | None = own.id
    peers: list[m.BrokerSummary] = []
    if view is not None:
        leader = view.leader()
        leader_id = leader.id if leader is not None else None
        peers = [b for b in view.brokers() if b.id != own.id]
    statuses = await dashboard.broker_statuses(
        own, peers, leader_id, view.peer_ssl_context if view is not None else None
    )
    body = m.BrokerStatusList(
        cluster_id=node.config.cluster_id,
        answered_by=own.id,
        leader=leader_id,
        brokers=statuses,
    )
    return 200, json_encoder.encode(body)


async def list_workers(api: ApiContext, request: Request) -> tuple[int, bytes]:
    no_query(request)
    state = api.node.state
    views = []
    for worker in sorted(state.workers.values(), key=lambda w: w.id):
        running = state.running_by_worker.get(worker.id, set())
        views.append(
            m.WorkerView(
                id=worker.id,
                state=worker.state,
                address=worker.address,
                task_types=worker.task_types,
                resources=worker.resources,
                tenants=worker.tenants,
                running_tasks=len(running),
                running=heapq.nsmallest(dashboard.RUNNING_SHOWN, running),
                connected_at=iso_ms(worker.connected_ms) or "",
                updated_at=iso_ms(worker.updated_ms) or "",
                reason=worker.reason,
            )
        )
    return 200, json_encoder.encode(m.WorkerList(views))


async def throughput_stats(api: ApiContext, request: Request) -> tuple[int, bytes]:
    no_query(request)
    recorder = api.throughput
    end_ms, series = recorder.series()
    body = m.ThroughputView(
        bucket_s=recorder.bucket_ms / 1000,
        end_ms=end_ms,
        submitted=series["submitted"],
        finished=series["finished"],
        failed=series["failed"],
        cancelled=series["cancelled"],
        max_task_id=api.node.state.max_task_id,
    )
    return 200, json_encoder.encode(body)
