"""The client side of the cluster tests: :class:`WriteLoad`, concurrent HTTP clients that
submit tasks with idempotency keys, follow the leader (307 redirects, retries on 503 and
broken connections) or stay pinned to one broker, and record every answer with its time;
the checks on what they recorded (every acknowledged task on every broker, idempotency),
reading a broker's tasks, and the flocks a broker process holds.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import threading
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx

if TYPE_CHECKING:
    pass
from tests.support.cluster_procs import BrokerNode
from tests.support.worker_procs import wait_until


@dataclass(frozen=True)
class Ack:
    """A 2xx answer to a submission."""

    key: str
    task_id: int
    params: dict[str, Any]
    broker_url: str  # who answered
    sent_at: float  # monotonic, when the answered request was sent
    at: float  # monotonic, when the answer arrived
    replayed: bool


@dataclass(frozen=True)
class Answer:
    """Any answer (or a transport error: status 0) to one request."""

    broker_url: str
    status: int
    sent_at: float
    at: float
    retryable: bool | None  # from the error body; None for 2xx and transport errors


@dataclass
class LoadRecord:
    attempted: dict[str, dict[str, Any]] = field(default_factory=dict)  # key -> params
    acked: dict[str, Ack] = field(default_factory=dict)
    answers: list[Answer] = field(default_factory=list)
    statuses: Counter[int] = field(default_factory=Counter)
    unexpected: list[str] = field(default_factory=list)  # 4xx other than 307 and the like


class WriteLoad:
    """``clients`` concurrent submitters on an asyncio loop in a background thread.

    ``follow=True``: start at ``targets[0]``, follow 307 redirects to ``leader_url``,
    move to the next broker on 503 or a broken connection, and retry the same
    submission with the same ``Idempotency-Key`` until it is acknowledged (when
    ``idempotent``; otherwise a submission whose fate is unknown is abandoned, so a
    retry can never create a second task). ``follow=False``: every request goes to
    ``targets[0]`` and each submission is tried once.
    """

    def __init__(
        self,
        targets: list[str],
        *,
        clients: int = 32,
        tag: str | None = None,
        task_type: str = "load.job",
        tenant: str = "load",
        follow: bool = True,
        idempotent: bool = True,
        request_timeout_s: float = 5.0,
        pause_s: float = 0.0,
    ) -> None:
        assert targets
        self.targets = list(targets)
        self.clients = clients
        self.tag = tag or uuid.uuid4().hex[:6]
        self.task_type = task_type
        self.tenant = tenant
        self.follow = follow
        self.idempotent = idempotent
        self.request_timeout_s = request_timeout_s
        self.pause_s = pause_s
        self.record = LoadRecord()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    # -- control ----------------------------------------------------------------------------

    def start(self) -> WriteLoad:
        self._thread = threading.Thread(target=self._run, name=f"load-{self.tag}", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout_s: float = 20.0) -> LoadRecord:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
            assert not self._thread.is_alive(), f"load {self.tag} did not stop in {timeout_s} s"
        if self._error is not None:
            raise AssertionError(f"load {self.tag} failed: {self._error!r}") from self._error
        return self.record

    def acked_count(self) -> int:
        with self._lock:
            return len(self.record.acked)

    def first_ack(self, after: float, excluding_url: str | None = None) -> Ack | None:
        """The earliest acknowledgement sent by a broker other than ``excluding_url``
        that arrived after ``after`` (monotonic)."""
        with self._lock:
            acks = [
                a
                for a in self.record.acked.values()
                if a.at > after and a.broker_url != excluding_url
            ]
        return min(acks, key=lambda a: a.at) if acks else None

    def wait_first_ack(
        self,
        after: float,
        timeout_s: float,
        what: str,
        *,
        excluding_url: str | None = None,
        pause_s: float,
    ) -> Ack:
        """Wait for :meth:`first_ack` (``after``, ``excluding_url``) and return it."""
        ack: Ack = wait_until(
            lambda: self.first_ack(after, excluding_url), timeout_s, what, pause_s=pause_s
        )
        return ack

    def wait_for_more_acks(self, count: int, timeout_s: float, what: str = "more writes") -> None:
        """Wait until more than ``count`` further writes are acknowledged."""
        acked = self.acked_count()
        wait_until(lambda: self.acked_count() > acked + count, timeout_s, what)

    def answers(self) -> list[Answer]:
        with self._lock:
            return list(self.record.answers)

    def answers_during(self, start: float, end: float) -> list[Answer]:
        """The answers to requests sent at or after ``start`` that came before ``end``
        (monotonic): what clients saw during an outage."""
        return [a for a in self.answers() if start <= a.sent_at and a.at < end]

    def acks(self) -> list[Ack]:
        with self._lock:
            return list(self.record.acked.values())

    # -- the clients ----------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            asyncio.run(self._main())
        except BaseException as exc:  # surfaced by stop()
            self._error = exc

    async def _main(self) -> None:
        limits = httpx.Limits(max_connections=self.clients * 2, max_keepalive_connections=0)
        async with httpx.AsyncClient(timeout=self.request_timeout_s, limits=limits) as http:
            await asyncio.gather(*(self._client(http, c) for c in range(self.clients)))

    async def _client(self, http: httpx.AsyncClient, client_no: int) -> None:
        rotation = itertools.cycle(range(len(self.targets)))
        target = self.targets[client_no % len(self.targets)] if self.follow else self.targets[0]
        for seq in itertools.count():
            if self._stop.is_set():
                return
            key = f"{self.tag}-{client_no}-{seq}"
            params = {"load": self.tag, "client": client_no, "seq": seq}
            with self._lock:
                self.record.attempted[key] = params
            target = await self._submit(http, target, key, params, rotation)
            if self.pause_s:
                await asyncio.sleep(self.pause_s)

    async def _submit(
        self,
        http: httpx.AsyncClient,
        target: str,
        key: str,
        params: dict[str, Any],
        rotation: itertools.cycle[int],
    ) -> str:
        """Send one submission until acknowledged (or given up); returns the next target."""
        # Writes only: no worker serves their tenant or type, which a broker that has seen
        # workers list their types refuses unless asked (docs/API.md, "Task types").
        body = {
            "type": self.task_type,
            "tenant": self.tenant,
            "params": params,
            "allow_unknown_type": True,
        }
        headers = {"Idempotency-Key": key} if self.idempotent else {}
        while not self._stop.is_set():
            sent_at = time.monotonic()
            try:
                response = await http.post(target + "/api/v1/tasks", json=body, headers=headers)
            except httpx.TransportError:
                self._answer(Answer(target, 0, sent_at, time.monotonic(), None))
                if not self.follow or not self.idempotent:
                    # The fate of this submission is unknown: never retry it blind.
                    await asyncio.sleep(0.02)
                    return target if not self.follow else self._next(rotation, target)
                target = self._next(rotation, target)
                await asyncio.sleep(0.02)
                continue
            at = time.monotonic()
            status = response.status_code
            if 200 <= status < 300:
                answer = response.json()
                ack = Ack(
                    key,
                    int(answer["id"]),
                    params,
                    target,
                    sent_at,
                    at,
                    bool(answer.get("replayed", False)),
                )
                with self._lock:
                    self.record.acked[key] = ack
                    self.record.answers.append(Answer(target, status, sent_at, at, None))
                    self.record.statuses[status] += 1
                return target
            error = _error_of(response)
            retryable = error.get("retryable") if error is not None else None
            self._answer(Answer(target, status, sent_at, at, retryable))
            if status not in (307, 503):
                with self._lock:
                    self.record.unexpected.append(f"{status} from {target}: {response.text[:300]}")
                return target
            if not self.follow:
                await asyncio.sleep(0.02)
                return target
            leader_url = error.get("leader_url") if error is not None else None
            if status == 307 and isinstance(leader_url, str) and leader_url != target:
                target = leader_url
            else:
                target = self._next(rotation, target)
                await asyncio.sleep(0.02)
        return target

    def _next(self, rotation: itertools.cycle[int], current: str | None = None) -> str:
        """The next broker in this client's rotation, never the one that just failed."""
        for _ in range(len(self.targets)):
            candidate = self.targets[next(rotation)]
            if candidate != current:
                return candidate
        return self.targets[0]

    def _answer(self, answer: Answer) -> None:
        with self._lock:
            self.record.answers.append(answer)
            self.record.statuses[answer.status] += 1


