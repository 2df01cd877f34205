"""Validates real HTTP responses against the served OpenAPI document (issue 17: "every
real response validates against the document"): the operation the method and path name,
a documented status, the required headers, and the JSON body against its schema
(jsonschema_rs, which the test extras bring with schemathesis)."""

from __future__ import annotations

import re
from typing import Any

import httpx
import jsonschema_rs


class ResponseChecker:
    """Validates each response an httpx client gets against the OpenAPI document: the
    operation its method and path name, the schema of its status, required headers."""

    def __init__(self, document: dict[str, Any]) -> None:
        self.document = document
        self.checked: list[tuple[str, str, int]] = []
        self.problems: list[str] = []
        # Requests no operation describes (a wrong path or method: 404/405, not checked).
        self.unmatched: list[str] = []
        self._validators: dict[int, Any] = {}
        # Literal paths before templated ones: /api/v1/tasks/recent is not /tasks/{id}.
        self.paths = sorted(
            (
                (re.compile("^" + re.sub(r"\{\w+\}", "[^/]+", p) + "$"), p)
                for p in document["paths"]
            ),
            key=lambda pair: pair[1].count("{"),
        )

    def _operation(self, method: str, path: str) -> dict[str, Any] | None:
        for pattern, template in self.paths:
            if pattern.match(path):
                found: dict[str, Any] | None = self.document["paths"][template].get(method.lower())
                return found
        return None

    def __call__(self, response: httpx.Response) -> None:
        """An httpx response hook (a sync client's; an async client awaits ``aread`` first)."""
        response.read()
        self.check(response)

    async def async_hook(self, response: httpx.Response) -> None:
        await response.aread()
        self.check(response)

    def check(self, response: httpx.Response) -> None:
        request = response.request
        where = f"{request.method} {request.url.path} -> {response.status_code}"
        operation = self._operation(request.method, request.url.path)
        if operation is None:
            self.unmatched.append(where)
            return
        answer = operation["responses"].get(str(response.status_code))
        if answer is None:
            self.problems.append(f"{where}: status not documented")
            return
        for name, header in answer.get("headers", {}).items():
            if header.get("required") and name not in response.headers:
                self.problems.append(f"{where}: no {name} header")
        media = answer.get("content", {}).get("application/json")
        if media is not None:
            validator = self._validators.get(id(media))
            if validator is None:
                schema = {**media["schema"], "components": self.document["components"]}
                validator = self._validators[id(media)] = jsonschema_rs.validator_for(schema)
            errors = [str(e) for e in validator.iter_errors(response.json())]
            if errors:
                self.problems.append(f"{where}: {errors[:3]}")
        self.checked.append((request.method, request.url.path, response.status_code))
