"""The worker protocol: the only module that encodes or decodes worker frames.

Sans-IO (h11's shape): :class:`FrameDecoder` takes bytes in and hands messages
out; :func:`encode_message` turns a message into bytes. The asyncio server in
the broker and the worker's client are thin wrappers around these.

A frame is a 4-byte big-endian length, then one msgpack map with a ``type``
tag and a message version ``v``. Frames above the size cap, undecodable
frames, unknown types and newer versions raise :class:`ProtocolError`; the
peer answers with an :class:`Error` frame and closes that one connection.

Conversation::

    worker -> Hello (id, capacities, resources, tenants, tasks it still runs, types it serves)
    broker -> Welcome (heartbeat timing, which reported tasks to keep / drop, tenant weights)
    both   -> Heartbeat (every interval; a peer silent past the timeout is dead)
    broker -> Assign (tasks, already logged as running)     worker -> Finish (batched)
    broker -> FinishAck (resend until acknowledged)          broker -> Cancel
    worker -> Output (a running attempt's new output, then its whole kept tail at the end)
    broker -> FetchOutput (the leader lacks an attempt's output)  worker -> Output
    worker -> Progress (a running attempt's latest ctx.progress, at most once a second)
    either -> Error (then closes)

Output is not state: it never enters the replicated log. A worker sends Output only to a
broker whose Welcome says ``output=True`` and a broker sends FetchOutput only to a worker
whose Hello does (an older peer refuses unknown frames; it ignores the unknown field).
Progress is not state either, and goes only to a broker whose Welcome says ``progress``.

Versions: a message carries the lowest version that has every field it uses, so a
newer peer still talks to an older one until it needs something new. Version 2: a
TaskReport may carry ``spawn`` requests (task trees); :func:`encode_message` marks
such a Finish v2, which an older broker refuses instead of silently dropping them.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from typing import Final

import msgspec

#: Highest message version this code understands.
PROTOCOL_VERSION: Final = 2
#: Version a message is sent with unless it uses a newer field.
BASE_VERSION: Final = 1
#: First version with TaskReport.spawn.
SPAWN_VERSION: Final = 2
DEFAULT_MAX_FRAME_BYTES: Final = 16 * 1024 * 1024
#: Most bytes of task output one Output frame carries (the tail an attempt keeps).
MAX_OUTPUT_BYTES: Final = 1024 * 1024
#: Longest ctx.progress message (characters) a Progress frame carries.
MAX_PROGRESS_CHARS: Final = 200
#: Most attempts one FetchOutput names.
MAX_FETCH_OUTPUT: Final = 64
#: Most task type names a Hello lists (``task_names``): a worker that registered more lists
#: none (the broker then checks no submit against it); the broker refuses a longer list.
#: broker/core/served_types.py's MAX_TASK_NAMES_PER_WORKER (tests hold them equal).
MAX_HELLO_TASK_NAMES: Final = 1000
#: A spawned child's default max_lost: broker/core/entries.py's DEFAULT_MAX_LOST (this
#: module imports nothing of the project; tests/unit/test_protocol.py holds them equal).
DEFAULT_MAX_LOST: Final = 3
_LENGTH: Final = struct.Struct(">I")


class ProtocolError(Exception):
    """The peer sent something that is not a valid frame of this protocol."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


class _Message(msgspec.Struct, tag_field="type", omit_defaults=True, frozen=True):
    v: int = BASE_VERSION


class TaskAttempt(msgspec.Struct, frozen=True, array_like=True):
    task_id: int
    attempt: int


class Hello(_Message, frozen=True, tag="hello"):
    worker_id: str = ""
    process_id: str = ""  # changes when the worker process restarts
    version: str = ""
    # Concurrent tasks per task type; "*" is the default for any type.
    task_types: dict[str, int] = {}
    resources: dict[str, float] = {}  # e.g. {"cpu": 8, "memory_mb": 16000, "gpu": 1}
    tenants: tuple[str, ...] = ()  # empty: serves every tenant
    running: tuple[TaskAttempt, ...] = ()  # tasks this worker still runs
    token: str | None = None
    # The worker answers FetchOutput (an older one would drop the connection on it).
    output: bool = False
    # ``running`` also lists the attempts whose report awaits a FinishAck, so an attempt
    # assigned to this same process and missing from it never reached it (docs/DESIGN.md
    # §6, "Lost assignments"). An older worker leaves it False.
    lists_unacked: bool = False
    # The task type names it can run (built-in and registered ones), sorted, so a submit of
    # a type no worker serves is refused (docs/DESIGN.md §6, "Served task types"); None: not
    # listed (an older worker, or over MAX_HELLO_TASK_NAMES). An older broker ignores it.
    task_names: tuple[str, ...] | None = None


