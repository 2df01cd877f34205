"""The Jepsen checker on hand-made histories: a clean one passes, and each kind of violation
(lost ack, duplicate, double run, stale report, split-brain ack, double-held slot, partial
transaction, backward read, diverged replicas, task ended in error, over-long outage, broken
tree) is detected (batches and cancels by filter too), and the report names the seed, the
schedule and the window around it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tests.jepsen.checker import check, report, zombie_attempts
from tests.jepsen.history import (
    Claim,
    Execution,
    History,
    NemesisEvent,
    Op,
    OpType,
    RunInfo,
    read_executions,
)


class Script:
    """Builds a history with explicit times (the recorder's clock is not used)."""

    def __init__(self) -> None:
        self.history = History(RunInfo(seed=7, log_dir="/tmp/run-7", outage_bound_s=8.0))
        self.history.info.ended = 100.0
        self._id = 0

    def op(
        self,
        f: str,
        args: dict[str, Any],
        start: float,
        end: float,
        type_: OpType = "ok",
        result: dict[str, Any] | None = None,
        node: str = "b1",
        process: str = "c1",
    ) -> None:
        self._id += 1
        self.history.ops.append(Op(process, self._id, "invoke", f, start, args))
        self.history.ops.append(Op(process, self._id, type_, f, end, args, result or {}, node))

    def task(self, task_id: int, state: str = "finished", attempt: int = 1, **extra: Any) -> None:
        params = {"key": f"k{task_id}"}
        self.history.final.tasks[task_id] = {
            "id": task_id,
            "state": state,
            "attempt": attempt,
            "tenant": "t",
            "params": params,
            "result": {"attempt": attempt},
            **extra,
        }

    def submit(self, task_id: int, start: float, end: float, **args: Any) -> None:
        self.op("submit", {"key": f"k{task_id}", "tenant": "t", **args}, start, end,
                result={"id": task_id})  # fmt: skip


def clean() -> Script:
    s = Script()
    s.history.claims.append(Claim(0.5, "b1", 1))
    for n in range(1, 4):
        s.submit(n, float(n), n + 0.5)
        s.task(n)
        s.history.executions.append(Execution(n, 1, "w1", n + 1.0, n + 1.5))
    s.op("read", {"id": 1}, 2.0, 2.1, result={"id": 1, "state": "running", "attempt": 1})
    s.op("read", {"id": 1}, 3.0, 3.1, result={"id": 1, "state": "finished", "attempt": 1})
    s.history.final.digests = {"b1": (40, "abc"), "b2": (40, "abc"), "b3": (40, "abc")}
    return s


def kinds(s: Script) -> list[str]:
    return [v.kind for v in check(s.history)]


def test_a_clean_history_passes() -> None:
    assert check(clean().history) == []


def test_a_lost_and_a_stuck_ack_are_detected() -> None:
    s = clean()
    del s.history.final.tasks[2]
    s.task(3, state="running")
    assert kinds(s) == ["lost-ack", "lost-ack"]


def test_an_unknown_submit_that_did_not_happen_is_no_loss() -> None:
    s = clean()
    s.op("submit", {"key": "k9", "tenant": "t"}, 5.0, 9.0, type_="info")
    assert check(s.history) == []


def test_one_key_two_tasks_is_a_duplicate() -> None:
    s = clean()
    s.task(4)
    s.history.final.tasks[4]["params"] = {"key": "k1"}
    assert kinds(s) == ["duplicate"]


def test_one_attempt_on_two_workers_at_once() -> None:
    s = clean()
    s.history.executions.append(Execution(1, 1, "w2", 2.2, 2.8))
    assert kinds(s) == ["double-run"]


def test_a_zombie_attempt_beside_its_replacement_is_allowed() -> None:
    s = clean()
    s.task(1, attempt=2)
    s.history.executions.append(Execution(1, 2, "w2", 2.2, 2.8))
    assert check(s.history) == []


def test_a_stale_report_accepted() -> None:
    s = clean()
    s.task(1, attempt=2)
    s.history.final.tasks[1]["result"] = {"attempt": 1}
    assert kinds(s) == ["stale-report"]


def test_an_ack_by_a_deposed_leader_is_split_brain() -> None:
    s = clean()
    s.history.claims.append(Claim(10.0, "b2", 5))
    s.submit(4, 11.0, 11.2)  # answered by b1, epoch 1, after b2 took over at epoch 5
    s.task(4)
    assert kinds(s) == ["split-brain"]


def test_the_old_leader_taking_over_again_is_no_split_brain() -> None:
    s = clean()
    s.history.claims += [Claim(10.0, "b2", 5), Claim(10.5, "b1", 7)]
    s.submit(4, 11.0, 11.2)
    s.task(4)
    assert check(s.history) == []


def test_a_slot_held_by_two_running_tasks() -> None:
    s = clean()
    s.history.executions = [
        Execution(1, 1, "w1", 2.0, 4.0, slot="s"),
        Execution(2, 1, "w2", 3.0, 5.0, slot="s"),
        Execution(3, 1, "w1", 4.0, 4.5),
    ]
    assert kinds(s) == ["double-slot"]


def test_a_slot_acknowledged_while_its_holder_lived() -> None:
    s = Script()
    s.submit(1, 1.0, 1.1, slot="s")
    s.submit(2, 2.0, 2.1, slot="s")  # task 1 runs until 3.0: the slot was busy
    s.task(1)
    s.task(2)
    s.history.executions = [Execution(1, 1, "w1", 1.5, 3.0, slot="s")]
    assert kinds(s) == ["double-slot"]


def test_a_committed_transaction_missing_a_task() -> None:
    s = clean()
    s.op("txn", {"ids": [1, 2, 9]}, 5.0, 5.5)
    s.op("txn", {"ids": [3]}, 6.0, 6.5, type_="fail")
    assert kinds(s) == ["partial-txn", "partial-txn"]


def test_a_failed_commit_may_leave_its_open_transaction_s_tasks_pending() -> None:
    # The commit reached only a follower (307): the transaction stays open until it expires,
    # its task pending and never run; a task of it that ran would be a violation.
    s = clean()
    s.task(7, state="pending")
    s.op("txn", {"ids": [7]}, 5.0, 5.5, type_="fail")
    assert check(s.history) == []
    s.history.executions.append(Execution(7, 1, "w1", 6.0, 6.5))
    assert "partial-txn" in kinds(s)


def test_an_unknown_transaction_is_all_or_nothing_too() -> None:
    s = clean()
    s.op("txn", {"ids": [1, 2]}, 5.0, 5.5, type_="info")
    s.op("txn", {"ids": [8, 9]}, 6.0, 6.5, type_="info")
    assert check(s.history) == []
    s.op("txn", {"ids": [3, 9]}, 7.0, 7.5, type_="info")
    assert kinds(s) == ["partial-txn"]


def test_a_read_going_backward_on_one_broker() -> None:
    s = clean()
    s.op("read", {"id": 1}, 4.0, 4.1, result={"id": 1, "state": "running", "attempt": 1})
    assert kinds(s) == ["backward-read"]


def test_a_lagging_follower_read_is_the_documented_weaker_guarantee() -> None:
    s = clean()
    s.op("read", {"id": 1}, 4.0, 4.1, result={"state": "running", "attempt": 1}, node="b2")
    assert check(s.history) == []


def test_diverged_digests() -> None:
    s = clean()
    s.history.final.digests["b3"] = (40, "abd")
    assert kinds(s) == ["diverged"]


def test_a_task_that_cannot_fail_ended_in_error() -> None:
    s = clean()
    s.task(2, state="error", error="Traceback ...")
    s.task(3, state="cancelled")
    s.submit(5, 7.0, 7.1, may_fail=True)
    s.task(5, state="error")
    s.op("cancel", {"id": 1}, 8.0, 8.1)
    s.task(1, state="cancelled")
    assert kinds(s) == ["unwanted-end", "unwanted-end"]


def test_an_outage_longer_than_the_bound() -> None:
    s = clean()
    s.history.nemesis.append(NemesisEvent(10.0, "kill", {"node": "b1"}, bounded=True))
    s.history.nemesis.append(NemesisEvent(30.0, "isolate-clients", {}, bounded=False))
    s.submit(4, 12.0, 17.0)
    s.task(4)
    assert check(s.history) == []
    s.history.nemesis.append(NemesisEvent(40.0, "kill", {"node": "b2"}, bounded=True))
    s.submit(5, 41.0, 49.5)
    s.task(5)
    violations = check(s.history)
    assert [v.kind for v in violations] == ["outage"]
    assert "9.5 s later" in violations[0].message


def test_the_report_shows_seed_schedule_window_and_logs() -> None:
    s = clean()
    s.history.nemesis.append(NemesisEvent(1.8, "partition", {"cut": ["b1", "zk"]}))
    del s.history.final.tasks[2]
    text = report(s.history, check(s.history))
    assert "seed 7" in text
    assert "--seed 7 --faults 0" in text
    assert "/tmp/run-7" in text
    assert "partition" in text
    assert "[lost-ack] acknowledged task 2" in text
    assert "k2" in text  # the submit of task 2 is in the window


def test_a_history_round_trips_through_json_lines(tmp_path: Path) -> None:
    s = tree_of(10, children=2)
    s.history.nemesis.append(NemesisEvent(1.8, "kill", {"node": "b1"}, bounded=True))
    path = tmp_path / "history.jsonl"
    s.history.dump(path)
    loaded = History.load(path)
    assert loaded.ops == s.history.ops
    assert loaded.executions == s.history.executions
    assert loaded.claims == s.history.claims
    assert loaded.nemesis == s.history.nemesis
    assert loaded.final.tasks == s.history.final.tasks
    assert loaded.final.digests == s.history.final.digests
    assert loaded.final.trees == s.history.final.trees
    assert loaded.info == s.history.info


def test_executions_pair_start_and_done_lines(tmp_path: Path) -> None:
    path = tmp_path / "effects.jsonl"
    path.write_text(
        '{"event": "start", "task": 1, "attempt": 1, "worker": "w1", "time": 2.0}\n'
        '{"event": "start", "task": 1, "attempt": 2, "worker": "w2", "time": 3.0, "slot": "s"}\n'
        '{"event": "done", "task": 1, "attempt": 1, "worker": "w1", "time": 4.0}\n'
    )
    assert read_executions(path) == [
        Execution(1, 1, "w1", 2.0, 4.0),
        Execution(1, 2, "w2", 3.0, None, "s"),
    ]


def test_a_trailing_confirm_marker_is_no_divergence() -> None:
    s = clean()
    s.history.final.digests["b1"] = (41, "abc")  # the leader's position counts its marker
    assert check(s.history) == []


def test_an_outage_prolonged_by_the_next_fault_is_not_the_first_ones() -> None:
    s = clean()
    s.history.nemesis.append(NemesisEvent(10.0, "kill-leader", {}, bounded=True))
    s.history.nemesis.append(NemesisEvent(15.0, "kill-zookeeper", {}))
    s.submit(4, 16.0, 30.0)  # ZooKeeper was down: the leader's kill is not to blame
    s.task(4)
    assert check(s.history) == []
    s.history.nemesis.append(NemesisEvent(40.0, "kill-leader", {}, bounded=True))
    s.history.nemesis.append(NemesisEvent(55.0, "kill-zookeeper", {}))
    assert [v.kind for v in check(s.history)] == ["outage"]  # 15 s without an ack


def test_a_run_without_an_end_proves_no_overlap() -> None:
    s = clean()
    s.history.executions.append(Execution(1, 1, "w2", 0.5, None))  # killed with its worker
    s.history.executions.append(Execution(2, 1, "w2", 1.0, None, slot="s"))
    s.history.executions.append(Execution(3, 1, "w1", 2.0, 2.5, slot="s"))
    assert check(s.history) == []


def test_a_task_of_an_uncommitted_transaction_is_no_lost_ack() -> None:
    s = clean()
    s.submit(8, 5.0, 5.1, txn=3)  # acknowledged as pending; the commit never came
    assert check(s.history) == []


def test_zombie_attempts_are_counted_and_allowed() -> None:
    s = clean()
    s.task(9, attempt=2)
    s.history.final.tasks[9]["result"] = {"attempt": 2}
    s.history.executions += [
        Execution(9, 1, "w1", 10.0, 25.0),  # paused, resumed after its replacement started
        Execution(9, 2, "w2", 22.0, 22.5),
        Execution(9, 3, "w2", 30.0, None),  # killed: proves nothing
    ]
    assert [(old.attempt, new.attempt) for old, new in zombie_attempts(s.history)] == [(1, 2)]
    assert kinds(s) == []


def batch_of(s: Script, ids: list[int], start: float) -> None:
    """A batch submit: one request key, each task's own key in the answer."""
    keys = [f"b{start}/{n}" for n in range(len(ids))]
    s.op("submit", {"key": f"b{start}", "tenant": "t", "batch": len(ids)}, start, start + 0.1,
         result={"ids": ids, "keys": keys})  # fmt: skip
    for task_id, key in zip(ids, keys, strict=True):
        s.task(task_id)
        s.history.final.tasks[task_id]["params"] = {"key": key}


def test_a_batch_is_one_task_per_key_and_its_loss_or_duplicate_is_detected() -> None:
    s = clean()
    batch_of(s, [4, 5, 6], 5.0)
    assert check(s.history) == []
    # Its retry answered the same ids (replayed): still one task per key.
    s.op("submit", {"key": "b5.0", "tenant": "t", "batch": 3}, 6.0, 6.1,
         result={"ids": [4, 5, 6], "keys": ["b5.0/0", "b5.0/1", "b5.0/2"]})  # fmt: skip
    assert check(s.history) == []
    del s.history.final.tasks[5]
    s.task(7)
    s.history.final.tasks[7]["params"] = {"key": "b5.0/0"}  # a second task of one item
    assert kinds(s) == ["lost-ack", "lost-ack", "duplicate"]  # each of its two acks


def tree_of(root: int, children: int, start: float = 5.0) -> Script:
    s = clean()
    s.submit(root, start, start + 0.1, children=children)
    s.task(root, root=root)
    for n in range(children):
        s.task(root + 1 + n, root=root, parent=root)
        s.history.final.tasks[root + 1 + n]["params"] = {"key": f"k{root}/c{n}"}
    s.history.final.trees[root] = {"root": root, "state": "completed", "attempt": 1}
    return s


def test_a_tree_completes_once_with_every_child_finished() -> None:
    assert check(tree_of(10, children=3).history) == []
    missing = tree_of(10, children=3)
    del missing.history.final.tasks[12]
    assert kinds(missing) == ["broken-tree"]
    failed = tree_of(10, children=2)
    failed.task(11, state="error", root=10, parent=10)
    failed.history.final.trees[10].update(state="failed", reason="task 11 failed")
    assert kinds(failed) == ["broken-tree"]
    replayed = tree_of(10, children=2)
    replayed.history.final.trees[10]["attempt"] = 2  # replayed, not by its timeout:
    for n in range(2):
        replayed.task(13 + n, state="cancelled", root=10, parent=10)
        replayed.history.final.tasks[13 + n]["params"] = {"key": f"k10/c{n}"}
        replayed.history.final.tasks[13 + n]["error"] = "tree of task 10 failed: task 9 failed"
    assert kinds(replayed) == ["broken-tree"]
    gone = tree_of(10, children=2)
    del gone.history.final.trees[10]
    assert kinds(gone) == ["broken-tree"]
    cancelled = tree_of(10, children=0)
    cancelled.task(10, state="cancelled", root=10)
    cancelled.history.final.trees[10].update(state="failed", reason="task 10 was cancelled")
    assert kinds(cancelled) == ["unwanted-end", "broken-tree"]
    cancelled.op("cancel", {"id": 10}, 6.0, 6.1)  # asked: both allowed
    assert check(cancelled.history) == []


def test_a_stale_attempt_spawning_its_children_again_is_detected() -> None:
    s = tree_of(10, children=2)
    s.task(13, root=10, parent=10)
    s.history.final.tasks[13]["params"] = {"key": "k10/c0"}  # spawned twice
    assert kinds(s) == ["broken-tree"]


def test_a_tree_replayed_after_its_timeout_spawns_once_per_run() -> None:
    s = tree_of(10, children=2)
    # Its first run's children waited past tree_timeout_s and were cancelled; the second
    # run spawned them again (same keys) and they finished.
    for n in range(2):
        s.task(13 + n, state="cancelled", root=10, parent=10)
        s.history.final.tasks[13 + n]["error"] = "tree of task 10 failed: tree timed out"
        s.history.final.tasks[13 + n]["params"] = {"key": f"k10/c{n}"}
    s.history.final.trees[10]["attempt"] = 2  # its reason is cleared once it completes
    assert check(s.history) == []
    s.history.final.tasks[14]["error"] = "tree of task 10 failed: task 9 ended in error"
    assert kinds(s) == ["broken-tree"]  # a run ended for another reason
    s.history.final.tasks[14]["error"] = "tree of task 10 failed: tree timed out"
    s.history.final.trees[10]["attempt"] = 3  # a run that timed out before its root ran
    assert check(s.history) == []
    s.task(15, root=10, parent=10)
    s.history.final.tasks[15]["params"] = {"key": "k10/c1"}  # a third spawn of one key
    assert kinds(s) == ["broken-tree"]
    s.history.final.trees[10]["attempt"] = 2
    s.task(16, root=10, parent=10)
    s.history.final.tasks[16]["params"] = {"key": "k10/c0"}  # three of each in two runs
    assert kinds(s) == ["broken-tree"]


def test_a_replayed_tree_root_may_read_waiting_after_finished() -> None:
    s = tree_of(10, children=2)
    s.history.final.trees[10]["attempt"] = 2
    s.op("read", {"id": 10}, 6.0, 6.1, result={"id": 10, "state": "finished", "attempt": 1})
    s.op("read", {"id": 10}, 7.0, 7.1, result={"id": 10, "state": "waiting", "attempt": 1})
    assert check(s.history) == []
    s.op("read", {"id": 2}, 6.0, 6.1, result={"id": 2, "state": "finished", "attempt": 1})
    s.op("read", {"id": 2}, 7.0, 7.1, result={"id": 2, "state": "waiting", "attempt": 1})
    assert kinds(s) == ["backward-read"]  # not a tree root


def test_a_cancel_by_filter_allows_cancelled_tasks_of_its_type_only() -> None:
    s = clean()
    s.submit(4, 5.0, 5.1, cancellable=True)
    s.task(4, state="cancelled")
    assert kinds(s) == ["unwanted-end"]  # nobody asked
    s.op("cancel-matching", {"tenant": "t", "type": "c", "state": "waiting"}, 6.0, 6.5,
         result={"matched": 1, "cancelled": 1})  # fmt: skip
    assert check(s.history) == []
    s.task(2, state="cancelled")  # not of the cancellable type: the filter cannot match it
    assert kinds(s) == ["unwanted-end"]
