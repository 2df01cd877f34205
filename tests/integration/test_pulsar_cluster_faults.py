"""Steward under faults of a real Pulsar cluster (issue 31, item 5: a bookie, the Pulsar broker
that owns Steward's ledger topic, a ZooKeeper member and Steward's own leader killed under
load; docs/TESTING.md, "A real Pulsar cluster"; docs/DESIGN.md §4).

One Pulsar cluster for the module (tests/support/pulsar_cluster.py: a 3-server ZooKeeper
ensemble, three bookies, two Pulsar brokers, ensemble 2 and write and ack quorums 2), started
by the first test and killed when the module ends, whatever happened. Each test runs three
real ``steward broker`` processes on it (``--pulsar-flavor pulsar``: ``ExclusiveWithFencing``
producers, one topic per ledger; their own election on the suite's ZooKeeper server, which
no fault touches), two workers running sleep tasks and :data:`CLIENTS` clients submitting
with idempotency keys (tests/support/write_load.py), kills one JVM of the Pulsar cluster
with SIGKILL mid-load and checks: writes go on (:data:`AFTER_FAULT` more acknowledged),
Steward's leader is the same broker on the same ledger (the fault never reaches Steward's
election: the Pulsar client behind its writer rides it out, well within its send timeout of
30 s), nothing acknowledged is lost nor stored twice, every sleep task finished exactly once,
every broker ends on one digest (the followers' readers followed), and the member restarted
is back. Each prints the longest pause in acknowledged writes the fault caused, for
docs/BENCHMARKS.md (not asserted).

- A bookie of the current ensemble of Steward's ledger, then the ZooKeeper ensemble's
  leader: the broker's BookKeeper client replaces the bookie by the spare one (an ensemble
  change, shown by the ledger's ensembles); with no spare bookie (ensemble 3 on three
  bookies) and an ack quorum of 2 the test fails (writes stop). The ZooKeeper leader's loss
  costs an election among the other two; the brokers' and bookies' sessions move to them.
- The Pulsar broker that owns the ledger's topic, with two brokers up: its ownership (a
  ZooKeeper ephemeral node) goes with its session, the other broker takes the topic over,
  and the Pulsar clients of Steward's writer and of the followers' readers reconnect there
  (the service URL names both brokers). With one Pulsar broker the test fails: nothing
  takes the topic over, the leader's appends time out and no write is acknowledged again.

- Steward's leader (the last test, the scenario of tests/support/leader_failover.py that
  tests/integration/test_cluster_failover.py runs on the file ledger and pulsar-lite): a new
  leader takes the ledger's topic over, fencing the dead one's producer in the engine, and
  recovers the ledger from its bookies.

Every wait is bounded.
"""

from __future__ import annotations

import itertools
import random
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from clients.dev.zk import ZooKeeperServer
from tests.support.cluster_procs import ClusterProcesses, ClusterWorker
from tests.support.leader_failover import (
    attempts_run,
    kill9_leader_under_load,
    seeded_rng,
    submit_task,
    task_of,
)
from tests.support.pulsar_cluster import PulsarCluster, PulsarClusterError, started_cluster
from tests.support.worker_procs import wait_until
from tests.support.write_load import WriteLoad, check_acknowledged, probe_idempotency

# The first test's set-up starts the cluster (30-115 s here; each member bounded), then
# each test runs about a minute.
pytestmark = pytest.mark.timeout(600)

#: Steward's default Pulsar namespace (``--pulsar-namespace``), created as an admin would.
NAMESPACE = "public/steward"
CLIENTS = 16
#: Acknowledged writes before a fault, and after it.
BEFORE_FAULT = 100
AFTER_FAULT = 200
#: Bound of the waits for writes to go on after a fault: a Pulsar broker's ZooKeeper
#: session (6 s) must expire before another broker takes its topics.
PROGRESS_TIMEOUT_S = 90.0
LONG_TASK_S = 10.0
FINISH_TIMEOUT_S = 60.0


@pytest.fixture(scope="module")
def pulsar_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PulsarCluster]:
    for cluster in started_cluster(tmp_path_factory, brokers=2):
        assert cluster.zookeeper is not None
        rss = cluster.rss_mb()
        print(
            f"\nPulsar {cluster.version} cluster started in {cluster.start_s:.1f} s "
            f"(ZooKeeper ensemble {cluster.zookeeper_start_s:.1f} s); resident MB "
            f"{ {name: round(mb) for name, mb in rss.items()} }, {sum(rss.values()):.0f} in all"
        )
        cluster.create_namespace(NAMESPACE)
        yield cluster


