"""The checker: what Steward promises, tested on a recorded :class:`History`.

Pure (no processes, no clock): every check reads the history and its final state and
returns :class:`Violation`s; :func:`report` renders them with the seed, the fault schedule,
the history window around each violation and where the logs are. docs/TESTING.md
("Partitions") lists the checks and the guarantee each one stands for.

Sound before complete: a check reports only what the history proves (an ``info``
operation may or may not have happened, so it never counts as acknowledged; a time
interval of an operation is [invoke, completion], and an ordering is claimed only when the
intervals do not overlap).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from tests.jepsen.history import (
    FINAL_STATES,
    NOT_FAULTS,
    Execution,
    History,
    NemesisEvent,
    Op,
)

WINDOW_S = 2.0  # history shown around a violation, either side


@dataclass(frozen=True)
class Violation:
    kind: str
    message: str
    time: float  # where in the history to look (monotonic seconds)
    tasks: tuple[int, ...] = ()
    ops: tuple[int, ...] = field(default=(), compare=False)


def _acked(history: History, f: str) -> list[tuple[Op, Op]]:
    return [(i, c) for i, c in history.pairs() if i.f == f and c is not None and c.type == "ok"]


def task_ids(op: Op) -> list[int]:
    """The task ids an acknowledged submit or transaction answered."""
    result = op.result
    if "ids" in result:
        return [int(i) for i in result["ids"]]
    return [int(result["id"])] if "id" in result else []


def _keyed_ids(invoke: Op, ok: Op) -> list[tuple[str, int]]:
    """(idempotency key, task id) of each task an acknowledged submit made: a batch's tasks
    each have a key of their own in its answer (``keys``; the request's key names the
    batch), a single task the request's."""
    ids = task_ids(ok)
    if "keys" in ok.result:
        return [(str(k), i) for k, i in zip(ok.result["keys"], ids, strict=True)]
    return [(str(invoke.args.get("key", "")), i) for i in ids]


def lost_acks(history: History) -> list[Violation]:
    """Every acknowledged submit exists after healing and reached a final state (one into
    a transaction exists only if the transaction committed: partial_transactions' part)."""
    out = []
    for invoke, ok in _acked(history, "submit"):
        if "txn" in invoke.args:
            continue
        for task_id in task_ids(ok):
            task = history.final.tasks.get(task_id)
            if task is None:
                what = f"acknowledged task {task_id} (key {invoke.args.get('key')}) is lost"
            elif task.get("state") not in FINAL_STATES:
                what = f"acknowledged task {task_id} is stuck in {task.get('state')!r}"
            else:
                continue
            out.append(Violation("lost-ack", what, ok.time, (task_id,), (ok.op_id,)))
    return out


def duplicates(history: History) -> list[Violation]:
    """No submission became two tasks: one idempotency key, one task id (in the answers
    and in the final state)."""
    by_key: dict[tuple[str, str], set[int]] = defaultdict(set)
    when: dict[tuple[str, str], float] = {}
    for invoke, ok in _acked(history, "submit"):
        for item_key, task_id in _keyed_ids(invoke, ok):
            key = (str(invoke.args.get("tenant", "")), item_key)
            if key[1]:
                by_key[key].add(task_id)
                when.setdefault(key, ok.time)
    for task in history.final.tasks.values():
        params = task.get("params") or {}
        if task.get("parent") is not None:
            continue  # a tree's child: once per run of its tree (broken_trees counts them)
        if isinstance(params, dict) and params.get("key"):
            key = (str(task.get("tenant", "")), str(params["key"]))
            by_key[key].add(int(task["id"]))
    return [
        Violation(
            "duplicate",
            f"submission {key[1]!r} of tenant {key[0]!r} became tasks {sorted(ids)}",
            when.get(key, 0.0),
            tuple(sorted(ids)),
        )
        for key, ids in sorted(by_key.items())
        if len(ids) > 1
    ]


def _overlap(a: Execution, b: Execution) -> bool:
    """Both runs certainly ran at one moment. A run without an end (its process was killed
    with its worker) ended at an unknown time: it proves no overlap."""
    if a.end is None or b.end is None:
        return False
    return a.start < b.end and b.start < a.end


