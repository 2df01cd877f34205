"""The nemesis of a Jepsen run: seeded faults on the network and the processes, each held
for a while then healed, every fault and heal logged in the history with its time
(docs/TESTING.md, "Partitions").

One ``random.Random(seed)`` draws every choice in a fixed order (each round's order of the
kinds, then per fault its target index, hold and gap), so a seed gives the same schedule of
draws; which broker a "leader" fault hits is the one leading at that moment.

With the real Pulsar cluster (``--ledger apache-pulsar``, tests/jepsen/cluster.py), the
Pulsar broker (``pl``) is partitioned from Steward's leader (``leader-from-ledger``), killed
or paused; a bookie is partitioned (``bookie-from-pulsar``), killed or paused. Steward's
leader never talks to a bookie, only the Pulsar broker does: a partitioned bookie is cut
from the Pulsar broker, and from Steward's leader too, which changes nothing. The bookie hit
is one holding the newest ledger of Steward's newest topic (so the fault meets the writes;
ledgers of ensemble 2 on three bookies: the broker replaces it by the spare), else the
drawn one. The heal restarts what was killed (same ports and data) and resumes what was
paused; a member of the Pulsar cluster found exited by itself is restarted too, and logged.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tests.jepsen.cluster import (
    HEARTBEAT_TIMEOUT_MS,
    PULSAR_BROKER_NODE,
    Broker,
    Cluster,
    NamespacedPulsarCluster,
    Node,
)
from tests.jepsen.history import History, NemesisEvent
from tests.jepsen.netns import NETNS_DIR, Network, kill_namespace_processes
from tests.support.pulsar_cluster import Bookie

# Every kind once per round (a network kind twice), in a seeded order: a short run covers
# as many kinds as it has faults.
NETWORK = (
    "leader-from-zk",
    "leader-from-followers",
    "leader-from-clients",
    "zk-one-way-from-leader",
    "leader-in-minority",
    "follower-in-minority",
    "bridge",
    "isolate-worker",
)
PROCESS = (
    "kill-leader",
    "stop-leader",
    "term-leader",  # graceful hand-over (SIGTERM)
    "kill-zookeeper",
    "zk-down-at-broker-start",  # a broker (re)started while ZooKeeper is down
    "kill-during-start",  # the leader killed, restarted, killed again while it starts
    "kill-worker",
    "pause-worker",  # past the heartbeat timeout: its attempt is reassigned (a zombie)
)
# With the pulsar ledger only (the file ledger is the brokers' shared filesystem).
PULSAR_NETWORK = ("leader-from-ledger",)
PULSAR_PROCESS = ("kill-pulsar", "stop-pulsar")
# With the real Pulsar cluster only (--ledger apache-pulsar).
BOOKIE_NETWORK = ("bookie-from-pulsar",)
BOOKIE_PROCESS = ("kill-bookie", "stop-bookie")
CLOCK = ("clock-forward-small", "clock-back-small", "clock-forward-big", "clock-back-big")
FAULTS = (*NETWORK, *PROCESS, *CLOCK)
#: Every kind a run may be limited to (``--kinds``): the pulsar ones need a pulsar ledger,
#: the bookie ones the real Pulsar cluster (:data:`KINDS_NEEDING`).
ALL_KINDS = (*FAULTS, *PULSAR_NETWORK, *PULSAR_PROCESS, *BOOKIE_NETWORK, *BOOKIE_PROCESS)
NETWORK_FAULTS = frozenset((*NETWORK, *PULSAR_NETWORK, *BOOKIE_NETWORK))
#: The ledgers (``--ledger``) a kind needs; any ledger for the kinds not named.
KINDS_NEEDING = {
    **{kind: ("pulsar", "apache-pulsar") for kind in (*PULSAR_NETWORK, *PULSAR_PROCESS)},
    **{kind: ("apache-pulsar",) for kind in (*BOOKIE_NETWORK, *BOOKIE_PROCESS)},
}
# "bounded": the cluster must take writes again within the outage bound while the fault
# still holds (a new leader takes over), see checker.long_outages.
BOUNDED = frozenset(
    {"leader-from-zk", "leader-in-minority", "kill-leader", "stop-leader", "term-leader",
     "kill-during-start"}
)  # fmt: skip
EFFECTS_TAIL_BYTES = 256 * 1024  # > 400 records of ~200 bytes
SMALL_JUMP_S = (0.5, 2.0)  # within the session timeout
BIG_JUMP_S = (10.0, 120.0)  # far beyond it (and beyond the ledger roll age)


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
        if kind == "pause-worker":
            # Silent past the heartbeat timeout it is declared dead (at the next heartbeat
            # round) and its attempts reassigned: the hold is the least time paused, and it
            # is held on until the replacement is seen to start (Nemesis.hold_zombie).
            hold = HEARTBEAT_TIMEOUT_MS / 1000 + rng.uniform(1.0, 3.0)
        return cls(kind, index, round(hold, 2), round(rng.uniform(0.5, 2.0), 2))


class Nemesis:
    def __init__(
        self,
        net: Network,
        cluster: Cluster,
        history: History,
        seed: int,
        session_timeout_s: float,
        kinds: frozenset[str] | None = None,
    ) -> None:
        self.net = net
        # None: every kind; else only these (a run aimed at one part, such as the ledger).
        self.kinds = kinds
        self.cluster = cluster
        self.history = history
        self.rng = random.Random(seed)
        self.session_timeout_s = session_timeout_s
        self.killed: list[Node] = []
        self.stopped: list[Broker] = []
        self.terminated: list[Broker] = []
        self.paused: list[int] = []  # pids of a paused worker's namespace
        self.jumped: list[Broker] = []
        # The run a paused worker was caught in (task, attempt), until the heal.
        self.zombie: tuple[int, int] | None = None
        self.zombies_arranged = 0  # pauses whose replacement attempt started while paused
        self.zookeeper_down = False
        self.pulsar_down = False
        self.pulsar_paused = False
        self.bookies_killed: list[Bookie] = []
        self.bookies_paused: list[Bookie] = []
        self.counts: dict[str, int] = {}
        self.crashes = 0  # brokers found exited at a heal without being killed

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
                order = self.round()
            draw = Draw.draw(self.rng, order.pop(), self.session_timeout_s)
            time.sleep(draw.gap_s)
            self.inject(draw)
            if self.zombie is not None:
                self.hold_zombie(draw.hold_s)
            else:
                time.sleep(draw.hold_s)
            self.heal()
            self.wait_for_leader(60.0)

    def round(self) -> list[str]:
        """Every network kind twice, every other kind once, each group shuffled, then
        interleaved in proportion: a run cut short keeps the round's mix of the two."""
        network = [*NETWORK, *NETWORK]
        others = [*PROCESS, *CLOCK]
        if self.cluster.pulsar is not None:
            network += [*PULSAR_NETWORK, *PULSAR_NETWORK]
            others += PULSAR_PROCESS
        if isinstance(self.cluster.pulsar, NamespacedPulsarCluster):
            network += [*BOOKIE_NETWORK, *BOOKIE_NETWORK]
            others += BOOKIE_PROCESS
        if self.kinds is not None:
            network = [kind for kind in network if kind in self.kinds]
            others = [kind for kind in others if kind in self.kinds]
        self.rng.shuffle(network)
        self.rng.shuffle(others)
        order: list[str] = []
        n = o = 0
        while n < len(network) or o < len(others):
            if o >= len(others) or (n < len(network) and n * len(others) <= o * len(network)):
                order.append(network[n])
                n += 1
            else:
                order.append(others[o])
                o += 1
        return order[::-1]  # run() pops from the end

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
        elif kind == "leader-from-ledger":
            self.net.block(leader.name, [PULSAR_BROKER_NODE])
        elif kind in ("kill-pulsar", "stop-pulsar"):
            if kind == "kill-pulsar":
                self.cluster.pulsar_server.kill()  # restarted (same data) at the heal
                self.pulsar_down = True
            else:
                self.cluster.pulsar_server.pause()
                self.pulsar_paused = True
        elif kind in (*BOOKIE_NETWORK, *BOOKIE_PROCESS):
            bookie, in_ensemble = self.bookie(draw.index)
            detail.update(bookie=bookie.name, in_newest_ensemble=in_ensemble)
            if kind == "bookie-from-pulsar":
                self.net.block(bookie.name, [PULSAR_BROKER_NODE, leader.name])
            elif kind == "kill-bookie":
                bookie.kill9()
                self.bookies_killed.append(bookie)
            else:
                bookie.pause()
                self.bookies_paused.append(bookie)
        elif kind == "term-leader":
            leader.signal(signal.SIGTERM)  # hands leadership over, then exits
            self.terminated.append(leader)
        elif kind == "zk-down-at-broker-start":
            broker = self.cluster.brokers[brokers[draw.index % len(brokers)]]
            broker.kill9()
            self.cluster.zookeeper.kill9()
            self.zookeeper_down = True
            broker.start()  # ZooKeeper comes back at the heal
            detail["broker"] = broker.name
        elif kind == "kill-during-start":
            leader.kill9()
            leader.start()
            delay = round(0.2 + (draw.index % 100) / 100 * 1.3, 2)  # 0.2-1.5 s into its start
            time.sleep(delay)
            leader.kill9()
            self.killed.append(leader)
            detail["killed_after_s"] = delay
        elif kind in ("kill-worker", "pause-worker"):
            name = sorted(self.cluster.workers)[draw.index % len(self.cluster.workers)]
            if kind == "pause-worker":
                name, self.zombie = self.busy_worker(name)
                detail["run"] = list(self.zombie) if self.zombie else None
            node = self.cluster.workers[name]
            detail["worker"] = name
            if kind == "kill-worker":
                node.kill9()
                kill_namespace_processes(self.net.namespace(name))  # its task processes too
                self.killed.append(node)
            else:
                # The worker and its task processes, as a paused VM: the attempt it runs
                # resumes after its replacement started and reports late.
                self.paused = self._namespace_pids(name)
                for pid in self.paused:
                    os.kill(pid, signal.SIGSTOP)
        elif kind.startswith("clock-"):
            broker = self.cluster.brokers[brokers[draw.index % len(brokers)]]
            low, high = BIG_JUMP_S if kind.endswith("big") else SMALL_JUMP_S
            jump = round(low + (draw.index % 100) / 100 * (high - low), 2)
            jump = -jump if "-back-" in kind else jump
            broker.set_clock(jump)
            self.jumped.append(broker)
            detail.update(broker=broker.name, jump_s=jump, was_leader=broker is leader)
        self.counts[kind] = self.counts.get(kind, 0) + 1
        detail["hold_s"] = draw.hold_s
        self.log(kind, detail, bounded=kind in BOUNDED)

    def bookie(self, index: int) -> tuple[Bookie, bool]:
        """The bookie a bookie fault hits, and whether it holds the newest ledger."""
        pulsar = self.cluster.pulsar
        assert isinstance(pulsar, NamespacedPulsarCluster), "the real Pulsar cluster only"
        ensemble = pulsar.newest_ensemble(self.cluster.name)
        if ensemble:
            return ensemble[index % len(ensemble)], True
        return pulsar.bookies[index % len(pulsar.bookies)], False

    def _effects(self, last: int = 400) -> list[dict[str, Any]]:
        """The task code's latest records (tests/jepsen/jepsen_tasks.py), from the file's
        tail only: it is polled ten times a second and grows to tens of MB in a long run."""
        effects = self.cluster.root / "effects" / "effects.jsonl"
        if not effects.exists():
            return []
        with effects.open("rb") as file:
            size = file.seek(0, os.SEEK_END)
            file.seek(max(0, size - EFFECTS_TAIL_BYTES))
            tail = file.read().decode(errors="replace")
        records = []
        # The first line of a tail may be cut: it fails to parse and is skipped.
        for line in tail.splitlines()[-last:]:
            with contextlib.suppress(ValueError):  # the line being written right now
                records.append(json.loads(line))
        return records

    def busy_worker(
        self, default: str, timeout_s: float = 20.0
    ) -> tuple[str, tuple[int, int] | None]:
        """A worker that just started a long run (>= 1 s, ahead of the queue: its
        replacement starts at once) and that run's (task, attempt), found in the task
        code's effects file (bounded wait); else ``default`` and None."""
        names = {
            f"net:[{os.stat(NETNS_DIR / self.net.namespace(w)).st_ino}]": w
            for w in self.cluster.workers
        }
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            now = time.monotonic()
            for record in reversed(self._effects(200)):
                if (
                    record["event"] == "start"
                    and float(record.get("seconds", 0)) >= 1.0
                    and now - float(record["time"]) < 0.5
                    and record["worker"] in names
                ):
                    return names[record["worker"]], (int(record["task"]), int(record["attempt"]))
            time.sleep(0.05)
        return default, None

    def hold_zombie(self, least_s: float) -> None:
        """Keep the worker paused (at least ``least_s``) until the paused run's replacement
        attempt is seen to start elsewhere, bounded: resumed then, the old attempt finishes
        and reports late while the new one runs, a zombie the checker must see change
        nothing (checker.stale_reports)."""
        assert self.zombie is not None
        task, attempt = self.zombie
        started = time.monotonic()
        # Declared dead a heartbeat timeout after its last frame, at a heartbeat round; a
        # leader change on the way may add a session timeout and an election.
        bound_s = least_s + 2 * HEARTBEAT_TIMEOUT_MS / 1000 + 3 * self.session_timeout_s
        seen = False
        while time.monotonic() - started < bound_s:
            seen = any(
                r["event"] == "start" and int(r["task"]) == task and int(r["attempt"]) > attempt
                for r in self._effects()
            )
            if seen and time.monotonic() - started >= least_s:
                break
            time.sleep(0.1)
        if seen:
            self.zombies_arranged += 1
        self.log(
            "zombie-hold",
            {"task": task, "attempt": attempt, "replacement_started": seen,
             "paused_s": round(time.monotonic() - started, 2)},
        )  # fmt: skip

    def _namespace_pids(self, node: str) -> list[int]:
        listed = subprocess.run(
            ["ip", "netns", "pids", self.net.namespace(node)],
            capture_output=True, text=True, timeout=10, check=True,
        ).stdout.split()  # fmt: skip
        return [int(pid) for pid in listed]

    def heal(self) -> None:
        self.net.heal()
        if self.zookeeper_down:
            self.cluster.zookeeper.start()
            self.zookeeper_down = False
        if self.pulsar_paused:
            self.cluster.pulsar_server.resume()
            self.pulsar_paused = False
        for bookie in self.bookies_paused:
            bookie.resume()
        # The bookies first: the Pulsar broker's health check writes a ledger.
        pulsar_exited = self._restart_pulsar_members()
        if self.pulsar_down:
            self.cluster.pulsar_server.start()
            self.pulsar_down = False
        for broker in self.stopped:
            broker.signal(signal.SIGCONT)
        for pid in self.paused:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
        for broker in self.jumped:
            broker.set_clock(0.0)  # back to the true time: a jump the other way
        exited = {}
        for broker in self.terminated:
            # A graceful exit is bounded: past it, the hand-over hung (a finding).
            exited[broker.name] = broker.wait_for_exit(30.0, why=" after SIGTERM")
            self.killed.append(broker)
        # A broker that exited by itself (not killed here) is restarted too, and logged.
        crashed = [
            b for b in self.cluster.brokers.values() if not b.running() and b not in self.killed
        ]
        for node in [*self.killed, *crashed]:
            node.start()
        detail: dict[str, Any] = {
            "restarted": [n.name for n in self.killed],
            "resumed": [b.name for b in self.stopped],
        }
        if exited:
            detail["sigterm_exit_codes"] = exited
        if self.paused:
            detail["resumed_pids"] = len(self.paused)
        if self.jumped:
            detail["clocks_reset"] = [b.name for b in self.jumped]
        if crashed:
            detail["exited_by_themselves"] = [b.name for b in crashed]
            self.crashes += len(crashed)
        if self.bookies_killed or self.bookies_paused:
            detail["bookies_restarted"] = [b.name for b in self.bookies_killed]
            detail["bookies_resumed"] = [b.name for b in self.bookies_paused]
        if pulsar_exited:
            detail["pulsar_exited_by_themselves"] = pulsar_exited
            self.crashes += len(pulsar_exited)
        for collection in (
            self.killed, self.stopped, self.terminated, self.paused, self.jumped,
            self.bookies_killed, self.bookies_paused,
        ):  # fmt: skip
            collection.clear()
        self.zombie = None
        self.log("heal", detail)

    def _restart_pulsar_members(self) -> list[str]:
        """Start the killed bookies again, and any bookie or Pulsar broker found exited
        without being killed here (the broker killed by ``kill-pulsar`` is started by the
        caller); the names of the latter."""
        pulsar = self.cluster.pulsar
        if not isinstance(pulsar, NamespacedPulsarCluster):
            return []
        killed = [*self.bookies_killed, *([pulsar.broker] if self.pulsar_down else [])]
        exited = [m for m in pulsar.members() if not m.is_running() and m not in killed]
        for member in [*self.bookies_killed, *exited]:
            member.start()
        return [m.name for m in exited]

    def wait_for_leader(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while not self.cluster.leaders():
            if time.monotonic() > deadline:
                raise AssertionError(f"no leader {timeout_s} s after healing")
            time.sleep(0.1)