def _error_of(response: httpx.Response) -> dict[str, Any] | None:
    try:
        body = response.json()
    except ValueError:
        return None
    error = body.get("error") if isinstance(body, dict) else None
    return error if isinstance(error, dict) else None


# -- checks ---------------------------------------------------------------------------------------


def fetch_tasks(node: BrokerNode, *, tenant: str | None = None) -> dict[int, dict[str, Any]]:
    """Every task on ``node`` (paged), by id; asserts no id is listed twice."""
    tasks: dict[int, dict[str, Any]] = {}
    after = 0
    with httpx.Client(base_url=node.url, timeout=30, verify=node.cluster.verify) as http:
        for _ in range(10_000):
            query: dict[str, Any] = {"limit": 1000, "after": after}
            if tenant is not None:
                query["tenant"] = tenant
            response = http.get("/api/v1/tasks", params=query)
            response.raise_for_status()
            body = response.json()
            for task in body["tasks"]:
                assert task["id"] not in tasks, f"task {task['id']} listed twice"
                tasks[task["id"]] = task
            if body.get("next_after") is None:
                return tasks
            after = body["next_after"]
    raise AssertionError("too many pages of tasks")


def check_acknowledged(
    node: BrokerNode, load: WriteLoad, *, where: str, expect_unique: bool = True
) -> dict[int, dict[str, Any]]:
    """Every acknowledged submission of ``load`` is on ``node`` with its data; no task
    appears that nobody sent; with idempotency keys no submission appears twice."""
    tasks = fetch_tasks(node, tenant=load.tenant)
    record = load.record
    mine = {
        tid: t
        for tid, t in tasks.items()
        if isinstance(t["params"], dict) and t["params"].get("load") == load.tag
    }
    problems: list[str] = []
    for key, ack in record.acked.items():
        task = mine.get(ack.task_id)
        if task is None:
            problems.append(f"acknowledged task {ack.task_id} ({key}) is lost")
        elif (task["type"], task["tenant"], task["params"]) != (
            load.task_type,
            load.tenant,
            ack.params,
        ):
            problems.append(f"task {ack.task_id} is {task}, was submitted as {ack.params}")
    by_params = Counter(_params_key(t["params"]) for t in mine.values())
    attempted = {_params_key(p) for p in record.attempted.values()}
    for tid, task in mine.items():
        if _params_key(task["params"]) not in attempted:
            problems.append(f"task {tid} {task['params']} was never submitted")
    if expect_unique:
        twice = [k for k, n in by_params.items() if n > 1]
        problems += [f"submission {k} appears {by_params[k]} times" for k in twice[:10]]
    assert not problems, (
        f"{len(problems)} problems {where} ({len(record.acked)} acknowledged):\n"
        + "\n".join(problems[:20])
    )
    return mine


