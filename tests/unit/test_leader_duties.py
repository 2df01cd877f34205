"""The leader's duties (docs/DESIGN.md §4, broker/leader): started in order when a term
opens for writes, stopped in reverse at step-down; a failed start stops the failed duty and
those started before it, and raises; both servers build the same list."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from broker.api.webhooks import WebhookSender
from broker.leader.code_replicas import CodeReplicaMonitor
from broker.leader.code_retention import CodeRetention
from broker.leader.duties import LeaderDuties, broker_duties
from broker.replication.node import BrokerStartupError
from broker.workers.worker_link import WorkerLink, WorkerLinkConfig
from tests.support.memory_node import memory_node


class Duty:
    """Records its starts and stops in the shared journal; may fail to start."""

    def __init__(self, name: str, journal: list[str], *, fail: bool = False) -> None:
        self.name = name
        self.journal = journal
        self.fail = fail

    async def start(self) -> None:
        self.journal.append(f"start {self.name}")
        if self.fail:
            raise BrokerStartupError(f"{self.name} cannot start")

    async def stop(self) -> None:
        self.journal.append(f"stop {self.name}")


async def test_duties_start_in_order_and_stop_in_reverse() -> None:
    journal: list[str] = []
    duties = LeaderDuties([Duty(name, journal) for name in ("link", "replicas", "retention")])
    await duties.start()
    await duties.stop()
    assert journal == [
        "start link",
        "start replicas",
        "start retention",
        "stop retention",
        "stop replicas",
        "stop link",
    ]
    await duties.stop()  # a second step-down stops nothing twice
    assert len(journal) == 6


async def test_a_failed_start_stops_the_started_duties_and_raises() -> None:
    journal: list[str] = []
    duties = LeaderDuties(
        [Duty("link", journal), Duty("replicas", journal, fail=True), Duty("retention", journal)]
    )
    with pytest.raises(BrokerStartupError, match="replicas cannot start"):
        await duties.start()
    # The failed one is stopped too (it may have begun something); the later ones never run.
    assert journal == ["start link", "start replicas", "stop replicas", "stop link"]
    await duties.stop()
    assert len(journal) == 4


async def test_a_duty_failing_to_stop_does_not_keep_the_others_running() -> None:
    journal: list[str] = []

    class Stuck(Duty):
        async def stop(self) -> None:
            await super().stop()
            raise RuntimeError("stuck")

    duties = LeaderDuties([Duty("link", journal), Stuck("replicas", journal)])
    await duties.start()
    await duties.stop()
    assert journal[-2:] == ["stop replicas", "stop link"]


def test_a_broker_term_runs_the_worker_link_code_replicas_retention_then_webhooks(
    tmp_path: Path,
) -> None:
    node = memory_node(tmp_path)
    link = WorkerLink(node, WorkerLinkConfig(port=0))
    webhooks = WebhookSender(node)
    zk: Any = object()  # the monitor touches ZooKeeper only once started
    monitor = CodeReplicaMonitor(node, zk, "c", min_code_replicas=2, max_replication_wait_ms=0)
    cluster = broker_duties(
        node, link, code_retention_ms=0, webhooks=webhooks, code_replicas=monitor
    )
    assert [type(d) for d in cluster.duties] == [
        WorkerLink,
        CodeReplicaMonitor,
        CodeRetention,
        WebhookSender,
    ]
    assert cluster.duties[:2] == (link, monitor) and cluster.duties[-1] is webhooks
    standalone = broker_duties(node, link, code_retention_ms=0, webhooks=webhooks)
    assert [type(d) for d in standalone.duties] == [WorkerLink, CodeRetention, WebhookSender]


async def test_the_webhook_sender_runs_only_between_start_and_stop(tmp_path: Path) -> None:
    sender = WebhookSender(memory_node(tmp_path))
    assert not asyncio.all_tasks() - {asyncio.current_task()}  # building it starts nothing
    await sender.start()
    running = {t.get_name() for t in asyncio.all_tasks()}
    assert "webhook-sender" in running
    await sender.stop()
    assert "webhook-sender" not in {t.get_name() for t in asyncio.all_tasks() if not t.done()}
