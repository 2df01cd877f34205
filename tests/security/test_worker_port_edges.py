"""The worker port of a real ``steward standalone`` broker under attack (issue 14, item 7).

Before a hello is accepted the broker reads no frame longer than a hello may be (a
frame announcing 16 MiB is refused with an error frame at once, its bytes unread), a
connection that sends no hello is closed after the deadline with an error frame, and
connections still in their handshake are capped (the next ones get an error frame at
once). During each attack the broker's resident memory grows by less than 64 MB,
``GET /healthz`` answers within 1 s, and a worker connected before keeps working.
"""

from __future__ import annotations

import asyncio
import contextlib
import struct
import time
from collections.abc import Iterator

import httpx
import pytest

from tests.support.edge_probes import AttackWatch, connect, read_until_closed, send_ignoring_close
from tests.support.fake_worker import FakeWorker
from tests.support.procs import HOST, BrokerProcess, free_port
from wire import worker_protocol as p

TOKEN = "worker-port-edges-token"
HELLO_TIMEOUT_S = 1.0
MAX_UNAUTHENTICATED = 8
# How much later than its deadline a silent connection may still be open (a loaded machine).
CUT_OFF_MARGIN_S = 3.0
ANSWER_TIMEOUT_S = 10.0
BIG_FRAME_BYTES = p.DEFAULT_MAX_FRAME_BYTES  # what the broker read before any hello
ATTACKERS = 6  # connections sending a BIG_FRAME_BYTES frame at once


class WorkerPortBroker:
    def __init__(self, process: BrokerProcess, worker_port: int) -> None:
        self.process = process
        self.worker_port = worker_port


def start_broker(
    tmp_path_factory: pytest.TempPathFactory, hello_timeout_s: float
) -> Iterator[WorkerPortBroker]:
    root = tmp_path_factory.mktemp("worker-port-edges")
    worker_port = free_port()
    process = BrokerProcess(
        root / "data",
        log_path=root / "broker.log",
        extra_args=(
            "--worker-listen",
            f"{HOST}:{worker_port}",
            "--worker-token",
            TOKEN,
            "--worker-hello-timeout-s",
            str(hello_timeout_s),
            "--worker-max-unauthenticated",
            str(MAX_UNAUTHENTICATED),
            "--heartbeat-timeout-ms",
            "5000",
        ),
    )
    with process:
        process.start()
        yield WorkerPortBroker(process, worker_port)
        assert process.running(), process.log_tail()
        assert "Traceback" not in process.log_text(), process.log_tail(20_000)


@pytest.fixture(scope="module")
def broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[WorkerPortBroker]:
    yield from start_broker(tmp_path_factory, HELLO_TIMEOUT_S)


@pytest.fixture(scope="module")
def patient_broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[WorkerPortBroker]:
    """A long hello deadline: connections holding the handshake slots stay for the test."""
    yield from start_broker(tmp_path_factory, 60.0)


async def read_messages_until_closed(
    reader: asyncio.StreamReader, timeout_s: float = ANSWER_TIMEOUT_S
) -> list[p.Message]:
    """Every frame the broker sends until it closes the connection (bounded)."""
    decoder = p.FrameDecoder()
    messages: list[p.Message] = []
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            data = await asyncio.wait_for(reader.read(65536), deadline - time.monotonic())
        except ConnectionResetError:
            return messages
        if not data:
            return messages
        messages.extend(decoder.feed(data))


async def close(writer: asyncio.StreamWriter) -> None:
    writer.close()
    with contextlib.suppress(OSError):
        await asyncio.wait_for(writer.wait_closed(), ANSWER_TIMEOUT_S)


async def run_task_on(worker: FakeWorker, client: httpx.AsyncClient, task_type: str) -> None:
    """Submit a task over HTTP; ``worker`` gets it and finishes it; the task finishes."""
    submitted = await client.post("/api/v1/tasks", json={"type": task_type, "tenant": "edges"})
    assert submitted.status_code == 201, submitted.text
    task_id = submitted.json()["id"]
    assign = await worker.expect(p.Assign, lambda a: any(t.task_id == task_id for t in a.tasks))
    attempt = next(t.attempt for t in assign.tasks if t.task_id == task_id)
    worker.finish_ok(task_id, attempt, b'"done"')
    deadline = time.monotonic() + ANSWER_TIMEOUT_S
    while (await client.get(f"/api/v1/tasks/{task_id}")).json()["state"] != "finished":
        assert time.monotonic() < deadline, f"task {task_id} did not finish"
        await asyncio.sleep(0.05)


async def test_big_pre_hello_frames_are_refused_without_being_read(
    broker: WorkerPortBroker,
) -> None:
    process = broker.process
    good = FakeWorker(broker.worker_port, "good-big", task_types={"big": 1}, token=TOKEN)
    await good.hello()
    try:
        # A frame header announcing 16 MiB and a little of it: refused for its size, so
        # without waiting for the rest (which is never sent).
        reader, writer = await asyncio.open_connection(HOST, broker.worker_port)
        writer.write(struct.pack(">I", BIG_FRAME_BYTES) + b"\x00" * 1024)
        answer = await read_messages_until_closed(reader)
        await close(writer)
        assert len(answer) == 1 and isinstance(answer[0], p.Error), answer
        assert answer[0].code == "frame_too_large"
        assert "of a hello" in answer[0].message

        def attack(_: int) -> list[p.Message]:
            with connect(broker.worker_port) as sock:
                send_ignoring_close(
                    sock, struct.pack(">I", BIG_FRAME_BYTES) + bytes(BIG_FRAME_BYTES)
                )
                return p.FrameDecoder().feed(read_until_closed(sock))

        with AttackWatch(process.url, process.pid) as watch:
            answers = await asyncio.gather(
                *(asyncio.to_thread(attack, i) for i in range(ATTACKERS))
            )
        for answer in answers:
            assert [type(m) for m in answer] == [p.Error], answer
            assert isinstance(answer[0], p.Error) and answer[0].code == "frame_too_large"
        watch.check()
        async with httpx.AsyncClient(base_url=process.url, timeout=10) as client:
            await run_task_on(good, client, "big")
        assert not good.closed_by_peer
    finally:
        await good.close()
    assert "worker port: refused 127.0.0.1:" in process.log_text()


