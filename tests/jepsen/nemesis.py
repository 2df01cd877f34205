"""The nemesis of a Jepsen run: seeded faults on the network and the processes, each held
for a while then healed, every fault and heal logged in the history with its time
(docs/TESTING.md, "Partitions").

One ``random.Random(seed)`` draws every choice in a fixed order (each round's order of the
kinds, then per fault its target index, hold and gap), so a seed gives the same schedule of
draws; which broker a "leader" fault hits is the one leading at that moment.
"""

from __future__ import annotations

import random
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tests.jepsen.cluster import Broker, Cluster
from tests.jepsen.history import History, NemesisEvent
from tests.jepsen.netns import Network

# Every kind once per round, in a seeded order: a short run covers as many kinds as it has
# faults.
FAULTS = (
    "leader-from-zk",
    "leader-from-followers",
    "leader-from-clients",
    "zk-one-way-from-leader",
    "leader-in-minority",
    "follower-in-minority",
    "bridge",
    "isolate-worker",
    "kill-leader",
    "stop-leader",
    "kill-zookeeper",
)
# "bounded": the cluster must take writes again within the outage bound while the fault
# still holds (a new leader takes over), see checker.long_outages.
NETWORK_FAULTS = frozenset(FAULTS) - {"kill-leader", "stop-leader", "kill-zookeeper"}
BOUNDED = frozenset({"leader-from-zk", "leader-in-minority", "kill-leader", "stop-leader"})


@dataclass(frozen=True)
class Draw:
    kind: str
    index: int
    hold_s: float
    gap_s: float

    @classmethod
    def draw(cls, rng: random.Random, kind: str, session_timeout_s: float) -> Draw:
        index = rng.randrange(1000)
        # Long enough for a session to expire (a fail-over), sometimes not.
        hold = rng.uniform(1.0, session_timeout_s * 2.0)
        if kind == "stop-leader":
            hold = session_timeout_s + rng.uniform(1.0, 3.0)  # past the session timeout
        return cls(kind, index, round(hold, 2), round(rng.uniform(0.5, 2.0), 2))


class Nemesis:
    def __init__(
        self, net: Network, cluster: Cluster, history: History, seed: int, session_timeout_s: float
    ) -> None:
        self.net = net
        self.cluster = cluster
        self.history = history
        self.rng = random.Random(seed)
        self.session_timeout_s = session_timeout_s
        self.killed: list[Broker] = []
        self.stopped: list[Broker] = []
        self.zookeeper_down = False
        self.counts: dict[str, int] = {}

    def log(self, action: str, detail: dict[str, Any], bounded: bool = False) -> None:
        event = NemesisEvent(time.monotonic(), action, detail, bounded)
        self.history.add_nemesis(event)
        print(f"nemesis {event.time:10.3f} {action} {detail}", flush=True)

    def leader(self, index: int) -> Broker:
        leaders = self.cluster.leaders()
        brokers = leaders or [b for b in self.cluster.brokers.values() if b.running()]
        return brokers[index % len(brokers)]

    def run(self, faults: int, stop: Callable[[], bool]) -> None:
        order: list[str] = []
        for _ in range(faults):
            if stop():
                return
            if not order:
                order = list(FAULTS)
                self.rng.shuffle(order)
            draw = Draw.draw(self.rng, order.pop(), self.session_timeout_s)
            time.sleep(draw.gap_s)
            self.inject(draw)
            time.sleep(draw.hold_s)
            self.heal()
            self.wait_for_leader(60.0)

    def inject(self, draw: Draw) -> None:
        leader = self.leader(draw.index)
        brokers = sorted(self.cluster.brokers)
        others = [b for b in brokers if b != leader.name]
        clients_side = ["cl", *self.cluster.workers]
        kind = draw.kind
        detail: dict[str, Any] = {"leader": leader.name}
        if kind == "leader-from-zk":
            self.net.block(leader.name, ["zk"])
        elif kind == "leader-from-followers":
            self.net.block(leader.name, others)
        elif kind == "leader-from-clients":
            self.net.block(leader.name, clients_side)
        elif kind == "zk-one-way-from-leader":
            self.net.block(leader.name, ["zk"], "in")  # the leader hears nothing from ZK
        elif kind in ("leader-in-minority", "follower-in-minority"):
            alone = (
                leader.name if kind == "leader-in-minority" else others[draw.index % len(others)]
            )
            rest = [n for n in self.net.nodes if n not in (alone, "ctl")]
            self.net.block(alone, rest)
            detail["minority"] = [alone]
        elif kind == "bridge":
            # The leader and one follower cannot talk; both still see the other follower.
            cut = others[draw.index % len(others)]
            self.net.block(leader.name, [cut])
            detail["cut"] = cut
        elif kind == "isolate-worker":
            worker = sorted(self.cluster.workers)[draw.index % len(self.cluster.workers)]
            self.net.isolate(worker)
            detail["worker"] = worker
        elif kind == "kill-leader":
            leader.kill9()
            self.killed.append(leader)
        elif kind == "stop-leader":
            leader.signal(signal.SIGSTOP)
            self.stopped.append(leader)
        elif kind == "kill-zookeeper":
            self.cluster.zookeeper.kill9()  # restarted (same data) at the heal
            self.zookeeper_down = True
        self.counts[kind] = self.counts.get(kind, 0) + 1
        detail["hold_s"] = draw.hold_s
        self.log(kind, detail, bounded=kind in BOUNDED)

    def heal(self) -> None:
        self.net.heal()
        if self.zookeeper_down:
            self.cluster.zookeeper.start()
            self.zookeeper_down = False
        for broker in self.stopped:
            broker.signal(signal.SIGCONT)
        for broker in self.killed:
            broker.start()
        restarted = [b.name for b in self.killed]
        resumed = [b.name for b in self.stopped]
        self.killed.clear()
        self.stopped.clear()
        self.log("heal", {"restarted": restarted, "resumed": resumed})

    def wait_for_leader(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while not self.cluster.leaders():
            if time.monotonic() > deadline:
                raise AssertionError(f"no leader {timeout_s} s after healing")
            time.sleep(0.1)
