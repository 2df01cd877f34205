"""Handlers of API tokens (admin) and of whoami."""

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
    token_view,
)
from broker.api.context import ApiContext
from broker.core import (
    ApiToken,
    Rejected,
    validate_token_fields,
)
from broker.core import entries as e
from broker.security.auth import hash_token, new_token, new_token_id

logger = logging.getLogger(__name__)

_token_decoder: Final = msgspec.json.Decoder(m.TokenCreate)


async def create_token(api: ApiContext, request: Request) -> tuple[int, bytes]:
    body = decode(_token_decoder, request.body)
    tenants = tuple(body.tenants or ())
    problem = validate_token_fields(body.name, body.role, body.tenant, tenants)
    if problem is not None:
        raise HttpError(400, "invalid_request", problem)
    # The secret is made here and shown once; only its hash goes to the log.
    secret = new_token()
    token_id = new_token_id()
    result = await api.node.propose(
        lambda stamp: e.CreateToken(
            time_ms=stamp.now_ms,
            token_id=token_id,
            name=body.name,
            role=body.role,
            tenant=body.tenant,
            sha256=hash_token(secret),
            tenants=tenants,
        )
    )
    if isinstance(result, Rejected):
        raise rejected_error(result)
    assert isinstance(result, ApiToken)
    view = token_view(result)
    return 201, json_encoder.encode(m.TokenCreated(token=secret, **msgspec.structs.asdict(view)))


async def list_tokens(api: ApiContext, request: Request) -> tuple[int, bytes]:
    views = [token_view(t) for t in api.node.state.tokens.values()]
    return 200, json_encoder.encode(m.TokenList(views))


async def revoke_token(api: ApiContext, request: Request) -> tuple[int, bytes]:
    if request.body.strip():
        raise HttpError(400, "invalid_request", "revoke takes no body")
    token_id = request.params[0]
    if token_id not in api.node.state.tokens:
        raise HttpError(404, "not_found", f"token {token_id} does not exist")
    result = await api.node.propose(
        lambda stamp: e.RevokeToken(time_ms=stamp.now_ms, token_id=token_id)
    )
    if isinstance(result, Rejected):
        raise rejected_error(result)
    assert isinstance(result, ApiToken)
    return 200, json_encoder.encode(token_view(result))


async def whoami(api: ApiContext, request: Request) -> tuple[int, bytes]:
    principal = request.principal
    body = m.WhoAmI(
        role=principal.role.value,
        tenant=principal.tenant,
        token_id=principal.token_id,
        auth=api.config.auth.enabled,
    )
    return 200, json_encoder.encode(body)