class Welcome(_Message, frozen=True, tag="welcome"):
    broker_id: str = ""
    heartbeat_interval_ms: int = 1000
    heartbeat_timeout_ms: int = 10_000
    keep: tuple[TaskAttempt, ...] = ()  # reported tasks the broker still counts as running
    drop: tuple[TaskAttempt, ...] = ()  # reported tasks to stop (already re-queued or over)
    # The broker takes Output frames (an older worker ignores the field, an older broker
    # never sets it).
    output: bool = False
    # The broker takes Progress frames (likewise).
    progress: bool = False
    # The weights of the tenants whose weight is not 1, for the worker's Spark fair pools
    # (docs/DESIGN.md §6, "Spark fairness"; an older worker ignores the field, from an
    # older broker every tenant weighs 1).
    tenant_weights: dict[str, float] = {}


class Heartbeat(_Message, frozen=True, tag="heartbeat"):
    seq: int = 0
    # Broker to worker: code artifacts deleted lately (docs/DESIGN.md §7), to drop from
    # the worker's cache; repeated for a while so every connected worker hears it. An
    # older worker ignores the field.
    dropped_code: tuple[str, ...] = ()


class AssignedTask(msgspec.Struct, frozen=True, omit_defaults=True):
    task_id: int
    attempt: int
    type: str
    tenant: str
    params: bytes = b"null"  # raw JSON text
    code: str | None = None
    deadline_ms: int | None = None
    resources: dict[str, float] = {}


class Assign(_Message, frozen=True, tag="assign"):
    tasks: tuple[AssignedTask, ...] = ()


class SpawnRequest(msgspec.Struct, frozen=True, omit_defaults=True, forbid_unknown_fields=True):
    """A child task the reporting task creates when it finishes successfully (v2).

    Anchors make the child part of the reporting task's tracked tree: ``anchor_self``
    (the reporting task) and/or ``anchors`` (other task ids of the same tree; several
    make a DAG), and ``anchor_spawns``: earlier children of the same report, by index (their
    ids are not known yet). Anchors other than the reporting task make a join: the child
    waits until they all finished. ``tracked=False`` (Storm's unanchored emit) takes no
    anchors. A child of an untracked task is never tracked. The broker validates every request: an
    invalid one fails the reporting task with a clear error (the report is not lost).
    """

    type: str
    params: bytes = b"null"  # raw JSON text
    tenant: str | None = None  # None: the reporting task's tenant
    tracked: bool = True
    anchor_self: bool = True
    anchors: tuple[int, ...] = ()
    slot: str | None = None
    max_attempts: int = 1
    deadline_ms: int | None = None
    start_after_ms: int | None = None
    resources: dict[str, float] = {}
    code: str | None = None  # None: the reporting task's code artifact
    anchor_spawns: tuple[int, ...] = ()  # last: an older worker never sends it
    # Attempts the child may lose with its worker (docs/DESIGN.md §6, "Lost workers"); sent
    # only when not the default, so a worker talking to an older broker sends it only if
    # a task asks for it.
    max_lost: int = DEFAULT_MAX_LOST


class TaskReport(msgspec.Struct, frozen=True, omit_defaults=True):
    task_id: int
    attempt: int
    ok: bool
    result: bytes | None = None  # raw JSON text when ok
    error: str | None = None  # message and traceback when not ok
    # Children to create with a successful finish (v2); ignored when not ok.
    spawn: tuple[SpawnRequest, ...] = ()
    # Not ok because the worker stops: give the attempt back, uncounted (docs/DESIGN.md §6).
    released: bool = False


class Finish(_Message, frozen=True, tag="finish"):
    reports: tuple[TaskReport, ...] = ()


class FinishAck(_Message, frozen=True, tag="finish_ack"):
    tasks: tuple[TaskAttempt, ...] = ()


class Cancel(_Message, frozen=True, tag="cancel"):
    tasks: tuple[TaskAttempt, ...] = ()
    reason: str = ""


class Output(_Message, frozen=True, tag="output"):
    """Captured stdout/stderr/``ctx.logger`` output of one attempt.

    ``offset`` is the position of ``data``'s first byte in everything the attempt wrote
    (earlier bytes may have been dropped: a worker keeps the last MAX_OUTPUT_BYTES).
    While the attempt runs, frames carry what is new; with ``complete`` the frame carries
    the attempt's whole kept tail and the attempt writes no more. ``missing``: the worker
    has no output of that attempt (an answer to FetchOutput).
    """

    task_id: int = 0
    attempt: int = 0
    offset: int = 0
    data: bytes = b""
    complete: bool = False
    missing: bool = False


class Progress(_Message, frozen=True, tag="progress"):
    """A running attempt's latest ``ctx.progress(fraction, message)`` (kept by the
    leader in memory, never logged: docs/DESIGN.md §6, "Task progress")."""

    task_id: int = 0
    attempt: int = 0
    fraction: float = 0.0
    message: str = ""


class FetchOutput(_Message, frozen=True, tag="fetch_output"):
    """The leader asks for attempts' output it does not hold (e.g. after a failover)."""

    tasks: tuple[TaskAttempt, ...] = ()


class Error(_Message, frozen=True, tag="error"):
    code: str = "protocol_error"
    message: str = ""


