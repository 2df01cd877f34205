"""The pipe protocol between the worker and its task processes.

Each task process has two pipes to the worker besides its output: ``control`` (worker to
process) and ``events`` (process to worker). Frames are a 4-byte big-endian length and a
msgpack body. The conversation, one task at a time::

    process: Ready -> (worker: Run -> process: Done)* -> EOF
    worker may send Cancel while a Run is in progress (with SIGTERM; SIGKILL after grace)

The process trusts nothing it did not get on ``control``; the worker trusts nothing
from ``events`` beyond its shape and size (the process runs a tenant's code and may
write anything there): a bad frame ends the process, it never reaches the broker.
"""

from __future__ import annotations

import os
import struct
from typing import Final

import msgspec

from broker.workers.protocol import SpawnRequest

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


class Cancel(msgspec.Struct, frozen=True, tag="cancel", tag_field="kind"):
    reason: str


class Done(msgspec.Struct, frozen=True, tag="done", tag_field="kind"):
    ok: bool
    result: bytes | None = None
    error: str | None = None
    spawn: tuple[SpawnRequest, ...] = ()
    # The task raised MemoryError (told apart so the worker can name the limit).
    out_of_memory: bool = False


ToProcess = Run | Cancel
FromProcess = Ready | Done

_to_process = msgspec.msgpack.Decoder(ToProcess)
_from_process = msgspec.msgpack.Decoder(FromProcess)
_encoder = msgspec.msgpack.Encoder()


class WireError(Exception):
    """A frame that is too large, cut short or not a message of this protocol."""


def encode(message: ToProcess | FromProcess) -> bytes:
    body = _encoder.encode(message)
    return _LENGTH.pack(len(body)) + body


def write_frame(fd: int, message: ToProcess | FromProcess) -> None:
    """Write a whole frame to a blocking fd."""
    view = memoryview(encode(message))
    while view:
        written = os.write(fd, view)
        view = view[written:]


def _read_exactly(fd: int, size: int) -> bytes | None:
    chunks: list[bytes] = []
    left = size
    while left:
        chunk = os.read(fd, min(left, 1 << 20))
        if not chunk:
            return None
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def read_to_process(fd: int, max_frame_bytes: int) -> ToProcess | None:
    """The next frame for a task process from a blocking fd; None at EOF."""
    head = _read_exactly(fd, _LENGTH.size)
    if head is None:
        return None
    (size,) = _LENGTH.unpack(head)
    if size > max_frame_bytes:
        raise WireError(f"frame of {size} bytes over the limit of {max_frame_bytes}")
    body = _read_exactly(fd, size)
    if body is None:
        raise WireError("control pipe closed inside a frame")
    try:
        message: ToProcess = _to_process.decode(body)
    except msgspec.DecodeError as exc:
        raise WireError(f"bad frame: {exc}") from None
    return message


class EventDecoder:
    """Sans-IO decoder of a task process's events: feed bytes, take messages."""

    def __init__(self, max_frame_bytes: int) -> None:
        self._buffer = bytearray()
        self._max_frame_bytes = max_frame_bytes

    def feed(self, data: bytes) -> list[FromProcess]:
        self._buffer += data
        messages: list[FromProcess] = []
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
                messages.append(_from_process.decode(body))
            except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                raise WireError(f"bad frame: {exc}") from None
        return messages

    @property
    def pending_bytes(self) -> int:
        return len(self._buffer)
