"""Handlers of the tenants' webhooks (docs/API.md, Webhooks; delivered by
broker/api/webhooks.py on the leader)."""

from __future__ import annotations

from typing import Final

import msgspec

from broker.api import api_models as m
from broker.api.common import (
    HttpError,
    Request,
    decode,
    iso_ms,
    json_encoder,
    rejected_error,
)
from broker.api.context import ApiContext
from broker.api.event_feed import WHOLE_ENTRY
from broker.api.webhooks import key_text
from broker.core import entries as e
from broker.core.records import Rejected, Tenant
from broker.core.validation import NAME_RE
from broker.core.webhooks import webhook_problem

_webhook_decoder: Final = msgspec.json.Decoder(m.WebhookBody)


def _tenant_name(request: Request) -> str:
    name = request.params[0]
    if not NAME_RE.match(name):
        raise HttpError(400, "invalid_request", f"tenant name {name!r} is not valid")
    if not request.principal.may_see_tenant(name):
        raise HttpError(403, "forbidden", "a tenant token manages its own tenant's webhook only")
    return name


def _view(api: ApiContext, tenant: Tenant) -> bytes:
    hook = tenant.webhook
    assert hook is not None
    outbox = api.node.state.webhook_outbox.get(tenant.name, ())
    pending = sum(1 for key, _ in outbox if key > hook.delivered)
    failure = api.webhooks.failing.get(tenant.name) if api.node.is_leader else None
    failing = None
    if failure is not None:
        failing = m.WebhookFailing(
            event=failure.event,
            failures=failure.failures,
            last_error=failure.last_error,
            last_failed_at=iso_ms(failure.last_failed_ms) or "",
            next_retry_at=iso_ms(failure.next_retry_ms) or "",
        )
    view = m.WebhookView(tenant.name, hook.url, key_text(hook.delivered), pending, failing)
    return json_encoder.encode(view)


async def get_webhook(api: ApiContext, request: Request) -> tuple[int, bytes]:
    name = _tenant_name(request)
    tenant = api.node.state.tenants.get(name)
    if tenant is None or tenant.webhook is None:
        raise HttpError(404, "not_found", f"tenant {name!r} has no webhook")
    return 200, _view(api, tenant)


async def put_webhook(api: ApiContext, request: Request) -> tuple[int, bytes]:
    name = _tenant_name(request)
    body = decode(_webhook_decoder, request.body)
    problem = webhook_problem(body.url, body.secret)
    if problem is not None:
        raise HttpError(400, "invalid_request", problem)
    # Events from now on: those of the entries after the one applied last.
    after = (*api.node.position, WHOLE_ENTRY)
    result = await api.node.propose(
        lambda stamp: e.SetWebhook(
            time_ms=stamp.now_ms, tenant=name, url=body.url, secret=body.secret, after=after
        )
    )
    if isinstance(result, Rejected):
        raise rejected_error(result)
    assert isinstance(result, Tenant)
    return 200, _view(api, result)


async def delete_webhook(api: ApiContext, request: Request) -> tuple[int, bytes]:
    name = _tenant_name(request)
    tenant = api.node.state.tenants.get(name)
    if tenant is None or tenant.webhook is None:
        raise HttpError(404, "not_found", f"tenant {name!r} has no webhook")
    was = _view(api, tenant)
    result = await api.node.propose(
        lambda stamp: e.SetWebhook(time_ms=stamp.now_ms, tenant=name, url=None)
    )
    if isinstance(result, Rejected):
        raise rejected_error(result)
    return 200, was
