"""What a Jepsen-style run recorded: client operations, task executions, leadership claims
and nemesis events, plus the final state read after healing (docs/TESTING.md, "Partitions").

Every record is one JSON line in ``history.jsonl`` (``kind`` names the record type), so a
failed run can be re-checked offline (``python -m tests.jepsen --check DIR``). Times are
``time.monotonic()`` seconds: CLOCK_MONOTONIC is one clock for every process of the host,
so the client threads' times and the workers' execution records compare directly.

Operations follow Jepsen: every operation is an ``invoke`` followed by exactly one
completion of the same ``process`` and ``op_id``: ``ok`` (acknowledged), ``fail`` (it
certainly did not happen: a 4xx or a refusal before anything was written) or ``info``
(unknown: a timeout or a lost connection; it may or may not have happened).
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

OpType = Literal["invoke", "ok", "fail", "info"]
COMPLETIONS: tuple[OpType, ...] = ("ok", "fail", "info")
FINAL_STATES = frozenset({"finished", "error", "cancelled", "timed_out", "expired"})
# Nemesis events that are not faults: a heal, and the note of how a paused worker's hold
# ended (tests/jepsen/nemesis.py, Nemesis.hold_zombie).
NOT_FAULTS = frozenset({"heal", "zombie-hold"})


@dataclass(frozen=True)
class Op:
    """One half of a client operation (``f``: ``submit`` (one task, or a batch: ``keys``
    in its args, ``ids`` in its answer), ``read``, ``cancel``, ``cancel-matching``
    (cancel by filter), ``txn``)."""

    process: str
    op_id: int
    type: OpType
    f: str
    time: float
    args: dict[str, Any] = field(default_factory=dict)
    result: dict[str, Any] = field(default_factory=dict)
    node: str = ""  # the broker that answered (its id), when known


@dataclass(frozen=True)
class Execution:
    """One run of a task's attempt on a worker, as the task code recorded it.

    ``end`` is None when the run never finished (its worker was killed or never resumed).
    """

    task: int
    attempt: int
    worker: str
    start: float
    end: float | None = None
    slot: str = ""


@dataclass(frozen=True)
class Claim:
    """An observation of who writes the ledger list: ``broker`` took over at ``epoch``
    (the newest ledger id it added when it became leader), seen at ``time``."""

    time: float
    broker: str
    epoch: int


@dataclass(frozen=True)
class NemesisEvent:
    """A fault or a heal, when it happened. ``bounded``: a fault after which the cluster
    must take writes again within the outage bound without a heal (leader killed or cut
    from ZooKeeper); faults that cut clients from every leader are not."""

    time: float
    action: str
    detail: dict[str, Any] = field(default_factory=dict)
    bounded: bool = False


@dataclass
class FinalState:
    """What the cluster holds after healing and draining."""

    tasks: dict[int, dict[str, Any]] = field(default_factory=dict)
    # root id -> its tree view (GET /api/v1/trees), the tracked trees of the run.
    trees: dict[int, dict[str, Any]] = field(default_factory=dict)
    # broker id -> (applied position, state digest), read once the replicas converged.
    digests: dict[str, tuple[int, str]] = field(default_factory=dict)


@dataclass
class RunInfo:
    seed: int = 0
    faults: int = 0
    max_attempts: int = 10
    ledger: str = "file"
    log_dir: str = ""
    outage_bound_s: float = 0.0
    started: float = 0.0
    ended: float = 0.0


class History:
    """The records of one run; ``record`` is thread-safe (many client threads append)."""

    def __init__(self, info: RunInfo | None = None) -> None:
        self.info = info or RunInfo()
        self.ops: list[Op] = []
        self.executions: list[Execution] = []
        self.claims: list[Claim] = []
        self.nemesis: list[NemesisEvent] = []
        self.final = FinalState()
        self._lock = threading.Lock()
        self._next_id = 0

    # -- recording ---------------------------------------------------------------------

    def invoke(self, process: str, f: str, args: dict[str, Any]) -> Op:
        with self._lock:
            self._next_id += 1
            op = Op(process, self._next_id, "invoke", f, time.monotonic(), dict(args))
            self.ops.append(op)
        return op

    def complete(
        self, invoked: Op, type_: OpType, result: dict[str, Any] | None = None, node: str = ""
    ) -> Op:
        assert type_ in COMPLETIONS, type_
        op = Op(
            invoked.process,
            invoked.op_id,
            type_,
            invoked.f,
            time.monotonic(),
            invoked.args,
            dict(result or {}),
            node,
        )
        with self._lock:
            self.ops.append(op)
        return op

    def add_nemesis(self, event: NemesisEvent) -> None:
        with self._lock:
            self.nemesis.append(event)

    def add_claim(self, claim: Claim) -> None:
        with self._lock:
            if not self.claims or (self.claims[-1].broker, self.claims[-1].epoch) != (
                claim.broker,
                claim.epoch,
            ):
                self.claims.append(claim)

    # -- views -------------------------------------------------------------------------

    def pairs(self) -> list[tuple[Op, Op | None]]:
        """Each invocation with its completion (None: the run ended before it completed)."""
        done = {(op.process, op.op_id): op for op in self.ops if op.type != "invoke"}
        return [(op, done.get((op.process, op.op_id))) for op in self.ops if op.type == "invoke"]

    # -- JSON lines --------------------------------------------------------------------

    def dump(self, path: Path) -> None:
        with path.open("w") as out:
            out.write(json.dumps({"kind": "info", **asdict(self.info)}) + "\n")
            for kind, records in (
                ("op", self.ops),
                ("execution", self.executions),
                ("claim", self.claims),
                ("nemesis", self.nemesis),
            ):
                for record in records:
                    out.write(json.dumps({"kind": kind, **asdict(record)}) + "\n")
            for task in self.final.tasks.values():
                out.write(json.dumps({"kind": "task", "task": task}) + "\n")
            for tree in self.final.trees.values():
                out.write(json.dumps({"kind": "tree", "tree": tree}) + "\n")
            for broker, (position, digest) in self.final.digests.items():
                line = {"kind": "digest", "broker": broker, "position": position, "digest": digest}
                out.write(json.dumps(line) + "\n")

    @classmethod
    def load(cls, path: Path) -> History:
        history = cls()
        for line in path.read_text().splitlines():
            if not line.strip():
                continue
            record = json.loads(line)
            kind = record.pop("kind")
            if kind == "info":
                history.info = RunInfo(**record)
            elif kind == "op":
                history.ops.append(Op(**record))
            elif kind == "execution":
                history.executions.append(Execution(**record))
            elif kind == "claim":
                history.claims.append(Claim(**record))
            elif kind == "nemesis":
                history.nemesis.append(NemesisEvent(**record))
            elif kind == "task":
                history.final.tasks[int(record["task"]["id"])] = record["task"]
            elif kind == "tree":
                history.final.trees[int(record["tree"]["root"])] = record["tree"]
            elif kind == "digest":
                history.final.digests[record["broker"]] = (record["position"], record["digest"])
            else:
                raise ValueError(f"{path}: unknown record kind {kind!r}")
        return history


def read_executions(path: Path) -> list[Execution]:
    """Pair the ``start``/``done`` lines the task code appends (one file, ``O_APPEND``)."""
    starts: dict[tuple[int, int, str], dict[str, Any]] = {}
    ends: dict[tuple[int, int, str], float] = {}
    if path.exists():
        for line in path.read_text().splitlines():
            if not line.strip():
                continue
            record = json.loads(line)
            key = (int(record["task"]), int(record["attempt"]), str(record["worker"]))
            if record["event"] == "start":
                starts[key] = record
            else:
                ends[key] = float(record["time"])
    return [
        Execution(key[0], key[1], key[2], float(r["time"]), ends.get(key), str(r.get("slot", "")))
        for key, r in sorted(starts.items(), key=lambda item: float(item[1]["time"]))
    ]
