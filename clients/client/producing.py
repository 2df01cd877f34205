"""The pipelining producer's core, shared by the sync and asyncio producers (no IO, no
threads, no clock of its own): encoding and checking one submission, the buffer of
submissions not yet sent and when the next batch is due, a batch's request, and what each
of its futures resolves to once the batch is answered (docs/API.md, "Pipelining producer").

Why batches are safe to retry: a batch is one ``POST /api/v1/tasks`` with ``{"tasks":
[...]}`` under one Idempotency-Key the producer generates, and a batch never changes
composition while it is retried, so task i of a batch is identified by (key, i): the broker
answers a retried batch with its first answer instead of creating the tasks again.
"""

from __future__ import annotations

import re
import uuid
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Final, Generic, TypeVar

import msgspec

from broker.api.api_models import TaskSubmission
from clients.client.api_calls import Request
from clients.client.errors import StewardError, _error_for

F = TypeVar("F")  # a future (concurrent.futures or asyncio)
H = TypeVar("H")  # the handle a future resolves to

DEFAULT_LINGER_MS: Final = 5.0
DEFAULT_MAX_BATCH: Final = 1000
DEFAULT_MAX_BUFFERED: Final = 100_000
DEFAULT_MAX_BLOCK_S: Final = 60.0
# The broker's defaults: 10,000 tasks and 8 MiB per request (docs/API.md, "Limits"). A batch
# stays at half the body limit, so one task (params <= 64 KiB) always fits.
MAX_BATCH: Final = 10_000
MAX_BATCH_BYTES: Final = 4 * 1024 * 1024

_encoder: Final = msgspec.json.Encoder()
_task_decoder: Final = msgspec.json.Decoder(TaskSubmission)
# A per-task refusal's code (in a batch answer) -> the status a single submit answers with.
_STATUS_BY_CODE: Final = {
    "invalid_request": 400,
    "not_found": 404,
    "slot_busy": 409,
    "conflict": 409,
    "stale": 409,
    "tenant_queue_full": 429,
}
_TASK_PREFIX: Final = re.compile(r"tasks\[(\d+)\]: (.*)", re.DOTALL)


class ProducerClosedError(StewardError):
    """``submit`` after the producer was closed."""

    def __init__(self) -> None:
        super().__init__(0, "producer_closed", "the producer is closed")


class ProducerFullError(StewardError):
    """``submit`` waited ``max_block_s`` for room among ``max_buffered`` unsent submissions."""

    def __init__(self, max_buffered: int, max_block_s: float) -> None:
        super().__init__(
            0,
            "producer_full",
            f"{max_buffered} submissions are waiting to be sent and none was sent within "
            f"max_block_s={max_block_s:g} s (is the broker reachable?)",
        )


def encode_task(type: str, params: Any, tenant: str | None, options: dict[str, Any]) -> bytes:
    """One task of a batch as JSON, checked as the broker decodes it: what the client can
    tell is wrong raises here (at ``submit``), so it never fails a whole batch."""
    if not isinstance(type, str) or not type:
        raise _invalid("type must be a non-empty string")
    body: dict[str, Any] = {"type": type, "params": params}
    if tenant is not None:
        body["tenant"] = tenant
    if options:
        body.update((k, v) for k, v in options.items() if v is not None)
    try:
        encoded = _encoder.encode(body)
    except (TypeError, ValueError, OverflowError) as exc:
        raise _invalid(f"the task is not JSON-serialisable: {exc}") from None
    if options or not isinstance(tenant, str | None):
        # Type, params (any JSON) and a str tenant always decode: check only the rest.
        try:
            _task_decoder.decode(encoded)
        except msgspec.ValidationError as exc:
            raise _invalid(str(exc)) from None
    return encoded


def _invalid(message: str) -> StewardError:
    return _error_for(400, "invalid_request", message)


@dataclass
class Pending(Generic[F]):
    seq: int  # 1, 2, ... in submit order
    body: bytes
    future: F
    at: float  # when it was submitted (the producer's clock)


