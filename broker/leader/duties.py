"""The leader's duties for one term, started in order and stopped in reverse."""

from __future__ import annotations

import logging
from collections.abc import Sequence

from broker.leader.code_replicas import CodeReplicaMonitor
from broker.leader.code_retention import CodeRetention
from broker.leader.duty import LeaderDuty
from broker.replication.node import Node
from broker.workers.worker_link import WorkerLink

__all__ = ["LeaderDuties", "broker_duties"]

logger = logging.getLogger(__name__)


class LeaderDuties:
    """Start the duties in order once the term is open for writes; stop them in reverse at
    step-down. A duty whose ``start`` raises is stopped, then those started before it (in
    reverse), and the error is raised: the term runs all its duties or none."""

    def __init__(self, duties: Sequence[LeaderDuty]) -> None:
        self.duties = tuple(duties)
        self._started: list[LeaderDuty] = []

    async def start(self) -> None:
        if self._started:
            raise RuntimeError("leader duties already started")
        for duty in self.duties:
            self._started.append(duty)  # stopped too if its start fails part-way
            try:
                await duty.start()
            except BaseException:
                await self.stop()
                raise

    async def stop(self) -> None:
        """Stop every started duty, last first; one failing to stop does not keep the
        others running (logged)."""
        while self._started:
            duty = self._started.pop()
            try:
                await duty.stop()
            except Exception:
                logger.exception("stopping the leader duty %s failed", type(duty).__name__)


def broker_duties(
    node: Node,
    link: WorkerLink,
    *,
    code_retention_ms: int,
    webhooks: LeaderDuty,
    code_replicas: CodeReplicaMonitor | None = None,
) -> LeaderDuties:
    """A broker's duties for a term, for the cluster and the standalone broker alike: the
    worker endpoint first (workers reconnect to it at once), then the code replica monitor
    (a cluster with ``min_code_replicas`` > 1 only), code retention, and the webhook sender
    (``broker.api.webhooks.WebhookSender``: the API shows its failures, so the server
    builds it and hands it to both)."""
    duties: list[LeaderDuty] = [link]
    if code_replicas is not None:
        duties.append(code_replicas)
    duties.append(CodeRetention(node, code_retention_ms))
    duties.append(webhooks)
    return LeaderDuties(duties)
