"""The driver of one Jepsen run, inside the control namespace (started by
``python -m tests.jepsen``, which made the network and tears it down).

Starts ZooKeeper, the brokers and the workers in their namespaces, uploads the task code,
starts the workload in the client namespace, watches who writes the ledger list (the
leaders' epochs), runs the nemesis, heals, drains, reads the final state and every
replica's digest, writes ``history.jsonl`` and checks it (docs/TESTING.md, "Partitions").
Exit status 0: the checker passed; 1: violations (the report is printed); 2: the run
itself failed (a process did not start, a wait ran out).
"""

from __future__ import annotations

import argparse
import logging
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
from kazoo.client import KazooClient  # type: ignore[import-untyped]

from tests.jepsen.checker import check, outages, report, task_ids, zombie_attempts
from tests.jepsen.cluster import BOOKIE_NODES, Broker, Cluster, NamespacedPulsarCluster
from tests.jepsen.history import (
    FINAL_STATES,
    Claim,
    Execution,
    History,
    RunInfo,
    read_executions,
)
from tests.jepsen.nemesis import ALL_KINDS, NETWORK_FAULTS, Nemesis
from tests.jepsen.netns import NETNS_DIR, Network

TASK_MODULE = Path(__file__).with_name("jepsen_tasks.py")
BROKERS = ["b1", "b2", "b3"]
WORKERS = ["w1", "w2"]
# pl: the ledger engine (--ledger pulsar: pulsar-lite; --ledger apache-pulsar: the Apache
# Pulsar broker, with the bookies in BOOKIE_NODES).
NODES = ["zk", *BROKERS, *WORKERS, "cl", "pl"]
LEDGERS = ("file", "pulsar", "apache-pulsar")
OUTAGE_MARGIN_S = 6.0  # over the session timeout: election, ledger recovery, a client retry


def nodes(ledger: str) -> list[str]:
    """The namespaces of a run on ``ledger`` (the control namespace is added by Network)."""
    return [*NODES, *BOOKIE_NODES] if ledger == "apache-pulsar" else NODES


def wait_for(check: Any, timeout_s: float, what: str) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not within {timeout_s} s")
        time.sleep(0.1)


class ClaimWatcher(threading.Thread):
    """Polls who writes the ledger list (ZooKeeper), recording each change as a claim."""

    def __init__(self, cluster: Cluster, history: History) -> None:
        super().__init__(daemon=True)
        self.cluster = cluster
        self.history = history
        self.done = threading.Event()

    def run(self) -> None:
        # Its connection losses during ZooKeeper faults are expected: not worth a line each.
        logging.getLogger("kazoo").setLevel(logging.ERROR)
        client = KazooClient(hosts=self.cluster.zookeeper.connect_string, timeout=2.0)
        client.start(timeout=15)
        try:
            while not self.done.wait(0.1):
                seen = self.cluster.ledger_writer(client)
                if seen is not None:
                    self.history.add_claim(Claim(time.monotonic(), seen[0], seen[1]))
        finally:
            client.stop()
            client.close()


def _pages(broker: Broker, path: str, items: str, key: str) -> dict[int, dict[str, Any]]:
    """Every page of a listing of the jepsen tenant's tasks or trees, by ``key``."""
    found: dict[int, dict[str, Any]] = {}
    after = 0
    for _ in range(1000):
        body = broker.get(f"{path}?tenant=jepsen&limit=1000&after={after}", 30)
        for item in body[items]:
            found[int(item[key])] = item
        if body.get("next_after") is None:
            return found
        after = body["next_after"]
    raise AssertionError(f"too many pages of {items}")


def fetch_tasks(broker: Broker) -> dict[int, dict[str, Any]]:
    return _pages(broker, "/api/v1/tasks", "tasks", "id")


def fetch_trees(broker: Broker) -> dict[int, dict[str, Any]]:
    return _pages(broker, "/api/v1/trees", "trees", "root")


def digests(cluster: Cluster) -> dict[str, tuple[int, str]] | None:
    found = {}
    for broker in cluster.brokers.values():
        try:
            body = broker.get("/api/v1/state/digest", 10)
        except httpx.HTTPError:
            return None
        position = body["position"]
        found[broker.name] = (
            int(position["ledger_id"]) * 10**9 + int(position["entry_id"]),
            str(body["digest"]),
        )
    # Positions may differ by a leader's trailing Confirm marker (docs/API.md): the digests
    # of the state must be equal.
    return found if len({digest for _, digest in found.values()}) == 1 else None