class StewardUnderLoad:
    """Three ``steward broker`` processes on the Pulsar cluster, two workers with sleep tasks
    and a write load with idempotency keys; :meth:`check` after a fault."""

    def __init__(self, steward: ClusterProcesses, rng: random.Random) -> None:
        self.steward = steward
        self.leader = steward.wait_for_leader(60)
        self.idempotent = probe_idempotency(self.leader, "load")
        self.workers: list[ClusterWorker] = [
            # DEBUG: each worker logs every attempt it runs, the record of what ran.
            steward.start_worker(
                f"w{i}", "--tenant", "sleepers", "--task-type", "sleep=6", "--log-level", "DEBUG"
            )
            for i in range(2)
        ]
        steward.wait_workers_connected([w.worker_id for w in self.workers], 30)
        self.ledger_id = max(steward.ledger_ids())
        self.load = WriteLoad(steward.urls(), clients=CLIENTS, idempotent=self.idempotent).start()
        self.load.wait_for_more_acks(BEFORE_FAULT, PROGRESS_TIMEOUT_S, "writes before the fault")
        # Long tasks run through the fault; the short ones end during it.
        seconds = [LONG_TASK_S] * 2 + [round(rng.uniform(1.0, 3.0), 2) for _ in range(10)]
        self.sleeps = [
            submit_task(
                self.leader, type="sleep", tenant="sleepers", params={"seconds": s}, max_attempts=3
            )
            for s in seconds
        ]

    @property
    def topic(self) -> str:
        """The Pulsar topic of Steward's current ledger."""
        return f"persistent://{NAMESPACE}/{self.steward.name}-ledger-{self.ledger_id:012d}"

    def writes_go_on(self, fault: str, at: float) -> None:
        """:data:`AFTER_FAULT` more writes are acknowledged; prints the longest pause in
        acknowledged writes from ``at`` (monotonic, the fault) on."""
        self.load.wait_for_more_acks(AFTER_FAULT, PROGRESS_TIMEOUT_S, f"writes after {fault}")
        times = sorted(ack.at for ack in self.load.acks())
        before = [t for t in times if t <= at]
        after = [t for t in times if t > at]
        stamps = [before[-1], *after] if before else after
        pause_s = max(b - a for a, b in itertools.pairwise(stamps))
        print(f"{fault}: longest pause in acknowledged writes {pause_s:.2f} s")

    def check(self) -> None:
        """The leader and its ledger unchanged, nothing acknowledged lost nor doubled, every
        sleep task finished exactly once, every broker on one digest."""
        record = self.load.stop()
        assert not record.unexpected, record.unexpected[:5]
        leader = self.steward.wait_for_leader(30)
        assert leader is self.leader, f"the leader moved from {self.leader} to {leader}"
        assert max(self.steward.ledger_ids()) == self.ledger_id, self.steward.ledger_ids()
        mine = check_acknowledged(
            leader, self.load, where="on the leader", expect_unique=self.idempotent
        )

        def all_final() -> dict[int, dict[str, Any]] | None:
            tasks = {i: task_of(leader, i) for i in self.sleeps}
            done = all(t["state"] in ("finished", "error", "cancelled") for t in tasks.values())
            return tasks if done else None

        final = wait_until(all_final, FINISH_TIMEOUT_S, "sleep tasks to finish", 0.2)
        runs = attempts_run(self.workers)
        problems = [
            f"task {i}: {t['state']} attempt {t['attempt']} on {t['worker']}, the workers ran "
            f"{runs.get(i, [])}"
            for i, t in final.items()
            if t["state"] != "finished" or runs.get(i, []) != [(t["worker"], t["attempt"])]
        ]
        assert not problems, "sleep tasks not run exactly once:\n" + "\n".join(problems)
        digest = self.steward.wait_for_equal_digests(30)
        print(
            f"{len(record.acked)} writes acknowledged ({len(mine)} load tasks on the leader, "
            f"idempotency keys honoured: {self.idempotent}), statuses {dict(record.statuses)}; "
            f"{len(final)} sleep tasks finished exactly once; leader {leader.broker_id} on "
            f"ledger {self.ledger_id} throughout; 3 brokers on digest {digest[:16]}"
        )


def created(cluster: PulsarCluster, namespace: str) -> bool:
    try:
        cluster.create_namespace(namespace, timeout_s=10.0)
    except PulsarClusterError:
        return False
    return True


def steward_on(zookeeper: ZooKeeperServer, cluster: PulsarCluster, root: Path) -> ClusterProcesses:
    return ClusterProcesses(
        zookeeper.connect_string,
        root,
        pulsar_url=cluster.service_url,
        pulsar_admin_url=cluster.admin_url,
    )


