"""Serve an ASGI app (an ApiApp or a minimal fake peer) with uvicorn on a free 127.0.0.1 port."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import uvicorn

from clients.dev.local_server import free_port

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]
Asgi = Callable[[Scope, Receive, Send], Awaitable[None]]

START_TIMEOUT_S = 30.0


@dataclass
class Served:
    url: str
    server: uvicorn.Server
    task: asyncio.Task[None]


async def serve(app: Asgi) -> Served:
    """Start serving ``app``; returns once uvicorn listens (bounded wait)."""
    port = free_port()
    server = uvicorn.Server(
        uvicorn.Config(
            app, host="127.0.0.1", port=port, log_level="warning", lifespan="off", access_log=False
        )
    )
    task = asyncio.create_task(server.serve())
    async with asyncio.timeout(START_TIMEOUT_S):
        while not server.started:
            if task.done():
                task.result()  # raises why it could not start
                raise AssertionError("uvicorn ended before it started")
            await asyncio.sleep(0.01)
    return Served(f"http://127.0.0.1:{port}", server, task)


async def unserve(served: Served) -> None:
    served.server.should_exit = True
    await asyncio.wait_for(served.task, START_TIMEOUT_S)