def worker_names() -> dict[str, str]:
    """The task code records its network namespace: ``net:[inode]`` -> worker name."""
    return {f"net:[{os.stat(NETNS_DIR / f'sj-{w}').st_ino}]": w for w in WORKERS}


def run(args: argparse.Namespace) -> int:
    root = Path(args.dir)
    session_s = args.session_timeout_ms / 1000
    info = RunInfo(
        seed=args.seed,
        faults=args.faults,
        max_attempts=args.max_attempts,
        ledger=args.ledger,
        log_dir=str(root),
        outage_bound_s=session_s + OUTAGE_MARGIN_S,
        started=time.monotonic(),
    )
    history = History(info)
    net = Network(nodes(args.ledger))  # made by the parent: addresses and names only
    cluster = Cluster(
        net,
        root,
        brokers=BROKERS,
        workers=WORKERS,
        session_timeout_ms=args.session_timeout_ms,
        ledger=args.ledger,
    )
    # Task processes run under other uids (docs/SECURITY.md, "Task users"): they must
    # reach and append to the effects file.
    os.chmod(root, os.stat(root).st_mode | 0o711)
    (root / "effects").mkdir(exist_ok=True)
    os.chmod(root / "effects", 0o1777)
    effects = root / "effects" / "effects.jsonl"
    watcher = ClaimWatcher(cluster, history)
    kinds = frozenset(args.kinds.split(",")) if args.kinds else None
    nemesis = Nemesis(net, cluster, history, args.seed, session_s, kinds)
    try:
        cluster.start()
        leader = wait_for(cluster.leaders, 60, "a leader")[0]
        code = TASK_MODULE.read_bytes()
        answer = httpx.post(
            leader.url + "/api/v1/code", params={"name": TASK_MODULE.name}, content=code, timeout=60
        )
        answer.raise_for_status()
        code_sha = str(answer.json()["sha256"])
        cluster.start_workers()

        def connected() -> bool:
            leaders = cluster.leaders()
            if not leaders:
                return False
            body = leaders[0].get("/api/v1/cluster", 5)
            return {w["id"] for w in body["workers"] if w["state"] == "connected"} >= set(WORKERS)

        wait_for(connected, 60, "workers connected")
        watcher.start()
        stop_file = root / "stop-load"
        load_out = root / "ops.jsonl"
        load = subprocess.Popen(
            [
                *net.exec_prefix("cl"), sys.executable, "-m", "tests.jepsen.workload",
                "--brokers", ",".join(f"{b.name}={b.url}" for b in cluster.brokers.values()),
                "--code", code_sha, "--effects", str(effects), "--out", str(load_out),
                "--seed", str(args.seed), "--duration-s", str(args.duration_s),
                "--stop-file", str(stop_file), "--max-attempts", str(args.max_attempts),
                # A bound that outlasts the nemesis: ~60 operations per client per fault.
                "--ops", str(2000 + 100 * args.faults),
            ],
            stdout=open(root / "logs" / "workload.log", "ab"),  # noqa: SIM115 - the child's
            stderr=subprocess.STDOUT,
        )  # fmt: skip
        try:
            nemesis.run(args.faults, stop=lambda: load.poll() is not None)
        finally:
            nemesis.heal()
        stop_file.touch()
        load.wait(timeout=args.duration_s + 60)
        history.ops = History.load(load_out).ops
        # Tasks submitted into a transaction exist only once it committed: a commit that
        # failed drops them (the checker's partial_transactions), so the drain waits for
        # a transaction's tasks only when its commit was acknowledged.
        acked = {t for i, c in history.pairs() if c and c.type == "ok" and i.f == "submit"
                 and "txn" not in i.args for t in task_ids(c)}  # fmt: skip
        acked |= {int(t) for i, c in history.pairs() if c and c.type == "ok" and i.f == "txn"
                  for t in i.args.get("ids", [])}  # fmt: skip

        def drained() -> dict[int, dict[str, Any]] | None:
            leaders = cluster.leaders()
            if not leaders:
                return None
            try:
                tasks = fetch_tasks(leaders[0])
            except httpx.HTTPError:
                return None
            # The children tracked roots spawned (never acknowledged to a client) too.
            children = [t for t in tasks.values() if t.get("parent") is not None]
            final = all(tasks.get(t, {}).get("state") in FINAL_STATES for t in acked) and all(
                t.get("state") in FINAL_STATES for t in children
            )
            return tasks if final else None

        # The backlog drains at ~the workers' pace: the bound grows with it.
        drain_s = 30 + 0.5 * len(acked)
        try:
            history.final.tasks = wait_for(drained, drain_s, "every acknowledged task final")
        except TimeoutError:
            history.final.tasks = fetch_tasks(cluster.leaders()[0])  # the checker reports them
        history.final.trees = fetch_trees(wait_for(cluster.leaders, 60, "a leader")[0])
        found = None
        try:
            found = wait_for(lambda: digests(cluster), 60, "equal digests")
        except TimeoutError:
            found = {}
            for broker in cluster.brokers.values():
                try:
                    body = broker.get("/api/v1/state/digest", 10)
                    found[broker.name] = (0, str(body["digest"]))
                except httpx.HTTPError as exc:
                    found[broker.name] = (0, f"unreachable: {exc}")
        history.final.digests = found
        if isinstance(cluster.pulsar, NamespacedPulsarCluster):
            # Each member's memory now (the JVMs' heaps are fixed: close to their peak).
            rss = {name: round(mb) for name, mb in cluster.pulsar.rss_mb().items()}
            print(f"jepsen pulsar cluster: started in {cluster.pulsar.start_s:.1f} s, "
                  f"RSS MB {rss}", flush=True)  # fmt: skip
    except BaseException:
        print(cluster.log_tails(), flush=True)
        raise
    finally:
        watcher.done.set()
        info.ended = time.monotonic()
        names = worker_names()
        history.executions = [
            Execution(e.task, e.attempt, names.get(e.worker, e.worker), e.start, e.end, e.slot)
            for e in read_executions(effects)
        ]
        history.dump(root / "history.jsonl")
        cluster.stop()
    violations = check(history)
    counts = {**cluster.log_counts(), "zombie attempts": len(zombie_attempts(history))}
    counts["brokers exited by themselves"] = nemesis.crashes
    counts["zombies arranged"] = nemesis.zombies_arranged
    print(summary(history, nemesis.counts, counts), flush=True)
    if violations:
        print(report(history, violations), flush=True)
        return 1
    print(f"checker passed: seed {args.seed}, history {root / 'history.jsonl'}", flush=True)
    return 0


