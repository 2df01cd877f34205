"""The OpenAPI 3.1 document, generated from the route table (broker/api/routes.py) and the
models of broker/api/api_models.py."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from broker.api import api_models as m
from broker.api.common import ApiConfig
from broker.api.routes import ROUTES, Content, Param, Route
from broker.replication.node import VERSION

_DESCRIPTION = (
    "When the broker has an admin token configured, every operation but "
    "/healthz, this document and the dashboard's files needs Authorization: Bearer <token> "
    "(401 without a valid one; 403 when the token's role may not do it). Every "
    "connection: request line and headers at most 64 KiB (431), sent within "
    "the header timeout, a body at a minimum rate (408); beyond the broker's "
    "connection cap a connection is answered 503 too_many_connections."
)


def _models(routes: Sequence[Route]) -> list[type]:
    """Every model the routes name, in table order, once; the error body first."""
    found: dict[type, None] = {m.ErrorBody: None}
    for route in routes:
        contents = [route.body, *route.responses.values()]
        for content in contents:
            if content is not None and content.model is not None:
                found.setdefault(content.model, None)
    return list(found)


def openapi_document(
    config: ApiConfig | None = None, routes: Sequence[Route] = ROUTES
) -> dict[str, Any]:
    """The OpenAPI 3.1 document; its bounds are those of ``config`` (default: ApiConfig())."""
    config = config or ApiConfig()
    models = _models(routes)
    refs, components = m.schema_components(models)
    ref = dict(zip(models, refs, strict=True))

    def content(body: Content) -> dict[str, Any]:
        if body.model is not None:
            return {"application/json": {"schema": ref[body.model]}}
        schema = body.schema or {"type": "string"}
        return {media: {"schema": schema} for media in body.media}

    def response(body: Content) -> dict[str, Any]:
        answer: dict[str, Any] = {"description": body.description, "content": content(body)}
        if body.headers:
            answer["headers"] = {
                name: {"description": text, "schema": {"type": "string", "pattern": pattern}}
                for name, text, pattern in body.headers
            }
        return answer

    def parameter(param: Param) -> dict[str, Any]:
        schema = param.schema(config) if callable(param.schema) else param.schema
        required = param.required or param.where == "path"
        return {"name": param.name, "in": param.where, "required": required, "schema": schema}

    error = response(Content(m.ErrorBody, "Error"))
    retry = response(Content(m.ErrorBody, "Retry later"))
    paths: dict[str, dict[str, Any]] = {}
    for route in routes:
        operation: dict[str, Any] = {"summary": route.summary}
        if route.description:
            operation["description"] = route.description
        if route.params:
            operation["parameters"] = [parameter(p) for p in route.params]
        if route.body is not None:
            operation["requestBody"] = {
                "required": route.body_required,
                "content": content(route.body),
            }
        responses = {str(code): response(body) for code, body in route.responses.items()}
        if route.permission.public:
            operation["security"] = []
        else:
            # With authentication on, any other operation may answer 401 or 403.
            responses.setdefault("4XX", error)
            responses.setdefault("503", retry)
        operation["responses"] = responses
        paths.setdefault(route.path, {})[route.method.lower()] = operation
    return {
        "openapi": "3.1.0",
        "info": {"title": "Steward", "version": VERSION, "description": _DESCRIPTION},
        "paths": paths,
        "components": {
            "schemas": components,
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        },
        "security": [{"bearer": []}, {}],
    }
