"""Task output on the leader: what each attempt wrote to stdout, stderr and ``ctx.logger``.

Workers capture an attempt's output in its task process (the last 1 MiB) and ship it over
the worker link (``wire/worker_protocol.py`` Output frames): new bytes about once a second while
the attempt runs, its whole kept tail when it ends. Output is not state: it never enters
the replicated log, and this store lives in the leader's memory only, bounded per attempt
(``max_attempt_bytes``, the last bytes win) and in total (``max_total_bytes`` and
``max_attempts``, the least recently written attempt is evicted first).

Why memory and not the data dir: a leader restart or a failover moves leadership to
another process or broker, whose disk would not hold the output anyway; the worker that ran
an attempt keeps its output (its last 256 attempts), so a leader that lacks an attempt's
output asks that worker over the worker link (FetchOutput) if it is connected. Keeping
output off disk also keeps untrusted tenant text out of the broker's data dir and its
writes off the ledger's disk.

``GET /api/v1/tasks/{id}/logs`` is answered by :func:`logs_answer` on the leader and by
:func:`logs_from_leader` on a follower (it asks the leader, so the dashboard of any broker
shows output); ``broker/api/routes.py`` declares the route, ``broker/api/handlers_tasks.py``
calls them.
"""

from __future__ import annotations

import asyncio
import re
import ssl
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Final

import httpx
import msgspec

from broker.api.progress_store import ProgressStore
from broker.core import FINAL_STATES, StateMachine, TaskState
from broker.security.auth import Principal
from broker.security.tls import peer_ssl_context

OutputKey = tuple[int, int]  # (task_id, attempt)

DEFAULT_MAX_ATTEMPT_BYTES: Final = 1024 * 1024
DEFAULT_MAX_TOTAL_BYTES: Final = 256 * 1024 * 1024
DEFAULT_MAX_ATTEMPTS: Final = 65_536
#: How long a request waits for the worker that ran an attempt to send its output.
FETCH_TIMEOUT_S: Final = 2.0
#: Drop output of forgotten tasks at most this often (a scan of the kept attempts).
_PRUNE_INTERVAL_S: Final = 30.0
_MAX_OFFSET: Final = 2**62


class TaskLogs(msgspec.Struct, frozen=True):
    """An attempt's captured output from ``offset`` on (GET /api/v1/tasks/{id}/logs)."""

    task_id: int
    attempt: int
    # The output from max(offset, first kept byte) on, decoded as UTF-8 (errors replaced).
    output: str
    # Output after ``offset`` and before the returned text was dropped (the last 1 MiB of
    # an attempt is kept): with offset 0, the attempt wrote more than is returned.
    truncated: bool
    # The attempt has ended and wrote everything it will write.
    complete: bool
    # Pass as ``offset`` to get only what is written after this answer.
    next_offset: int
    # Where the returned text starts (bytes since the attempt's first output).
    offset: int
    # The leader holds no output of this attempt (not run in a task process, the worker
    # that ran it is gone, or it has written nothing yet).
    available: bool = True


class LogsError(Exception):
    """A request the logs route refuses: ``status`` with an error ``code`` and message."""

    def __init__(self, status: int, code: str, message: str, *, retryable: bool = False) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.retryable = retryable


@dataclass
class _Kept:
    start: int  # the offset of data[0] in everything the attempt wrote
    data: bytearray = field(default_factory=bytearray)
    complete: bool = False

    @property
    def end(self) -> int:
        return self.start + len(self.data)


#: ``fetcher(worker_id, task_id, attempt)``: ask that worker for the output; False when
#: the worker is not connected to this leader.
Fetcher = Callable[[str, int, int], bool]


