"""The clients of a Jepsen run: ``python -m tests.jepsen.workload`` in the client namespace.

Threads submit ``jepsen_tasks:record`` tasks with idempotency keys (some into slots, some
two at a time in a transaction they then commit), read their tasks' state from any broker
and cancel a few, each operation one HTTP request to one broker, recorded as invoke then
ok / fail / info (docs/TESTING.md, "Partitions"). A submit that did not certainly fail or
succeed is retried with the same key (a new operation): the broker must answer the first
task again. Bounded in count and time; the history's operations are written to ``--out``
(JSON lines) when the run ends.
"""

from __future__ import annotations

import argparse
import json
import random
import threading
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import httpx

from tests.jepsen.history import History, Op

TENANT = "jepsen"
TASK_TYPE = "jepsen_tasks:record"
REQUEST_TIMEOUT_S = 2.0
SLOTS = ("s0", "s1")


class Client:
    def __init__(self, name: str, brokers: dict[str, str], history: History, config: Any) -> None:
        self.name = name
        self.brokers = brokers  # name -> url
        self.by_url = {url: n for n, url in brokers.items()}
        self.history = history
        self.config = config
        self.rng = random.Random(f"{config.seed}-{name}")
        self.leader = self.rng.choice(sorted(brokers))
        self.tasks: list[int] = []
        self.http = httpx.Client(timeout=REQUEST_TIMEOUT_S)

    def request(self, invoked: Op, method: str, broker: str, path: str, **kw: Any) -> Op:
        """One request, its outcome recorded: 2xx ok; 307, 4xx fail (nothing written);
        5xx and transport errors info (it may have been applied)."""
        try:
            response = self.http.request(method, self.brokers[broker] + path, **kw)
        except httpx.HTTPError as exc:
            if broker == self.leader:
                self.rotate()  # down or cut off: the next try goes to another broker
            return self.history.complete(invoked, "info", {"error": type(exc).__name__}, broker)
        try:
            body = response.json()
        except ValueError:
            body = {"text": response.text[:200]}
        if response.status_code == 307:
            leader = self.by_url.get(str(body.get("leader_url", "")).rstrip("/"))
            if leader:
                self.leader = leader
        if 200 <= response.status_code < 300:
            result = body if isinstance(body, dict) else {"body": body}
            return self.history.complete(invoked, "ok", _brief(result), broker)
        error = {"status": response.status_code, "error": body.get("error")}
        kind = "fail" if response.status_code < 500 else "info"
        if response.status_code >= 500 or response.status_code == 307:
            self.rotate()
        return self.history.complete(invoked, kind, error, broker)  # type: ignore[arg-type]

    def rotate(self) -> None:
        names = sorted(self.brokers)
        self.leader = names[(names.index(self.leader) + 1) % len(names)]

    def submit(self, seq: int, deadline: float, txn: int | None = None) -> int | None:
        """A task (retried with its key until acknowledged, refused or out of time; once
        only in a transaction, whose commit decides): its id, or None."""
        key = f"j{self.config.seed}-{self.name}-{seq}"
        # One in ten runs long, ahead of the queue: a worker paused by the nemesis is likely
        # mid-run, and the replacement of its attempt starts at once elsewhere while the old
        # attempt is paused (a zombie once resumed).
        long_run = self.rng.random() < 0.1
        params: dict[str, Any] = {
            "key": key,
            "seconds": round(
                self.rng.uniform(1.0, 2.5)
                if long_run
                else self.rng.uniform(0.05, self.config.task_seconds),
                3,
            ),
            "effects": self.config.effects,
        }
        body: dict[str, Any] = {
            "type": TASK_TYPE,
            "tenant": TENANT,
            "code": self.config.code,
            # As the chaos soak: an attempt lost with its worker's connection is retried.
            "max_attempts": self.config.max_attempts,
            "priority": 10 if long_run else 0,
        }
        args: dict[str, Any] = {"key": key, "tenant": TENANT}
        if txn is not None:
            args["txn"] = body["transaction"] = txn
        elif self.rng.random() < 0.1:
            args["slot"] = params["slot"] = body["slot"] = self.rng.choice(SLOTS)
        body["params"] = params
        while time.monotonic() < deadline:
            invoked = self.history.invoke(self.name, "submit", args)
            done = self.request(
                invoked, "POST", self.leader, "/api/v1/tasks",
                json=body, headers={"Idempotency-Key": key},
            )  # fmt: skip
            if done.type == "ok":
                self.tasks.append(int(done.result["id"]))
                return int(done.result["id"])
            if txn is not None or (done.type == "fail" and done.result.get("status") != 307):
                return None  # refused for good (a busy slot): nothing was written
            time.sleep(0.05 if done.result.get("status") == 307 else 0.2)
        return None

    def transaction(self, seq: int, deadline: float) -> None:
        """Two tasks in a transaction, then its commit: all of them or none."""
        begun = self.history.invoke(self.name, "txn-begin", {"tenant": TENANT})
        done = self.request(begun, "POST", self.leader, "/api/v1/transactions",
                            json={"tenant": TENANT, "ttl_s": 30})  # fmt: skip
        if done.type != "ok":
            return
        txn = int(done.result["id"])
        ids = [self.submit(seq * 1000 + n, deadline, txn) for n in range(2)]
        known = [i for i in ids if i is not None]
        invoked = self.history.invoke(self.name, "txn", {"txn": txn, "ids": known})
        self.request(invoked, "POST", self.leader, f"/api/v1/transactions/{txn}/commit")

    def read(self) -> None:
        task_id = self.rng.choice(self.tasks)
        broker = self.rng.choice(sorted(self.brokers))
        invoked = self.history.invoke(self.name, "read", {"id": task_id})
        self.request(invoked, "GET", broker, f"/api/v1/tasks/{task_id}")

    def cancel(self) -> None:
        task_id = self.rng.choice(self.tasks)
        invoked = self.history.invoke(self.name, "cancel", {"id": task_id})
        self.request(invoked, "POST", self.leader, f"/api/v1/tasks/{task_id}/cancel")

    def run(self, stop: threading.Event, deadline: float) -> None:
        for seq in range(self.config.ops):
            if stop.is_set() or time.monotonic() >= deadline:
                return
            draw = self.rng.random()
            if not self.tasks or draw < 0.55:
                self.submit(seq, deadline)
            elif draw < 0.6:
                self.transaction(seq, deadline)
            elif draw < 0.95:
                self.read()
            else:
                self.cancel()
            stop.wait(self.config.pause_s)


