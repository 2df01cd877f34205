"""Issue 4 acceptance: real broker clusters (three brokers unless said) on a real ZooKeeper.

Real ``steward broker`` and ``steward worker`` processes, real ``kill -9`` and SIGSTOP.
Each test runs its own cluster (its own cluster name, ledger dir and data dirs) on the
module's ZooKeeper server, prints its seed and the figures it measured, and bounds every
wait. Rerun one seed with ``STEWARD_TEST_SEED=<seed>``.
"""

from __future__ import annotations

import re
import time
from collections import Counter
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
import pytest

from clients.dev.pulsar_lite import PulsarLiteServer
from clients.dev.zk import ZooKeeperServer
from tests.support.cluster_procs import BrokerNode, ClusterProcesses
from tests.support.leader_failover import (
    CLIENTS,
    FAILOVER_LIMIT_S,
    SESSION_TIMEOUT_S,
    kill9_leader_under_load,
    seeded_rng,
    submit_task,
    take_over,
    task_of,
)
from tests.support.worker_procs import wait_until
from tests.support.write_load import (
    WriteLoad,
    check_acknowledged,
    fetch_tasks,
    flocks_held,
    probe_idempotency,
)


@pytest.fixture(params=["file", "pulsar"])
def pulsar_url(request: pytest.FixtureRequest) -> str | None:
    """The ledger backend of the cluster: None for the file backend (a shared directory),
    else pulsar-lite's URL for the pulsar backend (which cannot fence there: the ZooKeeper
    check and confirmed LACs protect acknowledged writes)."""
    if request.param == "file":
        return None
    server = request.getfixturevalue("pulsar_lite")
    url: str = server.service_url
    return url


pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]


def test_follower_redirects_writes_and_serves_reads(
    zookeeper: ZooKeeperServer, tmp_path: Path
) -> None:
    with ClusterProcesses(zookeeper.connect_string, tmp_path) as cluster:
        leader = cluster.wait_for_leader(30)
        followers = [node for node in cluster.live() if node is not leader]
        assert len(followers) == 2
        ids = [
            submit_task(leader, type="demo.job", tenant="reads", params={"n": n}) for n in range(20)
        ]
        for follower in followers:
            health = follower.health()
            assert health is not None
            assert (health["role"], health["writable"]) == ("follower", False), health
            response = httpx.post(
                follower.url + "/api/v1/tasks",
                json={"type": "demo.job", "tenant": "reads", "params": {"n": -1}},
                timeout=10,
                follow_redirects=False,
            )
            assert response.status_code == 307, response.text
            error = response.json()["error"]
            assert error["code"] == "not_leader", error
            assert error["leader_url"] == leader.url, (error, leader)
            assert error["retryable"] is True
            assert response.headers["location"] == leader.url + "/api/v1/tasks"

            # Reads on a follower see what the leader acknowledged (once it caught up).
            def visible(follower: BrokerNode = follower) -> bool:
                return len(fetch_tasks(follower, tenant="reads")) == len(ids)

            wait_until(visible, 10, f"tasks on follower {follower.broker_id}")
            for task_id, n in zip(ids, range(20), strict=True):
                task = task_of(follower, task_id)
                assert (task["type"], task["params"], task["state"]) == (
                    "demo.job",
                    {"n": n},
                    "waiting",
                )
            summary = follower.get_json("/api/v1/cluster")
            assert (summary["leader"], summary["leader_url"]) == (leader.broker_id, leader.url)
            assert summary["leader_worker_address"] == leader.worker_address
        # The redirected writes created nothing.
        assert sorted(fetch_tasks(leader, tenant="reads")) == ids
        digest = cluster.wait_for_equal_digests(10)
        print(f"3 brokers agree on digest {digest[:16]}")


def test_kill9_leader_under_load(
    zookeeper: ZooKeeperServer, tmp_path: Path, pulsar_url: str | None
) -> None:
    rng = seeded_rng("kill9")
    with ClusterProcesses(zookeeper.connect_string, tmp_path, pulsar_url=pulsar_url) as cluster:
        kill9_leader_under_load(cluster, rng)