def double_runs(history: History) -> list[Violation]:
    """One attempt never runs on two workers at once (a reassignment starts a new attempt;
    an older attempt still running beside it is a zombie, allowed, see stale_reports)."""
    out = []
    by_attempt: dict[tuple[int, int], list[Execution]] = defaultdict(list)
    for run in history.executions:
        by_attempt[(run.task, run.attempt)].append(run)
    for (task, attempt), runs in sorted(by_attempt.items()):
        for i, a in enumerate(runs):
            for b in runs[i + 1 :]:
                if a.worker != b.worker and _overlap(a, b):
                    message = (
                        f"attempt {attempt} of task {task} ran on {a.worker} and {b.worker} at once"
                    )
                    out.append(Violation("double-run", message, max(a.start, b.start), (task,)))
    return out


def stale_reports(history: History) -> list[Violation]:
    """The result a task keeps is its last attempt's: a late report of an older attempt
    (a zombie's, a paused worker resumed after reassignment) changes nothing."""
    out = []
    for task in history.final.tasks.values():
        result = task.get("result")
        if task.get("state") != "finished" or not isinstance(result, dict):
            continue
        reported = result.get("attempt")
        if reported is not None and int(reported) != int(task.get("attempt") or reported):
            message = (
                f"task {task['id']} kept attempt {reported}'s result but its last attempt "
                f"is {task.get('attempt')}"
            )
            out.append(Violation("stale-report", message, history.info.ended, (int(task["id"]),)))
    return out


def zombie_attempts(history: History) -> list[tuple[Execution, Execution]]:
    """Counted, not a violation: (older, newer) runs of one task where the older attempt
    was still running when its replacement started (a paused or cut-off worker's), the case
    :func:`stale_reports` guards. A run without an end (killed) proves nothing."""
    by_task: dict[int, list[Execution]] = defaultdict(list)
    for run in history.executions:
        by_task[run.task].append(run)
    out = []
    for runs in by_task.values():
        for old in runs:
            out += [
                (old, new)
                for new in runs
                if old.end is not None
                and old.attempt < new.attempt
                and old.start <= new.start < old.end
            ]
    return out


def split_brain(history: History) -> list[Violation]:
    """No acknowledgment by a leader after a newer leader took over: a write answered by
    broker B, invoked after another broker was seen writing the ledger list at a newer epoch
    than B's latest, and B never seen taking over again later."""
    out = []
    claims = sorted(history.claims, key=lambda c: c.time)
    for f in ("submit", "cancel", "cancel-matching", "txn"):
        for invoke, ok in _acked(history, f):
            if not ok.node:
                continue
            own = [c for c in claims if c.broker == ok.node and c.time <= ok.time]
            if not own:
                continue
            epoch = max(c.epoch for c in own)
            newer = [
                c
                for c in claims
                if c.broker != ok.node and c.epoch > epoch and c.time < invoke.time
            ]
            # B seen taking over again past the newer leader: the answer may be of that
            # later term (a claim is observed after the fact), so nothing is proven.
            retook = newer and any(c.broker == ok.node and c.epoch > newer[0].epoch for c in claims)
            if newer and not retook:
                first = newer[0]
                message = (
                    f"{ok.node} (epoch {epoch}) acknowledged {f} #{ok.op_id} at {ok.time:.3f} "
                    f"though {first.broker} took over at epoch {first.epoch} by {first.time:.3f}"
                )
                out.append(
                    Violation("split-brain", message, ok.time, tuple(task_ids(ok)), (ok.op_id,))
                )
    return out


