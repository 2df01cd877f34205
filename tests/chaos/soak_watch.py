"""The chaos soak's leadership watch (tests/chaos/soak.py): a thread that polls every
broker's own claim (``/healthz``: role, writable, the ledger it writes) in rounds, for
:func:`tests.chaos.soak_checks.check_split_brain`. ZooKeeper's election node is read in
the same round and recorded beside the claims (who ZooKeeper says leads), for the log."""

from __future__ import annotations

import json
import threading
import time
from collections import Counter
from collections.abc import Callable

import httpx
from kazoo.client import KazooClient  # type: ignore[import-untyped]

from broker.ha.zk_session import sorted_queue
from log.zk_list import cluster_path
from tests.chaos.soak_checks import Claim

POLL_TIMEOUT_S = 0.5  # a frozen broker does not answer: do not hold the round up long
ROUND_PAUSE_S = 0.05


class LeaderWatch:
    def __init__(self, urls: Callable[[], dict[str, str]], zookeeper: str, cluster: str) -> None:
        self._urls = urls
        self._zookeeper = zookeeper
        self._election = f"{cluster_path(cluster)}/election"
        self.rounds: list[list[Claim]] = []
        self.zk_leaders: Counter[str] = Counter()  # lowest election node's owner, per round
        self.zk_disagreements = 0  # one broker claims, ZooKeeper names another
        self.polls = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="chaos-leader-watch", daemon=True)

    def start(self) -> LeaderWatch:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(30)
        assert not self._thread.is_alive(), "the leader watch did not stop"

    def _run(self) -> None:
        zk = KazooClient(hosts=self._zookeeper, timeout=3.0)
        try:
            zk.start_async()
            with httpx.Client(timeout=POLL_TIMEOUT_S) as http:
                while not self._stop.is_set():
                    self._round(http, zk)
                    self._stop.wait(ROUND_PAUSE_S)
        finally:
            zk.stop()
            zk.close()

    def _round(self, http: httpx.Client, zk: KazooClient) -> None:
        claims = []
        for broker, url in self._urls().items():
            try:
                body = http.get(url + "/healthz").json()
            except (httpx.HTTPError, ValueError):
                continue
            if body.get("role") == "leader" and body.get("writable") is True:
                ledger = body.get("position", {}).get("ledger_id", -1)
                claims.append(Claim(time.monotonic(), broker, int(ledger)))
        if len(claims) > 1:
            self.rounds.append(claims)
        self.polls += 1
        owner = self._zookeeper_leader(zk)
        if owner is not None:
            self.zk_leaders[owner] += 1
            if len(claims) == 1 and claims[0].broker != owner:
                # Read after the claims: a hand-over in between looks the same (counted,
                # not failed; the brokers' own claims are what the check relies on).
                self.zk_disagreements += 1

    def _zookeeper_leader(self, zk: KazooClient) -> str | None:
        """The broker whose node is lowest in the election queue (docs/DESIGN.md §4)."""
        if not zk.connected:
            return None
        try:
            queue = sorted_queue(zk.get_children(self._election))
            if not queue:
                return None
            data, _ = zk.get(f"{self._election}/{queue[0]}")
            owner = json.loads(data).get("broker_id")
        except Exception:  # ZooKeeper restarts under us: skip this read
            return None
        return owner if isinstance(owner, str) else None
