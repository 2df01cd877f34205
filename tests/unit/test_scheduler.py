"""The scheduler (broker/core/scheduler.py) against states built from real entries.

Every round goes through the real path: ``schedule`` -> one ``AssignTasks``
entry -> ``StateMachine.apply``, which must accept every assignment; after
each round the placement rules are re-checked from scratch on the state.
"""

from __future__ import annotations

import random
from collections import Counter
from typing import Any, Final

import pytest

from broker.core import Rejected, StateMachine, Task, TaskRef, TaskState
from broker.core import entries as e
from broker.core.scheduler import schedule

T0: Final = 1_700_000_000_000


class Cluster:
    """A StateMachine driven with real entries, with scheduling rounds on top."""

    def __init__(self, check_invariants: bool = True) -> None:
        self.m = StateMachine()
        self.check_invariants = check_invariants  # O(all tasks) per entry: off in long loops
        self.now = T0
        self.next_id = 0

    def apply(self, entry: e.Entry) -> Any:
        self.now += 1
        result = self.m.apply(entry).result
        if self.check_invariants:
            self.m.check_invariants()
        return result

    def worker(
        self,
        worker_id: str,
        task_types: dict[str, int] | None = None,
        resources: dict[str, float] | None = None,
        tenants: tuple[str, ...] = (),
    ) -> None:
        result = self.apply(
            e.RegisterWorker(
                time_ms=self.now,
                worker_id=worker_id,
                task_types={"*": 4} if task_types is None else task_types,
                resources=resources or {},
                tenants=tenants,
            )
        )
        assert not isinstance(result, Rejected), result

    def dead(self, worker_id: str) -> None:
        assert self.apply(e.WorkerDead(time_ms=self.now, worker_id=worker_id)) is None

    def submit(
        self, tenant: str, count: int = 1, type: str = "py", **resources: float
    ) -> list[int]:
        specs = []
        for _ in range(count):
            self.next_id += 1
            specs.append(
                e.TaskSpec(
                    id=self.next_id, type=type, tenant=tenant, params=b"null", resources=resources
                )
            )
        results = self.apply(e.SubmitTasks(time_ms=self.now, tasks=tuple(specs)))
        assert all(isinstance(r, TaskRef) for r in results), results
        return [s.id for s in specs]

    def tenant(self, name: str, **limits: Any) -> None:
        patch = e.TenantLimitsPatch(**limits)
        result = self.apply(e.SetTenant(time_ms=self.now, tenant=name, limits=patch))
        assert not isinstance(result, Rejected), result

    def global_limits(self, **limits: float) -> None:
        assert self.apply(e.SetConfig(time_ms=self.now, global_limits=limits)) is None

    def round(self, max_assignments: int = 1000, lookahead: int = 16) -> list[e.Assignment]:
        """Schedule, log the assignments, check that apply took them all and the rules hold."""
        assignments = schedule(self.m, max_assignments, lookahead)
        assert schedule(self.m, max_assignments, lookahead) == assignments  # no hidden state
        if assignments:
            results = self.apply(e.AssignTasks(time_ms=self.now, assignments=tuple(assignments)))
            rejected = [r for r in results if isinstance(r, Rejected)]
            assert not rejected, rejected
        check_rules(self.m)
        return assignments

    def finish(self, task_ids: list[int]) -> None:
        outcomes = []
        for task_id in task_ids:
            task = self.m.tasks[task_id]
            assert task.state == TaskState.RUNNING and task.worker is not None
            outcomes.append(e.TaskOutcome(task_id, task.worker, task.attempt, ok=True))
        results = self.apply(e.FinishTasks(time_ms=self.now, outcomes=tuple(outcomes)))
        assert all(isinstance(r, TaskRef) for r in results), results

    def running(self, tenant: str | None = None, worker: str | None = None) -> list[Task]:
        tasks = (self.m.tasks[i] for i in self.m.by_state[TaskState.RUNNING])
        return sorted(
            (
                t
                for t in tasks
                if (tenant is None or t.tenant == tenant) and (worker is None or t.worker == worker)
            ),
            key=lambda t: t.id,
        )

    def running_count(self, tenant: str) -> int:
        return self.m.tenant_counts.get(tenant, {}).get("running", 0)