def test_sigstop_leader(zookeeper: ZooKeeperServer, tmp_path: Path, pulsar_url: str | None) -> None:
    rng = seeded_rng("sigstop")
    with ClusterProcesses(zookeeper.connect_string, tmp_path, pulsar_url=pulsar_url) as cluster:
        old = cluster.wait_for_leader(30)
        idempotent = probe_idempotency(old, "load")
        # Pinned to the leader, no redirects followed; a long timeout keeps the requests
        # of the frozen period open until it resumes and answers them.
        direct = WriteLoad(
            [old.url], clients=8, follow=False, idempotent=idempotent, request_timeout_s=30
        ).start()
        through = WriteLoad(
            cluster.urls(), clients=16, idempotent=idempotent, request_timeout_s=2.0
        ).start()
        time.sleep(rng.uniform(0.5, 1.5))
        stopped_at = cluster.sigstop(old.broker_id)
        # The take-over must not wait for the frozen leader, also when it froze inside a
        # batch holding its segment's flock (recovery fences with a marker instead).
        holding = flocks_held(old.pid, cluster.ledger_dir)
        frozen_s = SESSION_TIMEOUT_S + rng.uniform(1.0, 2.0)
        new, first = take_over(cluster, through, old, stopped_at)
        took_over = (
            f"took writes {first.at - stopped_at:.3f} s after the SIGSTOP "
            f"(frozen {'holding the flock of ' + str(holding) if holding else 'outside a batch'})"
        )
        # Clients redirected to the frozen leader wait out their 2 s request timeout
        # before trying again, so the first acknowledgement they see may lag the new
        # leader's readiness by that much (a kill -9 refuses connections at once instead).
        assert first.at - stopped_at < FAILOVER_LIMIT_S + 2.0, took_over
        time.sleep(max(0.0, stopped_at + frozen_s - time.monotonic()))
        resumed_at = cluster.sigcont(old.broker_id)

        def rejoined() -> bool:
            health = old.health()
            return health is not None and health["role"] == "follower"

        _, rejoin_s = _timed(lambda: wait_until(rejoined, 20, f"{old.broker_id} to follow"))
        time.sleep(1.0)  # the pinned clients keep writing to the deposed broker
        direct_record = direct.stop()
        through_record = through.stop()
        health = old.health()
        assert health is not None and (health["role"], health["writable"]) == ("follower", False)

        after = [a for a in direct.answers() if a.status != 0 and a.at >= resumed_at]
        held = [a for a in after if a.sent_at < resumed_at]
        # A write already durable when the SIGSTOP hit may still be acknowledged after the
        # resume: its ZooKeeper confirmation was answered before the take-over, and the new
        # leader's recovery includes it (check_acknowledged below proves it). Anything sent
        # during the freeze must be refused as retryable.
        in_flight = [a for a in after if a.status == 201 and a.sent_at < stopped_at]
        bad = [
            a
            for a in after
            if a not in in_flight and (a.status not in (307, 503) or a.retryable is not True)
        ]
        print(
            f"{old.broker_id} frozen {resumed_at - stopped_at:.2f} s; {new.broker_id} "
            f"{took_over}; {old.broker_id} followed {rejoin_s:.2f} s after SIGCONT; "
            f"it answered {len(after)} requests "
            f"after resuming ({len(held)} sent while frozen, {len(in_flight)} acknowledged "
            "writes durable before the freeze): "
            f"{dict(sorted(Counter(a.status for a in after).items()))}; "
            f"direct {dict(direct_record.statuses)}, through {dict(through_record.statuses)}"
        )
        assert held, "no request sent during the freeze was answered after it: nothing tested"
        assert not bad, f"the deposed leader answered {bad[:5]}"
        assert not through_record.unexpected, through_record.unexpected[:5]
        assert not direct_record.unexpected, direct_record.unexpected[:5]
        check_acknowledged(new, direct, where="(pinned clients)", expect_unique=idempotent)
        check_acknowledged(new, through, where="(leader-following)", expect_unique=idempotent)
        digest = cluster.wait_for_equal_digests(30)
        print(
            f"{len(direct_record.acked)} + {len(through_record.acked)} acknowledged writes "
            f"intact; 3 brokers agree on digest {digest[:16]}"
        )


def _ledger_ids(ledger_dir: Path) -> list[int]:
    return sorted(int(p.name.split("-")[1].split(".")[0]) for p in ledger_dir.glob("ledger-*.log"))


