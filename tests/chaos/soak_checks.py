"""The chaos soak's checks (tests/chaos/soak.py) as functions of what a run recorded: the
final task states, the drain bound, zombie attempts, leadership claims, outages and the
brokers' log events. Pure, so each is unit-tested on hand-made bad input
(tests/chaos/test_checks.py)."""

from __future__ import annotations

import json
import re
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.chaos.soak_parts import FINAL_STATES, LIVE_STATES, Acked

# What the brokers log when they roll a ledger, delete ledgers by retention, and when a
# follower whose history was deleted downloads a snapshot from a peer
# (broker/replication/leader.py, history.py; broker/server/following.py).
LOG_EVENTS: dict[str, re.Pattern[str]] = {
    "ledger_rolls": re.compile(r"rolled from ledger \d+ to \d+"),
    "retention_deletes": re.compile(r"retention deleted ledgers \["),
    "snapshot_downloads": re.compile(r"downloading a snapshot from "),
}


def check_final_states(
    acked: Mapping[int, str], tasks: Mapping[int, dict[str, Any]], cancelled: Iterable[int]
) -> list[str]:
    """Every acknowledged task (id -> key) ends ``finished``: their work cannot fail. A
    task the workload asked to cancel may end ``cancelled`` (or ``finished``, when the
    cancel came too late); any other ending is a failure."""
    asked = set(cancelled)
    problems = []
    for task_id, key in sorted(acked.items()):
        task = tasks.get(task_id)
        if task is None:
            continue  # reported as lost by the task check
        allowed = {"finished", "cancelled"} if task_id in asked else {"finished"}
        if task["state"] not in allowed:
            problems.append(
                f"acknowledged task {task_id} ({key}) ended {task['state']!r} after attempt "
                f"{task.get('attempt')} (allowed: {sorted(allowed)})"
            )
    return problems


def stuck_tasks(acked: Iterable[int], tasks: Mapping[int, dict[str, Any]]) -> dict[int, str]:
    """Acknowledged tasks not final: id -> "state attempt N on worker W"."""
    return {
        i: f"{tasks[i]['state']} attempt {tasks[i].get('attempt')} on {tasks[i].get('worker')}"
        for i in sorted(acked)
        if i in tasks and tasks[i]["state"] not in FINAL_STATES
    }


def drain_bound_s(backlog: int, rate_per_s: float, *, floor_s: float, factor: float = 3.0) -> float:
    """How long a drain of ``backlog`` tasks may take at the rate measured while the load
    ran (tasks made final per second): ``factor`` times the expected time, at least
    ``floor_s`` (the tail: a re-run waits a heartbeat timeout)."""
    if backlog <= 0:
        return floor_s
    return max(floor_s, factor * backlog / max(rate_per_s, 0.1))


def zombie_overlaps(effects: list[dict[str, Any]]) -> list[tuple[int, int, int]]:
    """(task, stale attempt, newer attempt) where the newer attempt started before the
    stale one's run ended, in the shared file's append order."""
    running: dict[int, set[int]] = {}
    found = []
    for record in effects:
        task_id, attempt, event = record["task"], record["attempt"], record["event"]
        if event == "start":
            found += [(task_id, old, attempt) for old in running.get(task_id, ()) if old < attempt]
            running.setdefault(task_id, set()).add(attempt)
        elif event == "end":
            running.get(task_id, set()).discard(attempt)
    return found


def check_zombies(
    overlaps: list[tuple[int, int, int]], tasks: Mapping[int, dict[str, Any]]
) -> list[str]:
    """A stale attempt's report changes nothing: a task that had a zombie ends finished
    with the result of its newest attempt (the task check compares the result)."""
    problems = []
    for task_id, stale, newer in overlaps:
        task = tasks.get(task_id)
        if task is None:
            problems.append(f"zombie task {task_id} is not on the leader")
        elif task["state"] != "finished" or task.get("attempt", 0) < newer:
            problems.append(
                f"task {task_id}: the stale attempt {stale} ran alongside attempt {newer}, "
                f"and the task ended {task['state']!r} at attempt {task.get('attempt')}"
            )
        elif (task.get("result") or {}).get("attempt") != task["attempt"]:
            problems.append(
                f"task {task_id}: the stale attempt {stale}'s report won: result "
                f"{task.get('result')}"
            )
    return problems