class OutputStore:
    """Bounded per attempt and in total; not thread safe (the broker's event loop owns it)."""

    def __init__(
        self,
        max_attempt_bytes: int = DEFAULT_MAX_ATTEMPT_BYTES,
        max_total_bytes: int = DEFAULT_MAX_TOTAL_BYTES,
        max_attempts: int = DEFAULT_MAX_ATTEMPTS,
    ) -> None:
        if max_attempt_bytes < 1 or max_total_bytes < 0 or max_attempts < 0:
            raise ValueError("output bounds must be positive")
        self.max_attempt_bytes = max_attempt_bytes
        self.max_total_bytes = max_total_bytes
        self.max_attempts = max_attempts
        self._kept: OrderedDict[OutputKey, _Kept] = OrderedDict()
        self._total_bytes = 0
        self._waiters: dict[OutputKey, list[asyncio.Future[None]]] = {}
        self._last_prune = time.monotonic()
        # Set by the worker link while this broker leads (None: no link, no fetches).
        self.fetcher: Fetcher | None = None
        # Running tasks' ctx.progress: reported over the same link, kept the same way
        # (leader memory, never logged) and read by the same API.
        self.progress = ProgressStore()

    @property
    def total_bytes(self) -> int:
        return self._total_bytes

    def __len__(self) -> int:
        return len(self._kept)

    def __contains__(self, key: OutputKey) -> bool:
        return key in self._kept

    def add(self, key: OutputKey, offset: int, data: bytes, *, complete: bool = False) -> None:
        """Take an Output frame's bytes. A complete frame replaces what is kept (it is the
        attempt's whole tail); a running one appends what is new after ``offset``."""
        kept = self._kept.get(key)
        if kept is not None and kept.complete and not complete:
            return  # a late chunk of an attempt already over
        if kept is None or complete or offset > kept.end:
            # New, final, or a gap (the worker dropped bytes we never saw): start afresh.
            if kept is not None:
                self._total_bytes -= len(kept.data)
            kept = _Kept(offset, bytearray(data), complete)
            self._kept[key] = kept
            self._total_bytes += len(kept.data)
        else:
            new = data[kept.end - offset :] if offset < kept.end else data
            kept.data += new
            self._total_bytes += len(new)
        self._kept.move_to_end(key)
        over = len(kept.data) - self.max_attempt_bytes
        if over > 0:  # the last bytes are the ones worth keeping
            del kept.data[:over]
            kept.start += over
            self._total_bytes -= over
        self._evict()
        self._wake(key)

    def missing(self, key: OutputKey) -> None:
        """The worker has no output of this attempt: stop waiting for it."""
        self._wake(key)

    def get(self, key: OutputKey) -> tuple[int, bytes, bool] | None:
        """(offset of the first kept byte, the kept bytes, complete) or None."""
        kept = self._kept.get(key)
        if kept is None:
            return None
        return kept.start, bytes(kept.data), kept.complete

    def drop_task(self, task_id: int) -> None:
        for key in [k for k in self._kept if k[0] == task_id]:
            self._remove(key)

    def prune(self, known: Callable[[int], bool], *, force: bool = False) -> None:
        """Drop the output of tasks no longer ``known`` (forgotten by retention): at most
        every _PRUNE_INTERVAL_S unless ``force``."""
        now = time.monotonic()
        if not force and now - self._last_prune < _PRUNE_INTERVAL_S:
            return
        self._last_prune = now
        for key in [k for k in self._kept if not known(k[0])]:
            self._remove(key)

    async def fetch(self, worker_id: str, key: OutputKey, timeout_s: float) -> bool:
        """Ask ``worker_id`` for an attempt's output; True once the store holds some."""
        if key in self._kept:
            return True
        if self.fetcher is None or not self.fetcher(worker_id, *key):
            return False
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.setdefault(key, []).append(waiter)
        try:
            await asyncio.wait_for(waiter, timeout=timeout_s)
        except TimeoutError:
            pass
        finally:
            waiters = self._waiters.get(key)
            if waiters is not None:
                if waiter in waiters:
                    waiters.remove(waiter)
                if not waiters:
                    del self._waiters[key]
        return key in self._kept

    def _wake(self, key: OutputKey) -> None:
        for waiter in self._waiters.pop(key, ()):
            if not waiter.done():
                waiter.set_result(None)

    def _evict(self) -> None:
        while self._kept and (
            self._total_bytes > self.max_total_bytes or len(self._kept) > self.max_attempts
        ):
            self._remove(next(iter(self._kept)))

    def _remove(self, key: OutputKey) -> None:
        kept = self._kept.pop(key)
        self._total_bytes -= len(kept.data)


# --- GET /api/v1/tasks/{id}/logs ---------------------------------------------------------


def _int_query(query: dict[str, str], name: str, default: int | None, low: int) -> int | None:
    raw = query.get(name)
    if raw is None:
        return default
    if not re.fullmatch(r"\d{1,19}", raw) or not low <= int(raw) <= _MAX_OFFSET:
        raise LogsError(400, "invalid_request", f"{name} must be an integer >= {low}")
    return int(raw)


