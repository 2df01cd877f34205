"""Fuzzing a running broker's worker port over real TCP (``steward standalone``).

Hundreds of connections send generated handshakes (valid hellos, mutated ones,
random bytes, the wrong first message, announced huge lengths), then a stream of
frames the broker must process and shrug off (finish reports for tasks the worker
does not run, with bad results and bad spawn requests; heartbeats), then one
hostile frame (mutated, truncated, deeply nested, not UTF-8, the wrong direction).
Every connection must end closed by the broker, with an error frame whenever it
read something invalid. Meanwhile a well-behaved worker stays connected and
finishes every task submitted over HTTP, and the HTTP API keeps answering. At
least ``MIN_INPUTS`` generated handshakes and frames are sent (counted, printed).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import struct
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import httpx
import msgspec
import pytest

from tests.support.fake_worker import FakeWorker
from tests.support.procs import HOST, BrokerProcess, free_port
from wire import worker_protocol as p

MIN_INPUTS = 10_000
CONNECTIONS = int(os.environ.get("STEWARD_FUZZ_CONNECTIONS", 800))
FRAMES_PER_CONNECTION = 30
PARALLEL = 16
BATCH_TASKS = 200
SEED = int(os.environ.get("STEWARD_FUZZ_SEED", 20261122))
# Bounds (generous: a loaded machine): a connection's whole life, the wait for tasks.
CONNECTION_TIMEOUT_S = 30.0
TASKS_DONE_TIMEOUT_S = 120.0
GOOD_TYPE = "good"
GOOD_TENANT = "good"
# Codes the broker may answer with (wire/worker_protocol.py and broker/workers/worker_link.py).
ERROR_CODES = {
    "frame_too_large",
    "bad_frame",
    "bad_message",
    "unsupported_version",
    "bad_handshake",
    "unexpected_message",
    "timeout",
}


# --- generated inputs -------------------------------------------------------------------------


def random_text(rng: random.Random, max_size: int = 12) -> str:
    alphabet = "abcxyz019-_.*/ \x00é\u2603"
    return "".join(rng.choice(alphabet) for _ in range(rng.randint(0, max_size)))


def frame(payload: bytes) -> bytes:
    return struct.pack(">I", len(payload)) + payload


def fuzz_hello(rng: random.Random, index: int) -> p.Hello:
    # Zero capacity for the good worker's tasks: the fuzzers must never get one.
    return p.Hello(
        worker_id=f"fuzz-{index}",
        process_id=random_text(rng),
        version=random_text(rng),
        task_types={"fuzz-only": rng.randint(0, 3)},
        resources={"cpu": rng.choice([0.0, 1.0, 1e300])},
        tenants=("fuzz",),
        running=tuple(
            p.TaskAttempt(rng.randint(0, 2**63 - 1), rng.randint(0, 5))
            for _ in range(rng.randint(0, 3))
        ),
    )


def mutate(rng: random.Random, data: bytes) -> bytes:
    out = bytearray(data)
    for _ in range(rng.randint(1, 4)):
        kind = rng.choice(["flip", "cut", "insert", "truncate"])
        position = rng.randint(0, max(0, len(out) - 1))
        if kind == "flip" and out:
            out[position] ^= rng.randint(1, 255)
        elif kind == "cut":
            del out[position : position + rng.randint(1, 8)]
        elif kind == "insert":
            out[position:position] = rng.randbytes(rng.randint(1, 8))
        else:
            del out[position:]
    return bytes(out)


def bad_handshake(rng: random.Random, index: int) -> bytes:
    choice = rng.randrange(7)
    if choice == 0:
        return rng.randbytes(rng.randint(1, 64))
    if choice == 1:
        return mutate(rng, p.encode_message(fuzz_hello(rng, index)))
    if choice == 2:  # the wrong first message
        wrong: list[p.Message] = [
            p.Heartbeat(seq=1),
            p.Finish(),
            p.Welcome(),
            p.Assign(),
            p.Error(message="x"),
        ]
        return p.encode_message(rng.choice(wrong))
    if choice == 3:  # hello and more before the welcome
        return p.encode_message(fuzz_hello(rng, index)) + p.encode_message(p.Heartbeat(seq=1))
    if choice == 4:  # an announced length far above the cap
        return struct.pack(">I", rng.randint(p.DEFAULT_MAX_FRAME_BYTES + 1, 2**32 - 1)) + b"x"
    if choice == 5:  # a hello with fields of the wrong type
        fields = {"type": "hello", "worker_id": rng.randint(0, 9), "task_types": [1, 2]}
        return frame(msgspec.msgpack.encode(fields))
    return frame(msgspec.msgpack.encode({"type": "hello", "worker_id": f"fuzz-{index}", "v": 99}))


def junk_json(rng: random.Random) -> bytes:
    return rng.choice([b"null", b"{}", b"not json", b"", b"[" * 200, rng.randbytes(20)])


def fuzz_report(rng: random.Random) -> p.TaskReport:
    spawn = tuple(
        p.SpawnRequest(
            type=random_text(rng),
            params=junk_json(rng),
            tenant=rng.choice([None, "", "fuzz", random_text(rng)]),
            tracked=rng.random() < 0.5,
            anchors=tuple(rng.randint(-3, 2**40) for _ in range(rng.randint(0, 2))),
            max_attempts=rng.randint(-2, 5),
            resources={random_text(rng): rng.choice([-1.0, 0.0, float("nan"), 1e308])},
        )
        for _ in range(rng.randint(0, 2))
    )
    return p.TaskReport(
        task_id=rng.choice([0, 1, 2, 3, rng.randint(0, 2**64 - 1)]),
        attempt=rng.randint(0, 3),
        ok=rng.random() < 0.5,
        result=rng.choice([None, junk_json(rng)]),
        error=rng.choice([None, random_text(rng, 200)]),
        spawn=spawn,
    )


def harmless_frame(rng: random.Random) -> bytes:
    """A frame a connected worker may send: it must be processed, not end the connection."""
    if rng.random() < 0.3:
        return p.encode_message(p.Heartbeat(seq=rng.randint(0, 2**64 - 1)))
    reports = tuple(fuzz_report(rng) for _ in range(rng.randint(0, 4)))
    return p.encode_message(p.Finish(reports=reports))


def nested(depth: int) -> bytes:
    return frame(b"\x82\xa4type\xa9heartbeat\xa1x" + b"\x91" * depth + b"\xc0")


def hostile_frame(rng: random.Random, index: int) -> bytes:
    """A last frame that must end the connection with an error frame (or be cut short)."""
    choice = rng.randrange(7)
    if choice == 0:
        return nested(rng.choice([1_000, 100_000]))
    if choice == 1:  # a string that is not UTF-8
        return frame(b"\x82\xa4type\xa5hello\xa9worker_id\xa2\x00\xc2")
    if choice == 2:  # a message only the broker sends
        broker_only: list[p.Message] = [p.Welcome(), p.Assign(), p.FinishAck(), p.Cancel()]
        return p.encode_message(rng.choice(broker_only))
    if choice == 3:
        return struct.pack(">I", 2**32 - 1)
    if choice == 4:
        return frame(rng.randbytes(rng.randint(0, 40)) + b"\xc1")
    if choice == 5:
        return frame(msgspec.msgpack.encode({"type": "heartbeat", "v": rng.choice([0, 3, -1])}))
    payload = p.encode_message(p.Finish(reports=(fuzz_report(rng),)))[4:]
    # The mutation may leave a valid finish: a never-valid frame follows it.
    return frame(mutate(rng, payload)) + frame(b"\xc1")


@dataclass
class Plan:
    index: int
    handshake: bytes
    valid_hello: bool
    frames: list[bytes]

    @property
    def inputs(self) -> int:
        return 1 + len(self.frames)


def make_plan(rng: random.Random, index: int) -> Plan:
    if rng.random() < 0.7:
        frames = [harmless_frame(rng) for _ in range(FRAMES_PER_CONNECTION)]
        frames.append(hostile_frame(rng, index))
        return Plan(index, p.encode_message(fuzz_hello(rng, index)), True, frames)
    return Plan(index, bad_handshake(rng, index), False, [])


# --- running them -----------------------------------------------------------------------------


@dataclass
class Answer:
    messages: list[p.Message]
    closed: bool
    undecodable: bool


async def run_connection(port: int, plan: Plan) -> Answer:
    reader, writer = await asyncio.open_connection(HOST, port)
    decoder = p.FrameDecoder()
    messages: list[p.Message] = []
    undecodable = False
    try:
        writer.write(plan.handshake)
        if plan.valid_hello:
            # A worker waits for the welcome before it sends more (else: bad_handshake).
            while not messages:
                data = await reader.read(65536)
                if not data:
                    return Answer(messages, True, undecodable)
                messages.extend(decoder.feed(data))
        for data in plan.frames:
            writer.write(data)
        # The broker may close (and reset) the connection before it read everything.
        with contextlib.suppress(OSError):
            await writer.drain()
            writer.write_eof()  # nothing more: the broker must not wait for us
        while True:
            try:
                data = await reader.read(65536)
            except OSError:
                data = b""
            if not data:
                return Answer(messages, True, undecodable)
            try:
                messages.extend(decoder.feed(data))
            except p.ProtocolError:
                undecodable = True
    finally:
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()


async def serve_good_worker(worker: FakeWorker, finished: Counter[str]) -> None:
    """Finish every assigned task at once, forever (the test cancels it)."""
    while True:
        try:
            assign = await worker.expect(p.Assign, wait_s=1.0)
        except TimeoutError:
            continue
        for task in assign.tasks:
            worker.finish_ok(task.task_id, task.attempt, b'{"ok": true}')
            finished[task.type] += 1


async def probe_http(client: httpx.AsyncClient, task_ids: list[int], stop: asyncio.Event) -> int:
    """Health checks and submissions while the fuzzers run; returns the probes made."""
    probes = 0
    while not stop.is_set():
        health = await client.get("/healthz")
        assert health.status_code == 200, health.text
        submitted = await client.post(
            "/api/v1/tasks",
            json={"type": GOOD_TYPE, "tenant": GOOD_TENANT, "max_attempts": 3},
        )
        assert submitted.status_code == 201, submitted.text
        task_ids.append(submitted.json()["id"])
        probes += 1
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), 0.2)
    return probes


@pytest.mark.slow
@pytest.mark.timeout(600)
async def test_worker_port_survives_fuzzed_connections(tmp_path: Path) -> None:
    rng = random.Random(SEED)
    plans = [make_plan(rng, index) for index in range(CONNECTIONS)]
    total_inputs = sum(plan.inputs for plan in plans)
    worker_port = free_port()
    broker = BrokerProcess(
        tmp_path / "data",
        log_path=tmp_path / "broker.log",
        extra_args=("--worker-listen", f"{HOST}:{worker_port}", "--heartbeat-timeout-ms", "5000"),
    )
    with broker:
        await asyncio.to_thread(broker.start)
        good = FakeWorker(worker_port, "good-1", task_types={GOOD_TYPE: 8}, tenants=(GOOD_TENANT,))
        await good.hello()
        finished: Counter[str] = Counter()
        serving = asyncio.create_task(serve_good_worker(good, finished))
        task_ids: list[int] = []
        stop = asyncio.Event()
        async with httpx.AsyncClient(base_url=broker.url, timeout=30) as client:
            # A batch queued up front keeps the good worker busy while the fuzzers run.
            batch = await client.post(
                "/api/v1/tasks",
                json={
                    "tasks": [
                        {"type": GOOD_TYPE, "tenant": GOOD_TENANT, "max_attempts": 3}
                        for _ in range(BATCH_TASKS)
                    ]
                },
            )
            assert batch.status_code == 200, batch.text
            task_ids += [item["id"] for item in batch.json()["tasks"]]
            prober = asyncio.create_task(probe_http(client, task_ids, stop))
            # A connection that never says hello is dropped after the handshake timeout.
            silent = await asyncio.open_connection(HOST, worker_port)
            limit = asyncio.Semaphore(PARALLEL)

            async def bounded(plan: Plan) -> Answer:
                async with limit:
                    return await asyncio.wait_for(
                        run_connection(worker_port, plan), CONNECTION_TIMEOUT_S
                    )

            started = time.monotonic()
            answers = await asyncio.gather(*(bounded(plan) for plan in plans))
            fuzz_s = time.monotonic() - started
            stop.set()
            probes = await asyncio.wait_for(prober, 60)

            silent_answer = await asyncio.wait_for(silent[0].read(65536), 30)
            silent[1].close()

            # Every task submitted meanwhile finishes on the well-behaved worker.
            deadline = time.monotonic() + TASKS_DONE_TIMEOUT_S
            states: dict[int, str] = {}
            while time.monotonic() < deadline:
                for task_id in task_ids:
                    if states.get(task_id) != "finished":
                        response = await client.get(f"/api/v1/tasks/{task_id}")
                        assert response.status_code == 200, response.text
                        states[task_id] = response.json()["state"]
                if all(state == "finished" for state in states.values()):
                    break
                await asyncio.sleep(0.2)
            cluster = (await client.get("/api/v1/cluster")).json()

        serving.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await serving
        good_still_connected = not good.closed_by_peer
        await good.close()

        codes: Counter[str] = Counter()
        for plan, answer in zip(plans, answers, strict=True):
            assert answer.closed, f"connection {plan.index} left open"
            assert not answer.undecodable, f"connection {plan.index}: broker sent garbage"
            errors = [m for m in answer.messages if isinstance(m, p.Error)]
            for error in errors:
                assert error.code in ERROR_CODES, error
                codes[error.code] += 1
            if plan.valid_hello:
                assert isinstance(answer.messages[0], p.Welcome), answer.messages[:3]
                # Its hostile last frame was read: an error frame came before the close.
                assert errors, f"connection {plan.index}: closed without an error frame"
        print(
            f"\nworker port fuzz: {total_inputs} inputs over {len(plans)} connections in "
            f"{fuzz_s:.1f} s (seed {SEED}); error frames by code: {dict(codes)}; "
            f"{probes} HTTP probes; good tasks finished: {finished[GOOD_TYPE]}"
        )
        assert total_inputs >= MIN_INPUTS
        assert sum(codes.values()) >= len(plans) // 2
        assert p.FrameDecoder().feed(silent_answer) == [
            p.Error(code="timeout", message="no hello within the handshake timeout")
        ]
        assert probes >= 1
        assert len(task_ids) > BATCH_TASKS
        assert all(states[t] == "finished" for t in task_ids), states
        assert finished[GOOD_TYPE] >= len(task_ids)
        assert good_still_connected, "the well-behaved worker was disconnected"
        assert any(w["id"] == "good-1" and w["state"] == "connected" for w in cluster["workers"])
        assert broker.running(), broker.log_tail()
        log = broker.log_text()
        assert "Traceback" not in log, broker.log_tail(20_000)
