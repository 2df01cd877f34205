"""The per-tenant Spark Connect servers' bookkeeping (clients/worker/spark/tenant_servers.py): start
on first use, one per tenant, at most N with the least recently used idle one evicted, a held
server never stopped, a bounded wait when all are held, idle stop. Fake servers, fake clock."""

from __future__ import annotations

import threading
from typing import Any

import pytest

from clients.worker import WorkerConfig
from clients.worker.spark.connect_server import ConnectEndpoint, SparkConnectError
from clients.worker.spark.tenant_servers import TenantSparkServers, tenant_servers_wanted
from clients.worker.task_identity import TaskIdentity


class FakeServer:
    def __init__(self, tenant: str, identity: TaskIdentity) -> None:
        self.tenant = tenant
        self.endpoint = ConnectEndpoint(1, "t", identity.uid)
        self.started = False
        self.stopped = False
        self.failed: str | None = None

    def start(self) -> None:
        self.started = True

    def stop(self) -> None:
        self.stopped = True

    def error(self) -> str | None:
        return self.failed

    def wait_ready(self, timeout_s: float) -> ConnectEndpoint:
        return self.endpoint

    def interrupt(self, session_id: str) -> None:
        return None


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def ident(uid: int) -> TaskIdentity:
    return TaskIdentity(uid, uid, switch=True)


def pool(max_servers: int = 2, idle_s: float = 60.0) -> tuple[TenantSparkServers, list[Any], Clock]:
    made: list[FakeServer] = []
    clock = Clock()

    def factory(tenant: str, identity: TaskIdentity) -> FakeServer:
        server = FakeServer(tenant, identity)
        made.append(server)
        return server

    servers = TenantSparkServers(factory, max_servers=max_servers, idle_s=idle_s, clock=clock)
    return servers, made, clock


def test_a_tenants_server_starts_on_first_use_under_its_uid_and_is_reused() -> None:
    servers, made, _ = pool()
    assert servers.tenants() == {}  # nothing started before a task asks
    first = servers.acquire("a", ident(61200), 0)
    assert made == [first] and made[0].started and first.endpoint.uid == 61200
    assert servers.acquire("a", ident(61200), 0) is first  # a second task of a: same server
    assert servers.tenants() == {"a": 2}
    other = servers.acquire("b", ident(61201), 0)
    assert other is not first and other.endpoint.uid == 61201


def test_the_least_recently_used_idle_server_makes_room() -> None:
    servers, made, clock = pool(max_servers=2)
    servers.acquire("a", ident(1), 0)
    clock.now += 1
    servers.acquire("b", ident(2), 0)
    clock.now += 1
    servers.release("b")  # b idle since 102
    clock.now += 1
    servers.release("a")  # a idle since 103: b is the least recently used
    servers.acquire("c", ident(3), 0)
    a, b, c = made
    assert b.stopped and not a.stopped and not c.stopped
    assert servers.tenants() == {"a": 0, "c": 1}


def test_a_held_server_is_never_evicted_and_a_new_tenant_fails_clearly_when_all_are_held() -> None:
    servers, made, _ = pool(max_servers=1)
    servers.acquire("a", ident(1), 0)
    with pytest.raises(SparkConnectError, match=r"all 1 Spark Connect servers .*\(tenants a\)"):
        servers.acquire("b", ident(2), 0)
    assert not made[0].stopped and servers.tenants() == {"a": 1}


def test_a_new_tenant_waits_for_a_server_to_be_released() -> None:
    servers = TenantSparkServers(lambda t, i: FakeServer(t, i), max_servers=1, idle_s=60)
    servers.acquire("a", ident(1), 0)
    got: list[Any] = []
    waiter = threading.Thread(target=lambda: got.append(servers.acquire("b", ident(2), 30)))
    waiter.start()
    servers.release("a")  # the waiting acquire takes a's place (a is idle now)
    waiter.join(30)
    assert got and got[0].tenant == "b"
    assert servers.tenants() == {"b": 1}


def test_idle_servers_stop_after_the_idle_time_held_ones_never() -> None:
    servers, made, clock = pool(max_servers=3, idle_s=60)
    servers.acquire("a", ident(1), 0)
    servers.acquire("b", ident(2), 0)
    servers.release("a")
    clock.now += 59
    assert servers.stop_idle() == []
    clock.now += 1
    assert servers.stop_idle() == ["a"]
    clock.now += 3600
    assert servers.stop_idle() == []  # b is held by a running task
    assert made[0].stopped and not made[1].stopped
    servers.release("b")
    clock.now += 60
    assert servers.stop_idle() == ["b"] and made[1].stopped


def test_a_failed_idle_server_is_replaced_and_stop_stops_all() -> None:
    servers, made, _ = pool()
    servers.acquire("a", ident(1), 0)
    servers.release("a")
    made[0].failed = "exited (1)"
    again = servers.acquire("a", ident(1), 0)
    assert made[0].stopped and again is made[1]
    servers.stop()
    assert made[1].stopped
    with pytest.raises(SparkConnectError, match="stopping"):
        servers.acquire("a", ident(1), 0)


def test_only_a_root_worker_with_its_own_server_and_no_spark_user_runs_one_per_tenant() -> None:
    def config(**overrides: Any) -> WorkerConfig:
        return WorkerConfig(broker="127.0.0.1:1", http_url="http://127.0.0.1:1", **overrides)

    assert tenant_servers_wanted(config(), worker_uid=0)
    assert not tenant_servers_wanted(config(), worker_uid=1000)  # one uid for all: shared
    assert not tenant_servers_wanted(config(spark_user="nobody"), worker_uid=0)
    assert not tenant_servers_wanted(config(spark_remote="sc://h:1"), worker_uid=0)
    assert not tenant_servers_wanted(config(spark="off"), worker_uid=0)
    with pytest.raises(ValueError, match="--spark-max-servers"):
        config(spark_max_servers=0)
