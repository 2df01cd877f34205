"""The clients of a Jepsen run: ``python -m tests.jepsen.workload`` in the client namespace.

Threads submit ``jepsen_tasks:record`` tasks with idempotency keys (some into slots, some
two at a time in a transaction they then commit, some three at a time in a batch, some as
the root of a tracked tree whose children the task spawns), read their tasks' state from
any broker, cancel a few by id, and cancel the waiting ``jepsen_tasks:cancellable`` ones
by filter; each operation one HTTP request to one broker, recorded as invoke then
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
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import httpx

from tests.jepsen.history import History, Op

TENANT = "jepsen"
TASK_TYPE = "jepsen_tasks:record"
CANCELLABLE_TYPE = "jepsen_tasks:cancellable"  # cancelled by filter, while waiting
TREE_ROOT_TYPE = "jepsen_tasks:tree_root"
BATCH_SIZE = 3
MAX_BACKLOG = 400  # waiting tasks: past it the clients read instead of submitting
REQUEST_TIMEOUT_S = 2.0
SLOTS = ("s0", "s1")


class Backlog:
    """The tenant's waiting tasks, read from any broker at most once a second (shared by
    the clients): above :data:`MAX_BACKLOG` the clients read instead of submitting, so a
    long run's queue stays far shorter than the trees' timeout (a backlog of 20,000 tasks
    at the two workers' ~16 tasks/s kept tree children waiting past ``tree_timeout_s``)."""

    def __init__(self, brokers: dict[str, str]) -> None:
        self.urls = sorted(brokers.values())
        self.waiting = 0
        self._read_at = 0.0
        self._lock = threading.Lock()
        self._http = httpx.Client(timeout=REQUEST_TIMEOUT_S)

    def full(self) -> bool:
        with self._lock:
            now = time.monotonic()
            if now - self._read_at >= 1.0:
                self._read_at = now
                url = self.urls[int(now) % len(self.urls)]
                try:
                    body = self._http.get(f"{url}/api/v1/tenants/{TENANT}").json()
                    self.waiting = int(body["counts"]["waiting"])
                except (httpx.HTTPError, ValueError, KeyError, TypeError):
                    pass  # unreachable in a fault: keep the last reading
            return self.waiting > MAX_BACKLOG


class Client:
    def __init__(
        self,
        name: str,
        brokers: dict[str, str],
        history: History,
        config: Any,
        backlog: Backlog | None = None,
    ) -> None:
        self.name = name
        self.backlog = backlog
        self.brokers = brokers  # name -> url
        self.by_url = {url: n for n, url in brokers.items()}
        self.history = history
        self.config = config
        self.rng = random.Random(f"{config.seed}-{name}")
        self.leader = self.rng.choice(sorted(brokers))
        self.tasks: list[int] = []
        self.http = httpx.Client(timeout=REQUEST_TIMEOUT_S)

    def request(
        self,
        invoked: Op,
        method: str,
        broker: str,
        path: str,
        answer: Callable[[dict[str, Any]], dict[str, Any]] | None = None,
        **kw: Any,
    ) -> Op:
        """One request, its outcome recorded: 2xx ok (its body through ``answer``, then
        :func:`_brief`); 307, 4xx fail (nothing written); 5xx and transport errors info (it
        may have been applied)."""
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
            if answer is not None:
                result = answer(result)
            return self.history.complete(invoked, "ok", _brief(result), broker)
        error = {"status": response.status_code, "error": body.get("error")}
        kind = "fail" if response.status_code < 500 else "info"
        if response.status_code >= 500 or response.status_code == 307:
            self.rotate()
        return self.history.complete(invoked, kind, error, broker)  # type: ignore[arg-type]

    def rotate(self) -> None:
        names = sorted(self.brokers)
        self.leader = names[(names.index(self.leader) + 1) % len(names)]

    def _task(self, key: str, long_run: bool = False) -> dict[str, Any]:
        """One task's body (its params carry its key: the checker finds it in the state)."""
        seconds = (
            self.rng.uniform(1.0, 2.5)
            if long_run
            else self.rng.uniform(0.05, self.config.task_seconds)
        )
        return {
            "type": TASK_TYPE,
            "tenant": TENANT,
            "code": self.config.code,
            "params": {"key": key, "seconds": round(seconds, 3), "effects": self.config.effects},
            # As the chaos soak: an attempt lost with its worker's connection is retried, and
            # so is one lost with the worker (max_lost, docs/DESIGN.md §6, "Lost workers").
            "max_attempts": self.config.max_attempts,
            "max_lost": self.config.max_attempts,
            "priority": 10 if long_run else 0,
        }

    def submit(
        self, seq: int, deadline: float, txn: int | None = None, kind: str = "one"
    ) -> int | None:
        """A task, a batch of :data:`BATCH_SIZE` (``kind="batch"``), the root of a tracked
        tree (``"tree"``) or a task cancel by filter may end (``"cancellable"``), retried
        with its key until acknowledged, refused or out of time (once only in a
        transaction, whose commit decides): its (first) id, or None."""
        key = f"j{self.config.seed}-{self.name}-{seq}"
        args: dict[str, Any] = {"key": key, "tenant": TENANT}
        answer: Callable[[dict[str, Any]], dict[str, Any]] | None = None
        if kind == "batch":
            keys = [f"{key}/{i}" for i in range(BATCH_SIZE)]
            body: dict[str, Any] = {"tasks": [self._task(k) for k in keys]}
            args["batch"] = BATCH_SIZE

            def batch_answer(result: dict[str, Any], keys: list[str] = keys) -> dict[str, Any]:
                items = result.get("tasks") or []
                made = [(k, t) for k, t in zip(keys, items, strict=False) if "id" in t]
                return {
                    "ids": [int(t["id"]) for _, t in made],
                    "keys": [k for k, _ in made],  # the checker's key of each id
                    "replayed": result.get("replayed"),
                }

            answer = batch_answer
        else:
            # One in ten runs long, ahead of the queue: a worker paused by the nemesis is
            # likely mid-run, and the replacement of its attempt starts at once elsewhere
            # while the old attempt is paused (a zombie once resumed).
            body = self._task(key, long_run=kind == "one" and self.rng.random() < 0.1)
            if kind == "tree":
                children = self.rng.randint(2, 4)
                body.update(type=TREE_ROOT_TYPE, track_tree=True, tree_timeout_s=600)
                body["params"].update(
                    children=children, child_seconds=0.1, max_attempts=self.config.max_attempts
                )
                args["children"] = children
            elif kind == "cancellable":
                body["type"] = CANCELLABLE_TYPE
                args["cancellable"] = True
            if txn is not None:
                args["txn"] = body["transaction"] = txn
            elif kind == "one" and self.rng.random() < 0.1:
                args["slot"] = body["params"]["slot"] = body["slot"] = self.rng.choice(SLOTS)
        while time.monotonic() < deadline:
            invoked = self.history.invoke(self.name, "submit", args)
            done = self.request(
                invoked, "POST", self.leader, "/api/v1/tasks", answer,
                json=body, headers={"Idempotency-Key": key},
            )  # fmt: skip
            if done.type == "ok":
                ids = done.result["ids"] if "ids" in done.result else [done.result["id"]]
                self.tasks += [int(i) for i in ids]
                return int(ids[0]) if ids else None
            if txn is not None or (done.type == "fail" and done.result.get("status") != 307):
                return None  # refused for good (a busy slot): nothing was written
            time.sleep(0.05 if done.result.get("status") == 307 else 0.2)
        return None

    def cancel_matching(self) -> None:
        """Cancel the waiting tasks of the cancellable type (by filter, not by id)."""
        filters = {"tenant": TENANT, "type": CANCELLABLE_TYPE, "state": "waiting"}
        invoked = self.history.invoke(self.name, "cancel-matching", filters)
        self.request(
            invoked,
            "POST",
            self.leader,
            "/api/v1/tasks/cancel",
            json={**filters, "reason": "jepsen"},
        )

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
            if draw < 0.6 and self.tasks and self.backlog is not None and self.backlog.full():
                draw = 0.6  # a read instead: the workers have a long queue already
            if not self.tasks or draw < 0.4:
                self.submit(seq, deadline)
            elif draw < 0.46:
                self.submit(seq, deadline, kind="batch")
            elif draw < 0.5:
                self.submit(seq, deadline, kind="tree")
            elif draw < 0.55:
                self.submit(seq, deadline, kind="cancellable")
            elif draw < 0.6:
                self.transaction(seq, deadline)
            elif draw < 0.93:
                self.read()
            elif draw < 0.97:
                self.cancel()
            else:
                self.cancel_matching()
            stop.wait(self.config.pause_s)


def _brief(result: dict[str, Any]) -> dict[str, Any]:
    """What the checker needs of an answer (a task view is large)."""
    keep: tuple[str, ...] = (
        "id",
        "ids",
        "keys",
        "state",
        "attempt",
        "replayed",
        "worker",
        "tenant",
    )
    keep += ("matched", "cancelled", "skipped")  # a cancel by filter's counts
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
    backlog = Backlog(brokers)
    clients = [Client(f"c{i}", brokers, history, config, backlog) for i in range(config.clients)]
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
