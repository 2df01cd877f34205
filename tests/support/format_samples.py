"""Writes the checked-in format samples of tests/data/formats (docs/OPERATIONS.md, "Rolling
upgrade"): a broker reads every earlier log entry and snapshot format, and
tests/unit/test_format_versions.py proves it on files written by earlier code.

Run it once per new format version, with the code of that version, into a new directory
(never over an existing one: those files are what older releases wrote)::

    python -m tests.support.format_samples tests/data/formats/entries-v5-snapshot-v4

It writes ``entries.msgpack`` (a msgpack array of log entries exactly as logged: every entry
type, of every entry version this code writes), ``state.snap`` (a snapshot file of the state
they build) and ``expected.json`` (the versions, the state's digest as written, and what a
user can see of that state, which the test checks the entries and the snapshot still give:
the digest itself moves whenever a record gains a field).
"""

from __future__ import annotations

import json
import struct
import sys
from pathlib import Path

import msgspec

from broker.core import StateMachine
from broker.core import entries as e
from broker.core.records import Rejected
from snapshot.format import FORMAT_VERSION, MAGIC, read_snapshot, write_snapshot

T0 = 1_700_000_000_000
SHA = "ab" * 32
CLUSTER = "format-samples"


def sample_entries() -> list[e.Entry]:
    """Every entry type today's code writes, in an order that applies without rejections."""

    def task(task_id: int, **fields: object) -> e.TaskSpec:
        return e.TaskSpec(id=task_id, type="noop", tenant="acme", **fields)  # type: ignore[arg-type]

    t = T0
    running = (e.TaskAttempt(1, 1),)
    return [
        e.SetConfig(time_ms=t, finished_task_retention_ms=3_600_000, global_limits={"cpu": 8}),
        e.SetTenant(time_ms=t, tenant="acme", limits=e.TenantLimitsPatch(weight=2.0)),
        e.CreateToken(time_ms=t, token_id="a1", name="ci", tenant="acme", sha256="cd" * 32),
        e.CreateToken(time_ms=t, token_id="b2", name="old", role="admin", sha256="ef" * 32),
        e.RevokeToken(time_ms=t + 1, token_id="b2"),
        e.AddCode(time_ms=t + 2, sha256=SHA, name="job.zip", size_bytes=10, ready=False),
        e.CodeReady(time_ms=t + 3, sha256=SHA),
        e.RegisterWorker(
            time_ms=t + 4,
            worker_id="w1",
            address="127.0.0.1:1",
            process_id="p1",
            resources={"cpu": 4},
            task_types={"*": 4},
        ),
        e.SubmitTasks(
            time_ms=t + 5,
            tasks=(
                task(1, params=b'{"n": 1}', track_tree=True, max_attempts=3),
                task(2, slot="nightly", code=SHA),
                task(3, start_after_ms=t + 60_000, resources={"cpu": 1}),
            ),
            idempotency_key="submit-1",
            assignments=(e.Assignment(1, "w1"),),
        ),
        e.AssignTasks(time_ms=t + 6, assignments=(e.Assignment(2, "w1"),)),
        e.BeginTransaction(time_ms=t + 7, transaction_id=1, tenant="acme"),
        e.SubmitTasks(time_ms=t + 8, tasks=(task(4, transaction=1),)),
        e.CommitTransaction(time_ms=t + 9, transaction_id=1, tenant="acme"),
        e.BeginTransaction(time_ms=t + 10, transaction_id=2, tenant="acme"),
        e.RollbackTransaction(time_ms=t + 11, transaction_id=2, tenant="acme"),
        e.finish_tasks(
            t + 12,
            (
                e.TaskOutcome(
                    task_id=1,
                    worker_id="w1",
                    attempt=1,
                    ok=True,
                    result=b"42",
                    spawn=(e.Spawn(task(5), anchors=(1,)),),
                ),
            ),
        ),
        # Version 2: an attempt given back (docs/DESIGN.md §6, "Stopping").
        e.finish_tasks(
            t + 13,
            (e.TaskOutcome(task_id=2, worker_id="w1", attempt=1, ok=False, released=True),),
        ),
        e.CancelTask(time_ms=t + 14, task_id=3),
        e.RegisterWorker(
            time_ms=t + 15,
            worker_id="w1",
            address="127.0.0.1:1",
            process_id="p2",
            task_types={"*": 4},
            running=running,
        ),
        e.WorkerDead(time_ms=t + 16, worker_id="w1"),
        e.Tick(time_ms=t + 17),
        e.AddCode(time_ms=t + 18, sha256="9f" * 32, name="old.zip", size_bytes=3),
        e.DeleteCode(time_ms=t + 19, sha256="9f" * 32),
        e.CreateSchedule(
            time_ms=t + 20,
            tenant="acme",
            name="hourly",
            task=e.TaskSpec(id=0, type="noop", tenant="acme"),
            first_ms=t + 3_600_000,
            cron="0 * * * *",
            missed="run_once",
        ),
        e.CreateSchedule(
            time_ms=t + 21,
            tenant="acme",
            name="every-minute",
            task=e.TaskSpec(id=0, type="noop", tenant="acme"),
            first_ms=t + 60_000,
            interval_ms=60_000,
        ),
        e.FireSchedule(
            time_ms=t + 60_001,
            tenant="acme",
            name="every-minute",
            tick_ms=t + 60_000,
            next_ms=t + 120_000,
            task_id=6,
        ),
        e.DeleteSchedule(time_ms=t + 60_002, tenant="acme", name="hourly"),
        # Entry format 3: a task that runs after another (docs/API.md, "Dependencies").
        e.SubmitTasks(
            time_ms=t + 60_003,
            tasks=(task(7, after=(6,)),),
            v=e.submit_version((task(7, after=(6,)),)),
        ),
        e.SubmitTasks(
            time_ms=t + 60_004,
            tasks=(task(8, priority=5, retry_backoff_ms=1_000),),
            v=e.submit_version((task(8, priority=5, retry_backoff_ms=1_000),)),
        ),
        e.CancelTasks(time_ms=t + 60_005, task_ids=(8, 99), tenant="acme"),
        e.SetWebhook(
            time_ms=t + 60_006, tenant="acme", url="https://hooks.example/acme", secret="s3"
        ),
        e.WebhookProgress(
            time_ms=t + 60_007, marks=(e.WebhookMark(tenant="acme", delivered=(1, 20, 0)),)
        ),
        # A final task after the delivered position: it stays in the webhook's outbox.
        e.CancelTask(time_ms=t + 60_008, task_id=7),
        # Entry format 4: a worker silent to the leader (docs/DESIGN.md §8, "Silence across
        # leader changes"), kept in the snapshot (body version 3).
        e.RegisterWorker(time_ms=t + 60_009, worker_id="w2", task_types={"*": 1}),
        e.WorkerSilent(time_ms=t + 65_009, workers=(e.SilentWorker("w2", t + 60_009, t + 60_009),)),
        # Entry format 4 too: a schedule paused (body version 3 keeps it), resumed, paused.
        e.PauseSchedule(time_ms=t + 65_010, tenant="acme", name="every-minute"),
        e.PauseSchedule(time_ms=t + 65_011, tenant="acme", name="every-minute", paused=False),
        e.PauseSchedule(time_ms=t + 65_012, tenant="acme", name="every-minute"),
        # Entry format 5: a task's own max_lost, and a death that ends its attempt as lost,
        # not counted (docs/DESIGN.md §6, "Lost workers"; snapshot body version 4).
        e.SubmitTasks(
            time_ms=t + 65_013,
            tasks=(task(9, max_lost=1),),
            v=e.submit_version((task(9, max_lost=1),)),
        ),
        e.AssignTasks(time_ms=t + 65_014, assignments=(e.Assignment(9, "w2"),)),
        e.WorkerDead(time_ms=t + 65_015, worker_id="w2", v=e.lost_attempts_version(True)),
        # Entry format 5: entries that start attempts record their start and queue time
        # (body version 4 keeps them): a submit that places its task (others are waiting,
        # so it does not start) and an assignment of it and of task 4.
        e.RegisterWorker(
            time_ms=t + 65_016,
            worker_id="w3",
            address="127.0.0.1:3",
            process_id="p3",
            task_types={"*": 4},
        ),
        e.SubmitTasks(
            time_ms=t + 65_017,
            tasks=(task(10),),
            assignments=(e.Assignment(10, "w3"),),
            v=e.submit_version((task(10),), (e.Assignment(10, "w3"),)),
        ),
        e.AssignTasks(
            time_ms=t + 65_023,
            assignments=(e.Assignment(10, "w3"), e.Assignment(4, "w3")),
            v=e.STARTS_RECORDED_VERSION,
        ),
        # Entry format 5: w3's connection closed; it is disconnected, its tasks still running
        # (docs/DESIGN.md §8, "Closed connections"; body version 4 keeps the state).
        e.WorkerDisconnected(
            time_ms=t + 65_024,
            workers=(e.DisconnectedWorker("w3", t + 65_023, t + 65_016),),
        ),
        # Entry format 5: a worker serving one tenant lists the task types it serves
        # (docs/DESIGN.md §6, "Served task types"; body version 4 keeps the record).
        e.RegisterWorker(
            time_ms=t + 65_025,
            worker_id="w4",
            address="127.0.0.1:4",
            process_id="p4",
            task_types={"*": 2},
            tenants=("acme",),
            task_names=("etl.load", "noop"),
            v=e.register_version(False, ("etl.load", "noop")),
        ),
    ]