async def logs_answer(
    store: OutputStore,
    state: StateMachine,
    principal: Principal,
    task_id: int,
    query: dict[str, str],
) -> bytes:
    """The JSON answer of GET /api/v1/tasks/{id}/logs; raises LogsError."""
    unknown = set(query) - {"attempt", "offset"}
    if unknown:
        raise LogsError(400, "invalid_request", f"unknown query parameters: {sorted(unknown)}")
    task = state.tasks.get(task_id)
    # Another tenant's task answers like a missing one (as GET /api/v1/tasks/{id}).
    if task is None or not principal.may_see_tenant(task.tenant):
        raise LogsError(404, "not_found", f"task {task_id} does not exist")
    attempt = _int_query(query, "attempt", None, 1)
    offset = _int_query(query, "offset", 0, 0)
    assert offset is not None
    if task.attempt == 0:
        if attempt is not None:
            raise LogsError(400, "invalid_request", f"task {task_id} has not run yet")
        # Not run yet: complete only if it never will (e.g. cancelled while waiting).
        never = task.state in FINAL_STATES
        return _encode(TaskLogs(task_id, 0, "", False, never, 0, 0, available=False))
    if attempt is None:
        attempt = task.attempt
    if attempt > task.attempt:
        raise LogsError(
            400,
            "invalid_request",
            f"task {task_id} has run {task.attempt} attempt(s); attempt must be 1..{task.attempt}",
        )
    store.prune(lambda tid: tid in state.tasks)
    key = (task_id, attempt)
    if key not in store and attempt == task.attempt and task.worker is not None:
        # Not here (a new leader, or the leader restarted): the worker that ran it may
        # still hold it. Only the latest attempt's worker is known.
        await store.fetch(task.worker, key, FETCH_TIMEOUT_S)
    kept = store.get(key)
    # Only the latest attempt of a running task may still write.
    over = not (task.state == TaskState.RUNNING and attempt == task.attempt)
    if kept is None:
        return _encode(TaskLogs(task_id, attempt, "", False, over, offset, offset, available=False))
    start, data, complete = kept
    end = start + len(data)
    begin = min(max(offset, start), end)
    text = data[begin - start :].decode("utf-8", errors="replace")
    return _encode(
        TaskLogs(
            task_id=task_id,
            attempt=attempt,
            output=text,
            truncated=begin > offset,
            complete=complete or over,
            next_offset=max(end, offset),
            offset=begin,
        )
    )


#: Marks a request a follower passed on to its leader: one hop only (brokers with stale
#: views must not pass a request around).
PROXIED_HEADER: Final = b"x-steward-logs-proxied"
_PROXY_TIMEOUT_S: Final = FETCH_TIMEOUT_S + 3.0


async def logs_from_leader(
    leader_url: str | None,
    path: str,
    query: dict[str, str],
    authorization: bytes | None,
    *,
    proxied: bool,
    ssl_context: ssl.SSLContext | None,
) -> tuple[int, bytes]:
    """A follower's answer: the leader's (status, JSON body) for the same request, with
    the caller's credentials (the leader checks them and the tenant scope again)."""
    if leader_url is None or proxied:
        raise LogsError(
            503, "unavailable", "no leader to serve task output right now; retry", retryable=True
        )
    headers = {PROXIED_HEADER.decode(): "1"}
    if authorization is not None:
        headers["authorization"] = authorization.decode("latin-1")
    try:
        async with httpx.AsyncClient(
            timeout=_PROXY_TIMEOUT_S, verify=ssl_context or peer_ssl_context()
        ) as client:
            response = await client.get(leader_url + path, params=query, headers=headers)
    except httpx.HTTPError as exc:
        raise LogsError(
            503, "unavailable", f"the leader at {leader_url} did not answer: {exc}", retryable=True
        ) from None
    if response.headers.get("content-type", "").split(";")[0] != "application/json":
        raise LogsError(503, "unavailable", "the leader's answer was not JSON", retryable=True)
    return response.status_code, response.content


_encoder: Final = msgspec.json.Encoder()


def _encode(value: Any) -> bytes:
    return _encoder.encode(value)
