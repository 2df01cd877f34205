"""Handlers of tenants: their service levels and task counts."""

from __future__ import annotations

import logging
from typing import Final

import msgspec

from broker.api import api_models as m
from broker.api.common import (
    HttpError,
    Request,
    decode,
    json_encoder,
    rejected_error,
)
from broker.api.context import ApiContext
from broker.core import (
    NAME_RE,
    Rejected,
    Tenant,
    validate_limits,
)
from broker.core import entries as e

logger = logging.getLogger(__name__)

_limits_decoder: Final = msgspec.json.Decoder(m.TenantLimits)


def _tenant_view(api: ApiContext, tenant: Tenant) -> m.TenantView:
    return m.TenantView(
        name=tenant.name,
        max_waiting=tenant.max_waiting,
        max_running=tenant.max_running,
        weight=tenant.weight,
        counts=api.node.state.tenant_counts_view(tenant.name),
        submit_rate=tenant.submit_rate,
        submit_burst=tenant.submit_burst,
    )


def _tenant_name(api: ApiContext, request: Request) -> str:
    name = request.params[0]
    if not NAME_RE.match(name):
        raise HttpError(400, "invalid_request", f"tenant name {name!r} is not valid")
    return name


async def list_tenants(api: ApiContext, request: Request) -> tuple[int, bytes]:
    views = [
        _tenant_view(api, t)
        for t in api.node.state.tenants.values()
        if request.principal.may_see_tenant(t.name)
    ]
    return 200, json_encoder.encode(m.TenantList(views))


async def get_tenant(api: ApiContext, request: Request) -> tuple[int, bytes]:
    name = _tenant_name(api, request)
    if not request.principal.may_see_tenant(name):
        # Whatever the name: existence of other tenants is not shown.
        raise HttpError(403, "forbidden", "a tenant token reads its own tenant only")
    tenant = api.node.state.tenants.get(name)
    if tenant is None:
        raise HttpError(
            404, "not_found", f"tenant {name!r} is unknown (PUT creates it with limits)"
        )
    return 200, json_encoder.encode(_tenant_view(api, tenant))


async def put_tenant(api: ApiContext, request: Request) -> tuple[int, bytes]:
    name = _tenant_name(api, request)
    limits = decode(_limits_decoder, request.body)
    patch = e.TenantLimitsPatch(
        max_waiting=limits.max_waiting,
        max_running=limits.max_running,
        weight=limits.weight,
        submit_rate=limits.submit_rate,
        submit_burst=limits.submit_burst,
    )
    # Format 3 with a rate limit: an older broker would ignore it and fork the state.
    rated = limits.submit_rate is not None or limits.submit_burst is not None
    version = 3 if rated else e.BASE_ENTRY_FORMAT_VERSION
    problem = validate_limits(patch)
    if problem is not None:
        raise HttpError(400, "invalid_request", problem)
    result = await api.node.propose(
        lambda stamp: e.SetTenant(time_ms=stamp.now_ms, tenant=name, limits=patch, v=version)
    )
    if isinstance(result, Rejected):
        raise rejected_error(result)
    assert isinstance(result, Tenant)
    return 200, json_encoder.encode(_tenant_view(api, result))