@dataclass(frozen=True)
class Claim:
    """One broker's answer in one poll round: it says it leads and takes writes."""

    at: float  # monotonic, when the answer arrived
    broker: str
    ledger_id: int  # the ledger it writes: a newer leader writes a newer one


def check_split_brain(rounds: list[list[Claim]]) -> tuple[list[str], int]:
    """Two live leaders at once: in one poll round, two brokers claim to lead and take
    writes, and the older leader (the older ledger) said so *after* the newer one had.
    Returns the problems and the number of ambiguous rounds (the older claim came first:
    it may have stepped down before the newer one took over; counted, not failed)."""
    problems = []
    ambiguous = 0
    for claims in rounds:
        if len({c.broker for c in claims}) < 2:
            continue
        ordered = sorted(claims, key=lambda c: c.ledger_id)
        older, newer = ordered[0], ordered[-1]
        if older.ledger_id == newer.ledger_id:
            problems.append(f"two brokers lead on one ledger: {claims}")
        elif older.at >= newer.at:
            problems.append(
                f"split brain: {older.broker} (ledger {older.ledger_id}) still claimed to lead "
                f"and take writes {older.at - newer.at:.3f} s after {newer.broker} "
                f"(ledger {newer.ledger_id}) did"
            )
        else:
            ambiguous += 1
    return problems, ambiguous


@dataclass(frozen=True)
class Outage:
    kind: str  # the fault on the leader
    at: float  # monotonic
    clean: bool  # nothing else was down (or failed) from the fault to the next ack
    seconds: float | None  # to the next acknowledged write; None: none came


def measure_outages(
    faults: list[tuple[str, float, bool]], acks: list[float], others: list[float]
) -> list[Outage]:
    """For each (kind, time, clean) fault on the leader: the time to the first acknowledged
    write after it. ``others``: times of other broker or ZooKeeper faults; one of them
    before that ack makes the outage not clean (its length is not this fault's)."""
    ordered = sorted(acks)
    outages = []
    for kind, at, clean in faults:
        after = next((a for a in ordered if a > at), None)
        if after is not None and any(at < o < after for o in others):
            clean = False
        outages.append(Outage(kind, at, clean, None if after is None else after - at))
    return outages


def check_outages(outages: list[Outage], bound_s: float) -> list[str]:
    return [
        f"{o.kind} at +{o.at:.2f}: no acknowledged write for "
        f"{'ever' if o.seconds is None else f'{o.seconds:.2f} s'} (bound {bound_s:.1f} s)"
        for o in outages
        if o.clean and (o.seconds is None or o.seconds > bound_s)
    ]


def count_log_events(paths: Iterable[Path]) -> Counter[str]:
    counts: Counter[str] = Counter({name: 0 for name in LOG_EVENTS})
    for path in paths:
        if not path.exists():
            continue
        text = path.read_text(errors="replace")
        for name, pattern in LOG_EVENTS.items():
            counts[name] += len(pattern.findall(text))
    return counts


def check_counted(counts: Mapping[str, int], required: Iterable[str]) -> list[str]:
    """Each of these happened at least once (else the run proved less than it says)."""
    return [f"no {name.replace('_', ' ')} in this run" for name in required if counts[name] < 1]


