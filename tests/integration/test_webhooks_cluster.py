"""Issue 18 acceptance, webhooks across a fail-over: three real brokers and a real
ZooKeeper, a real HTTP receiver that fails the first deliveries. The leader is killed with
``kill -9`` while deliveries are pending (the receiver refuses them); the new leader
resumes from the replicated delivery position: every event arrives at least once, none is
skipped, what was logged as delivered is not sent again, and every signature verifies
(HMAC-SHA256). Tasks are made final by cancelling them (no worker needed). Every wait is
bounded."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from clients.client import StewardClient
from clients.dev.zk import ZooKeeperServer
from tests.support.cluster_procs import ClusterProcesses
from tests.support.webhook_receiver import Receiver, webhook_receiver
from tests.support.worker_procs import wait_until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

SECRET = "cluster-hook-secret"
TENANT = "hooked"


def _final_tasks(client: StewardClient, count: int) -> list[int]:
    ids = [client.submit("noop", tenant=TENANT).id for _ in range(count)]
    for task_id in ids:
        client.cancel(task_id)  # no worker: cancelled is its final state, one event each
    return ids


def test_a_new_leader_resumes_delivery_from_the_replicated_position(
    zookeeper: ZooKeeperServer, tmp_path: Path
) -> None:
    state = Receiver(SECRET, failures_left=3)
    with (
        webhook_receiver(state) as url,
        ClusterProcesses(zookeeper.connect_string, tmp_path) as cluster,
    ):
        old = cluster.wait_for_leader(30)
        put = httpx.put(
            f"{old.url}/api/v1/tenants/{TENANT}/webhook",
            json={"url": url, "secret": SECRET},
            timeout=10,
        )
        assert put.status_code == 200, put.text
        with StewardClient(cluster.urls(), failover_timeout_s=60) as client:
            first = _final_tasks(client, 5)
            wait_until(lambda: set(state.delivered_ids()) >= set(first), 30, "first batch")
            with state.lock:
                logged_key = state.delivered[-1][0]
                state.refusing = True  # from here on, deliveries stay pending

            def logged() -> bool:
                view = httpx.get(f"{old.url}/api/v1/tenants/{TENANT}/webhook", timeout=5)
                return bool(view.json()["delivered"] == logged_key)

            wait_until(logged, 30, "the first batch's delivery logged")
            pending = _final_tasks(client, 5)
            refused = len(state.refused_at)
            wait_until(lambda: len(state.refused_at) > refused, 30, "a pending delivery refused")
            cluster.kill9(old.broker_id)
            new = cluster.wait_for_leader(30, excluding=[old.broker_id])
            with state.lock:
                seen_before_kill = len(state.delivered)
                state.refusing = False
            # The new leader delivers what was pending with nothing new applied, then its own.
            wait_until(lambda: set(state.delivered_ids()) >= set(pending), 60, "pending ones")
            later = _final_tasks(client, 3)
            every = first + pending + later
            wait_until(lambda: set(state.delivered_ids()) >= set(every), 60, "every event")
        print(f"{old.broker_id} killed; {new.broker_id} delivered the rest")
    with state.lock:
        delivered = list(state.delivered)
    assert state.bad_signatures == 0
    after_kill = [int(str(task["id"])) for _, task in delivered[seen_before_kill:]]
    # Resumed after the logged position: nothing logged as delivered came again, nothing
    # pending at the kill was skipped, and the new leader's own events came too.
    assert not set(after_kill) & set(first), after_kill
    assert set(after_kill) >= set(pending + later)
    keys = [tuple(int(part) for part in key.split(":")) for key, _ in delivered]
    assert keys[seen_before_kill:] == sorted(keys[seen_before_kill:])  # in log order
    assert all(task["state"] == "cancelled" for _, task in delivered)