def observable(machine: StateMachine) -> dict[str, object]:
    """What a user can see of a state, independent of how its body is encoded: a field
    added later (with its default) changes the digest of the same entries, not this."""
    return {
        "tasks": {str(t.id): [str(t.state), t.attempt, t.worker] for t in machine.tasks.values()},
        "tenants": sorted(machine.tenants),
        "workers": {w.id: str(w.state) for w in machine.workers.values()},
        "served_types": {
            scope or "*": sorted(names) for scope, names in sorted(machine.served_types.items())
        },
        "silent_workers": {
            w.id: w.silent_since_ms
            for w in machine.workers.values()
            if w.silent_since_ms is not None
        },
        "lost_attempts": {
            str(t.id): [t.lost, t.max_lost]
            for t in machine.tasks.values()
            if t.lost or t.max_lost != e.DEFAULT_MAX_LOST
        },
        "code": sorted(machine.artifacts),
        "tokens": sorted(machine.tokens),
        "schedules": sorted(f"{tenant}/{name}" for tenant, name in machine.schedules),
        "paused_schedules": {
            f"{s.tenant}/{s.name}": s.paused_ms
            for s in machine.schedules.values()
            if s.paused_ms is not None
        },
        "task_starts": {
            str(t.id): [t.started_ms, t.queued_ms]
            for t in machine.tasks.values()
            if t.started_ms is not None
        },
        "webhook_outbox": {
            tenant: [[list(key), task_id] for key, task_id in outbox]
            for tenant, outbox in sorted(machine.webhook_outbox.items())
        },
    }


