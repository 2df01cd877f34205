"""The served task types (docs/DESIGN.md §6, "Served task types"): the replicated record of
the task type names workers listed, by the tenants they serve, read at submit."""

from __future__ import annotations

import pytest

from broker.core import StateMachine, WorkerState, served_types
from broker.core import entries as e
from broker.core.snapshot_body import body_version, decode_snapshot_body
from broker.core.validation import unknown_type_problem
from tests.support.link_broker import Broker
from tests.support.machine import Machine
from wire import worker_protocol as p

BUILTINS = ("fail", "noop", "sleep", "spark.sql")


def _register(
    m: Machine,
    worker_id: str,
    task_names: tuple[str, ...] | None,
    tenants: tuple[str, ...] = (),
) -> None:
    entry = e.RegisterWorker(
        time_ms=m.at(1),
        worker_id=worker_id,
        task_types={"*": 2},
        tenants=tenants,
        task_names=task_names,
        v=e.register_version(False, task_names),
    )
    m.apply(entry)


def test_nothing_listed_yet_tells_nothing_then_listed_names_are_served() -> None:
    m = Machine()
    assert m.m.type_served("acme", "sleeep") is None  # no worker ever: the cluster knows nothing
    _register(m, "w1", (*BUILTINS, "etl.load"))
    assert m.m.type_served("acme", "etl.load") is True
    assert m.m.type_served("anyone", "noop") is True
    assert m.m.type_served("acme", "sleeep") is False
    # Ever served: the worker's death does not forget its types.
    m.apply(e.WorkerDead(time_ms=m.at(1), worker_id="w1"))
    assert m.m.type_served("acme", "etl.load") is True
    assert m.m.workers["w1"].lists_task_names


def test_a_dedicated_workers_types_are_served_to_its_tenants_only() -> None:
    m = Machine()
    _register(m, "shared", BUILTINS)
    _register(m, "alice-w", (*BUILTINS, "alice.report"), tenants=("alice",))
    assert m.m.type_served("alice", "alice.report") is True
    assert m.m.type_served("bob", "alice.report") is False
    assert m.m.type_served("bob", "noop") is True  # the shared worker's
    # The refusal reads the same as for a name nobody serves: nothing of alice's leaks.
    theirs = unknown_type_problem("alice.report", None, "bob", False)
    nobodys = unknown_type_problem("nobody.x", None, "bob", False)
    assert theirs is not None and nobodys is not None
    assert theirs.replace("alice.report", "T") == nobodys.replace("nobody.x", "T")
    assert "start a worker that registers it" in theirs and "allow_unknown_type" in theirs


def test_a_live_worker_that_lists_nothing_leaves_its_tenants_unchecked() -> None:
    m = Machine()
    _register(m, "new", BUILTINS, tenants=("alice",))
    _register(m, "old", None, tenants=("bob",))  # an older worker: no task_names
    assert not m.m.workers["old"].lists_task_names
    assert m.m.type_served("bob", "etl.load") is None
    assert m.m.type_served("alice", "etl.load") is False
    m.apply(e.WorkerDead(time_ms=m.at(1), worker_id="old"))
    assert m.m.workers["old"].state == WorkerState.DEAD
    assert m.m.type_served("bob", "etl.load") is False


def test_module_function_without_code_stays_refused_unless_a_worker_listed_it() -> None:
    assert unknown_type_problem("jobs:run", None, "acme", None) is not None
    assert unknown_type_problem("jobs:run", "ab" * 32, "acme", False) is None
    assert unknown_type_problem("jobs:run", None, "acme", True) is None
    assert unknown_type_problem("sleeep", None, "acme", None) is None
    assert unknown_type_problem("sleeep", None, "acme", False) is not None


def test_the_caps_bound_the_record_and_a_full_tenant_is_no_longer_checked(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(served_types, "MAX_TASK_NAMES_PER_WORKER", 3)
    monkeypatch.setattr(served_types, "MAX_SERVED_TYPE_NAMES", 5)
    m = Machine()
    _register(m, "w1", ("a", "b", "c", "d", "bad name"))  # past the per-worker cap: d
    assert m.m.served_types == {"": dict.fromkeys(("a", "b", "c"))}
    assert m.m.type_served("t", "d") is False
    _register(m, "w2", ("x", "y", "z"), tenants=("t",))  # only x and y fit the total
    assert m.m.served_types["t"] == dict.fromkeys(("x", "y"))
    assert m.m.served_types_full == {"t"}
    assert m.m.type_served("t", "z") is None  # a type served past the cap is not refused
    assert m.m.type_served("u", "z") is False  # another tenant's record is not full
    assert sum(len(names) for names in m.m.served_types.values()) == 5


def test_the_record_survives_a_snapshot_in_body_version_4() -> None:
    m = Machine()
    _register(m, "w1", BUILTINS)
    _register(m, "w2", ("alice.report",), tenants=("alice", "carol"))
    _register(m, "w3", None)
    body = m.m.snapshot_body()
    assert body_version(body) == 4
    assert body.served_types == {
        "": list(BUILTINS),
        "alice": ["alice.report"],
        "carol": ["alice.report"],
    }
    loaded = StateMachine.from_snapshot(m.m.encode_snapshot())
    assert loaded.digest() == m.m.digest()
    assert loaded.served_types == m.m.served_types
    assert [w.lists_task_names for w in loaded.workers.values()] == [True, True, False]
    assert loaded.type_served("carol", "alice.report") is True
    assert decode_snapshot_body(m.m.encode_snapshot()).served_types == body.served_types


def test_a_registration_listing_types_is_written_as_format_5_and_the_caps_agree() -> None:
    assert e.register_version(False, None) == e.BASE_ENTRY_FORMAT_VERSION
    assert e.register_version(False, ("noop",)) == e.SERVED_TYPES_VERSION == 5
    assert e.register_version(True, None) == e.LOST_ATTEMPTS_VERSION
    assert p.MAX_HELLO_TASK_NAMES == served_types.MAX_TASK_NAMES_PER_WORKER
    # A Hello without the field decodes as an older worker's: nothing listed.
    hello = p.Hello(worker_id="w", task_types={"*": 1})
    assert p.encode_message(hello, p.DEFAULT_MAX_FRAME_BYTES).find(b"task_names") == -1


async def test_the_leader_logs_a_hellos_names_and_refuses_a_list_over_the_cap(
    broker: Broker,
) -> None:
    listing = broker.worker("lists", task_types={"*": 1})
    await listing.connect()
    listing.send(
        p.Hello(worker_id="lists", task_types={"*": 1}, task_names=("etl.load", "not valid!"))
    )
    await listing.expect(p.Welcome)
    (entry,) = broker.entries(e.RegisterWorker)
    assert entry.task_names == ("etl.load",) and entry.v == e.SERVED_TYPES_VERSION
    assert broker.node.state.type_served("acme", "etl.load") is True
    assert broker.node.state.type_served("acme", "etl.lod") is False

    greedy = broker.worker("greedy", task_types={"*": 1})
    await greedy.connect()
    names = tuple(f"t{n}" for n in range(p.MAX_HELLO_TASK_NAMES + 1))
    greedy.send(p.Hello(worker_id="greedy", task_types={"*": 1}, task_names=names))
    error = await greedy.expect(p.Error)
    assert error.code == "bad_handshake" and "over the limit of 1000" in error.message
    await greedy.wait_closed_by_peer()
    assert "greedy" not in broker.node.state.workers