def test_new_broker_joins_after_retention(
    zookeeper: ZooKeeperServer, tmp_path: Path, pulsar_url: str | None
) -> None:
    # Tiny ledgers that roll often, snapshots every 0.3 s and a retention of ~1 s: the
    # first ledgers are deleted while the load runs.
    args = (
        "--ledger-roll-mb",
        "0.01",
        "--ledger-roll-age-s",
        "0.3",
        "--snapshot-interval-s",
        "0.3",
        "--ledger-retention-h",
        str(1.0 / 3600),
    )
    with ClusterProcesses(
        zookeeper.connect_string, tmp_path, extra_args=args, pulsar_url=pulsar_url
    ) as cluster:
        leader = cluster.wait_for_leader(30)
        first_ids = cluster.ledger_ids()
        assert first_ids == [1], first_ids
        idempotent = probe_idempotency(leader, "load")
        load = WriteLoad(cluster.urls(), clients=8, idempotent=idempotent).start()
        wait_until(
            lambda: load.acked_count() > 300 and 1 not in cluster.ledger_ids(),
            30,
            "retention to delete ledger 1",
            pause_s=0.1,
        )
        record = load.stop()
        digest = cluster.wait_for_equal_digests(30)
        kept = cluster.ledger_ids()
        if pulsar_url is None:  # the files are gone too (pulsar-lite cannot delete topics)
            assert 1 not in _ledger_ids(cluster.ledger_dir)
        print(
            f"{len(record.acked)} writes; ledgers left {kept[0]}..{kept[-1]} ({len(kept)}); "
            f"digest {digest[:16]}"
        )
        newcomer, join_s = _timed(lambda: cluster.add_broker())
        caught_up, catch_up_s = _timed(lambda: cluster.wait_for_equal_digests(60))
        assert caught_up == digest
        text = newcomer.log_text()
        assert "downloading a snapshot" in text, newcomer.log_tail()
        print(
            f"new broker {newcomer.broker_id} serving after {join_s:.2f} s, caught up "
            f"{catch_up_s:.2f} s later"
        )
        others = [b for b in cluster.live() if b is not newcomer]
        killed_at = time.monotonic()
        for node in others:
            node.kill9()
        new = cluster.wait_for_leader(3 * FAILOVER_LIMIT_S)
        print(f"{new.broker_id} leads {time.monotonic() - killed_at:.2f} s after the kills")
        assert new is newcomer
        after = newcomer.get_json("/api/v1/state/digest")
        assert after["digest"] == digest, (after, digest)
        check_acknowledged(newcomer, load, where="on the new broker", expect_unique=idempotent)
        # It takes writes of its own.
        submit_task(newcomer, type="demo.job", tenant="load", params={"after": "retention"})


def test_zookeeper_restart(
    zookeeper_factory: Callable[[], ZooKeeperServer], tmp_path: Path
) -> None:
    rng = seeded_rng("zookeeper restart")
    zookeeper = zookeeper_factory()
    with ClusterProcesses(zookeeper.connect_string, tmp_path) as cluster:
        leader = cluster.wait_for_leader(30)
        idempotent = probe_idempotency(leader, "load")
        load = WriteLoad(cluster.urls(), clients=16, idempotent=idempotent).start()
        time.sleep(rng.uniform(0.5, 1.5))
        zookeeper.kill9()  # returns once the process is gone (reaped)
        # The outage starts when ZooKeeper is gone: a write sent while the JVM was still
        # dying could have its leadership check answered (seen in CI: 5 acks 2 ms after).
        killed_at = time.monotonic()
        time.sleep(SESSION_TIMEOUT_S + rng.uniform(0.0, 1.0))
        restarted_at = time.monotonic()
        zookeeper.start()
        started_s = time.monotonic() - restarted_at
        new = cluster.wait_for_leader(30)
        first = load.wait_first_ack(
            restarted_at, 30, "a write acknowledged after the restart", pause_s=0.01
        )
        load.wait_for_more_acks(100, 15)
        record = load.stop()
        outage = load.answers_during(killed_at, restarted_at)
        succeeded = [a for a in outage if 200 <= a.status < 300]
        refused = [a for a in outage if a.status != 0]
        print(
            f"ZooKeeper down {restarted_at - killed_at:.2f} s (restart took {started_s:.2f} s); "
            f"during the outage {len(outage)} requests: "
            f"{dict(sorted(Counter(a.status for a in outage).items()))}; leader "
            f"{leader.broker_id} -> {new.broker_id}; first write {first.at - restarted_at:.3f} s "
            f"after the restart began; statuses {dict(record.statuses)}"
        )
        assert not succeeded, f"writes sent while ZooKeeper was down succeeded: {succeeded[:5]}"
        assert refused, "no broker answered during the outage: nothing tested"
        assert all(a.status in (307, 503) and a.retryable is True for a in refused), refused[:5]
        assert not record.unexpected, record.unexpected[:5]
        check_acknowledged(new, load, where="after the restart", expect_unique=idempotent)
        digest = cluster.wait_for_equal_digests(30)
        print(f"{len(record.acked)} acknowledged writes intact; digest {digest[:16]}")


