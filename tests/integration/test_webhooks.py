"""Issue 18 acceptance, per-tenant webhooks: a real broker and worker, a real HTTP receiver
that fails the first deliveries. Every completion event of the tenant arrives (at least
once, in log order), signed with HMAC-SHA256 under the secret; the failed ones were
retried with a growing delay; the delivered position is logged (GET shows it) and the
webhook is removed by DELETE; a leader killed and restarted does not redeliver what was
logged as delivered. Every wait is bounded."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from clients.client import StewardClient
from tests.support.procs import BrokerProcess
from tests.support.webhook_receiver import Receiver, webhook_receiver
from tests.support.worker_procs import broker_with_worker, wait_until

pytestmark = [pytest.mark.timeout(120)]

SECRET = "s3cret-for-the-test"
FAILURES = 3  # the receiver answers 503 to its first deliveries


@pytest.fixture
def receiver() -> Iterator[tuple[Receiver, str]]:
    state = Receiver(SECRET, failures_left=FAILURES)
    with webhook_receiver(state) as url:
        yield state, url


def test_events_are_posted_signed_and_retried(
    tmp_path: Path, receiver: tuple[Receiver, str]
) -> None:
    state, url = receiver
    with broker_with_worker(tmp_path, "hook-worker", ("--task-type", "*=8")) as (broker, _):
        http = httpx.Client(base_url=broker.url, timeout=10)
        put = http.put("/api/v1/tenants/hooked/webhook", json={"url": url, "secret": SECRET})
        assert put.status_code == 200, put.text
        assert put.json()["url"] == url and "secret" not in put.json()
        bad = http.put("/api/v1/tenants/hooked/webhook", json={"url": "ftp://x", "secret": "k"})
        assert bad.status_code == 400 and "http://" in bad.json()["error"]["message"]
        with StewardClient(broker.url) as client:
            ids = [client.submit("noop", tenant="hooked").id for _ in range(5)]
            other = client.submit("noop", tenant="quiet")
            client.wait_many([*ids, other], timeout=30)

        def all_delivered() -> bool:
            with state.lock:
                return {int(str(task["id"])) for _, task in state.delivered} >= set(ids)

        wait_until(all_delivered, 30, "every event of the tenant delivered")
        with state.lock:
            delivered = list(state.delivered)
            refused_at = list(state.refused_at)
        assert state.bad_signatures == 0
        assert sorted(int(str(task["id"])) for _, task in delivered) == ids  # once each here
        keys = [tuple(int(part) for part in event_id.split(":")) for event_id, _ in delivered]
        assert keys == sorted(keys)  # in log order
        assert all(task["tenant"] == "hooked" for _, task in delivered)
        assert len(refused_at) == FAILURES
        gaps = [b - a for a, b in itertools.pairwise(refused_at)]
        assert gaps[1] > gaps[0] * 1.5, gaps  # exponential backoff
        last_id = delivered[-1][0]

        def logged() -> bool:
            view = http.get("/api/v1/tenants/hooked/webhook").json()
            return bool(view["delivered"] == last_id)

        wait_until(logged, 10, "the delivered position logged")
        removed = http.delete("/api/v1/tenants/hooked/webhook")
        assert removed.status_code == 200 and removed.json()["delivered"] == last_id
        assert http.get("/api/v1/tenants/hooked/webhook").status_code == 404
        http.close()


def test_a_restarted_leader_does_not_redeliver_what_was_logged(
    tmp_path: Path, receiver: tuple[Receiver, str]
) -> None:
    state, url = receiver
    state.failures_left = 0
    with broker_with_worker(tmp_path, "hook-worker", ("--task-type", "*=8")) as (broker, _):
        with httpx.Client(base_url=broker.url, timeout=10) as http:
            put = http.put("/api/v1/tenants/hooked/webhook", json={"url": url, "secret": SECRET})
            assert put.status_code == 200, put.text
        with StewardClient(broker.url) as client:
            before = [client.submit("noop", tenant="hooked").id for _ in range(4)]
            client.wait_many(before, timeout=30)

        def logged() -> bool:
            with state.lock:
                delivered = [event_id for event_id, _ in state.delivered]
            if len(delivered) < len(before):
                return False
            view = httpx.get(broker.url + "/api/v1/tenants/hooked/webhook", timeout=5).json()
            return bool(view["delivered"] == delivered[-1])

        wait_until(logged, 30, "the first deliveries logged")
        broker.kill9()  # the leader dies; a new one (here: the same, restarted) takes over
        broker.start()
        with StewardClient(broker.url) as client:
            after = [client.submit("noop", tenant="hooked").id for _ in range(3)]
            client.wait_many(after, timeout=60)

        def all_delivered() -> bool:
            with state.lock:
                return {int(str(task["id"])) for _, task in state.delivered} >= set(after)

        wait_until(all_delivered, 30, "the deliveries after the restart")
    with state.lock:
        ids = [int(str(task["id"])) for _, task in state.delivered]
    # Nothing delivered and logged before the kill came again; the later events came.
    assert sorted(ids) == sorted(before + after), ids


def test_events_not_delivered_before_a_restart_are_delivered_after_it(
    tmp_path: Path, receiver: tuple[Receiver, str]
) -> None:
    # The receiver refuses everything until the restart: every event is still pending when
    # the broker stops, and must come after it. Once cleanly (the state then comes back
    # from the snapshot taken at the stop: no entry is replayed), once by kill -9 (the log
    # after the last snapshot is replayed).
    state, url = receiver
    # No worker: cancelled tasks are final too, one event each.
    with BrokerProcess(tmp_path / "data", log_path=tmp_path / "broker.log") as broker:
        broker.start()
        with httpx.Client(base_url=broker.url, timeout=10) as http:
            put = http.put("/api/v1/tenants/hooked/webhook", json={"url": url, "secret": SECRET})
            assert put.status_code == 200, put.text
        ids: list[int] = []
        for stop in ("sigterm", "kill9"):
            with state.lock:
                state.failures_left = 10**9
                refused = len(state.refused_at)
            with StewardClient(broker.url) as client:
                batch = [client.submit("noop", tenant="hooked").id for _ in range(3)]
                for task_id in batch:
                    client.cancel(task_id)
            ids += batch

            def refused_again(before: int = refused) -> bool:
                return len(state.refused_at) > before

            wait_until(refused_again, 30, "a refused delivery")
            if stop == "sigterm":
                assert broker.terminate() == 0
            else:
                broker.kill9()
            with state.lock:
                assert {int(str(task["id"])) for _, task in state.delivered}.isdisjoint(batch)
                state.failures_left = 0
            broker.start()

            wanted = frozenset(ids)

            def all_delivered(wanted: frozenset[int] = wanted) -> bool:
                with state.lock:
                    return {int(str(task["id"])) for _, task in state.delivered} >= wanted

            wait_until(all_delivered, 30, f"the events pending at the restart ({stop})")
    with state.lock:
        delivered = [int(str(task["id"])) for _, task in state.delivered]
    assert sorted(set(delivered)) == ids and state.bad_signatures == 0
