"""A Steward leader in a process of its own, for a test to pause (SIGSTOP) while another
node takes over (tests/integration/test_ledger_real_pulsar.py, the engine-fencing test).

The process runs one cluster-mode :class:`~broker.replication.node.Node` on the pulsar ledger
backend, ledger ids and list in ZooKeeper
(:class:`~tests.support.ledger_backends.PulsarZooKeeperBackend`), built by
``cluster_node(..., zookeeper_confirmation=False)``: the TEST-ONLY switch that takes
Steward's own ZooKeeper confirmation out of the way (its elector view always says "leader"
and it never confirms a batch in ZooKeeper), so only the ledger engine can stop it.

Commands, one per line on stdin; each gets one JSON line on stdout:

- ``lead``: boot, recover the log, open a ledger -> ``{"ledger_id": N}``
- ``propose TAG COUNT``: COUNT writes at once, the i-th a task whose params are the JSON string
  ``TAG-i`` -> ``{"acknowledged": [TAG-i, ...], "refused": [{"tag", "error", "retryable"},
  ...], "deposed": REASON or null}`` (``retryable``: a ``BrokerUnavailableError``)
- ``exit`` (or end of input): step down, close, exit 0.

It prints ``{"ready": true}`` once started. :class:`LeaderProcess` drives it from a test:
every read of an answer is bounded, and the process is killed on every exit path.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

import msgspec

from broker.core import entries as e
from broker.replication.node import BrokerUnavailableError, Node, Stamp
from log.pulsar import PulsarConfig

ROOT = Path(__file__).resolve().parents[2]
#: Bound of every answer: a start, a take-over of the log, a batch of writes.
ANSWER_TIMEOUT_S = 60.0
PAUSE_TIMEOUT_S = 10.0


def tagged_task(tag: str) -> Callable[[Stamp], e.Entry]:
    """A write whose task carries ``tag`` as its params (a JSON string)."""

    def build(stamp: Stamp) -> e.Entry:
        [task_id] = stamp.task_ids(1)
        spec = e.TaskSpec(id=task_id, type="noop", tenant="t", params=msgspec.json.encode(tag))
        return e.SubmitTasks(time_ms=stamp.now_ms, tasks=(spec,))

    return build


def task_tags(node: Node) -> set[str]:
    return {msgspec.json.decode(bytes(task.params)) for task in node.state.tasks.values()}


async def lead(node: Node) -> None:
    await node.boot()
    await node.recover_log()
    await node.open_for_writes()


class LeaderProcess:
    """Drives ``python -m tests.support.leader_process`` (see the module docstring)."""

    def __init__(self, process: asyncio.subprocess.Process, log: IO[bytes]) -> None:
        self._process = process
        self._log = log
        self.paused = False

    @classmethod
    async def start(
        cls, config: PulsarConfig, zookeeper_connect: str, directory: Path
    ) -> LeaderProcess:
        log = _open_log(directory)
        spec = {
            "config": dataclasses.asdict(config),
            "zookeeper": zookeeper_connect,
            "directory": str(directory),
        }
        process = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "tests.support.leader_process",
            json.dumps(spec),
            cwd=ROOT,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=log,
        )
        leader = cls(process, log)
        try:
            assert await leader.answer() == {"ready": True}
        except BaseException:
            await leader.kill()
            raise
        return leader

    @property
    def pid(self) -> int:
        return self._process.pid

    def send(self, command: str) -> None:
        """Write a command (into the pipe: a paused process reads it once resumed)."""
        assert self._process.stdin is not None
        self._process.stdin.write(command.encode() + b"\n")

    async def answer(self) -> Any:
        assert self._process.stdout is not None
        line = await asyncio.wait_for(self._process.stdout.readline(), ANSWER_TIMEOUT_S)
        if not line:
            raise AssertionError(f"the leader process ended (exit {self._process.returncode})")
        return json.loads(line)

    async def ask(self, command: str) -> Any:
        self.send(command)
        return await self.answer()

    def pause(self) -> None:
        """SIGSTOP, and wait (bounded) until the kernel shows the process stopped."""
        os.kill(self.pid, signal.SIGSTOP)
        self.paused = True
        deadline = time.monotonic() + PAUSE_TIMEOUT_S
        while _state(self.pid) != "T":
            assert time.monotonic() < deadline, f"pid {self.pid} not stopped"
            time.sleep(0.01)

    def resume(self) -> None:
        os.kill(self.pid, signal.SIGCONT)
        self.paused = False

    async def kill(self) -> None:
        """SIGKILL (works on a stopped process too) and reap it, bounded."""
        with contextlib.suppress(ProcessLookupError):
            self._process.kill()
        try:
            await asyncio.wait_for(self._process.wait(), PAUSE_TIMEOUT_S)
        finally:
            self._log.close()


def _open_log(directory: Path) -> IO[bytes]:
    """The process's stderr (its log), ``leader.log`` in ``directory``."""
    directory.mkdir(parents=True, exist_ok=True)
    return (directory / "leader.log").open("wb")


def _state(pid: int) -> str:
    stat = Path(f"/proc/{pid}/stat").read_text()
    return stat.rsplit(")", 1)[1].split()[0]


# -- the process ---------------------------------------------------------------------------------


def _say(answer: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(answer) + "\n")
    sys.stdout.flush()


async def _propose(node: Node, tag: str, count: int) -> dict[str, Any]:
    tags = [f"{tag}-{i}" for i in range(count)]
    results = await asyncio.gather(
        *(node.propose(tagged_task(t)) for t in tags), return_exceptions=True
    )
    acknowledged: list[str] = []
    refused: list[dict[str, Any]] = []
    for t, result in zip(tags, results, strict=True):
        if isinstance(result, BaseException):
            retryable = isinstance(result, BrokerUnavailableError)
            refused.append({"tag": t, "error": repr(result), "retryable": retryable})
        else:
            acknowledged.append(t)
    return {"acknowledged": acknowledged, "refused": refused, "deposed": node.deposed_reason}


async def _serve(spec: dict[str, Any]) -> None:
    from tests.support.ledger_backends import PulsarZooKeeperBackend, cluster_node

    config = PulsarConfig(**spec["config"])
    directory = Path(spec["directory"])
    backend = PulsarZooKeeperBackend(directory, config, spec["zookeeper"])
    node = cluster_node(backend, directory, "old", config.cluster, zookeeper_confirmation=False)
    _say({"ready": True})
    try:
        while True:
            line = (await asyncio.to_thread(sys.stdin.readline)).split()
            if not line or line[0] == "exit":
                return
            if line[0] == "lead":
                await lead(node)
                listed, _ = await backend.new_list_store().get()
                _say({"ledger_id": listed.ledgers[-1].ledger_id})
            elif line[0] == "propose":
                _say(await _propose(node, line[1], int(line[2])))
            else:
                _say({"error": f"unknown command {line[0]!r}"})
    finally:
        await node.step_down("leader process exits")
        await backend.close()


if __name__ == "__main__":
    asyncio.run(_serve(json.loads(sys.argv[1])))
