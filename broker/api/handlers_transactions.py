"""Handlers of transactions: begin, commit, roll back."""

from __future__ import annotations

import logging
import math
from typing import Final

import msgspec

from broker.api import api_models as m
from broker.api.common import (
    MAX_TTL_S,
    HttpError,
    Request,
    decode,
    iso_ms,
    json_encoder,
    rejected_error,
)
from broker.api.context import ApiContext
from broker.core import (
    NAME_RE,
    Rejected,
    TransactionDone,
    TransactionRef,
)
from broker.core import entries as e
from broker.replication.node import Stamp
from broker.security.auth import Role as CallerRole

logger = logging.getLogger(__name__)

_txn_decoder: Final = msgspec.json.Decoder(m.TransactionBegin)


async def begin_transaction(api: ApiContext, request: Request) -> tuple[int, bytes]:
    body = decode(_txn_decoder, request.body or b"{}")
    tenant = api.tenant_of(request, body.tenant)
    if not NAME_RE.match(tenant):
        raise HttpError(400, "invalid_request", "tenant name is not valid")
    if not (math.isfinite(body.ttl_s) and 0 < body.ttl_s <= MAX_TTL_S):
        raise HttpError(400, "invalid_request", f"ttl_s must be in (0, {MAX_TTL_S:.0f}]")
    ttl_ms = max(1, int(body.ttl_s * 1000))
    result = await api.node.propose(
        lambda stamp: e.BeginTransaction(
            time_ms=stamp.now_ms,
            transaction_id=stamp.transaction_id(),
            tenant=tenant,
            ttl_ms=ttl_ms,
        )
    )
    if isinstance(result, Rejected):
        raise rejected_error(result)
    assert isinstance(result, TransactionRef)
    view = m.TransactionView(result.id, result.tenant, iso_ms(result.expires_ms) or "")
    return 201, json_encoder.encode(view)


async def _end_transaction(api: ApiContext, request: Request, commit: bool) -> tuple[int, bytes]:
    txn_id = int(request.params[0])
    if request.body.strip():
        raise HttpError(400, "invalid_request", "commit and rollback take no body")
    txn = api.node.state.transactions.get(txn_id)
    if txn is None or not request.principal.may_see_tenant(txn.tenant):
        raise HttpError(404, "not_found", f"transaction {txn_id} is not open")

    # The state machine checks the tenant again when it applies the entry.
    tenant = request.principal.tenant if request.principal.role is CallerRole.TENANT else None

    def build(stamp: Stamp) -> e.Entry:
        if commit:
            return e.CommitTransaction(time_ms=stamp.now_ms, transaction_id=txn_id, tenant=tenant)
        return e.RollbackTransaction(time_ms=stamp.now_ms, transaction_id=txn_id, tenant=tenant)

    result = await api.node.propose(build)
    if isinstance(result, Rejected):
        raise rejected_error(result)
    assert isinstance(result, TransactionDone)
    outcome = m.TransactionOutcome(result.id, result.outcome, list(result.task_ids))
    return 200, json_encoder.encode(outcome)


async def commit_transaction(api: ApiContext, request: Request) -> tuple[int, bytes]:
    return await _end_transaction(api, request, commit=True)


async def rollback_transaction(api: ApiContext, request: Request) -> tuple[int, bytes]:
    return await _end_transaction(api, request, commit=False)