async def test_connections_without_a_hello_are_closed_after_the_deadline(
    broker: WorkerPortBroker,
) -> None:
    process = broker.process
    give_up_s = HELLO_TIMEOUT_S + CUT_OFF_MARGIN_S

    async def silent_or_dribbling(index: int) -> tuple[float, list[p.Message]]:
        started = time.monotonic()
        reader, writer = await asyncio.open_connection(HOST, broker.worker_port)
        try:
            if index % 2:  # a hello frame announced, its bytes sent one by one
                writer.write(struct.pack(">I", 200))
                reading = asyncio.create_task(read_messages_until_closed(reader, give_up_s))
                while not reading.done() and time.monotonic() - started < give_up_s:
                    with contextlib.suppress(OSError):
                        writer.write(b"\x80")
                    await asyncio.sleep(0.1)
                messages = await reading
            else:
                messages = await read_messages_until_closed(reader, give_up_s)
            return time.monotonic() - started, messages
        finally:
            await close(writer)

    with AttackWatch(process.url, process.pid) as watch:
        results = await asyncio.gather(
            *(silent_or_dribbling(i) for i in range(MAX_UNAUTHENTICATED))
        )
    for lived_s, messages in results:
        assert lived_s < give_up_s, f"a connection without hello lived {lived_s:.1f} s"
        assert messages == [
            p.Error(code="timeout", message="no hello within the handshake timeout")
        ]
    watch.check()
    assert f"no hello within {HELLO_TIMEOUT_S} s" in process.log_text()


async def hello_answer(port: int, hello: p.Hello) -> list[p.Message]:
    reader, writer = await asyncio.open_connection(HOST, port)
    try:
        writer.write(p.encode_message(hello))
        return await read_messages_until_closed(reader)
    finally:
        await close(writer)


async def test_unauthenticated_connections_beyond_the_cap_are_refused(
    patient_broker: WorkerPortBroker,
) -> None:
    broker = patient_broker
    process = broker.process
    good = FakeWorker(broker.worker_port, "good-cap", task_types={"cap": 1}, token=TOKEN)
    await good.hello()
    held: list[asyncio.StreamWriter] = []
    try:
        async with httpx.AsyncClient(base_url=process.url, timeout=10) as client:
            with AttackWatch(process.url, process.pid) as watch:
                # The cap's worth of connections that say nothing (yet)...
                for _ in range(MAX_UNAUTHENTICATED):
                    held.append((await asyncio.open_connection(HOST, broker.worker_port))[1])

                async def beyond() -> tuple[int, list[p.Message]]:
                    reader, writer = await asyncio.open_connection(HOST, broker.worker_port)
                    local_port: int = writer.get_extra_info("sockname")[1]
                    try:
                        return local_port, await read_messages_until_closed(reader)
                    finally:
                        await close(writer)

                # ... so every other one is refused, with an error frame.
                refused = await asyncio.gather(*(beyond() for _ in range(100)))
                # The worker connected before keeps being served meanwhile.
                await run_task_on(good, client, "cap")
            watch.check()
            for _, messages in refused:
                assert len(messages) == 1 and isinstance(messages[0], p.Error), messages
                assert messages[0].code == "too_many_connections"
            log = process.log_text()
            assert any(f"worker port: refused 127.0.0.1:{port}:" in log for port, _ in refused)
            for writer in held:
                await close(writer)
            held = []

            # Free handshake slots again (once the broker saw the closes): a wrong token
            # is refused; a worker still running 20,000 tasks (a hello over 64 KiB) is
            # welcome.
            intruder = p.Hello(worker_id="intruder", token="guessed")
            deadline = time.monotonic() + ANSWER_TIMEOUT_S
            while True:
                answer = await hello_answer(broker.worker_port, intruder)
                assert len(answer) == 1 and isinstance(answer[0], p.Error), answer
                if answer[0].code != "too_many_connections":
                    break
                assert time.monotonic() < deadline, "the handshake slots were never freed"
                await asyncio.sleep(0.1)
            assert answer[0].code == "unauthorized"
            running = [(2**31 + n, 1) for n in range(20_000)]
            hello_bytes = p.encode_message(
                p.Hello(running=tuple(p.TaskAttempt(*r) for r in running))
            )
            assert len(hello_bytes) > 64 * 1024
            busy = FakeWorker(broker.worker_port, "busy", task_types={"busy": 1}, token=TOKEN)
            welcome = await busy.hello(running, wait_s=ANSWER_TIMEOUT_S)
            assert len(welcome.drop) == len(running)  # the broker never assigned them
            await busy.close()
            assert not good.closed_by_peer
            await run_task_on(good, client, "cap")
    finally:
        for writer in held:
            await close(writer)
        await good.close()
