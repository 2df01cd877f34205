"""Kazoo clients for tests that talk to ZooKeeper directly (the election, the ledger list,
code replication), started and stopped off the event loop."""

from __future__ import annotations

import asyncio

from kazoo.client import KazooClient  # type: ignore[import-untyped]

# Short, so that tests of session loss do not wait long.
SESSION_TIMEOUT_S = 3.0


async def start_client(connect_string: str) -> KazooClient:
    client = KazooClient(hosts=connect_string, timeout=SESSION_TIMEOUT_S)
    await asyncio.to_thread(client.start, 15)
    return client


async def close_client(client: KazooClient) -> None:
    await asyncio.to_thread(client.stop)
    await asyncio.to_thread(client.close)