def write_samples(directory: Path) -> dict[str, object]:
    directory.mkdir(parents=True, exist_ok=False)  # never over an earlier release's files
    entries = sample_entries()
    machine = StateMachine()
    for index, entry in enumerate(entries):
        machine.position = (1, index)  # as logged: ledger 1, one entry each (the snapshot's)
        result = machine.apply(entry).result
        if isinstance(result, Rejected):
            raise SystemExit(f"sample entry {entry!r} rejected: {result.message}")
    encoded = [e.encode_entry(entry) for entry in entries]
    (directory / "entries.msgpack").write_bytes(msgspec.msgpack.encode(encoded))
    body = machine.encode_snapshot()
    info = write_snapshot(
        directory,
        cluster_id=CLUSTER,
        ledger_id=1,
        entry_id=len(entries) - 1,
        created_ms=T0,
        digest=machine.digest(),
        body=body,
    )
    info.path.rename(directory / "state.snap")
    read_snapshot(directory / "state.snap")  # written whole
    expected: dict[str, object] = {
        "entry_format_version": e.ENTRY_FORMAT_VERSION,
        "entry_versions": sorted({e.decode_entry(data).v for data in encoded}),
        "entry_types": sorted({type(entry).__name__ for entry in entries}),
        "snapshot_format_version": FORMAT_VERSION,
        "snapshot_body_version": machine.snapshot_body().format_version,
        "cluster_id": CLUSTER,
        "entries": len(entries),
        "digest": machine.digest(),
        "observable": observable(machine),
    }
    (directory / "expected.json").write_text(json.dumps(expected, indent=2) + "\n")
    return expected


def bump_file_version(path: Path) -> None:
    """Rewrite the header's format_version to the next one (header checksum aside: the
    version is checked first, as a newer layout may differ anywhere after it)."""
    data = path.read_bytes()
    (length,) = struct.unpack(">I", data[len(MAGIC) : len(MAGIC) + 4])
    start = len(MAGIC) + 4
    header = msgspec.msgpack.decode(data[start : start + length])
    header["format_version"] = FORMAT_VERSION + 1
    raw = msgspec.msgpack.encode(header)
    path.write_bytes(MAGIC + struct.pack(">I", len(raw)) + raw + data[start + length :])


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit("usage: python -m tests.support.format_samples NEW_DIRECTORY")
    print(json.dumps(write_samples(Path(sys.argv[1])), indent=2))