def check_rules(m: StateMachine) -> None:
    """Placement rules recomputed from the tasks alone (independent of the scheduler)."""
    per_pool: Counter[tuple[str, str]] = Counter()
    per_resource: dict[tuple[str, str], float] = {}
    global_used: dict[str, float] = {}
    for task_id in m.by_state[TaskState.RUNNING]:
        task = m.tasks[task_id]
        assert task.worker is not None
        worker = m.workers[task.worker]
        assert worker.state == "connected"
        assert not worker.tenants or task.tenant in worker.tenants
        key = task.type if task.type in worker.task_types else "*"
        assert key in worker.task_types, f"task {task.id} of type {task.type} on {worker.id}"
        per_pool[(worker.id, key)] += 1
        for name, amount in task.resources.items():
            if amount > 0:
                assert name in worker.resources, f"{name} asked but {worker.id} has none"
            per_resource[(worker.id, name)] = per_resource.get((worker.id, name), 0) + amount
            global_used[name] = global_used.get(name, 0) + amount
    for (worker_id, key), count in per_pool.items():
        assert count <= m.workers[worker_id].task_types[key], (worker_id, key, count)
    for (worker_id, name), used in per_resource.items():
        if name in m.workers[worker_id].resources:
            assert used <= m.workers[worker_id].resources[name] + 1e-9, (worker_id, name)
    for name, limit in m.config.global_limits.items():
        assert global_used.get(name, 0) <= limit + 1e-9, (name, global_used[name], limit)


# --- capacity per task type ---------------------------------------------------------


def test_capacity_per_type_and_shared_star_pool() -> None:
    c = Cluster()
    c.worker("w1", task_types={"spark": 2, "*": 3})
    spark = c.submit("t", 5, type="spark")
    c.submit("t", 5, type="py")
    c.submit("t", 5, type="sql")
    c.round()
    running = c.running()
    by_type = Counter(t.type for t in running)
    assert by_type["spark"] == 2
    assert by_type["py"] + by_type["sql"] == 3  # one pool shared by every unlisted type
    assert c.round() == []  # everything full
    # A freed "*" slot goes to an unlisted type, a freed spark slot to spark.
    c.finish([next(t.id for t in running if t.type == "py")])
    (a,) = c.round()
    assert c.m.tasks[a.task_id].type in ("py", "sql")
    c.finish([spark[0]])
    (b,) = c.round()
    assert c.m.tasks[b.task_id].type == "spark"


def test_listed_type_never_falls_back_to_star_and_empty_map_accepts_nothing() -> None:
    c = Cluster()
    c.worker("w1", task_types={"spark": 0, "*": 10})
    c.worker("w2", task_types={})
    c.submit("t", 3, type="spark")
    assert c.round() == []
    py = c.submit("t", 3, type="py")
    assert sorted(a.task_id for a in c.round()) == py
    assert not c.running(worker="w2")


def test_picks_the_worker_with_most_free_capacity_ties_by_id() -> None:
    c = Cluster()
    c.worker("b", task_types={"*": 2})
    c.worker("a", task_types={"*": 2})
    c.worker("c", task_types={"*": 3})
    c.submit("t", 7)
    workers = [a.worker_id for a in c.round()]
    assert workers == ["c", "a", "b", "c", "a", "b", "c"]


def test_overcommitted_worker_gets_nothing_more() -> None:
    c = Cluster()
    c.worker("w1", task_types={"*": 4})
    c.submit("t", 10)
    assert len(c.round()) == 4
    running = c.running()
    # It comes back smaller but still runs the four: no new task until below 2.
    c.apply(
        e.RegisterWorker(
            time_ms=c.now,
            worker_id="w1",
            task_types={"*": 2},
            running=tuple(e.TaskAttempt(t.id, t.attempt) for t in running),
        )
    )
    assert len(c.running()) == 4
    assert schedule(c.m) == []
    c.finish([running[0].id, running[1].id])
    assert schedule(c.m) == []
    c.finish([running[2].id])
    assert len(c.round()) == 1


# --- resources ------------------------------------------------------------------------


def test_cpu_and_memory_bound_a_worker() -> None:
    c = Cluster()
    c.worker("w1", task_types={"*": 100}, resources={"cpu": 8, "memory_mb": 16000})
    c.submit("t", 10, cpu=1, memory_mb=5000)  # memory allows 3
    assert len(c.round()) == 3
    c.submit("u", 10, cpu=2)  # 5 cpu left: 2 tasks
    assert len(c.round()) == 2
    c.submit("v", 10, cpu=0.5, memory_mb=1000)  # 1 cpu and 1000 MB left: 1 task
    assert len(c.round()) == 1
    assert c.round() == []


