"""The state machine's tenants, cluster config and API tokens (docs/DESIGN.md §6)."""

from __future__ import annotations

import math
import re

import msgspec

from broker.core import entries as e
from broker.core.books import Books
from broker.core.entries import SHA256_RE
from broker.core.records import (
    ApiToken,
    ErrorCode,
    Rejected,
    Tenant,
)
from broker.core.validation import (
    NAME_RE,
    validate_limits,
    validate_token_fields,
)


def set_tenant(books: Books, entry: e.SetTenant) -> Tenant | Rejected:
    if not NAME_RE.match(entry.tenant):
        return Rejected(ErrorCode.INVALID, "tenant name is not valid")
    problem = validate_limits(entry.limits)
    if problem is not None:
        return Rejected(ErrorCode.INVALID, problem)
    tenant = books.tenant(entry.tenant)
    if entry.limits.max_waiting is not None:
        tenant.max_waiting = entry.limits.max_waiting
    if entry.limits.max_running is not None:
        tenant.max_running = entry.limits.max_running
    if entry.limits.weight is not None:
        tenant.weight = float(entry.limits.weight)
    if entry.limits.submit_rate is not None:
        tenant.submit_rate = float(entry.limits.submit_rate)
    if entry.limits.submit_burst is not None:
        tenant.submit_burst = entry.limits.submit_burst
    # The tenant as this entry left it (a later entry of its group commit must not
    # change the answer before it is sent).
    return msgspec.structs.replace(tenant)


def set_config(books: Books, entry: e.SetConfig) -> Rejected | None:
    retention_ms = entry.finished_task_retention_ms
    if retention_ms is not None and retention_ms <= 0:
        return Rejected(ErrorCode.INVALID, "finished_task_retention_ms must be > 0")
    if entry.global_limits is not None:
        for name, amount in entry.global_limits.items():
            if not NAME_RE.match(name) or not (math.isfinite(amount) and amount >= 0):
                return Rejected(ErrorCode.INVALID, f"global limit {name!r} is not valid")
        books.config.global_limits = {n: float(v) for n, v in entry.global_limits.items()}
    if entry.finished_task_retention_ms is not None and entry.finished_task_retention_ms > 0:
        books.config.finished_task_retention_ms = entry.finished_task_retention_ms
        books.rebuild_timers()
    return None


def tick(books: Books, entry: e.Tick) -> None:
    return None


def create_token(books: Books, entry: e.CreateToken) -> ApiToken | Rejected:
    if not re.fullmatch(r"[0-9a-f]{1,64}", entry.token_id):
        return Rejected(ErrorCode.INVALID, "token_id must be 1 to 64 lowercase hex digits")
    if not SHA256_RE.fullmatch(entry.sha256):
        return Rejected(ErrorCode.INVALID, "sha256 must be 64 lowercase hex digits")
    problem = validate_token_fields(entry.name, entry.role, entry.tenant, entry.tenants)
    if problem is not None:
        return Rejected(ErrorCode.INVALID, problem)
    if books.token_index.known(entry.token_id, entry.sha256):
        return Rejected(ErrorCode.CONFLICT, f"token {entry.token_id} already exists")
    token = ApiToken(
        entry.token_id,
        entry.name,
        entry.role,
        entry.tenant,
        entry.sha256,
        books.now_ms,
        tenants=list(entry.tenants),
    )
    books.token_index.add(token)
    return token


def revoke_token(books: Books, entry: e.RevokeToken) -> ApiToken | Rejected:
    token = books.token_index.revoke(entry.token_id)
    if token is None:
        return Rejected(ErrorCode.NOT_FOUND, f"token {entry.token_id} does not exist")
    return token
