"""Format versions (docs/OPERATIONS.md, "Rolling upgrade"): this code reads the log entries and
snapshots earlier code wrote (checked-in files of tests/data/formats, written by
tests/support/format_samples.py) and refuses newer ones with a message naming the version."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Union

import msgspec
import pytest

from broker.core import StateMachine
from broker.core import entries as e
from broker.core.snapshot_body import (
    SNAPSHOT_BODY_VERSION,
    SnapshotBodyVersionError,
    decode_snapshot_body,
)
from broker.replication.applier import Applier
from broker.replication.common import NewerFormatError
from broker.replication.context import RoleContext
from broker.replication.snapshots import Snapshots
from snapshot.format import (
    FORMAT_VERSION,
    NewerSnapshotVersionError,
    read_snapshot,
    snapshot_file_name,
    write_snapshot,
)
from snapshot.store import SnapshotStore
from tests.support.format_samples import CLUSTER, bump_file_version, observable, sample_entries

FORMATS = Path(__file__).resolve().parents[1] / "data" / "formats"
SAMPLES = sorted(p for p in FORMATS.iterdir() if p.is_dir())


def test_there_are_samples_of_todays_versions() -> None:
    expected = [json.loads((p / "expected.json").read_text()) for p in SAMPLES]
    # A new version needs a new sample directory (the generator's docstring says how).
    assert any(x["entry_format_version"] == e.ENTRY_FORMAT_VERSION for x in expected)
    assert any(x["snapshot_format_version"] == FORMAT_VERSION for x in expected)
    assert any(x["snapshot_body_version"] == SNAPSHOT_BODY_VERSION for x in expected)


def _seen(machine: StateMachine, expected: dict[str, Any]) -> dict[str, object]:
    """What a user sees of ``machine``, of the kinds the sample recorded (a later sample
    may record more kinds, as the state grows)."""
    seen = observable(machine)
    return {kind: seen[kind] for kind in expected["observable"]}


def _apply_sample_entries(sample: Path) -> StateMachine:
    raw = msgspec.msgpack.decode((sample / "entries.msgpack").read_bytes(), type=list[bytes])
    machine = StateMachine()
    for index, data in enumerate(raw):
        machine.position = (1, index)  # where the generator logged it (format_samples.py)
        machine.apply(e.decode_entry(data))
    machine.check_invariants()
    return machine


@pytest.mark.parametrize("sample", SAMPLES, ids=lambda p: p.name)
def test_entries_written_by_earlier_code_apply_to_the_same_state(sample: Path) -> None:
    expected = json.loads((sample / "expected.json").read_text())
    machine = _apply_sample_entries(sample)
    assert machine.entries_applied == expected["entries"]
    assert _seen(machine, expected) == expected["observable"]


@pytest.mark.parametrize("sample", SAMPLES, ids=lambda p: p.name)
def test_snapshots_written_by_earlier_code_load_to_the_same_state(sample: Path) -> None:
    expected = json.loads((sample / "expected.json").read_text())
    header, body = read_snapshot(sample / "state.snap")
    assert header.format_version == expected["snapshot_format_version"]
    assert header.cluster_id == CLUSTER
    machine = StateMachine.from_snapshot(body)
    machine.check_invariants()
    # Whatever the versions, today's code gets one state from the old entries and from the
    # old snapshot of them.
    assert machine.digest() == _apply_sample_entries(sample).digest()
    assert _seen(machine, expected) == expected["observable"]


def test_the_generator_still_covers_every_entry_type() -> None:
    # A new entry type joins the samples (and a new sample directory is written for it).
    written = {type(entry) for entry in sample_entries()}
    assert written == set(e.Entry.__args__)  # type: ignore[attr-defined]


def test_a_newer_entry_version_is_refused_naming_it() -> None:
    data = e.encode_entry(e.Tick(time_ms=1, v=e.ENTRY_FORMAT_VERSION + 1))
    newer, ours = e.ENTRY_FORMAT_VERSION + 1, e.ENTRY_FORMAT_VERSION
    with pytest.raises(
        e.NewerEntryFormatError, match=f"version {newer} is newer than this broker's {ours}"
    ):
        e.decode_record(data)


def test_an_unknown_entry_type_of_a_newer_version_is_a_version_problem() -> None:
    newer = e.ENTRY_FORMAT_VERSION + 1
    data = msgspec.msgpack.encode({"type": "from_the_future", "time_ms": 1, "v": newer})
    with pytest.raises(e.NewerEntryFormatError, match="upgrade the broker") as info:
        e.decode_record(data)
    assert info.value.version == newer
    # Of a version this code knows, the same bytes are garbage, not a version problem.
    old = msgspec.msgpack.encode(
        {"type": "from_the_future", "time_ms": 1, "v": e.ENTRY_FORMAT_VERSION}
    )
    with pytest.raises(e.EntryDecodeError, match="undecodable") as plain:
        e.decode_record(old)
    assert not isinstance(plain.value, e.NewerEntryFormatError)


def _newer_body() -> bytes:
    body = msgspec.msgpack.decode(StateMachine().encode_snapshot())
    body["format_version"] = SNAPSHOT_BODY_VERSION + 1
    body["tasks"] = {"a new layout": True}  # does not decode as today's body either
    return msgspec.msgpack.encode(body)


def test_a_newer_snapshot_body_is_refused_naming_its_version() -> None:
    newer = SNAPSHOT_BODY_VERSION + 1
    with pytest.raises(SnapshotBodyVersionError, match=f"version {newer} is newer") as info:
        decode_snapshot_body(_newer_body())
    assert info.value.newer


def _write(directory: Path, body: bytes, position: tuple[int, int] = (1, 5)) -> Path:
    info = write_snapshot(
        directory,
        cluster_id=CLUSTER,
        ledger_id=position[0],
        entry_id=position[1],
        digest="0" * 64,
        body=body,
    )
    return info.path


def test_a_newer_snapshot_file_is_refused_naming_its_version(tmp_path: Path) -> None:
    path = _write(tmp_path, StateMachine().encode_snapshot())
    bump_file_version(path)
    with pytest.raises(NewerSnapshotVersionError, match="format version 2 is newer"):
        read_snapshot(path)


def _context(store: SnapshotStore) -> RoleContext:
    """What Snapshots.load uses of a node's context: the store and the applier."""
    return SimpleNamespace(snapshots=store, applier=Applier())  # type: ignore[return-value]


