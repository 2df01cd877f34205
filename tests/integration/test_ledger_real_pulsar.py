"""The ledger contract and a deposed leader's fencing on real Apache Pulsar (issue 31, items 2
and 3; docs/DESIGN.md §3, §4; docs/TESTING.md, "Real Apache Pulsar").

One Pulsar standalone for the module (clients/dev/pulsar_standalone.py: a JVM, started
by the first test that needs it, its process group killed when the module ends, whatever
happened). Every wait is bounded.

- The contract: every test of tests/support/ledger_contract.py (imported, not copied) runs
  here with this module's ``backend``: :class:`~tests.support.ledger_backends.ApachePulsarBackend`,
  ``PulsarConfig.for_apache_pulsar`` (ExclusiveWithFencing, its measured defaults).
  pulsar-lite keeps its own run of the contract there (in-process beside a cheap server).
- A deposed leader on real Pulsar: the take-over tests of
  tests/support/deposed_leader.py (imported) run on this backend too, and the
  broker's start-up check (``verify_fencing``) finds fencing enforced.
- The engine alone fences a paused leader: a leader node in a process of its own
  (tests/support/leader_process.py; ledger ids and list in the suite's ZooKeeper) leads and
  writes, is paused with SIGSTOP while a node of the test takes over (fences and recovers
  its ledger, opens its own), then gets writes again and SIGCONT. Steward's own ZooKeeper
  confirmation is out of the way on both (``cluster_node(..., zookeeper_confirmation=False)``,
  a test-only switch, and an elector view that always says "leader"), so only the engine
  guards: on real Pulsar every late append fails with ``ProducerFenced`` and none is
  acknowledged nor stored; on pulsar-lite (no access modes) the same steps get every late
  write acknowledged and stored in the old ledger's topic. In both, Steward's readers stop
  at the recovered end (the SEAL) and a follower ends with the new leader's digest.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pulsar  # type: ignore[import-untyped]
import pytest

from broker.replication.node import Node
from clients.dev.pulsar_standalone import PulsarStandalone
from clients.dev.zk import ZooKeeperServer
from log.pulsar import PulsarLedgerStore
from tests.support.deposed_leader import take_over_tests
from tests.support.leader_process import LeaderProcess, lead, tagged_task, task_tags
from tests.support.ledger_backends import (
    ApachePulsarBackend,
    LedgerBackend,
    PulsarZooKeeperBackend,
    apache_pulsar_config,
    cluster_node,
    pulsar_lite_config,
)
from tests.support.ledger_contract import contract_tests
from tests.support.pulsar_fixture import started_standalone

# The first test's set-up starts the standalone (bounded by FIRST_START_TIMEOUT_S, 180 s).
pytestmark = pytest.mark.timeout(300)

WAIT_S = 30.0
TAKE_OVER_TIMEOUT_S = 120.0
READ_TIMEOUT_MS = 10_000
WRITES = 20


@pytest.fixture(scope="module")
def pulsar_standalone(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PulsarStandalone]:
    yield from started_standalone(tmp_path_factory)


@pytest.fixture
async def backend(
    pulsar_standalone: PulsarStandalone, tmp_path: Path
) -> AsyncIterator[LedgerBackend]:
    """The contract's and the take-over tests' backend here: real Apache Pulsar."""
    backend = ApachePulsarBackend(tmp_path, pulsar_standalone=pulsar_standalone)
    yield backend
    await backend.close()  # idempotent: the take-over tests close it themselves too


# The contract's tests and its ``store`` fixture (which takes ``backend``, the one above).
globals().update(contract_tests())
# The take-over tests that take ``backend`` (its unfenced_backend one is pulsar-lite's).
globals().update(
    take_over_tests(
        "test_deposed_leader_never_gets_a_write_acknowledged",
        "test_writes_racing_a_take_over_are_acknowledged_only_if_the_new_leader_has_them",
        "test_a_fencing_backend_leader_asks_zookeeper_nothing_per_batch",
    )
)


async def test_the_broker_start_check_finds_fencing_enforced(backend: LedgerBackend) -> None:
    # What a broker with --pulsar-flavor pulsar checks at start (on pulsar-lite it refuses
    # to start: tests/integration/test_ledger_pulsar.py).
    store = backend.new_store()
    assert isinstance(store, PulsarLedgerStore) and store.can_fence
    assert await store.verify_fencing("test") is True


async def test_brokers_starting_at_once_all_find_fencing_enforced(backend: LedgerBackend) -> None:
    # The brokers of a cluster start at once (`steward cluster up`): each checks on a topic
    # of its own. Checks sharing one topic fence each other's producers, and a check whose
    # fenced producer's send went through read "not enforced" (a broker refused to start;
    # on a shared topic 1 round in 10 here).
    stores = [backend.new_store() for _ in range(3)]
    for _round in range(10):
        found = await asyncio.gather(
            *(store.verify_fencing(f"broker-{i}") for i, store in enumerate(stores))
        )
        assert found == [True, True, True]


# -- the engine alone fences a paused leader ----------------------------------------------------


def stored_messages(service_url: str, topic: str) -> list[bytes]:
    """Every message the engine stored in ``topic``, read with the plain client (not
    Steward's reader, which stops at the SEAL): bounded, it stops at the end."""
    client = pulsar.Client(service_url, operation_timeout_seconds=30)
    try:
        reader = client.create_reader(topic, pulsar.MessageId.earliest, receiver_queue_size=1)
        messages: list[bytes] = []
        while reader.has_message_available():
            messages.append(reader.read_next(timeout_millis=READ_TIMEOUT_MS).data())
        reader.close()
        return messages
    finally:
        client.close()


async def wait_for_digest(follower: Node, digest: str) -> None:
    following = asyncio.create_task(follower.follow())
    try:
        for _ in range(int(WAIT_S / 0.05)):
            if follower.state.digest() == digest:
                return
            await asyncio.sleep(0.05)
        raise AssertionError("the follower never reached the new leader's digest")
    finally:
        following.cancel()
        with pytest.raises(asyncio.CancelledError):
            await following


@pytest.mark.parametrize("engine", ["apache-pulsar", "pulsar-lite"])
async def test_only_the_engine_fences_a_paused_leader_without_zookeeper_confirmation(
    engine: str, request: pytest.FixtureRequest, zookeeper: ZooKeeperServer, tmp_path: Path
) -> None:
    cluster = f"t{uuid.uuid4().hex[:12]}"
    if engine == "apache-pulsar":
        config = apache_pulsar_config(request.getfixturevalue("pulsar_standalone"), cluster)
    else:
        config = pulsar_lite_config(request.getfixturevalue("pulsar_lite"), cluster)
    backend = PulsarZooKeeperBackend(tmp_path, config, zookeeper.connect_string)
    # The test-only switch, on both leaders: nothing of Steward's checks that they lead.
    new = cluster_node(backend, tmp_path, "new", cluster, zookeeper_confirmation=False)
    follower = cluster_node(backend, tmp_path, "follower", cluster)
    old = await LeaderProcess.start(config, zookeeper.connect_string, tmp_path / "old")
    try:
        async with asyncio.timeout(TAKE_OVER_TIMEOUT_S):
            old_ledger = (await old.ask("lead"))["ledger_id"]
            before = await old.ask(f"propose before {WRITES}")
            assert len(before["acknowledged"]) == WRITES, before

            old.pause()  # SIGSTOP: the new leader fences and recovers its ledger meanwhile
            await lead(new)
            old.send(f"propose late {WRITES}")  # waits in the pipe until SIGCONT
            old.resume()
            late = await old.answer()

            await new.propose(tagged_task("after"))
            tags = task_tags(new)
            assert {f"before-{i}" for i in range(WRITES)} | {"after"} <= tags
            assert not any(tag.startswith("late-") for tag in tags), tags
            stored = await asyncio.to_thread(
                stored_messages, config.service_url, config.topic(old_ledger)
            )
            stored_late = [message for message in stored if b"late-" in message]

            if engine == "apache-pulsar":
                # The engine refused every late append (ProducerFenced): none acknowledged,
                # none stored, the old leader deposed by its fenced append.
                assert late["acknowledged"] == [], late
                assert len(late["refused"]) == WRITES and all(
                    refusal["retryable"] for refusal in late["refused"]
                ), late
                assert "producer was fenced" in (late["deposed"] or ""), late
                assert stored_late == []
            else:
                # pulsar-lite fences nothing: with Steward's ZooKeeper confirmation switched
                # off, every late write is acknowledged to its caller and stored (after the
                # SEAL, so no reader of Steward's returns it).
                assert late["acknowledged"] == [f"late-{i}" for i in range(WRITES)], late
                assert late["refused"] == [] and late["deposed"] is None, late
                assert len(stored_late) >= 1

            # Steward's readers agree on the history the new leader recovered.
            await follower.boot()
            await wait_for_digest(follower, new.state.digest())
            assert not any(tag.startswith("late-") for tag in task_tags(follower))
    finally:
        await old.kill()
        for node in (new, follower):
            await node.step_down("test over")
        await backend.close()
