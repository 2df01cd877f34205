"""The pipe protocol between the worker and its task processes.

Each task process has two pipes to the worker besides its output: ``control`` (worker to
process) and ``events`` (process to worker). Frames are a 4-byte big-endian length and a
msgpack body. The conversation::

    process: Ready -> (worker: Run+ ... process: Done per Run, in the order sent)* -> EOF
    process: Progress (the running Run's latest ctx.progress) any time while it runs
    process: SparkWanted (the running Run's first ctx.spark, per-tenant Spark servers),
             worker: SparkGranted for it (the tenant's server, or why there is none)
    worker: Cancel(task) at any time, then SIGTERM (SIGKILL after the grace if it runs on)

The worker may send several Runs before their Dones (pipelining, for tasks that take
well under a millisecond; ``clients/worker/task_processes/pool.py``); the process runs them one at a
time in order. A Cancel for a Run not started yet makes the process skip it (a Done with
``skipped``); for the running one, the SIGTERM that follows raises ``TaskCancelled`` in it.
After each Run the process writes ``--output-marker`` to its output pipe, so the worker
can tell one attempt's output from the next.

The process trusts nothing it did not get on ``control``; the worker trusts nothing
from ``events`` beyond its shape and size (the process runs a tenant's code and may
write anything there): a bad frame ends the process, it never reaches the broker.
"""

from __future__ import annotations

import os
import struct
from typing import Annotated, Final, Generic, TypeVar

import msgspec

from wire.worker_protocol import MAX_PROGRESS_CHARS, SpawnRequest

_LENGTH: Final = struct.Struct(">I")


class Ready(msgspec.Struct, frozen=True, tag="ready", tag_field="kind"):
    pid: int


class Run(msgspec.Struct, frozen=True, tag="run", tag_field="kind"):
    task_id: int
    attempt: int
    tenant: str
    type: str
    params: bytes
    workdir: str
    max_result_bytes: int
    code: str | None = None
    # A verified copy of the task's code artifact the process may read: the .py file or
    # the extracted archive's directory.
    code_path: str | None = None
    deadline_ms: int | None = None
    resources: dict[str, float] = {}
    spark_master: str = "local[*]"
    spark_conf: dict[str, str] = {}
    # Spark (clients/worker/spark/connect_server.py): "connect", "classic" or "off". With
    # "connect", the worker's server (port, token, its uid) and this attempt's session id;
    # spark_error says why the server is unavailable, spark_wait_s how long to wait for it.
    spark_mode: str = "classic"
    spark_connect_port: int = 0
    spark_connect_token: str = ""
    spark_connect_uid: int = -1
    spark_session_id: str = ""
    spark_wait_s: float = 0.0
    spark_error: str = ""
    allow_classic_spark: bool = True
    # --spark-remote: the remote server's sc:// URL (its token too) instead of the port.
    spark_remote: str = ""
    # The tenant's fair-scheduler pool (clients/worker/spark/pools.py); "": the default.
    spark_pool: str = ""
    # A server of the tenant's own (clients/worker/spark/tenant_servers.py): no port above; the
    # first use of ctx.spark asks for it (SparkWanted) and waits for SparkGranted.
    spark_on_request: bool = False


class Cancel(msgspec.Struct, frozen=True, tag="cancel", tag_field="kind"):
    reason: str
    task_id: int = 0
    attempt: int = 0


class Done(msgspec.Struct, frozen=True, tag="done", tag_field="kind"):
    ok: bool
    result: bytes | None = None
    error: str | None = None
    spawn: tuple[SpawnRequest, ...] = ()
    # The task raised MemoryError (told apart so the worker can name the limit).
    out_of_memory: bool = False
    task_id: int = 0
    attempt: int = 0
    skipped: bool = False  # cancelled before it started: it never ran
    elapsed_us: int = 0  # how long the task's code ran


class Progress(msgspec.Struct, frozen=True, tag="progress", tag_field="kind"):
    """The running task's latest ctx.progress (at most one per interval: child.py)."""

    task_id: int
    attempt: int
    fraction: Annotated[float, msgspec.Meta(ge=0.0, le=1.0)]
    message: Annotated[str, msgspec.Meta(max_length=MAX_PROGRESS_CHARS)] = ""


class SparkWanted(msgspec.Struct, frozen=True, tag="spark_wanted", tag_field="kind"):
    """The running Run's ctx.spark wants its tenant's Spark Connect server."""

    task_id: int
    attempt: int


class SparkGranted(msgspec.Struct, frozen=True, tag="spark_granted", tag_field="kind"):
    """The tenant's server for a SparkWanted (port, token, its uid), or why there is none."""

    task_id: int
    attempt: int
    port: int = 0
    token: str = ""
    uid: int = -1
    error: str = ""


class Limit(msgspec.Struct, frozen=True, tag="limit", tag_field="kind"):
    """A spare process's memory limit (0: none), sent once, before its first Run
    (``clients/worker/task_processes/pool.py``, spares): it applies it before any tenant code."""

    memory_limit_mb: Annotated[int, msgspec.Meta(ge=0)]


ToProcess = Run | Cancel | SparkGranted | Limit
FromProcess = Ready | Done | Progress | SparkWanted

_Message = TypeVar("_Message", ToProcess, FromProcess)

_to_process = msgspec.msgpack.Decoder(ToProcess)
_from_process = msgspec.msgpack.Decoder(FromProcess)
_encoder = msgspec.msgpack.Encoder()


def output_marker(token: str) -> bytes:
    """What a task process writes to its output after each Run (NULs: not in text)."""
    return b"\0\0" + token.encode("ascii") + b"\0\0"


class WireError(Exception):
    """A frame that is too large, cut short or not a message of this protocol."""


def encode(message: ToProcess | FromProcess) -> bytes:
    body = _encoder.encode(message)
    return _LENGTH.pack(len(body)) + body


def write_frame(fd: int, message: ToProcess | FromProcess) -> None:
    """Write a whole frame to a blocking fd."""
    write_all(fd, encode(message))


def write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


class _FrameDecoder(Generic[_Message]):
    """Sans-IO frame decoder: feed bytes, take messages."""

    def __init__(self, max_frame_bytes: int, decoder: msgspec.msgpack.Decoder[_Message]) -> None:
        self._buffer = bytearray()
        self._max_frame_bytes = max_frame_bytes
        self._decoder: msgspec.msgpack.Decoder[_Message] = decoder

    def feed(self, data: bytes) -> list[_Message]:
        self._buffer += data
        messages: list[_Message] = []
        while len(self._buffer) >= _LENGTH.size:
            (size,) = _LENGTH.unpack_from(self._buffer)
            if size > self._max_frame_bytes:
                raise WireError(f"frame of {size} bytes over the limit of {self._max_frame_bytes}")
            end = _LENGTH.size + size
            if len(self._buffer) < end:
                break
            body = bytes(self._buffer[_LENGTH.size : end])
            del self._buffer[:end]
            try:
                messages.append(self._decoder.decode(body))
            except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                raise WireError(f"bad frame: {exc}") from None
        return messages

    @property
    def pending_bytes(self) -> int:
        return len(self._buffer)


class EventDecoder(_FrameDecoder[FromProcess]):
    """The worker's decoder of a task process's events."""

    def __init__(self, max_frame_bytes: int) -> None:
        super().__init__(max_frame_bytes, _from_process)


class ControlDecoder(_FrameDecoder[ToProcess]):
    """A task process's decoder of the worker's control frames."""

    def __init__(self, max_frame_bytes: int) -> None:
        super().__init__(max_frame_bytes, _to_process)
