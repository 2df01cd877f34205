"""A deposed leader's tests (docs/DESIGN.md §4), written once for every backend.

A test module takes them with ``globals().update(take_over_tests(...))`` beside fixtures of
its own: ``backend`` (any :class:`~tests.support.ledger_backends.LedgerBackend`) and, for the
test of a leader that confirms each batch in ZooKeeper, ``unfenced_backend``.
tests/integration/test_deposed_leader.py runs them over BACKENDS;
tests/integration/test_ledger_real_pulsar.py over real Apache Pulsar.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

import msgspec
import pytest

from broker.core import entries as e
from broker.replication.node import BrokerUnavailableError, Node, Stamp
from tests.support.ledger_backends import LedgerBackend, cluster_node

WAIT_S = 30.0


def make_node(backend: LedgerBackend, tmp_path: Path, name: str) -> Node:
    return cluster_node(backend, tmp_path, name, "deposed")  # a stale view: it always leads


def submit(tag: str) -> Callable[[Stamp], e.Entry]:
    def build(stamp: Stamp) -> e.Entry:
        [task_id] = stamp.task_ids(1)
        spec = e.TaskSpec(id=task_id, type="noop", tenant="t", params=msgspec.json.encode(tag))
        return e.SubmitTasks(time_ms=stamp.now_ms, tasks=(spec,))

    return build


async def lead(node: Node) -> None:
    await node.boot()
    await node.recover_log()
    await node.open_for_writes()


async def test_deposed_leader_never_gets_a_write_acknowledged(
    backend: LedgerBackend, tmp_path: Path
) -> None:
    old = make_node(backend, tmp_path, "old")
    new = make_node(backend, tmp_path, "new")
    follower = make_node(backend, tmp_path, "follower")
    try:
        async with asyncio.timeout(WAIT_S):
            await lead(old)
            acknowledged = [await old.propose(submit(f"before-{i}")) for i in range(20)]
            assert len(acknowledged) == 20

            await lead(new)  # takes over while `old` still believes it leads
            late = await asyncio.gather(
                *(old.propose(submit(f"late-{i}")) for i in range(20)), return_exceptions=True
            )
            assert all(isinstance(r, BrokerUnavailableError) for r in late), late
            assert old.deposed_reason is not None
            # The new leader takes writes, and has every acknowledged one.
            await new.propose(submit("after"))
            params = {bytes(t.params) for t in new.state.tasks.values()}
            assert {msgspec.json.encode(f"before-{i}") for i in range(20)} <= params
            assert not any(p.startswith(b'"late-') for p in params), params

            await follower.boot()
            following = asyncio.create_task(follower.follow())
            try:
                for _ in range(int(WAIT_S / 0.05)):
                    if follower.state.digest() == new.state.digest():
                        break
                    await asyncio.sleep(0.05)
                else:
                    raise AssertionError("the follower never reached the new leader's digest")
            finally:
                following.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await following
        print(f"{type(backend).__name__}: old leader refused: {old.deposed_reason}")
    finally:
        for node in (old, new, follower):
            await node.step_down("test over")
        await backend.close()


async def test_a_confirmation_answered_before_a_take_over_acknowledges_only_what_it_holds(
    unfenced_backend: LedgerBackend, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The CI run of test_sigstop_leader that froze the leader after ZooKeeper had answered
    # its leadership check but before it acted on the answer: on resuming it acknowledged
    # that batch, which is right only because the batch was durable before the check, so
    # the new leader's recovery holds it. Here the answer is held back by hand across a
    # whole take-over.
    backend = unfenced_backend
    old = make_node(backend, tmp_path, "old")
    new = make_node(backend, tmp_path, "new")
    assert not old.ledgers.can_fence  # (a fencing backend's leader confirms nothing per batch)
    answered, release = asyncio.Event(), asyncio.Event()
    try:
        async with asyncio.timeout(WAIT_S):
            await lead(old)
            await old.propose(submit("before"))
            check = old.ledger_list.confirmed_version

            async def answered_then_frozen() -> int:
                version = await check()
                answered.set()
                await release.wait()
                return version

            monkeypatch.setattr(old.ledger_list, "confirmed_version", answered_then_frozen)
            in_flight = asyncio.create_task(old.propose(submit("in-flight")))
            await answered.wait()
            await lead(new)  # the take-over happens while `old` holds a stale "you lead"
            release.set()
            await in_flight  # acknowledged on the pre-take-over confirmation...
            params = {bytes(t.params) for t in new.state.tasks.values()}
            assert msgspec.json.encode("in-flight") in params, params  # ...which was true
            late = await asyncio.gather(old.propose(submit("late")), return_exceptions=True)
            assert isinstance(late[0], BrokerUnavailableError), late
            await new.propose(submit("after"))
            params = {bytes(t.params) for t in new.state.tasks.values()}
            assert msgspec.json.encode("late") not in params, params
    finally:
        release.set()
        for node in (old, new):
            await node.step_down("test over")
        await backend.close()


async def test_writes_racing_a_take_over_are_acknowledged_only_if_the_new_leader_has_them(
    backend: LedgerBackend, tmp_path: Path
) -> None:
    # Proposals keep flowing into the old leader while the new one fences and recovers its
    # ledger: each is either acknowledged and in the new leader's history (durable before
    # the fence, or confirmed before the take-over), or refused. On a fencing backend this
    # rests on the fence alone: no ZooKeeper round trip confirms those batches.
    old = make_node(backend, tmp_path, "old")
    new = make_node(backend, tmp_path, "new")
    try:
        async with asyncio.timeout(WAIT_S):
            await lead(old)
            await old.propose(submit("first"))
            stop = asyncio.Event()
            outcomes: dict[str, bool] = {}

            async def writer(lane: int) -> None:
                for i in range(10_000):
                    if stop.is_set():
                        return
                    tag = f"race-{lane}-{i}"
                    try:
                        await old.propose(submit(tag))
                    except BrokerUnavailableError:
                        outcomes[tag] = False
                        return
                    outcomes[tag] = True

            writers = [asyncio.create_task(writer(lane)) for lane in range(8)]
            await asyncio.sleep(0.05)
            await lead(new)
            stop.set()
            await asyncio.gather(*writers)
            await new.propose(submit("after"))
            params = {bytes(t.params) for t in new.state.tasks.values()}
            acknowledged = [tag for tag, ok in outcomes.items() if ok]
            missing = [t for t in acknowledged if msgspec.json.encode(t) not in params]
            assert acknowledged and not missing, missing
            late = await asyncio.gather(old.propose(submit("late")), return_exceptions=True)
            assert isinstance(late[0], BrokerUnavailableError), late
    finally:
        for node in (old, new):
            await node.step_down("test over")
        await backend.close()


async def test_a_fencing_backend_leader_asks_zookeeper_nothing_per_batch(
    backend: LedgerBackend, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The fence makes the per-batch check redundant there (docs/DESIGN.md §4); without a
    # fence (pulsar-lite) every acknowledged batch waits for one.
    node = make_node(backend, tmp_path, "leader")
    checks = 0
    confirmed_version = node.ledger_list.confirmed_version

    async def counted() -> int:
        nonlocal checks
        checks += 1
        return await confirmed_version()

    monkeypatch.setattr(node.ledger_list, "confirmed_version", counted)
    try:
        async with asyncio.timeout(WAIT_S):
            await lead(node)
            for i in range(5):
                await node.propose(submit(f"write-{i}"))
        if node.ledgers.can_fence:
            assert checks == 0
        else:
            assert checks >= 5
    finally:
        await node.step_down("test over")
        await backend.close()


def take_over_tests(*names: str) -> dict[str, object]:
    """The tests named (every one when none is), for a test module's namespace."""
    return {
        name: value
        for name, value in globals().items()
        if name.startswith("test_") and (not names or name in names)
    }