def _brief(result: dict[str, Any]) -> dict[str, Any]:
    """What the checker needs of an answer (a task view is large)."""
    keep = ("id", "ids", "state", "attempt", "replayed", "worker", "tenant", "cancelled")
    return {k: result[k] for k in keep if k in result}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m tests.jepsen.workload")
    parser.add_argument("--brokers", required=True, help="name=url,name=url")
    parser.add_argument("--code", required=True)
    parser.add_argument("--effects", required=True)
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--clients", type=int, default=3)
    parser.add_argument("--ops", type=int, default=2000, help="per client (a bound)")
    parser.add_argument("--duration-s", type=float, default=60.0)
    parser.add_argument("--pause-s", type=float, default=0.1)
    parser.add_argument("--task-seconds", type=float, default=0.3)
    parser.add_argument("--max-attempts", type=int, default=10)
    parser.add_argument("--stop-file", type=Path, help="stop early once this file exists")
    config = parser.parse_args(argv)
    brokers = dict(item.split("=", 1) for item in config.brokers.split(","))
    history = History()
    stop = threading.Event()
    deadline = time.monotonic() + config.duration_s
    clients = [Client(f"c{i}", brokers, history, config) for i in range(config.clients)]
    threads = [threading.Thread(target=c.run, args=(stop, deadline), daemon=True) for c in clients]
    for thread in threads:
        thread.start()
    while any(t.is_alive() for t in threads):
        if config.stop_file is not None and config.stop_file.exists():
            stop.set()
        time.sleep(0.1)
    with config.out.open("w") as out:
        for op in history.ops:
            out.write(json.dumps({"kind": "op", **asdict(op)}) + "\n")


if __name__ == "__main__":
    main()