def double_slots(history: History) -> list[Violation]:
    """A slot is never held by two live tasks: two runs of different tasks of one slot
    overlapped, or a task was acknowledged into a slot certainly while another was live."""
    out = []
    by_slot: dict[str, list[Execution]] = defaultdict(list)
    for run in history.executions:
        if run.slot:
            by_slot[run.slot].append(run)
    for slot, runs in sorted(by_slot.items()):
        for i, a in enumerate(runs):
            for b in runs[i + 1 :]:
                if a.task != b.task and _overlap(a, b):
                    message = f"slot {slot!r} held by running tasks {a.task} and {b.task} at once"
                    out.append(
                        Violation("double-slot", message, max(a.start, b.start), (a.task, b.task))
                    )
    # A holder is live at least from its acknowledgment to the end of its last run.
    last_end: dict[int, float] = {}
    for run in history.executions:
        if run.end is not None:
            last_end[run.task] = max(last_end.get(run.task, run.end), run.end)
    acked = [
        (i, ok, tid)
        for i, ok in _acked(history, "submit")
        if i.args.get("slot")
        for tid in task_ids(ok)
    ]
    for i_a, ok_a, held in acked:
        for i_b, ok_b, other in acked:
            if held == other or i_a.args["slot"] != i_b.args["slot"] or held not in last_end:
                continue
            if i_b.time > ok_a.time and ok_b.time < last_end[held]:
                message = (
                    f"slot {i_a.args['slot']!r}: task {other} acknowledged while {held} held it "
                    f"(live until at least {last_end[held]:.3f})"
                )
                out.append(
                    Violation("double-slot", message, ok_b.time, (held, other), (ok_b.op_id,))
                )
    return out


def partial_transactions(history: History) -> list[Violation]:
    """A committed transaction is all-or-nothing: all of its tasks exist after healing, or
    (when its commit certainly failed) none made runnable: a commit refused before it reached
    a leader (a follower's 307) leaves the transaction open, its tasks ``pending`` and never
    run until it expires, which may come after the final read; an unknown commit either way."""
    ran = {execution.task for execution in history.executions}
    out = []
    for invoke, done in history.pairs():
        if invoke.f != "txn" or done is None:
            continue
        ids = [int(i) for i in invoke.args.get("ids", [])]  # the tasks submitted into it
        present = [i for i in ids if i in history.final.tasks]
        if done.type == "ok" and len(present) != len(ids):
            missing = sorted(set(ids) - set(present))
            message = f"committed transaction #{done.op_id} lost tasks {missing}"
        elif done.type == "fail" and any(
            history.final.tasks[i].get("state") != "pending" or i in ran for i in present
        ):
            message = f"failed transaction #{done.op_id} left tasks {present}"
        elif done.type == "info" and present and len(present) != len(ids):
            message = f"transaction #{done.op_id} (unknown) applied partly: {present} of {ids}"
        else:
            continue
        out.append(Violation("partial-txn", message, done.time, tuple(ids), (done.op_id,)))
    return out


def _read_key(task: dict[str, Any]) -> tuple[int, int]:
    return (1 if task.get("state") in FINAL_STATES else 0, int(task.get("attempt") or 0))


def backward_reads(history: History) -> list[Violation]:
    """Reads of one client from one broker never go backward: a task seen final stays final
    with the same state, and its attempt never decreases; but a tracked tree's root, which
    its tree's replay runs again. (Reads are served by any broker from its replica,
    docs/API.md, so across brokers a lagging follower may answer older state: the
    guarantee is per client and broker.)"""
    # A tracked root whose tree is replayed goes from finished back to waiting (docs/
    # TASKS.md: a failed tree's root runs again): its reads may go back, by design.
    roots = {t for i, ok in _acked(history, "submit") if "children" in i.args for t in task_ids(ok)}
    out = []
    seen: dict[tuple[str, str, int], tuple[tuple[int, int], str, Op]] = {}
    reads = sorted(
        ((i, c) for i, c in history.pairs() if i.f == "read" and c is not None and c.type == "ok"),
        key=lambda pair: pair[0].time,
    )
    for invoke, ok in reads:
        task_id = int(invoke.args["id"])
        if task_id in roots:
            continue
        key = (invoke.process, ok.node, task_id)
        now = (_read_key(ok.result), str(ok.result.get("state")))
        before = seen.get(key)
        if before is not None and before[2].time < invoke.time:
            (old_key, old_state, old_op) = before
            went_back = now[0] < old_key or (old_key[0] == 1 and now[1] != old_state)
            if went_back:
                message = (
                    f"{invoke.process} read task {task_id} on {ok.node} as {now[1]} "
                    f"(attempt {now[0][1]}) after {old_state} (attempt {old_key[1]})"
                )
                out.append(
                    Violation(
                        "backward-read", message, ok.time, (task_id,), (old_op.op_id, ok.op_id)
                    )
                )
                continue
        if before is None or now[0] >= before[0]:
            seen[key] = (now[0], now[1], ok)
    return out


