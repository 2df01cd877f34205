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
from broker.api.handlers_cluster import own_summary
from broker.observability import dashboard

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
    """Every broker the cluster view knows, departed ones too: the same rows (and so the
    same roles, positions, lags and uptimes) as ``GET /api/v1/cluster`` and ``steward
    status``, from this broker's polls of its peers (docs/DESIGN.md §4)."""
    no_query(request)
    node = api.node
    view = api.cluster_view
    own = own_summary(api)
    leader = view.leader() if view is not None else own
    rows = view.broker_summaries(own) if view is not None else [own]
    leader_id = leader.id if leader is not None else None
    body = m.BrokerStatusList(
        cluster_id=node.config.cluster_id,
        answered_by=own.id,
        leader=leader_id,
        brokers=dashboard.broker_statuses(rows, leader_id, own.id, node.writable),
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