def test_fractional_asks_fill_a_worker_exactly() -> None:
    c = Cluster()
    c.worker("w1", task_types={"*": 100}, resources={"cpu": 1})
    c.submit("t", 12, cpu=0.1)
    assert len(c.round()) == 10


def test_named_resource_the_worker_lacks_does_not_fit_unless_asked_zero() -> None:
    c = Cluster()
    c.worker("cpu-only", task_types={"*": 10}, resources={"cpu": 8})
    gpu = c.submit("t", 3, gpu=1)
    zero = c.submit("t", 2, gpu=0)
    assert sorted(a.task_id for a in c.round()) == zero
    c.worker("gpu-box", task_types={"*": 10}, resources={"cpu": 8, "gpu": 2})
    placed = c.round()
    assert len(placed) == 2 and {a.worker_id for a in placed} == {"gpu-box"}
    assert {a.task_id for a in placed} < set(gpu)


# --- workers: tenant filters, death ---------------------------------------------------


def test_worker_tenant_filter() -> None:
    c = Cluster()
    c.worker("private", task_types={"*": 5}, tenants=("a",))
    c.worker("shared", task_types={"*": 2})
    c.submit("a", 4)
    c.submit("b", 10)
    c.round()
    assert {t.tenant for t in c.running(worker="private")} == {"a"}
    assert c.running_count("b") == 2
    assert c.running_count("a") == 4


def test_dead_workers_get_nothing() -> None:
    c = Cluster()
    c.worker("w1")
    c.worker("w2")
    c.dead("w1")
    c.submit("t", 20)
    assert {a.worker_id for a in c.round()} == {"w2"}
    c.dead("w2")  # its tasks go back to waiting
    assert schedule(c.m) == []
    c.worker("w1")  # back again
    assert {a.worker_id for a in c.round()} == {"w1"}


# --- limits -----------------------------------------------------------------------------


def test_tenant_max_running_never_exceeded_also_after_lowering_it() -> None:
    c = Cluster()
    c.worker("w1", task_types={"*": 20})
    c.tenant("t", max_running=5)
    c.submit("t", 30)
    c.submit("u", 3)
    c.round()
    assert c.running_count("t") == 5
    assert c.running_count("u") == 3
    assert c.round() == []
    c.tenant("t", max_running=2)  # applies at the next call
    running = [t.id for t in c.running("t")]
    c.finish(running[:2])
    assert c.round() == []  # 3 running > 2: nothing new
    c.finish(running[2:3])
    assert c.round() == []  # 2 running == 2
    c.finish(running[3:4])
    assert len(c.round()) == 1
    assert c.running_count("t") == 2
    c.tenant("t", max_running=0)  # unlimited
    assert len(c.round()) == 20 - 2 - 3


def test_global_limits_cap_the_sum_over_running_tasks() -> None:
    c = Cluster()
    for i in range(3):
        c.worker(f"w{i}", task_types={"*": 10}, resources={"cpu": 10, "licence": 5})
    c.global_limits(licence=4)
    c.submit("t", 10, licence=1)
    c.submit("u", 10, licence=0.5)
    c.submit("v", 5, cpu=1)  # not limited
    c.round()
    used = sum(t.resources.get("licence", 0) for t in c.running())
    assert used == 4
    assert c.running_count("v") == 5
    assert c.round() == []
    c.global_limits(licence=6)  # raised: applies at the next call
    c.round()
    assert sum(t.resources.get("licence", 0) for t in c.running()) == 6
    c.submit("w", 2, licence=0)  # asking 0 of a limited resource is never blocked
    assert len(c.round()) == 2


# --- fair sharing -----------------------------------------------------------------------


def run_rounds(c: Cluster, rng: random.Random, rounds: int) -> list[tuple[int, int]]:
    """Schedule, record (running a, running b), finish a random half; repeat."""
    seen = []
    for _ in range(rounds):
        c.round()
        seen.append((c.running_count("a"), c.running_count("b")))
        c.finish([t.id for t in c.running() if rng.random() < 0.5])
    return seen