def diverged_replicas(history: History) -> list[Violation]:
    """Every replica's digest equal, at one position, after healing."""
    digests = history.final.digests
    if len({digest for _, digest in digests.values()}) <= 1:
        return []
    shown = ", ".join(f"{b}@{p}={d[:12]}" for b, (p, d) in sorted(digests.items()))
    return [Violation("diverged", f"replicas differ after healing: {shown}", history.info.ended)]


def unwanted_errors(history: History) -> list[Violation]:
    """An acknowledged task whose work cannot fail ends ``finished``; ``cancelled`` only
    when a client asked to cancel it: by id, or (a task of the cancellable type) by a
    filter sent after the task's submission."""
    cancel_asked = {int(i.args["id"]) for i, _ in history.pairs() if i.f == "cancel"}
    filter_sent = [i.time for i, _ in history.pairs() if i.f == "cancel-matching"]
    out = []
    for invoke, ok in _acked(history, "submit"):
        if invoke.args.get("may_fail", False):
            continue
        for task_id in task_ids(ok):
            task = history.final.tasks.get(task_id)
            state = task.get("state") if task else None
            if state in (None, "finished") or state not in FINAL_STATES:
                continue  # lost or stuck ones are lost_acks' to report
            if state == "cancelled" and task_id in cancel_asked:
                continue
            by_filter = invoke.args.get("cancellable") and any(t > invoke.time for t in filter_sent)
            if state == "cancelled" and by_filter:
                continue
            error = (task or {}).get("error") or ""
            message = f"task {task_id} cannot fail but ended {state}: {str(error)[:200]}"
            out.append(Violation("unwanted-end", message, ok.time, (task_id,), (ok.op_id,)))
    return out


def outages(history: History) -> list[tuple[NemesisEvent, float, bool]]:
    """For each fault that must heal by itself (``bounded``): how long until the next
    acknowledged write, and whether one came (else: the time until the next fault, which
    may prolong the outage for its own reasons, or the end of the run)."""
    acks = sorted((ok.time, invoke.time) for invoke, ok in _acked(history, "submit"))
    faults = sorted(e.time for e in history.nemesis if e.action not in NOT_FAULTS)
    out = []
    for event in history.nemesis:
        if not event.bounded:
            continue
        window_end = min([t for t in faults if t > event.time] + [history.info.ended])
        # Writes sent after the fault: an answer already on its way when it struck says
        # nothing about the cluster after it.
        after = [t for t, sent in acks if event.time < sent and t <= window_end]
        out.append((event, (after[0] if after else window_end) - event.time, bool(after)))
    return out


def long_outages(history: History) -> list[Violation]:
    """After a fault that must heal by itself, the cluster acknowledges a write within the
    outage bound (measured as :func:`outages` says; a shorter window proves nothing)."""
    bound = history.info.outage_bound_s
    if bound <= 0:
        return []
    out = []
    for event, lasted, acked in outages(history):
        if lasted > bound:
            how = "the next acknowledged write came" if acked else "no write acknowledged for"
            message = (
                f"after {event.action} {event.detail} at {event.time:.3f}: {how} "
                f"{lasted:.1f} s later (bound {bound:.1f} s)"
            )
            out.append(Violation("outage", message, event.time))
    return out


def broken_trees(history: History) -> list[Violation]:
    """An acknowledged tracked root's tree (unless a client cancelled the root) completed,
    and every run of it spawned the root's children at most once: each child key as often
    as any other and at most once per run (a run that timed out before its root finished
    spawned none; a stale attempt's late report spawning them again shows as one more),
    each key finished in the end. No task of it can fail, so a run may end only by the tree's
    timeout (its children waited in the backlog longer than ``tree_timeout_s``; those not
    finished then are cancelled, saying so): a replay for another reason is a violation."""
    children: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for task in history.final.tasks.values():
        if task.get("parent") is not None:
            children[int(task["parent"])].append(task)
    cancel_asked = {int(i.args["id"]) for i, _ in history.pairs() if i.f == "cancel"}
    out = []
    for invoke, ok in _acked(history, "submit"):
        if "children" not in invoke.args:
            continue
        for root in task_ids(ok):
            if root in cancel_asked:
                continue  # a client cancelled the root: its tree fails (unwanted_errors' part)
            out += _broken_tree(history, root, int(invoke.args["children"]), children, ok)
    return out


