"""Issue 18 acceptance, completion events: the event feed (``GET /api/v1/events`` without
``tasks``) on three real brokers and a real ZooKeeper, with a real worker. The leader is
killed with ``kill -9`` while the client reads the feed; the client reopens it on another
broker with ``Last-Event-ID`` and sees every task's event exactly once, in log order.
A handle's ``wait`` rides the same streams. Every wait is bounded; the seed is printed.
"""

from __future__ import annotations

import os
import random
import threading
from collections import Counter
from pathlib import Path

import pytest

from clients.client import StewardClient, TaskEvent
from clients.dev.zk import ZooKeeperServer
from tests.support.cluster_procs import ClusterProcesses
from tests.support.event_streams import open_feed
from tests.support.worker_procs import wait_until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

TENANT = "feed"
BEFORE, AFTER = 30, 30  # tasks submitted before and after the kill


def _seed() -> random.Random:
    seed = int(os.environ.get("STEWARD_TEST_SEED", random.SystemRandom().randrange(2**32)))
    print(f"\nevents feed seed: {seed} (rerun with STEWARD_TEST_SEED={seed})")
    return random.Random(seed)


class Reader(threading.Thread):
    """Reads the feed of one tenant (a client of its own, every broker's URL) until told
    to stop; the events it saw, in order."""

    def __init__(self, urls: list[str]) -> None:
        super().__init__(daemon=True)
        self.urls = urls
        self.events: list[TaskEvent] = []
        self.stop = threading.Event()
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            with StewardClient(self.urls, failover_timeout_s=60) as client:
                while not self.stop.is_set():
                    last = self.events[-1].id if self.events else None
                    # Short slices, so stop is seen soon; each resumes after the last event.
                    for event in client.events(tenant=TENANT, last_event_id=last, timeout=2):
                        self.events.append(event)
        except BaseException as exc:  # reported by the test
            self.error = exc

    def task_ids(self) -> list[int]:
        return [int(event.task["id"]) for event in self.events]


def test_kill9_leader_mid_stream_every_event_once(
    zookeeper: ZooKeeperServer, tmp_path: Path
) -> None:
    rng = _seed()
    with ClusterProcesses(zookeeper.connect_string, tmp_path) as cluster:
        old = cluster.wait_for_leader(30)
        cluster.start_worker("w1", "--task-type", "sleep=8")
        cluster.wait_workers_connected(["w1"], 30)
        reader = Reader(cluster.urls())
        reader.start()
        submitted: list[int] = []
        with StewardClient(cluster.urls(), failover_timeout_s=60) as client:
            # The feed is open before the first task can finish (the probe's event says so).
            probes = open_feed(
                lambda: client.submit("sleep", {"seconds": 0}, tenant=TENANT).id,
                reader.task_ids,
            )
            for _ in range(BEFORE):
                seconds = round(rng.uniform(0.0, 0.3), 2)
                submitted.append(client.submit("sleep", {"seconds": seconds}, tenant=TENANT).id)
            wait_until(lambda: len(reader.events) >= BEFORE // 3, 30, "events before the kill")
            seen_before_kill = len(reader.events)
            cluster.kill9(old.broker_id)
            new = cluster.wait_for_leader(30, excluding=[old.broker_id])
            print(f"{old.broker_id} killed after {seen_before_kill} events; leader {new.broker_id}")
            for _ in range(AFTER):
                submitted.append(client.submit("sleep", {"seconds": 0.01}, tenant=TENANT).id)
            # A handle's wait is on the event stream too (tasks=ID), on the new leader.
            waited = client.submit("sleep", {"seconds": 0}, tenant=TENANT)
            submitted.append(waited.id)
            assert waited.wait(30)["state"] == "finished"

            def all_seen() -> bool:
                assert reader.error is None, reader.error
                return set(submitted) <= set(reader.task_ids())

            wait_until(all_seen, 90, "every task's event")
        reader.stop.set()
        reader.join(10)
        assert reader.error is None, reader.error
        # The same keys name the same events on every broker, the new leader and the
        # follower alike: resuming from any event there replays exactly the rest.
        cut = rng.randrange(len(reader.events) - 1)
        for node in cluster.live():
            with StewardClient(node.url) as alone:
                rest = alone.events(tenant=TENANT, last_event_id=reader.events[cut].id, timeout=1)
                replayed = [(event.id, event.task["id"]) for event in rest]
            expected = [(event.id, event.task["id"]) for event in reader.events[cut + 1 :]]
            assert replayed == expected, node.broker_id
    ids = reader.task_ids()
    twice = {task_id: n for task_id, n in Counter(ids).items() if n > 1}
    assert not twice, f"events seen more than once: {twice}"
    assert sorted(ids) == sorted(submitted + [p for p in probes if p in ids])
    keys = [tuple(int(part) for part in event.id.split(":")) for event in reader.events]
    assert keys == sorted(keys), "events out of log order"
    assert {event.task["state"] for event in reader.events} == {"finished"}
    print(f"{len(ids)} events, each once, across the kill of {old.broker_id}")