def test_pulsar_lite_restart(
    zookeeper: ZooKeeperServer,
    pulsar_lite_factory: Callable[[], PulsarLiteServer],
    tmp_path: Path,
) -> None:
    # The ledger store itself dies (kill -9) under load and comes back on the same data:
    # brokers reconnect (whoever leads then recovers the open ledger), writes resume,
    # nothing acknowledged is lost.
    rng = seeded_rng("pulsar-lite restart")
    pulsar = pulsar_lite_factory()
    with ClusterProcesses(
        zookeeper.connect_string, tmp_path, pulsar_url=pulsar.service_url
    ) as cluster:
        leader = cluster.wait_for_leader(30)
        idempotent = probe_idempotency(leader, "load")
        load = WriteLoad(cluster.urls(), clients=16, idempotent=idempotent).start()
        wait_until(lambda: load.acked_count() > 200, 30, "writes before the kill")
        time.sleep(rng.uniform(0.2, 1.0))
        killed_at = time.monotonic()
        pulsar.kill()
        time.sleep(rng.uniform(1.0, 3.0))
        restarted_at = time.monotonic()
        pulsar.start()
        first = load.wait_first_ack(
            restarted_at + 0.001,
            60,
            "a write acknowledged after pulsar-lite came back",
            pause_s=0.02,
        )
        load.wait_for_more_acks(100, 30)
        record = load.stop()
        new = cluster.wait_for_leader(30)
        outage = load.answers_during(killed_at, restarted_at)
        print(
            f"pulsar-lite down {restarted_at - killed_at:.2f} s; during the outage "
            f"{dict(sorted(Counter(a.status for a in outage).items()))}; first write "
            f"{first.at - restarted_at:.3f} s after the restart; leader {leader.broker_id} -> "
            f"{new.broker_id}; statuses {dict(record.statuses)}"
        )
        assert not record.unexpected, record.unexpected[:5]
        check_acknowledged(new, load, where="after the restart", expect_unique=idempotent)
        digest = cluster.wait_for_equal_digests(30)
        print(f"{len(record.acked)} acknowledged writes intact; digest {digest[:16]}")


_LOG_TIME = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) ")


def _log_time(node: BrokerNode, needle: str) -> float | None:
    """Wall-clock time of the last log line of ``node`` containing ``needle``."""
    found = None
    for line in node.log_text().splitlines():
        match = _LOG_TIME.match(line)
        if match and needle in line:
            found = match.group(1)
    if found is None:
        return None
    return datetime.strptime(found, "%Y-%m-%d %H:%M:%S,%f").timestamp()


def test_graceful_handover(
    zookeeper: ZooKeeperServer, tmp_path: Path, pulsar_url: str | None
) -> None:
    with ClusterProcesses(zookeeper.connect_string, tmp_path, pulsar_url=pulsar_url) as cluster:
        old = cluster.wait_for_leader(30)
        idempotent = probe_idempotency(old, "load")
        load = WriteLoad(cluster.urls(), clients=CLIENTS, idempotent=idempotent).start()
        wait_until(lambda: load.acked_count() > 200, 15, "load")
        signalled_wall = time.time()
        signalled_at = cluster.sigterm(old.broker_id)
        first = load.wait_first_ack(
            signalled_at, 10, "a write on the next leader", excluding_url=old.url, pause_s=0.005
        )
        handover_s = first.at - signalled_at
        code = old.wait_exit(20)
        load.wait_for_more_acks(100, 15)
        record = load.stop()
        new = cluster.wait_for_leader(10)
        reported = re.findall(r"leadership handed over after ([0-9.]+) s", old.log_text())
        acting = _log_time(new, "is the acting leader")
        print(
            f"SIGTERM to {old.broker_id} (exit code {code}); {new.broker_id} acknowledged a "
            f"write {handover_s:.3f} s after the signal; the old leader reports hand-over "
            f"after {reported[-1] if reported else '?'} s; the new one logged acting leader "
            f"{(acting - signalled_wall) if acting else float('nan'):.3f} s after the signal; "
            f"statuses {dict(record.statuses)}"
        )
        assert code == 0, old.log_tail()
        assert reported, old.log_tail()
        assert not record.unexpected, record.unexpected[:5]
        assert handover_s < 1.0
        check_acknowledged(new, load, where="after the hand-over", expect_unique=idempotent)
        digest = cluster.wait_for_equal_digests(30)
        print(f"{len(record.acked)} acknowledged writes intact; digest {digest[:16]}")


def _timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    started = time.monotonic()
    value = fn()
    return value, time.monotonic() - started


def test_leader_takes_writes_across_ledger_rolls(
    zookeeper: ZooKeeperServer, tmp_path: Path, pulsar_url: str | None
) -> None:
    # Every 0.3 s the leader rolls to a new ledger; writes arriving mid-roll must wait
    # for the new ledger, not be refused (they were answered 503 "not ready" before).
    args = ("--ledger-roll-age-s", "0.3")
    with ClusterProcesses(
        zookeeper.connect_string, tmp_path, brokers=1, extra_args=args, pulsar_url=pulsar_url
    ) as c:
        leader = c.wait_for_leader(30)
        load = WriteLoad([leader.url], clients=8, follow=False).start()
        time.sleep(4.0)
        record = load.stop()
        rolls = leader.log_text().count("rolled from ledger")
        print(f"{len(record.acked)} writes across {rolls} ledger rolls: {dict(record.statuses)}")
        assert rolls >= 5, "too few rolls to prove anything"
        assert set(record.statuses) == {201}, record.statuses
        check_acknowledged(leader, load, where="across rolls")