def check_tasks(
    acked: Mapping[str, Acked], attempted: Mapping[str, Any], tasks: Mapping[int, dict[str, Any]]
) -> list[str]:
    """Every acknowledged task is on the leader as submitted; no submission became two
    tasks; none appeared that nobody sent; a finished task's result is its last attempt's."""
    problems: list[str] = []
    for key, ack in acked.items():
        task = tasks.get(ack.task_id)
        if task is None:
            problems.append(f"acknowledged task {ack.task_id} ({key}) is lost")
            continue
        if (task["type"], task["tenant"], task["params"]) != (ack.type, ack.tenant, ack.params):
            problems.append(
                f"task {ack.task_id} is {task['type']}/{task['tenant']} {task['params']}, "
                f"was submitted as {ack.params}"
            )
    keys = Counter(t["params"].get("key") for t in tasks.values() if isinstance(t["params"], dict))
    problems += [f"submission {k} became {n} tasks" for k, n in keys.items() if n > 1][:10]
    problems += [
        f"task {i} ({t['params']}) was never submitted"
        for i, t in tasks.items()
        if not isinstance(t["params"], dict) or _submitter(t["params"].get("key")) not in attempted
    ][:10]
    for task_id, task in tasks.items():
        if task["state"] == "finished":
            expected = {
                "task": task_id,
                "attempt": task["attempt"],
                "key": task["params"]["key"],
            }
            if task["result"] != expected:
                problems.append(
                    f"finished task {task_id} attempt {task['attempt']} has result "
                    f"{task['result']}, expected {expected}"
                )
        elif task["state"] not in FINAL_STATES | LIVE_STATES:
            problems.append(f"task {task_id} is in unknown state {task['state']}")
    return problems


def read_effects(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    records = []
    for line in path.read_text().splitlines():
        records.append(json.loads(line))
    return records


def check_effects(tasks: Mapping[int, dict[str, Any]], effects: list[dict[str, Any]]) -> list[str]:
    problems: list[str] = []
    runs = Counter((e["task"], e["attempt"], e["event"]) for e in effects)
    problems += [
        f"task {t} attempt {a} has {n} '{ev}' records (ran twice)"
        for (t, a, ev), n in runs.items()
        if n > 1
    ][:10]
    started: dict[int, list[int]] = {}
    for task_id, attempt, event in runs:
        if event == "start":
            started.setdefault(task_id, []).append(attempt)
    for task_id, task in tasks.items():
        attempts = started.get(task_id, [])
        if attempts and max(attempts) > task["attempt"]:
            problems.append(
                f"task {task_id} ran attempt {max(attempts)} but the broker shows attempt "
                f"{task['attempt']}"
            )
        if task["state"] == "finished" and (task_id, task["attempt"], "done") not in runs:
            problems.append(
                f"task {task_id} finished with attempt {task['attempt']} but no run of it completed"
            )
    unknown = {t for (t, _, _) in runs} - set(tasks)
    if unknown:
        problems.append(f"records of tasks the leader does not know: {sorted(unknown)[:10]}")
    return problems


def _submitter(key: Any) -> Any:
    """The key the load submitted: a tree child's key is its root's plus
    ``-a<root attempt>-c<index>``."""
    if isinstance(key, str) and re.fullmatch(r".*-a\d+-c\d+", key):
        return key.rsplit("-a", 1)[0]
    return key


def check_trees(
    acked: Mapping[str, Acked], tasks: Mapping[int, dict[str, Any]], cancelled: Iterable[int]
) -> list[str]:
    """A tree root that finished spawned its children with its finish (one log entry):
    each child of its last attempt exists and finished (their work cannot fail either;
    children of attempts before a replay may have ended either way)."""
    by_key = {t["params"]["key"]: t for t in tasks.values() if isinstance(t["params"], dict)}
    asked = set(cancelled)
    problems = []
    for key, ack in acked.items():
        root = tasks.get(ack.task_id)
        children = int(ack.params.get("children", 0))
        if not children or root is None or root["state"] != "finished" or ack.task_id in asked:
            continue
        for index in range(children):
            child = by_key.get(f"{key}-a{root['attempt']}-c{index}")
            if child is None:
                problems.append(f"tree root {ack.task_id} ({key}) finished without child {index}")
            elif child["state"] != "finished":
                problems.append(
                    f"child {child['id']} of tree root {ack.task_id} ended {child['state']!r}"
                )
    return problems


def check_transactions(unknown: list[list[str]], tasks: Mapping[int, dict[str, Any]]) -> list[str]:
    """A transaction whose outcome the client never learned is all or nothing."""
    keys = {t["params"].get("key") for t in tasks.values() if isinstance(t["params"], dict)}
    return [
        f"transaction of {group} is partly there: {sorted(k for k in group if k in keys)}"
        for group in unknown
        if 0 < sum(k in keys for k in group) < len(group)
    ]