@dataclass
class Batch(Generic[F]):
    """Submissions sent together, in submit order, under one idempotency key."""

    items: list[Pending[F]]
    upto: int  # the last seq this batch settles (cancelled ones before it included)
    key: str = field(default_factory=lambda: uuid.uuid4().hex)

    def request(self) -> Request:
        content = b'{"tasks":[' + b",".join(p.body for p in self.items) + b"]}"
        headers = f"Idempotency-Key: {self.key}\r\nContent-Type: application/json\r\n"
        return Request("POST", "/api/v1/tasks", content=content, headers=headers, field="tasks")

    def outcomes(
        self, answers: list[dict[str, Any]], handle: Callable[[int, str], H]
    ) -> list[tuple[F, H | BaseException]]:
        """What each future resolves to: its task's handle, or that task's refusal (e.g.
        TenantQueueFullError when the tenant's max_waiting is reached)."""
        bad = _error_for(
            502, "bad_answer", f"the broker answered a batch of {len(self.items)} wrongly"
        )
        if not isinstance(answers, list) or len(answers) != len(self.items):
            return self.failed(bad)
        out: list[tuple[F, H | BaseException]] = []
        try:
            for item, answer in zip(self.items, answers, strict=True):
                detail = answer.get("error")
                if detail is None:
                    out.append((item.future, handle(int(answer["id"]), str(answer["state"]))))
                else:
                    code = str(detail.get("code"))
                    status = _STATUS_BY_CODE.get(code, 400)
                    out.append((item.future, _error_for(status, code, str(detail.get("message")))))
        except (AttributeError, KeyError, TypeError, ValueError):
            return self.failed(bad)  # a future must not wait on an answer we cannot read
        return out

    def failed(self, error: BaseException) -> list[tuple[F, H | BaseException]]:
        """The batch was not answered (or not usably): every future gets ``error``."""
        return [(item.future, error) for item in self.items]

    def settle(
        self, answer: Any, handle: Callable[[int, str], H]
    ) -> tuple[list[tuple[F, H | BaseException]], Batch[F] | None]:
        """What the futures resolve to after one send, given its answer (the tasks' list)
        or the exception it raised (after the client's own retries); and the batch to send
        next, when one task's fields made the broker refuse the whole batch."""
        if isinstance(answer, StewardError):
            split = self.split(answer)
            if split is not None:
                future, error, rest = split
                return [(future, error)], rest
        if isinstance(answer, BaseException):
            return self.failed(answer), None
        return self.outcomes(answer, handle), None

    def split(self, error: StewardError) -> tuple[F, StewardError, Batch[F] | None] | None:
        """A batch refused whole because of one task's fields (``tasks[i]: ...``, 400 or
        413): that task's future, its error, and the others as a new batch (a new key), or
        None when the error is about the whole batch.

        Safe: these refusals depend only on the request's bytes and come before anything
        is logged, so no try of this batch created a task, and the rest goes once."""
        match = _TASK_PREFIX.fullmatch(error.message)
        if error.status not in (400, 413) or match is None:
            return None
        index = int(match.group(1))
        if index >= len(self.items):
            return None
        own = _error_for(error.status, error.code, match.group(2))
        rest = self.items[:index] + self.items[index + 1 :]
        return self.items[index].future, own, Batch(rest, self.upto) if rest else None


class Buffer(Generic[F]):
    """Submissions not yet sent, and when the next batch is due: ``max_batch`` are
    waiting, the oldest has waited ``linger_s``, or a flush (or close) asks for them."""

    def __init__(self, linger_ms: float, max_batch: int, max_buffered: int) -> None:
        if not linger_ms >= 0:
            raise ValueError("linger_ms must be >= 0")
        if not 1 <= max_batch <= MAX_BATCH:
            raise ValueError(f"max_batch must be between 1 and {MAX_BATCH}")
        if max_buffered < max_batch:
            raise ValueError("max_buffered must be >= max_batch")
        self.linger_s = linger_ms / 1000
        self.max_batch = max_batch
        self.max_buffered = max_buffered
        self.pending: deque[Pending[F]] = deque()
        self.pending_bytes = 0
        self.submitted = 0  # the last seq given out
        self.resolved = 0  # every seq up to this one is resolved (batches go in order)
        self.flush_to = 0  # send without lingering up to this seq
        self.closed = False

    @property
    def full(self) -> bool:
        return len(self.pending) >= self.max_buffered

    def add(self, body: bytes, future: F, now: float) -> bool:
        """Queue one submission; True when the sender should be woken."""
        self.submitted += 1
        self.pending.append(Pending(self.submitted, body, future, now))
        self.pending_bytes += len(body)
        return len(self.pending) in (1, self.max_batch)

    def due(self, now: float) -> bool:
        if not self.pending:
            return False
        return (
            len(self.pending) >= self.max_batch
            or self.pending_bytes >= MAX_BATCH_BYTES
            or self.closed
            or self.pending[0].seq <= self.flush_to
            or now >= self.pending[0].at + self.linger_s
        )

    def wait_s(self, now: float) -> float | None:
        """How long the sender may sleep before a batch is due (None: until woken)."""
        if not self.pending:
            return None
        return max(0.0, self.pending[0].at + self.linger_s - now)

    def take(self, cancelled: Callable[[F], bool]) -> Batch[F] | None:
        """The next batch (up to max_batch, oldest first), without the futures the caller
        cancelled before they were sent (so nothing of theirs is created); None if all
        were."""
        items: list[Pending[F]] = []
        size = 0
        while self.pending and len(items) < self.max_batch:
            size += len(self.pending[0].body) + 1
            if items and size > MAX_BATCH_BYTES:
                break
            items.append(self.pending.popleft())
            self.pending_bytes -= len(items[-1].body)
        kept = [p for p in items if not cancelled(p.future)]
        if not kept:
            self.done(items[-1].seq)
            return None
        return Batch(kept, items[-1].seq)

    def done(self, upto: int) -> None:
        self.resolved = max(self.resolved, upto)

    def flushed(self, upto: int) -> bool:
        return self.resolved >= upto


def check_options(max_block_s: float) -> None:
    if not max_block_s >= 0:
        raise ValueError("max_block_s must be >= 0")


def resolve_all(
    outcomes: Iterable[tuple[F, H | BaseException]],
    set_result: Callable[[F, H], None],
    set_exception: Callable[[F, BaseException], None],
) -> None:
    for future, outcome in outcomes:
        if isinstance(outcome, BaseException):
            set_exception(future, outcome)
        else:
            set_result(future, outcome)
