"""The worker's side of the conversation table (wire/conversation.py): a frame
the broker may not send now ends the connection with an Error frame, then a reconnect."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from tests.support.worker_harness import WAIT_S, Env, worker_env
from wire.worker_protocol import Assign, Error, Hello


@pytest.fixture
async def env(tmp_path: Path) -> AsyncIterator[Env]:
    async with worker_env(tmp_path, stop_timeout_s=0.5, stop_wait_s=WAIT_S + 5) as environment:
        yield environment


async def test_a_frame_the_broker_may_not_send_ends_the_connection(env: Env) -> None:
    worker, conn = await env.started()
    conn.send(Hello(worker_id="not-a-broker-frame"))
    error = await conn.next(Error)
    assert (error.code, error.message) == ("unexpected_message", "unexpected Hello from the broker")
    await asyncio.wait_for(conn.closed.wait(), WAIT_S)
    again = await env.broker.connect()  # the worker reconnects
    assert again.hello is not None and again.hello.worker_id == "w1"
    await asyncio.wait_for(worker.wait_connected(), WAIT_S)


async def test_anything_but_welcome_or_error_first_ends_the_connection(env: Env) -> None:
    env.worker()
    conn = await env.broker.accept()
    conn.send(Assign())
    error = await conn.next(Error)
    assert error.code == "unexpected_message"
    assert error.message.startswith("expected welcome, got ")
    await asyncio.wait_for(conn.closed.wait(), WAIT_S)
    assert (await env.broker.accept()).hello is not None  # and it tries again
