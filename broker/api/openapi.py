"""The OpenAPI 3.1 document, generated from the route table (broker/api/routes.py) and the
models of broker/api/api_models.py."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Final

import msgspec

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


# Error statuses any operation may answer (docs/API.md, Errors): a malformed request, no
# such object, the connection's header or body deadline, headers over 64 KiB, a bug, and a
# broker that cannot serve (no leader known, over its connection cap, stopping).
_EVERY_ROUTE_ERRORS: Final = {
    400: "Invalid request (the error's message says what to change)",
    404: "No such object",
    408: "The request's headers or body came too slowly",
    431: "Request line and headers over 64 KiB",
    500: "Internal error (see the broker's log)",
    503: "Not serving now (no leader known, too many connections, stopping): retry later",
}
_ERROR_TEXT: Final = {
    409: "Conflict (a busy slot, a reused idempotency key, a final task or transaction)",
    413: "Request body over the broker's limit",
    429: "The tenant's queue is full (max_waiting): retry later",
}


def _models(routes: Sequence[Route]) -> list[type]:
    """Every model the routes name, in table order, once; the error body first."""
    found: dict[type, None] = {m.ErrorBody: None}
    for route in routes:
        contents = [route.body, *route.responses.values()]
        for content in contents:
            if content is None:
                continue
            for model in content.one_of or (content.model,):
                if model is not None:
                    found.setdefault(model, None)
    return list(found)


_Structs = dict[type[msgspec.Struct], msgspec.inspect.StructType]


def _structs(info: msgspec.inspect.Type, found: _Structs) -> None:
    """Every Struct type ``info`` holds, at any depth, into ``found``."""
    if isinstance(info, msgspec.inspect.StructType):
        if info.cls in found:
            return
        found[info.cls] = info
        for field in info.fields:
            _structs(field.type, found)
    elif isinstance(info, msgspec.inspect.Metadata):
        _structs(info.type, found)
    elif isinstance(info, msgspec.inspect.UnionType):
        for member in info.types:
            _structs(member, found)
    elif isinstance(info, msgspec.inspect.DictType):
        _structs(info.value_type, found)
    elif isinstance(
        info, msgspec.inspect.ListType | msgspec.inspect.SetType | msgspec.inspect.VarTupleType
    ):
        _structs(info.item_type, found)


def _mark_always_present(routes: Sequence[Route], components: dict[str, Any]) -> None:
    """In a response, a field with a default is still always sent unless its struct omits
    defaults: mark those required, so a generated client types them as present (msgspec's
    schema marks only fields without a default, which is right for request bodies)."""
    found: _Structs = {}
    for route in routes:
        for content in route.responses.values():
            if content.model is not None:
                _structs(msgspec.inspect.type_info(content.model), found)
    for cls, info in found.items():
        schema = components.get(cls.__name__)
        if schema is None or cls.__struct_config__.omit_defaults:
            continue
        schema["required"] = [field.encode_name for field in info.fields]


def _error(description: str, headers: dict[str, Any] | None = None) -> dict[str, Any]:
    answer: dict[str, Any] = {
        "description": description,
        "content": {"application/json": {"schema": {"$ref": _ERROR_REF}}},
    }
    if headers:
        answer["headers"] = headers
    return answer


_ERROR_REF: Final = "#/components/schemas/ErrorBody"
_NOT_LEADER: Final = _error(
    "This broker is a follower: the same request goes to the leader, whose URL for it is"
    " in Location (and the error's leader_url); clients follow it with the same method and"
    " body (docs/DESIGN.md §4)",
    {"Location": {"description": "This request's URL on the leader", "required": True,
                  "schema": {"type": "string", "format": "uri"}}},
)  # fmt: skip
_UNAUTHORIZED: Final = _error(
    "No valid API token (send Authorization: Bearer <token>)",
    {"WWW-Authenticate": {"description": 'Bearer realm="steward"', "required": True,
                          "schema": {"type": "string"}}},
)  # fmt: skip


def _errors(route: Route) -> dict[str, Any]:
    """Every error status ``route`` may answer, each with the error body's schema."""
    answers: dict[int, dict[str, Any]] = {}
    if not route.permission.public:
        answers[401] = _UNAUTHORIZED
        answers[403] = _error("The token's role may not do this")
        if route.method != "GET":
            # Only writes are redirected: a follower serves reads itself.
            answers[307] = _NOT_LEADER
    if route.method in ("POST", "PUT"):
        answers[413] = _error(_ERROR_TEXT[413])
    for code in route.errors:
        answers[code] = _error(_ERROR_TEXT[code])
    for code, text in _EVERY_ROUTE_ERRORS.items():
        answers[code] = _error(text)
    return {str(code): answers[code] for code in sorted(answers)}


def openapi_document(
    config: ApiConfig | None = None, routes: Sequence[Route] = ROUTES
) -> dict[str, Any]:
    """The OpenAPI 3.1 document; its bounds are those of ``config`` (default: ApiConfig())."""
    config = config or ApiConfig()
    models = _models(routes)
    refs, components = m.schema_components(models)
    ref = dict(zip(models, refs, strict=True))
    _mark_always_present(routes, components)

    def content(body: Content) -> dict[str, Any]:
        if body.one_of:
            return {"application/json": {"schema": {"oneOf": [ref[x] for x in body.one_of]}}}
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

    paths: dict[str, dict[str, Any]] = {}
    tags: dict[str, None] = {}
    for route in routes:
        assert route.operation_id and route.tag, f"{route.method} {route.path}: name it"
        tags.setdefault(route.tag, None)
        operation: dict[str, Any] = {
            "operationId": route.operation_id,
            "tags": [route.tag],
            "summary": route.summary,
        }
        if route.description:
            operation["description"] = route.description
        if route.params:
            operation["parameters"] = [parameter(p) for p in route.params]
        if route.body is not None:
            operation["requestBody"] = {
                "required": route.body_required,
                "content": content(route.body),
            }
        responses = _errors(route)
        responses.update((str(code), response(body)) for code, body in route.responses.items())
        if route.permission.public:
            operation["security"] = []
        operation["responses"] = dict(sorted(responses.items()))
        paths.setdefault(route.path, {})[route.method.lower()] = operation
    return {
        "openapi": "3.1.0",
        "info": {"title": "Steward", "version": VERSION, "description": _DESCRIPTION},
        "tags": [{"name": tag} for tag in tags],
        "paths": paths,
        "components": {
            "schemas": components,
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        },
        "security": [{"bearer": []}, {}],
    }