def test_weighted_fair_share_3_to_1() -> None:
    c = Cluster(check_invariants=False)
    c.worker("w1", task_types={"*": 4})
    c.worker("w2", task_types={"*": 4})
    c.tenant("a", weight=3)
    c.tenant("b", weight=1)
    c.submit("a", 2000)
    c.submit("b", 2000)
    seen = run_rounds(c, random.Random(7), 300)
    assert all(a + b == 8 for a, b in seen)  # saturated throughout
    mean_a = sum(a for a, _ in seen) / len(seen)
    mean_b = sum(b for _, b in seen) / len(seen)
    print(f"mean running a={mean_a:.3f} b={mean_b:.3f}")
    assert mean_a / mean_b == pytest.approx(3, rel=0.10)


def test_weight_change_applies_without_resubmission() -> None:
    c = Cluster(check_invariants=False)
    c.worker("w1", task_types={"*": 4})
    c.worker("w2", task_types={"*": 4})
    c.tenant("a", weight=3)
    c.submit("a", 2000)
    c.submit("b", 2000)
    rng = random.Random(11)
    run_rounds(c, rng, 50)
    c.tenant("a", weight=1)
    c.tenant("b", weight=3)
    run_rounds(c, rng, 10)  # settle: the running tasks must finish first
    seen = run_rounds(c, rng, 200)
    mean_a = sum(a for a, _ in seen) / len(seen)
    mean_b = sum(b for _, b in seen) / len(seen)
    print(f"mean running a={mean_a:.3f} b={mean_b:.3f}")
    assert mean_b / mean_a == pytest.approx(3, rel=0.10)


def test_drf_equalises_dominant_shares_textbook() -> None:
    # Ghodsi et al.: 9 cpu, 18 GB; A asks <1 cpu, 4 GB>, B asks <3 cpu, 1 GB>.
    c = Cluster()
    c.worker("w1", task_types={"*": 100}, resources={"cpu": 9, "memory_mb": 18000})
    c.submit("a", 10, cpu=1, memory_mb=4000)
    c.submit("b", 10, cpu=3, memory_mb=1000)
    c.round()
    assert c.running_count("a") == 3  # dominant share: memory 12/18 = 2/3
    assert c.running_count("b") == 2  # dominant share: cpu 6/9 = 2/3
    assert c.round() == []


def test_weighted_drf_on_a_resource() -> None:
    c = Cluster()
    c.worker("w1", task_types={"*": 100}, resources={"cpu": 12})
    c.tenant("a", weight=2)
    c.submit("a", 20, cpu=1)
    c.submit("b", 20, cpu=1)
    c.round()
    assert (c.running_count("a"), c.running_count("b")) == (8, 4)


def test_drf_counts_resources_of_already_running_tasks() -> None:
    c = Cluster()
    c.worker("w1", task_types={"*": 100}, resources={"cpu": 100})
    c.submit("a", 1, cpu=50)
    c.round()
    c.submit("a", 10, cpu=1)
    c.submit("b", 10, cpu=1)
    placed = c.round(max_assignments=10)
    # a already holds half the cpu: b is served until it catches up.
    assert all(c.m.tasks[p.task_id].tenant == "b" for p in placed)


def test_slot_fairness_without_resources_is_round_robin_by_name() -> None:
    c = Cluster()
    c.worker("w1", task_types={"*": 6})
    c.submit("b", 5)
    c.submit("a", 5)
    c.submit("c", 5)
    tenants = [c.m.tasks[a.task_id].tenant for a in c.round()]
    assert tenants == ["a", "b", "c", "a", "b", "c"]


# --- FIFO and lookahead -----------------------------------------------------------------


def test_fifo_within_a_tenant() -> None:
    c = Cluster()
    c.worker("w1", task_types={"*": 3})
    ids = c.submit("t", 10)
    assert [a.task_id for a in c.round()] == ids[:3]
    c.finish(ids[:2])
    assert [a.task_id for a in c.round()] == ids[3:5]


def test_lookahead_skips_a_non_fitting_head_without_starving_the_rest() -> None:
    c = Cluster()
    c.worker("w1", task_types={"*": 10}, resources={"cpu": 4})
    big = c.submit("t", 1, cpu=16)  # fits nowhere
    small = c.submit("t", 3, cpu=1)
    assert [a.task_id for a in c.round()] == small
    assert list(c.m.waiting["t"]) == big  # kept in place for later
    c.worker("w2", task_types={"*": 10}, resources={"cpu": 16})
    assert [a.task_id for a in c.round()] == big