def _params_key(params: Any) -> str:
    return json.dumps(params, sort_keys=True, separators=(",", ":"))


def probe_idempotency(node: BrokerNode, tenant: str) -> bool:
    """Whether the leader honours ``Idempotency-Key`` (the same key twice: one task)."""
    key = f"probe-{uuid.uuid4().hex}"
    body = {"type": "probe.noop", "tenant": tenant, "params": {"probe": key}}
    with httpx.Client(base_url=node.url, timeout=10) as http:
        ids: list[int] = []
        for _ in range(2):
            response = http.post("/api/v1/tasks", json=body, headers={"Idempotency-Key": key})
            assert response.status_code == 201, response.text
            ids.append(int(response.json()["id"]))
    return ids[0] == ids[1]


def flocks_held(pid: int, directory: Path) -> list[str]:
    """Names of the files in ``directory`` on which process ``pid`` holds a flock."""
    inodes = {path.stat().st_ino: path.name for path in directory.iterdir() if path.is_file()}
    held = []
    for line in Path("/proc/locks").read_text().splitlines():
        # "1: FLOCK  ADVISORY  WRITE <pid> <major>:<minor>:<inode> 0 EOF"; waiters
        # ("1: -> FLOCK ...") hold nothing.
        fields = line.split()
        if len(fields) < 6 or fields[1] != "FLOCK" or int(fields[4]) != pid:
            continue
        name = inodes.get(int(fields[5].rsplit(":", 1)[1]))
        if name is not None:
            held.append(name)
    return held
