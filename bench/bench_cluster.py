"""A 3-broker cluster (real ZooKeeper, `steward broker` processes, shared file ledgers):
failover and hand-over times, follower lag, and the cost of replication.

    python bench/bench_cluster.py --scenario failover --runs 10
    python bench/bench_cluster.py --scenario load --seconds 10
    python bench/bench_cluster.py --scenario load --ledgers pulsar   # on pulsar-lite
    python bench/bench_cluster.py --scenario backends --seconds 10   # file and pulsar, one run
    python bench/bench_cluster.py --scenario failover-engines --runs 5

failover-engines: the failover scenario (kill -9 only) on the file ledger, pulsar-lite and
real Apache Pulsar (clients/dev/pulsar_standalone.py, jars from ./scripts/fetch-engines;
brokers with --pulsar-flavor pulsar, so the new leader fences the old one in the engine),
the three clusters one after the other in one run.

failover: kill -9 of the leader while one client writes, time from the kill to the first
write acknowledged by the new leader (the killed broker restarts between runs); then
graceful hand-over: SIGTERM of the leader to the first acknowledged write on the next.

load: the submission load of bench_submit.py (batches of 100 from 4 clients, single
tasks from 32 clients) against a standalone broker and against the cluster's leader, one
after the other on this machine; meanwhile a probe submits one task every 20 ms to the
leader and polls a follower until the task is visible there: follower lag = visible on
the follower - acknowledged by the leader (resolution: one follower GET, ~0.3 ms).
Prints figures; asserts nothing about timing.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import uvloop

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench_submit import (
    free_port,
    percentile,
    read_response,
    request_bytes,
    run_scenario,
    start_broker,
)

from clients.dev.pulsar_lite import PulsarLiteServer
from clients.dev.pulsar_standalone import PulsarStandalone
from clients.dev.zk import ZooKeeperServer

SESSION_TIMEOUT_MS = 4000


class Cluster:
    def __init__(
        self,
        root: Path,
        zookeeper: str,
        brokers: int = 3,
        pulsar_url: str | None = None,
        pulsar_admin_url: str | None = None,
    ) -> None:
        self.root = root
        self.zookeeper = zookeeper
        pulsar = ["--ledgers", "pulsar", "--pulsar-url", str(pulsar_url)]
        if pulsar_url is None:
            self.ledger_args = ["--ledger-dir", str(root / "ledgers")]
            self.name = "bench-file"
        elif pulsar_admin_url is None:
            self.ledger_args = [*pulsar, "--pulsar-flavor", "pulsar-lite"]
            self.name = "bench-pulsar"
        else:  # Apache Pulsar: fencing on, the namespace's policies applied at start
            self.ledger_args = [
                *pulsar, "--pulsar-flavor", "pulsar", "--pulsar-admin-url", pulsar_admin_url,
            ]  # fmt: skip
            self.name = "bench-apache-pulsar"
        # One ZooKeeper serves every cluster of a run: distinct names.
        self.ports = [free_port() for _ in range(brokers)]
        self.procs: list[subprocess.Popen[bytes] | None] = [None] * brokers

    def url(self, index: int) -> str:
        return f"http://127.0.0.1:{self.ports[index]}"

    def start(self, index: int) -> None:
        log = open(self.root / f"broker-{index}.log", "ab")  # noqa: SIM115 - child owns it
        self.procs[index] = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "clients.cli",
                "broker",
                "--zookeeper",
                self.zookeeper,
                "--cluster",
                self.name,
                "--broker-id",
                f"b{index}",
                "--data-dir",
                str(self.root / f"b{index}"),
                *self.ledger_args,
                "--http",
                f"127.0.0.1:{self.ports[index]}",
                "--session-timeout-ms",
                str(SESSION_TIMEOUT_MS),
                "--log-level",
                "WARNING",
            ],
            stdout=log,
            stderr=log,
        )

    def alive(self) -> list[int]:
        return [i for i, p in enumerate(self.procs) if p is not None and p.poll() is None]

    def leader(self, timeout_s: float = 60.0) -> int:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for i in self.alive():
                try:
                    health = httpx.get(self.url(i) + "/healthz", timeout=1).json()
                except (httpx.HTTPError, ValueError):
                    continue
                if health.get("role") == "leader" and health.get("writable"):
                    return i
            time.sleep(0.05)
        raise SystemExit("no leader")

    def wait_followers(self, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            roles = []
            for i in self.alive():
                try:
                    roles.append(httpx.get(self.url(i) + "/healthz", timeout=1).json()["role"])
                except (httpx.HTTPError, ValueError, KeyError):
                    roles.append("down")
            if len(roles) == len(self.procs) and roles.count("follower") == len(roles) - 1:
                return
            time.sleep(0.1)
        raise SystemExit("brokers did not settle")

    def stop(self) -> None:
        for proc in self.procs:
            if proc is not None and proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.procs:
            if proc is not None:
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    proc.kill()


def first_write_after(cluster: Cluster, excluded: int, since: float, limit_s: float) -> float:
    body = {"type": "noop", "tenant": "failover"}
    with httpx.Client(timeout=1.0) as client:
        while time.monotonic() - since < limit_s:
            for i in cluster.alive():
                if i == excluded:
                    continue
                try:
                    response = client.post(cluster.url(i) + "/api/v1/tasks", json=body)
                except httpx.HTTPError:
                    continue
                if response.status_code == 201:
                    return time.monotonic() - since
            time.sleep(0.005)
    raise SystemExit(f"no write acknowledged within {limit_s} s")


def measure_leader_loss(cluster: Cluster, runs: int, how: str) -> list[float]:
    """``how`` = "kill" (kill -9) or "term" (SIGTERM, graceful): seconds from the signal to
    the first write acknowledged by another broker, per run (the broker restarts after)."""
    took_s: list[float] = []
    for run in range(runs):
        leader = cluster.leader()
        cluster.wait_followers()
        time.sleep(1.0)
        proc = cluster.procs[leader]
        assert proc is not None
        started = time.monotonic()
        if how == "kill":
            proc.kill()
        else:
            proc.send_signal(signal.SIGTERM)
        took = first_write_after(cluster, leader, started, 30.0)
        took_s.append(took)
        label = "kill -9" if how == "kill" else "SIGTERM"
        print(f"{label} run {run + 1}: first acknowledged write after {took:.3f} s", flush=True)
        proc.wait(timeout=60)
        cluster.start(leader)
    return took_s


def scenario_failover_engines(root: Path, zookeeper: str, pulsar_lite_url: str, runs: int) -> None:
    """kill -9 of the leader on the file ledger, pulsar-lite and Apache Pulsar, one run."""
    times_s: dict[str, list[float]] = {}
    with PulsarStandalone(root / "pulsar-standalone", jvm_options=()) as standalone:
        standalone.create_namespace("public/steward")
        print(
            f"Apache Pulsar {standalone.version} standalone up in {standalone.first_start_s:.1f} s"
        )
        engines: dict[str, tuple[str | None, str | None]] = {
            "file": (None, None),
            "pulsar-lite": (pulsar_lite_url, None),
            "apache-pulsar": (standalone.service_url, standalone.admin_url),
        }
        for name, (url, admin_url) in engines.items():
            cluster_root = root / f"failover-{name}"
            cluster_root.mkdir()
            cluster = Cluster(cluster_root, zookeeper, pulsar_url=url, pulsar_admin_url=admin_url)
            try:
                for index in range(3):
                    cluster.start(index)
                cluster.leader()
                print(f"-- {name}", flush=True)
                times_s[name] = measure_leader_loss(cluster, runs, "kill")
            finally:
                cluster.stop()
    for name, took_s in times_s.items():
        print(
            f"failover on {name} (kill -9, session timeout {SESSION_TIMEOUT_MS} ms): median "
            f"{statistics.median(took_s):.3f} s, max {max(took_s):.3f} s over {runs} runs"
        )


def scenario_failover(cluster: Cluster, runs: int) -> None:
    kills = measure_leader_loss(cluster, runs, "kill")
    graceful = measure_leader_loss(cluster, runs, "term")
    print(
        f"failover (kill -9, session timeout {SESSION_TIMEOUT_MS} ms): median "
        f"{statistics.median(kills):.3f} s, max {max(kills):.3f} s over {runs} runs"
    )
    print(
        f"graceful hand-over (SIGTERM): median {statistics.median(graceful):.3f} s, "
        f"max {max(graceful):.3f} s over {runs} runs"
    )


async def probe_lag(
    leader_port: int, follower_port: int, stop_at: float, lags: list[float]
) -> None:
    leader_reader, leader_writer = await asyncio.open_connection("127.0.0.1", leader_port)
    reader, writer = await asyncio.open_connection("127.0.0.1", follower_port)
    body = b'{"type":"noop","tenant":"probe"}'
    try:
        while time.perf_counter() < stop_at:
            await asyncio.sleep(0.02)
            leader_writer.write(request_bytes(leader_port, body))
            head = await leader_reader.readuntil(b"\r\n\r\n")
            length = next(
                int(line[15:])
                for line in head.split(b"\r\n")
                if line[:15].lower() == b"content-length:"
            )
            answer = json.loads(await leader_reader.readexactly(length))
            acknowledged = time.perf_counter()
            if int(head[9:12]) != 201:
                continue
            get = (f"GET /api/v1/tasks/{answer['id']} HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n").encode()
            while time.perf_counter() - acknowledged < 5:
                writer.write(get)
                if await read_response(reader) == 200:
                    lags.append(time.perf_counter() - acknowledged)
                    break
    finally:
        leader_writer.close()
        writer.close()


async def load_with_probe(
    port: int, follower_port: int | None, clients: int, batch: int, seconds: float
) -> tuple[dict[str, float], list[float]]:
    lags: list[float] = []
    probe = None
    if follower_port is not None:
        # Starts after bench_submit's 2 s warm-up and runs through the measured part.
        stop_at = time.perf_counter() + 2.0 + seconds
        probe = asyncio.create_task(probe_lag(port, follower_port, stop_at, lags))
    figures = await run_scenario(port, clients, batch, seconds, 2.0)
    if probe is not None:
        await probe
    return figures, sorted(lags)


def print_figures(name: str, figures: dict[str, float]) -> None:
    print(
        f"{name}: {figures['tasks_per_s']:,.0f} tasks/s, {figures['requests_per_s']:,.0f} req/s, "
        f"p50 {figures['p50_ms']:.2f} ms, p99 {figures['p99_ms']:.2f} ms, "
        f"errors {figures['errors']:.0f}",
        flush=True,
    )


def scenario_load(root: Path, cluster: Cluster, seconds: float, *, standalone: bool = True) -> None:
    if standalone:
        run_standalone_load(root, seconds)
    cluster_load(cluster, seconds, "cluster leader")


def run_standalone_load(root: Path, seconds: float) -> None:
    standalone_port = free_port()
    standalone = start_broker(root / "standalone", standalone_port)
    try:
        for name, clients, batch in (("batch", 4, 100), ("single", 32, 1)):
            figures, _ = uvloop.run(load_with_probe(standalone_port, None, clients, batch, seconds))
            print_figures(f"standalone {name} ({clients} clients x {batch})", figures)
    finally:
        standalone.send_signal(signal.SIGTERM)
        standalone.wait(timeout=60)


def cluster_load(cluster: Cluster, seconds: float, label: str) -> None:
    leader = cluster.leader()
    cluster.wait_followers()
    follower = next(i for i in cluster.alive() if i != leader)
    for name, clients, batch in (("batch", 4, 100), ("single", 32, 1)):
        figures, lags = uvloop.run(
            load_with_probe(cluster.ports[leader], cluster.ports[follower], clients, batch, seconds)
        )
        print_figures(f"{label} {name} ({clients} clients x {batch})", figures)
        print(
            f"  follower lag under that load: p50 {percentile(lags, 0.5) * 1000:.2f} ms, "
            f"p99 {percentile(lags, 0.99) * 1000:.2f} ms, max {lags[-1] * 1000:.2f} ms "
            f"({len(lags)} probes)",
            flush=True,
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--scenario",
        choices=["failover", "load", "backends", "failover-engines", "all"],
        default="all",
    )
    parser.add_argument(
        "--ledgers", choices=["file", "pulsar"], default="file", help="load / failover"
    )
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--seconds", type=float, default=10.0)
    args = parser.parse_args()
    print(f"machine: {os.cpu_count()} cores, python {sys.version.split()[0]}")
    with tempfile.TemporaryDirectory(prefix="steward-bench-cluster-") as tmp:
        root = Path(tmp)
        zookeeper = ZooKeeperServer(root / "zk")
        zookeeper.start()
        pulsar = PulsarLiteServer(root / "pulsar")
        pulsar.start()
        if args.scenario in ("backends", "failover-engines"):
            try:
                if args.scenario == "backends":
                    run_backends(root, zookeeper.connect_string, pulsar.service_url, args.seconds)
                else:
                    scenario_failover_engines(
                        root, zookeeper.connect_string, pulsar.service_url, args.runs
                    )
            finally:
                pulsar.stop()
                zookeeper.stop()
            return
        url = pulsar.service_url if args.ledgers == "pulsar" else None
        cluster = Cluster(root, zookeeper.connect_string, pulsar_url=url)
        try:
            for index in range(3):
                cluster.start(index)
            cluster.leader()
            if args.scenario in ("load", "all"):
                scenario_load(root, cluster, args.seconds)
            if args.scenario in ("failover", "all"):
                scenario_failover(cluster, args.runs)
        finally:
            cluster.stop()
            pulsar.stop()
            zookeeper.stop()


def run_backends(root: Path, zookeeper: str, pulsar_url: str, seconds: float) -> None:
    """The same 3-broker cluster on the file backend, then on pulsar-lite."""
    for name, url in (("file", None), ("pulsar", pulsar_url)):
        cluster_root = root / f"cluster-{name}"  # root/pulsar is pulsar-lite's
        cluster_root.mkdir()
        cluster = Cluster(cluster_root, zookeeper, pulsar_url=url)
        try:
            for index in range(3):
                cluster.start(index)
            cluster.leader()
            cluster_load(cluster, seconds, f"cluster on {name} ledgers")
        finally:
            cluster.stop()


if __name__ == "__main__":
    main()