def test_lookahead_bounds_the_depth_per_round_and_keeps_order() -> None:
    c = Cluster()
    c.worker("w1", task_types={"py": 10})
    heads = c.submit("t", 4, type="spark")  # no capacity for spark
    tail = c.submit("t", 2)
    assert c.round(lookahead=4) == []  # four misfits: t is done for this round
    assert [a.task_id for a in c.round(lookahead=5)] == tail
    assert list(c.m.waiting["t"]) == heads
    # Strict FIFO with lookahead 1.
    c.submit("t", 2)
    assert c.round(lookahead=1) == []


def test_round_examines_only_the_lookahead_window() -> None:
    c = Cluster()
    c.worker("w1", task_types={"*": 5})
    c.submit("big", 20_000, gpu=1)  # none fits
    c.submit("small", 5)

    class CountingTasks(dict[int, Task]):
        reads = 0

        def __getitem__(self, key: int) -> Task:
            CountingTasks.reads += 1
            return super().__getitem__(key)

    c.m.tasks = CountingTasks(c.m.tasks)
    assert len(schedule(c.m, lookahead=16)) == 5
    assert CountingTasks.reads <= 16 + 5


def test_max_assignments_and_argument_checks() -> None:
    c = Cluster()
    c.worker("w1", task_types={"*": 50})
    c.submit("t", 30)
    assert len(c.round(max_assignments=7)) == 7
    assert schedule(c.m, max_assignments=0) == []
    with pytest.raises(ValueError):
        schedule(c.m, lookahead=0)
    assert schedule(StateMachine()) == []


# --- determinism and randomized rounds ----------------------------------------------------


def build_mixed(seed: int) -> Cluster:
    rng = random.Random(seed)
    c = Cluster()
    for i in range(6):
        resources: dict[str, float] = {"cpu": rng.choice([4, 8]), "memory_mb": 16000}
        if i % 3 == 0:
            resources["gpu"] = 1
        c.worker(
            f"w{i}",
            task_types=rng.choice([{"*": 6}, {"spark": 3, "*": 2}, {"py": 4}]),
            resources=resources,
            tenants=("t0",) if i == 5 else (),
        )
    c.global_limits(licence=3)
    for name in ("t0", "t1", "t2", "t3"):
        c.tenant(name, weight=rng.choice([0.5, 1, 2, 5]), max_running=rng.choice([0, 0, 4]))
    for _ in range(40):
        resources = {}
        if rng.random() < 0.5:
            resources["cpu"] = rng.choice([0.5, 1, 2, 3])
        if rng.random() < 0.3:
            resources["memory_mb"] = rng.choice([1000, 4000, 9000])
        if rng.random() < 0.1:
            resources["gpu"] = 1
        if rng.random() < 0.1:
            resources["licence"] = 1
        c.submit(
            rng.choice(["t0", "t1", "t2", "t3"]),
            rng.randint(1, 30),
            type=rng.choice(["py", "spark", "sql"]),
            **resources,
        )
    return c


def test_same_state_same_assignments_also_after_a_snapshot_round_trip() -> None:
    first, second = build_mixed(3), build_mixed(3)
    assert first.m.digest() == second.m.digest()
    expected = schedule(first.m)
    assert expected
    assert schedule(second.m) == expected
    reloaded = StateMachine.from_snapshot(first.m.encode_snapshot())
    assert schedule(reloaded) == expected


@pytest.mark.parametrize("seed", range(8))
def test_random_workload_keeps_every_rule_and_apply_accepts_all(seed: int) -> None:
    c = build_mixed(seed)
    rng = random.Random(seed)
    assigned = 0
    for step in range(60):
        before = {name: c.running_count(name) for name in c.m.tenants}
        assigned += len(c.round(max_assignments=rng.choice([5, 50, 1000])))
        for tenant in c.m.tenants.values():
            after = c.running_count(tenant.name)
            if tenant.max_running and before[tenant.name] >= tenant.max_running:
                assert after == before[tenant.name]  # at or above a lowered limit: none
            elif tenant.max_running:
                assert after <= tenant.max_running
        c.finish([t.id for t in c.running() if rng.random() < 0.4])
        if step % 10 == 3:
            c.tenant(f"t{rng.randrange(4)}", weight=rng.choice([0.5, 1, 3]), max_running=2)
        if step % 15 == 7:
            c.dead(f"w{rng.randrange(6)}")
        if step % 15 == 12:
            c.worker(f"w{rng.randrange(6)}", task_types={"*": 5}, resources={"cpu": 8})
    assert assigned > 100
