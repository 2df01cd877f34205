"""Boot after a crash with a damaged ledger tail, and restart after a clean SIGTERM.

A crash can leave the newest ledger's last frame half written (or, on bad disks,
with flipped bytes), or leave junk after it. Boot must find the end of the valid
data by CRC, cut the rest, keep every entry before it, and keep working.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import random
import struct
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest

from broker.core import StateMachine, TaskRef
from broker.core import entries as e
from broker.replication.node import Node, NodeConfig, Stamp
from broker.server.standalone import build_node
from log.api import LedgerState
from log.file import FRAME_HEADER, encode_frame
from tests.support.procs import BrokerProcess, fetch_all_tasks, get_digest

WAIT_S = 30.0
LEDGER_LOGGER = "log.file"

# -- in-process helpers ------------------------------------------------------------------------


@dataclass(frozen=True)
class Frame:
    offset: int
    size: int  # header + payload
    entry_id: int
    payload: bytes


def read_frames(path: Path) -> list[Frame]:
    """The frames of a segment file up to its first invalid one (no CRC check here)."""
    data = path.read_bytes()
    frames: list[Frame] = []
    pos = 0
    while len(data) - pos >= FRAME_HEADER.size:
        length, _, entry_id, _ = FRAME_HEADER.unpack_from(data, pos)
        end = pos + FRAME_HEADER.size + length
        if end > len(data):
            break
        frames.append(Frame(pos, end - pos, entry_id, data[pos + FRAME_HEADER.size : end]))
        pos = end
    return frames


def ledger_path(data_dir: Path, ledger_id: int) -> Path:
    return data_dir / "ledgers" / f"ledger-{ledger_id:012d}.log"


@dataclass
class Recorder:
    """Every entry the node logged through :meth:`propose`, in log order."""

    entries: list[e.Entry] = field(default_factory=list)

    async def propose(self, node: Node, build: Callable[[Stamp], e.Entry]) -> Any:
        def recording(stamp: Stamp) -> e.Entry:
            entry = build(stamp)
            self.entries.append(entry)
            return entry

        return await asyncio.wait_for(node.propose(recording), WAIT_S)

    async def submit(self, node: Node, params: dict[str, Any], tenant: str = "acme") -> int:
        raw = msgspec.json.encode(params)

        def build(stamp: Stamp) -> e.Entry:
            (task_id,) = stamp.task_ids(1)
            spec = e.TaskSpec(id=task_id, type="job.torn", tenant=tenant, params=raw)
            return e.SubmitTasks(time_ms=stamp.now_ms, tasks=(spec,))

        results = await self.propose(node, build)
        assert isinstance(results, list) and isinstance(results[0], TaskRef), results
        return results[0].id


def reference_digest(entries: list[e.Entry]) -> str:
    machine = StateMachine()
    for entry in entries:
        machine.apply(e.decode_entry(e.encode_entry(entry)))
    return machine.digest()


async def crash(node: Node) -> None:
    """Lose the node the way a kill -9 does once its writes are durable: no stop().

    The ledger stays open in the ledger list, no final snapshot is taken.
    """
    background = list(node._background)
    for task in background:
        task.cancel()
    await asyncio.gather(*background, return_exceptions=True)
    await node.ledgers.close()


async def settle(node: Node) -> None:
    """Wait for a ledger roll in progress to finish."""
    async with asyncio.timeout(WAIT_S):
        while node.leader is not None and node.leader.gate is not None:
            await node.leader.gate.wait()


def node_config(data_dir: Path, *, roll_bytes: int = 64 * 1024 * 1024) -> NodeConfig:
    # No periodic snapshot or timer entry: the test decides every entry.
    return NodeConfig(
        data_dir=data_dir,
        ledger_roll_bytes=roll_bytes,
        snapshot_interval_s=3600.0,
        timer_poll_interval_s=3600.0,
    )


async def started(config: NodeConfig) -> Node:
    node = build_node(config)
    await asyncio.wait_for(node.start(), WAIT_S)
    return node


async def open_ledger_info(node: Node) -> tuple[int, LedgerState]:
    ledger_list, _ = await node.ledger_list.get()
    last = ledger_list.ledgers[-1]
    return last.ledger_id, last.state


# -- damage to the last frame ------------------------------------------------------------------

LAST_MARKER = 987654321  # in the params of the last entry; the flip turns it into 987654322


def _chop_half(path: Path, last: Frame, rng: random.Random) -> None:
    os.truncate(path, last.offset + last.size // 2)


def _chop_inside_header(path: Path, last: Frame, rng: random.Random) -> None:
    os.truncate(path, last.offset + rng.randrange(1, FRAME_HEADER.size))


def _flip_params_byte(path: Path, last: Frame, rng: random.Random) -> None:
    # The payload still decodes after this flip; only the CRC tells it is wrong.
    where = last.payload.index(str(LAST_MARKER).encode()) + len(str(LAST_MARKER)) - 1
    _xor_byte(path, last.offset + FRAME_HEADER.size + where, 0x03)  # '1' -> '2'


def _flip_crc_byte(path: Path, last: Frame, rng: random.Random) -> None:
    _xor_byte(path, last.offset + 4 + rng.randrange(4), 1 << rng.randrange(8))


def _xor_byte(path: Path, offset: int, mask: int) -> None:
    with open(path, "r+b") as segment:
        segment.seek(offset)
        (value,) = segment.read(1)
        segment.seek(offset)
        segment.write(bytes([value ^ mask]))


def _append_garbage(path: Path, last: Frame, rng: random.Random) -> None:
    with open(path, "ab") as segment:
        segment.write(rng.randbytes(rng.randrange(1, 300)))


def _append_frame_with_bad_crc(path: Path, last: Frame, rng: random.Random) -> None:
    # A well-formed frame for the next entry id holding a valid entry: only its CRC is off.
    intruder = e.SubmitTasks(
        time_ms=2**40,
        tasks=(e.TaskSpec(id=10**9, type="job.intruder", tenant="acme", params=b"{}"),),
    )
    frame = bytearray(encode_frame(last.entry_id + 1, last.entry_id, e.encode_entry(intruder)))
    struct.pack_into(">I", frame, 4, struct.unpack_from(">I", frame, 4)[0] ^ 0x10)
    with open(path, "ab") as segment:
        segment.write(frame)


@dataclass(frozen=True)
class Damage:
    apply: Callable[[Path, Frame, random.Random], None]
    loses_last_entry: bool


DAMAGES = {
    "chop-last-frame-in-half": Damage(_chop_half, loses_last_entry=True),
    "chop-inside-last-header": Damage(_chop_inside_header, loses_last_entry=True),
    "flip-params-byte-of-last-frame": Damage(_flip_params_byte, loses_last_entry=True),
    "flip-crc-byte-of-last-frame": Damage(_flip_crc_byte, loses_last_entry=True),
    "append-garbage": Damage(_append_garbage, loses_last_entry=False),
    "append-frame-with-bad-crc": Damage(_append_frame_with_bad_crc, loses_last_entry=False),
}


@pytest.mark.parametrize("damage_name", list(DAMAGES))
async def test_boot_cuts_a_damaged_tail_and_keeps_everything_before_it(
    tmp_path: Path, damage_name: str, caplog: pytest.LogCaptureFixture
) -> None:
    damage = DAMAGES[damage_name]
    seed = int(os.environ.get("STEWARD_TEST_SEED", "20240601")) + len(damage_name)
    print(f"seed {seed}")
    rng = random.Random(seed)
    data_dir = tmp_path / "data"
    # Small ledgers: earlier ledgers are closed, recovery must touch only the open one.
    config = node_config(data_dir, roll_bytes=1500)
    recorder = Recorder()

    node = await started(config)
    task_params: dict[int, dict[str, Any]] = {}
    for n in range(60):
        if n % 17 == 5:
            await recorder.propose(
                node,
                lambda stamp: e.SetTenant(
                    time_ms=stamp.now_ms, tenant="acme", limits=e.TenantLimitsPatch(weight=2.0)
                ),
            )
        params = {"n": n, "pad": "x" * rng.randrange(40)}
        task_params[await recorder.submit(node, params)] = params
    # The last entry must stay in the open ledger: a roll it triggers would close it.
    for attempt in range(5):
        last_params = {"n": "last", "attempt": attempt, "marker": LAST_MARKER}
        last_task_id = await recorder.submit(node, last_params)
        task_params[last_task_id] = last_params
        await settle(node)
        open_id, open_state = await open_ledger_info(node)
        if node.position[0] == open_id:
            break
    assert open_state == LedgerState.OPEN and node.position[0] == open_id
    assert open_id > 1, "the scenario should span several ledgers"
    live_position = node.position
    await crash(node)

    path = ledger_path(data_dir, open_id)
    frames = read_frames(path)
    assert frames[-1].entry_id == live_position[1]
    last = frames[-1]
    damage.apply(path, last, rng)

    survivors = recorder.entries[:-1] if damage.loses_last_entry else list(recorder.entries)
    expected_end = (open_id, live_position[1] - 1 if damage.loses_last_entry else live_position[1])
    valid_bytes = last.offset if damage.loses_last_entry else last.offset + last.size

    caplog.set_level(logging.INFO)
    node = await started(config)
    try:
        assert node.position == expected_end
        assert node.state.digest() == reference_digest(survivors)
        expected_tasks = dict(task_params)
        if damage.loses_last_entry:
            del expected_tasks[last_task_id]
        assert {i: t.params for i, t in node.state.tasks.items()} == {
            i: msgspec.json.encode(p) for i, p in expected_tasks.items()
        }
        assert all(t.type == "job.torn" and t.tenant == "acme" for t in node.state.tasks.values())
        # The tail was cut from the file and the ledger closed at the last valid entry.
        assert path.stat().st_size == valid_bytes
        ledger_list, _ = await node.ledger_list.get()
        info = {i.ledger_id: i for i in ledger_list.ledgers}[open_id]
        assert (info.state, info.last_entry_id) == (LedgerState.CLOSED, expected_end[1])
        assert "recovered ledger" in caplog.text
        assert "torn or corrupt tail" in caplog.text

        # The broker keeps working, and the new writes survive another crash.
        for n in range(5):
            params = {"after": n}
            expected_tasks[await recorder.submit(node, params)] = params
        digest_after = node.state.digest()
        position_after = node.position
        if damage.loses_last_entry:
            survivors += recorder.entries[-5:]
        else:
            survivors = list(recorder.entries)
        assert digest_after == reference_digest(survivors)
    finally:
        await crash(node)

    node = await started(config)
    try:
        assert node.position == position_after
        assert node.state.digest() == digest_after
        assert {i: t.params for i, t in node.state.tasks.items()} == {
            i: msgspec.json.encode(p) for i, p in expected_tasks.items()
        }
    finally:
        await node.stop()
        await node.ledgers.close()


# -- the same with a real broker process ------------------------------------------------------


def _submit(http: httpx.Client, params: dict[str, Any]) -> int:
    response = http.post(
        "/api/v1/tasks", json={"type": "job.proc", "tenant": "acme", "params": params}
    )
    assert response.status_code == 201, response.text
    task_id: int = response.json()["id"]
    return task_id


def _ledger_list(data_dir: Path) -> list[dict[str, Any]]:
    ledgers: list[dict[str, Any]] = json.loads((data_dir / "ledgers.list").read_text())[
        "ledger_list"
    ]["ledgers"]
    return ledgers


@pytest.fixture
def broker(tmp_path: Path) -> Iterator[BrokerProcess]:
    """A ``steward standalone`` started on tmp_path / "data", killed at the end."""
    with BrokerProcess(tmp_path / "data", log_path=tmp_path / "broker.log") as broker:
        broker.start()
        yield broker


def _client(broker: BrokerProcess) -> httpx.Client:
    return httpx.Client(base_url=broker.url, timeout=10.0)


def _submit_numbered(http: httpx.Client, count: int) -> dict[int, dict[str, Any]]:
    """``count`` tasks with params {"n": 0}, {"n": 1}, ...: their params by id."""
    return {_submit(http, {"n": n}): {"n": n} for n in range(count)}


def _params_by_id(http: httpx.Client) -> dict[int, Any]:
    return {t["id"]: t["params"] for t in fetch_all_tasks(http)}


@pytest.mark.timeout(120)
def test_killed_broker_with_torn_tail_restarts_without_the_torn_entry(
    broker: BrokerProcess,
) -> None:
    data_dir = broker.data_dir
    with _client(broker) as http:
        ids = _submit_numbered(http, 50)
        before_last = get_digest(http)
        last_id = _submit(http, {"n": "last"})
    broker.kill9()

    open_ledger = _ledger_list(data_dir)[-1]
    assert open_ledger["state"] == "open"
    path = ledger_path(data_dir, open_ledger["ledger_id"])
    last = read_frames(path)[-1]
    os.truncate(path, last.offset + last.size // 2)

    broker.start()
    with _client(broker) as http:
        tasks = _params_by_id(http)
        assert tasks == ids, "every task but the torn one must be there"
        assert last_id not in tasks
        assert get_digest(http) == before_last
        new_ids = {_submit(http, {"after": n}): {"after": n} for n in range(5)}
        final = get_digest(http)
    assert "torn or corrupt tail" in broker.log_text()
    assert broker.terminate() == 0

    broker.start()
    with _client(broker) as http:
        tasks = _params_by_id(http)
        assert tasks == ids | new_ids
        assert get_digest(http) == final


@pytest.mark.timeout(120)
def test_restart_after_sigterm_keeps_everything_and_closes_the_ledger(
    broker: BrokerProcess,
) -> None:
    data_dir = broker.data_dir
    with _client(broker) as http:
        ids = _submit_numbered(http, 120)
        digest = get_digest(http)
    open_before = _ledger_list(data_dir)[-1]
    assert open_before["state"] == "open"

    started = time.monotonic()
    assert broker.terminate() == 0
    print(f"clean shutdown took {time.monotonic() - started:.2f} s")
    ledgers = _ledger_list(data_dir)
    assert [i["state"] for i in ledgers] == ["closed"] * len(ledgers)
    (closed,) = [i for i in ledgers if i["ledger_id"] == open_before["ledger_id"]]
    assert closed["last_entry_id"] == digest["position"]["entry_id"]
    # The shutdown snapshot is at the final position.
    position = digest["position"]
    assert (
        data_dir / "snapshots" / f"snapshot-{position['ledger_id']:012d}-"
        f"{position['entry_id']:012d}.snap"
    ).exists()

    log_before = len(broker.log_text())
    broker.start()
    boot_log = broker.log_text()[log_before:]
    # A clean shutdown leaves nothing to recover.
    assert f"recovered ledger {open_before['ledger_id']}:" not in boot_log
    assert f"loaded snapshot at position ({position['ledger_id']}" in boot_log
    with _client(broker) as http:
        tasks = _params_by_id(http)
        assert tasks == ids
        assert get_digest(http) == digest
        extra = _submit(http, {"n": "after restart"})
    ledgers = _ledger_list(data_dir)
    assert [i["state"] for i in ledgers] == ["closed"] * (len(ledgers) - 1) + ["open"]
    assert broker.terminate() == 0

    broker.start()
    with _client(broker) as http:
        tasks = _params_by_id(http)
        assert tasks == ids | {extra: {"n": "after restart"}}
    assert broker.terminate() == 0
    ledgers = _ledger_list(data_dir)
    assert [i["state"] for i in ledgers] == ["closed"] * len(ledgers)