def test_a_killed_bookie_then_zookeeper_member_under_steward_load_lose_nothing(
    zookeeper: ZooKeeperServer, pulsar_cluster: PulsarCluster, tmp_path: Path
) -> None:
    rng = seeded_rng("bookie and ZooKeeper member kill on a Pulsar cluster")
    ensemble = pulsar_cluster.zookeeper
    assert ensemble is not None
    with steward_on(zookeeper, pulsar_cluster, tmp_path) as steward:
        run = StewardUnderLoad(steward, rng)
        before = pulsar_cluster.ledger_ensembles(run.topic)
        assert before, f"no ensemble for {run.topic}"
        victim = next(b for b in pulsar_cluster.bookies if b.bookie_id in before[-1])
        killed_at = time.monotonic()
        pulsar_cluster.kill9(victim)
        # Until its ZooKeeper session expires the dead bookie is still listed as available,
        # and a broker without a spare bookie rolls over to new ledgers placed on it, each
        # taking a write or two: the writes that count come after it left the list.
        wait_until(
            lambda: victim.bookie_id not in pulsar_cluster.available_bookies(),
            PROGRESS_TIMEOUT_S,
            f"{victim.name} gone from /ledgers/available",
        )
        run.writes_go_on(f"kill -9 of {victim.name}", killed_at)

        def changed() -> list[list[str]] | None:
            now = pulsar_cluster.ledger_ensembles(run.topic)
            return now if now and victim.bookie_id not in now[-1] else None

        after = wait_until(changed, PROGRESS_TIMEOUT_S, f"an ensemble without {victim.name}")
        print(f"{run.topic}: ensembles {before} before the kill, {after} after")
        assert after != before
        pulsar_cluster.restart(victim)
        wait_until(
            lambda: victim.bookie_id in pulsar_cluster.available_bookies(),
            PROGRESS_TIMEOUT_S,
            f"{victim.name} available again",
        )
        pulsar_cluster.wait_healthy()

        zk_leader = wait_until(ensemble.leader, 30, "a ZooKeeper leader")
        killed_at = time.monotonic()
        ensemble.kill9(zk_leader)
        run.writes_go_on(
            f"kill -9 of ZooKeeper member {zk_leader} (the ensemble's leader)", killed_at
        )
        # Metadata is written meanwhile (by the two members left): a namespace made through
        # the admin API (ZooKeeper's new leader may still be elected at first).
        wait_until(
            lambda: created(pulsar_cluster, f"public/without-zk-{zk_leader}"),
            PROGRESS_TIMEOUT_S,
            f"a namespace created without ZooKeeper member {zk_leader}",
            pause_s=1.0,
        )
        pulsar_cluster.wait_healthy()
        ensemble.restart(zk_leader)
        run.check()
    pulsar_cluster.wait_healthy()


def test_the_topic_owner_killed_steward_follows_the_other_broker_and_loses_nothing(
    zookeeper: ZooKeeperServer, pulsar_cluster: PulsarCluster, tmp_path: Path
) -> None:
    assert len(pulsar_cluster.brokers) == 2
    rng = seeded_rng("topic owner kill on a Pulsar cluster")
    with steward_on(zookeeper, pulsar_cluster, tmp_path) as steward:
        run = StewardUnderLoad(steward, rng)
        owner = pulsar_cluster.owner_of(run.topic)
        assert owner is not None, f"no broker owns {run.topic}"
        killed_at = time.monotonic()
        pulsar_cluster.kill9(owner)
        run.writes_go_on(f"kill -9 of {owner.name}, the owner of Steward's topic", killed_at)
        new_owner = pulsar_cluster.owner_of(run.topic)
        assert new_owner is not None and new_owner is not owner, new_owner
        run.check()
        pulsar_cluster.restart(owner)
        pulsar_cluster.wait_healthy()


def test_kill9_of_steward_s_leader_on_the_cluster_loses_nothing(
    zookeeper: ZooKeeperServer, pulsar_cluster: PulsarCluster, tmp_path: Path
) -> None:
    """Steward's own leader killed -9 under load (tests/support/leader_failover.py) on the
    multi-bookie cluster: the new leader takes the ledger's topic over (the engine fences the
    dead leader's producer) and recovers the ledger from two bookies; nothing acknowledged
    lost, every task once, one digest. Prints the fail-over time."""
    rng = seeded_rng("kill9 of Steward's leader on a Pulsar cluster")
    with steward_on(zookeeper, pulsar_cluster, tmp_path) as steward:
        failover_s = kill9_leader_under_load(steward, rng)
    version = pulsar_cluster.version
    print(f"Pulsar {version} cluster: fail-over {failover_s:.3f} s after the kill -9")