async def _nothing() -> None:
    pass


@pytest.mark.parametrize("what", ["file", "body"])
async def test_a_broker_refuses_to_boot_from_a_newer_snapshot(tmp_path: Path, what: str) -> None:
    store = SnapshotStore(tmp_path, cluster_id=CLUSTER)
    _write(tmp_path, StateMachine().encode_snapshot(), (1, 1))  # an older, readable one
    if what == "file":
        bump_file_version(_write(tmp_path, StateMachine().encode_snapshot(), (2, 1)))
    else:
        _write(tmp_path, _newer_body(), (2, 1))
    snapshots = Snapshots(_context(store), after_take=_nothing)
    with pytest.raises(NewerFormatError) as info:
        await snapshots.load()
    message = str(info.value)
    assert snapshot_file_name(2, 1) in message
    newer = (FORMAT_VERSION if what == "file" else SNAPSHOT_BODY_VERSION) + 1
    assert f"version {newer} is newer" in message and "upgrade the broker" in message
    # Skipped, not loaded and not quarantined: the file is fine for the newer release.
    assert (tmp_path / snapshot_file_name(2, 1)).exists()


def test_a_log_entry_of_a_newer_release_stops_the_broker_naming_where() -> None:
    from log.api import LedgerEntry

    data = e.encode_entry(e.Tick(time_ms=1, v=e.ENTRY_FORMAT_VERSION + 1))
    applier = Applier()
    newer = e.ENTRY_FORMAT_VERSION + 1
    with pytest.raises(
        NewerFormatError, match=f"ledger 7 entry 3: log entry format version {newer}"
    ):
        applier.apply_logged(LedgerEntry(ledger_id=7, entry_id=3, last_add_confirmed=-1, data=data))


# The entry types added in format 3: a broker of format 2 does not know their tags.
FORMAT_3_TYPES = {
    e.CancelTasks,
    e.DeleteCode,
    e.CreateSchedule,
    e.DeleteSchedule,
    e.FireSchedule,
    e.SetWebhook,
    e.WebhookProgress,
}