def summary(history: History, counts: dict[str, int], counters: dict[str, int]) -> str:
    outcomes: dict[str, int] = {}
    for _, done in history.pairs():
        kind = done.type if done else "open"
        outcomes[kind] = outcomes.get(kind, 0) + 1
    states: dict[str, int] = {}
    for task in history.final.tasks.values():
        states[str(task.get("state"))] = states.get(str(task.get("state")), 0) + 1
    leaders = len({(c.broker, c.epoch) for c in history.claims})
    network = sum(n for kind, n in counts.items() if kind in NETWORK_FAULTS)
    others = sum(counts.values()) - network
    measured = ", ".join(
        f"{event.action} {lasted:.1f} s{'' if acked else ' (no ack before the next fault)'}"
        for event, lasted, acked in outages(history)
    )
    return (
        f"seed {history.info.seed}, ledger {history.info.ledger}; "
        f"faults {sum(counts.values())} (network {network}, process or clock {others}) "
        f"{dict(sorted(counts.items()))}; operations {outcomes}; counters {counters}; "
        f"tasks {states}; executions {len(history.executions)}; leader epochs seen {leaders}; "
        f"outages (fault to the next acknowledged write): {measured or 'none'}; "
        f"longest {max((lasted for _, lasted, _ in outages(history)), default=0.0):.1f} s"
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m tests.jepsen.run")
    parser.add_argument("--dir", required=True)
    parser.add_argument("--seed", type=int, required=True)
    parser.add_argument("--faults", type=int, required=True)
    parser.add_argument("--ledger", choices=LEDGERS, default="file")
    parser.add_argument("--kinds", default="", help="only these fault kinds (comma-separated)")
    parser.add_argument("--duration-s", type=float, required=True)
    parser.add_argument("--session-timeout-ms", type=int, default=4000)
    parser.add_argument("--max-attempts", type=int, default=10)
    args = parser.parse_args(argv)
    unknown = set(args.kinds.split(",")) - set(ALL_KINDS) if args.kinds else set()
    if unknown:
        parser.error(f"unknown fault kinds {sorted(unknown)}; known: {', '.join(ALL_KINDS)}")
    try:
        sys.exit(run(args))
    except (TimeoutError, AssertionError, OSError, httpx.HTTPError) as exc:
        print(f"the run failed: {exc}", file=sys.stderr, flush=True)
        sys.exit(2)


if __name__ == "__main__":
    main()