def _broken_tree(
    history: History,
    root: int,
    spawned: int,
    children: dict[int, list[dict[str, Any]]],
    ok: Op,
) -> list[Violation]:
    tree = history.final.trees.get(root)
    kids = children.get(root, [])
    runs = int((tree or {}).get("attempt") or 0)
    per_key: dict[str, int] = defaultdict(int)
    for kid in kids:
        per_key[str((kid.get("params") or {}).get("key"))] += 1
    finished = {
        str((t.get("params") or {}).get("key")) for t in kids if t.get("state") == "finished"
    }
    # An earlier run's children that had not finished were cancelled when it timed out.
    stopped = [t for t in kids if t.get("state") != "finished"]
    if tree is None:
        message = f"acknowledged tracked root {root} has no tree"
    elif tree.get("state") != "completed":
        message = f"tree {root} ended {tree.get('state')!r} (reason {tree.get('reason')!r})"
    elif (
        len(per_key) != spawned
        or len(set(per_key.values())) > 1
        or max(per_key.values(), default=0) > runs
    ):
        counts = dict(sorted(per_key.items()))
        message = (
            f"tree {root} ({runs} run(s)) has children by key {counts}: its root spawns "
            f"{spawned}, at most once per run"
        )
    elif finished != set(per_key):
        message = f"tree {root}: children {sorted(set(per_key) - finished)} never finished"
    elif bad := [t for t in stopped if "timed out" not in str(t.get("error"))]:
        what = ", ".join(f"{t['id']} {t.get('state')} ({t.get('error')})" for t in bad[:5])
        message = f"tree {root} was run {runs} times, not only for its timeout: {what}"
    else:
        return []
    ids = (root, *sorted(int(t["id"]) for t in kids))
    return [Violation("broken-tree", message, ok.time, ids, (ok.op_id,))]


CHECKS: tuple[Callable[[History], list[Violation]], ...] = (
    lost_acks,
    duplicates,
    double_runs,
    stale_reports,
    split_brain,
    double_slots,
    partial_transactions,
    backward_reads,
    diverged_replicas,
    unwanted_errors,
    broken_trees,
    long_outages,
)


def check(history: History) -> list[Violation]:
    return [v for c in CHECKS for v in c(history)]


def _window(history: History, violation: Violation, window_s: float) -> Iterable[str]:
    related = set(violation.ops)
    for op in history.ops:
        near = abs(op.time - violation.time) <= window_s
        task_of = set(task_ids(op)) | ({int(op.args["id"])} if "id" in op.args else set())
        if near or op.op_id in related or task_of & set(violation.tasks):
            args = {k: v for k, v in op.args.items() if k != "params"}
            yield (
                f"  {op.time:10.3f} {op.process:>4} #{op.op_id:<5} {op.type:<6} {op.f:<6} "
                f"{args} -> {op.result} {op.node}"
            )
    for run in history.executions:
        if run.task in violation.tasks:
            yield f"  {run.start:10.3f} exec   {run}"


def report(history: History, violations: list[Violation], window_s: float = WINDOW_S) -> str:
    """What a failing run prints: how to rerun it, the schedule, each violation's window."""
    info = history.info
    lines = [
        f"{len(violations)} violation(s): seed {info.seed}, ledger {info.ledger}",
        f"rerun: python -m tests.jepsen --seed {info.seed} --faults {info.faults} "
        f"--ledger {info.ledger} --max-attempts {info.max_attempts}",
        f"logs and history: {info.log_dir}",
        "fault schedule:",
        *(f"  {e.time:10.3f} {e.action} {e.detail}" for e in history.nemesis),
    ]
    for violation in violations:
        lines.append(f"[{violation.kind}] {violation.message}")
        lines.extend(_window(history, violation, window_s))
    return "\n".join(lines)