Message = (
    Hello
    | Welcome
    | Heartbeat
    | Assign
    | Finish
    | FinishAck
    | Cancel
    | Output
    | FetchOutput
    | Error
    | Progress
)

_encoder: Final = msgspec.msgpack.Encoder()
_decoder: Final = msgspec.msgpack.Decoder(Message)


def required_version(message: Message) -> int:
    """The lowest version that carries everything ``message`` uses."""
    if isinstance(message, Finish) and any(r.spawn for r in message.reports):
        return SPAWN_VERSION
    return BASE_VERSION


def encode_message(message: Message, max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES) -> bytes:
    needed = required_version(message)
    if message.v < needed:
        message = msgspec.structs.replace(message, v=needed)
    payload = _encoder.encode(message)
    if len(payload) > max_frame_bytes:
        raise ProtocolError(
            "frame_too_large", f"{message.__class__.__name__} frame of {len(payload)} bytes"
        )
    return _LENGTH.pack(len(payload)) + payload


#: What one AssignedTask adds to a frame beside its params and code: ids, deadline, its
#: type and tenant (names of at most 64 characters) and per resource a name and a float.
ASSIGNED_TASK_OVERHEAD_BYTES: Final = 256
ASSIGNED_RESOURCE_BYTES: Final = 80


def assign_messages(tasks: Sequence[AssignedTask], max_frame_bytes: int) -> list[Assign]:
    """``tasks`` in as few Assign messages as fit half a frame each (estimated from the
    sizes of their params and code; a task alone over it still goes, alone): a worker
    with many slots may be given more than one frame holds (docs/DESIGN.md §8)."""
    budget = max_frame_bytes // 2
    messages: list[Assign] = []
    batch: list[AssignedTask] = []
    size = 0
    for task in tasks:
        n = ASSIGNED_TASK_OVERHEAD_BYTES + len(task.params) + len(task.code or "")
        n += ASSIGNED_RESOURCE_BYTES * len(task.resources)
        if batch and size + n > budget:
            messages.append(Assign(tasks=tuple(batch)))
            batch, size = [], 0
        batch.append(task)
        size += n
    if batch:
        messages.append(Assign(tasks=tuple(batch)))
    return messages


def decode_payload(payload: bytes) -> Message:
    try:
        message: Message = _decoder.decode(payload)
    except msgspec.ValidationError as exc:
        raise ProtocolError("bad_message", f"invalid message: {exc}") from None
    except msgspec.DecodeError as exc:
        raise ProtocolError("bad_frame", f"undecodable frame: {exc}") from None
    except UnicodeDecodeError as exc:  # a msgpack str that is not UTF-8
        raise ProtocolError("bad_frame", f"undecodable frame: {exc}") from None
    except RecursionError:
        # msgspec refuses deep nesting (even inside a field it would skip) this way.
        raise ProtocolError("bad_frame", "undecodable frame: nested too deeply") from None
    if message.v < BASE_VERSION:
        raise ProtocolError("bad_message", f"message version {message.v} is below {BASE_VERSION}")
    if message.v > PROTOCOL_VERSION:
        raise ProtocolError(
            "unsupported_version",
            f"message version {message.v} is newer than {PROTOCOL_VERSION}",
        )
    if isinstance(message, Output) and (len(message.data) > MAX_OUTPUT_BYTES or message.offset < 0):
        raise ProtocolError(
            "output_too_large",
            f"an Output frame carries at most {MAX_OUTPUT_BYTES} bytes at offset >= 0",
        )
    if isinstance(message, FetchOutput) and len(message.tasks) > MAX_FETCH_OUTPUT:
        raise ProtocolError("bad_message", f"FetchOutput names at most {MAX_FETCH_OUTPUT} attempts")
    return message


class FrameDecoder:
    """Bytes in, messages out. After a ProtocolError the decoder is unusable."""

    def __init__(self, max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES) -> None:
        self.max_frame_bytes = max_frame_bytes
        self._buffer = bytearray()
        self._failed: ProtocolError | None = None

    @property
    def buffered_bytes(self) -> int:
        return len(self._buffer)

    def feed(self, data: bytes) -> list[Message]:
        """Add received bytes; return every message now complete, in order."""
        if self._failed is not None:
            raise self._failed
        self._buffer += data
        messages: list[Message] = []
        buffer = self._buffer
        offset = 0
        try:
            while len(buffer) - offset >= 4:
                (length,) = _LENGTH.unpack_from(buffer, offset)
                if length > self.max_frame_bytes:
                    raise ProtocolError(
                        "frame_too_large",
                        f"frame of {length} bytes exceeds the {self.max_frame_bytes} byte cap",
                    )
                end = offset + 4 + length
                if end > len(buffer):
                    break
                messages.append(decode_payload(bytes(buffer[offset + 4 : end])))
                offset = end
        except ProtocolError as exc:
            self._failed = exc
            raise
        finally:
            if offset:
                del buffer[:offset]
        return messages