# The entry types added in format 4: a broker of format 3 does not know their tags.
FORMAT_4_TYPES = {e.WorkerSilent, e.PauseSchedule}
FORMAT_5_TYPES = {e.WorkerDisconnected}


def test_each_entry_is_written_in_the_oldest_format_that_knows_its_type() -> None:
    for entry in sample_entries():
        written = msgspec.msgpack.decode(e.encode_entry(entry))
        version = written.get("v", e.BASE_ENTRY_FORMAT_VERSION)
        if type(entry) in FORMAT_3_TYPES:
            assert version == 3, entry
        elif type(entry) in FORMAT_4_TYPES:
            assert version == 4, entry
        elif type(entry) in FORMAT_5_TYPES:
            assert version == 5, entry
        else:  # what its fields need, never raised by the type
            assert version == entry.v, entry
        # Decodes as it was made, but for the version it was written in.
        decoded = e.decode_entry(e.encode_entry(entry))
        assert decoded == msgspec.structs.replace(entry, v=version)


def test_a_broker_of_format_2_refuses_a_format_3_entry_type_naming_the_version(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from log.api import LedgerEntry

    # The release before: it reads format 2 and knows none of the format-3 entry types.
    known = tuple(t for t in e.Entry.__args__ if t not in FORMAT_3_TYPES)  # type: ignore[attr-defined]
    monkeypatch.setattr(e, "ENTRY_FORMAT_VERSION", 2)
    older = msgspec.msgpack.Decoder(Union[(e.Confirm, *known)])  # type: ignore[valid-type]
    monkeypatch.setattr(e, "_record_decoder", older)
    applier = Applier()
    for entry in sample_entries():
        if type(entry) not in FORMAT_3_TYPES:
            continue
        data = e.encode_entry(entry)
        with pytest.raises(NewerFormatError) as info:
            applier.apply_logged(LedgerEntry(4, 9, last_add_confirmed=-1, data=data))
        message = str(info.value)
        assert "ledger 4 entry 9: log entry format version 3 is newer than this broker's 2" in (
            message
        ), message
        assert "upgrade the broker to a release that reads version 3" in message


def test_a_broker_of_format_3_refuses_a_format_4_entry_type_naming_the_version(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from log.api import LedgerEntry

    known = tuple(t for t in e.Entry.__args__ if t not in FORMAT_4_TYPES)  # type: ignore[attr-defined]
    monkeypatch.setattr(e, "ENTRY_FORMAT_VERSION", 3)
    older = msgspec.msgpack.Decoder(Union[(e.Confirm, *known)])  # type: ignore[valid-type]
    monkeypatch.setattr(e, "_record_decoder", older)
    applier = Applier()
    refused: set[type] = set()
    for entry in sample_entries():
        if type(entry) not in FORMAT_4_TYPES:
            continue
        data = e.encode_entry(entry)
        with pytest.raises(
            NewerFormatError, match="format version 4 is newer than this broker's 3"
        ):
            applier.apply_logged(LedgerEntry(4, 9, last_add_confirmed=-1, data=data))
        refused.add(type(entry))
    assert refused == FORMAT_4_TYPES


def test_a_broker_of_format_4_refuses_a_format_5_entry_type_naming_the_version(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from log.api import LedgerEntry

    known = tuple(t for t in e.Entry.__args__ if t not in FORMAT_5_TYPES)  # type: ignore[attr-defined]
    monkeypatch.setattr(e, "ENTRY_FORMAT_VERSION", 4)
    older = msgspec.msgpack.Decoder(Union[(e.Confirm, *known)])  # type: ignore[valid-type]
    monkeypatch.setattr(e, "_record_decoder", older)
    applier = Applier()
    refused: set[type] = set()
    for entry in sample_entries():
        if type(entry) not in FORMAT_5_TYPES:
            continue
        data = e.encode_entry(entry)
        with pytest.raises(
            NewerFormatError, match="format version 5 is newer than this broker's 4"
        ):
            applier.apply_logged(LedgerEntry(4, 9, last_add_confirmed=-1, data=data))
        refused.add(type(entry))
    assert refused == FORMAT_5_TYPES


def test_a_snapshot_body_is_written_in_the_oldest_version_that_keeps_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from broker.core import snapshot_body

    assert decode_snapshot_body(StateMachine().encode_snapshot()).format_version == 1
    hooked = StateMachine()
    hooked.apply(e.SetWebhook(time_ms=1, tenant="t", url="http://hooks.example", secret="k"))
    data = hooked.encode_snapshot()
    assert decode_snapshot_body(data).format_version == 2
    # A broker that reads body version 1 only would drop the webhook: it refuses instead.
    monkeypatch.setattr(snapshot_body, "SNAPSHOT_BODY_VERSION", 1)
    with pytest.raises(SnapshotBodyVersionError, match="version 2 is newer than this broker's 1"):
        decode_snapshot_body(data)
    # A worker's silence (docs/DESIGN.md §8): version 3, which a version-2 reader refuses.
    monkeypatch.setattr(snapshot_body, "SNAPSHOT_BODY_VERSION", 3)
    hooked.apply(e.RegisterWorker(time_ms=2, worker_id="w1"))
    hooked.apply(e.WorkerSilent(time_ms=3, workers=(e.SilentWorker("w1", 2, 2),)))
    data = hooked.encode_snapshot()
    assert decode_snapshot_body(data).format_version == 3
    monkeypatch.setattr(snapshot_body, "SNAPSHOT_BODY_VERSION", 2)
    with pytest.raises(SnapshotBodyVersionError, match="version 3 is newer than this broker's 2"):
        decode_snapshot_body(data)
    # So is a paused schedule (a version-2 reader would drop the pause and fire it).
    paused = StateMachine()
    paused.apply(
        e.CreateSchedule(
            time_ms=1, tenant="t", name="s", task=e.TaskSpec(0, "noop", "t"), interval_ms=1_000
        )
    )
    assert decode_snapshot_body(paused.encode_snapshot()).format_version == 2
    paused.apply(e.PauseSchedule(time_ms=2, tenant="t", name="s"))
    with pytest.raises(SnapshotBodyVersionError, match="version 3 is newer than this broker's 2"):
        decode_snapshot_body(paused.encode_snapshot())


def test_lost_attempts_need_body_version_4_and_entry_format_5(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """docs/DESIGN.md §6, "Lost workers": a version-3 reader would drop a task's lost count
    (and count those attempts against max_attempts) or its max_lost; an older broker would
    apply a format-5 death as a failure. Both refuse instead, naming the version."""
    from broker.core import snapshot_body

    machine = StateMachine()
    machine.apply(e.RegisterWorker(time_ms=1, worker_id="w1"))
    spec = e.TaskSpec(1, "noop", "t")
    machine.apply(e.SubmitTasks(time_ms=2, tasks=(spec,)))
    assert decode_snapshot_body(machine.encode_snapshot()).format_version == 1
    machine.apply(e.AssignTasks(time_ms=3, assignments=(e.Assignment(1, "w1"),)))
    dead = e.WorkerDead(time_ms=4, worker_id="w1", v=e.lost_attempts_version(True))
    assert e.decode_entry(e.encode_entry(dead)).v == 5
    machine.apply(dead)
    assert (machine.tasks[1].state, machine.tasks[1].lost) == ("waiting", 1)
    data = machine.encode_snapshot()
    assert decode_snapshot_body(data).format_version == 4
    monkeypatch.setattr(snapshot_body, "SNAPSHOT_BODY_VERSION", 3)
    with pytest.raises(SnapshotBodyVersionError, match="version 4 is newer than this broker's 3"):
        decode_snapshot_body(data)
    monkeypatch.setattr(e, "ENTRY_FORMAT_VERSION", 4)
    with pytest.raises(e.NewerEntryFormatError, match="version 5 is newer than this broker's 4"):
        e.decode_entry(e.encode_entry(dead))
    # Only what needs it: a death with nothing to lose, a default max_lost, stay at 1.
    assert e.lost_attempts_version(False) == e.BASE_ENTRY_FORMAT_VERSION
    assert e.submit_version((spec,)) == e.BASE_ENTRY_FORMAT_VERSION
    assert e.submit_version((e.TaskSpec(2, "noop", "t", max_lost=0),)) == 5
    child = e.Spawn(e.TaskSpec(0, "noop", "t", max_lost=5))
    outcome = e.TaskOutcome(task_id=1, worker_id="w1", attempt=2, ok=True, spawn=(child,))
    assert e.finish_tasks(5, (outcome,)).v == 5
