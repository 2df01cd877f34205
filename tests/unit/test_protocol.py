"""The worker protocol's framing and messages (wire/worker_protocol.py)."""

from __future__ import annotations

import struct

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from wire import worker_protocol as p

# Each message with the exact map it must encode to (the wire contract).
TABLE: list[tuple[p.Message, dict[str, object]]] = [
    (
        p.Hello(
            worker_id="w1",
            process_id="pid-1",
            version="0.1.0",
            task_types={"*": 4, "spark.sql": 2},
            resources={"cpu": 8.0, "memory_mb": 16000.0},
            tenants=("acme",),
            running=(p.TaskAttempt(7, 2),),
            token="s3cret",
        ),
        {
            "type": "hello",
            "worker_id": "w1",
            "process_id": "pid-1",
            "version": "0.1.0",
            "task_types": {"*": 4, "spark.sql": 2},
            "resources": {"cpu": 8.0, "memory_mb": 16000.0},
            "tenants": ["acme"],
            "running": [[7, 2]],
            "token": "s3cret",
        },
    ),
    (p.Hello(worker_id="w2"), {"type": "hello", "worker_id": "w2"}),
    (
        p.Welcome(
            broker_id="b1",
            heartbeat_interval_ms=500,
            heartbeat_timeout_ms=4000,
            keep=(p.TaskAttempt(1, 1),),
            drop=(p.TaskAttempt(2, 1),),
        ),
        {
            "type": "welcome",
            "broker_id": "b1",
            "heartbeat_interval_ms": 500,
            "heartbeat_timeout_ms": 4000,
            "keep": [[1, 1]],
            "drop": [[2, 1]],
        },
    ),
    (p.Heartbeat(seq=9), {"type": "heartbeat", "seq": 9}),
    (
        p.Assign(
            tasks=(
                p.AssignedTask(
                    task_id=5,
                    attempt=1,
                    type="noop",
                    tenant="t",
                    params=b'{"a":1}',
                    code="ab" * 32,
                    deadline_ms=123,
                    resources={"cpu": 1.0},
                ),
            )
        ),
        {
            "type": "assign",
            "tasks": [
                {
                    "task_id": 5,
                    "attempt": 1,
                    "type": "noop",
                    "tenant": "t",
                    "params": b'{"a":1}',
                    "code": "ab" * 32,
                    "deadline_ms": 123,
                    "resources": {"cpu": 1.0},
                }
            ],
        },
    ),
    (
        p.Finish(
            reports=(
                p.TaskReport(task_id=5, attempt=1, ok=True, result=b"[1,2]"),
                p.TaskReport(task_id=6, attempt=2, ok=False, error="boom"),
            )
        ),
        {
            "type": "finish",
            "reports": [
                {"task_id": 5, "attempt": 1, "ok": True, "result": b"[1,2]"},
                {"task_id": 6, "attempt": 2, "ok": False, "error": "boom"},
            ],
        },
    ),
    (p.FinishAck(tasks=(p.TaskAttempt(5, 1),)), {"type": "finish_ack", "tasks": [[5, 1]]}),
    (
        p.Cancel(tasks=(p.TaskAttempt(5, 1),), reason="deadline exceeded"),
        {"type": "cancel", "tasks": [[5, 1]], "reason": "deadline exceeded"},
    ),
    (
        p.Error(code="bad_frame", message="nope"),
        {"type": "error", "code": "bad_frame", "message": "nope"},
    ),
]


def frame_of(obj: object) -> bytes:
    payload = msgspec.msgpack.encode(obj)
    return struct.pack(">I", len(payload)) + payload


@pytest.mark.parametrize(("message", "wire"), TABLE, ids=lambda x: type(x).__name__)
def test_message_to_bytes_and_back(message: p.Message, wire: dict[str, object]) -> None:
    encoded = p.encode_message(message)
    assert msgspec.msgpack.decode(encoded[4:]) == wire
    assert struct.unpack(">I", encoded[:4])[0] == len(encoded) - 4
    # The hand-built frame decodes to the same message.
    assert p.FrameDecoder().feed(frame_of(wire)) == [message]


def test_byte_by_byte_equals_one_chunk() -> None:
    stream = b"".join(p.encode_message(m) for m, _ in TABLE)
    whole = p.FrameDecoder().feed(stream)
    decoder = p.FrameDecoder()
    pieces: list[p.Message] = []
    for i in range(len(stream)):
        pieces.extend(decoder.feed(stream[i : i + 1]))
    assert pieces == whole == [m for m, _ in TABLE]
    assert decoder.buffered_bytes == 0


@given(st.lists(st.integers(min_value=1, max_value=64), min_size=1, max_size=40))
def test_any_chunking_equals_one_chunk(cuts: list[int]) -> None:
    stream = b"".join(p.encode_message(m) for m, _ in TABLE)
    decoder = p.FrameDecoder()
    out: list[p.Message] = []
    offset = 0
    for cut in cuts:
        out.extend(decoder.feed(stream[offset : offset + cut]))
        offset += cut
    out.extend(decoder.feed(stream[offset:]))
    assert out == [m for m, _ in TABLE]


def test_oversized_frame_is_refused_before_buffering() -> None:
    decoder = p.FrameDecoder(max_frame_bytes=1024)
    with pytest.raises(p.ProtocolError) as info:
        decoder.feed(struct.pack(">I", 1025))
    assert info.value.code == "frame_too_large"
    # The decoder stays failed: the connection must be closed.
    with pytest.raises(p.ProtocolError):
        decoder.feed(p.encode_message(p.Heartbeat(seq=1)))


def test_encoding_over_the_cap_raises() -> None:
    big = p.Finish(reports=(p.TaskReport(task_id=1, attempt=1, ok=True, result=b"x" * 2000),))
    with pytest.raises(p.ProtocolError):
        p.encode_message(big, max_frame_bytes=1000)


@pytest.mark.parametrize(
    ("payload", "code"),
    [
        (b"\xc1", "bad_frame"),  # never-used msgpack byte
        (msgspec.msgpack.encode([1, 2]), "bad_message"),
        (msgspec.msgpack.encode({"type": "launch_missiles"}), "bad_message"),
        (msgspec.msgpack.encode({"type": "heartbeat", "seq": "x"}), "bad_message"),
        (msgspec.msgpack.encode({"type": "heartbeat", "v": 99}), "unsupported_version"),
        (msgspec.msgpack.encode({"seq": 1}), "bad_message"),
        (b"", "bad_frame"),
    ],
)
def test_bad_frames_raise_protocol_errors(payload: bytes, code: str) -> None:
    with pytest.raises(p.ProtocolError) as info:
        p.FrameDecoder().feed(struct.pack(">I", len(payload)) + payload)
    assert info.value.code == code


@settings(max_examples=3000, deadline=None)
@given(st.binary(max_size=512))
def test_fuzz_garbage_parses_or_raises_protocol_error(garbage: bytes) -> None:
    decoder = p.FrameDecoder(max_frame_bytes=4096)
    try:
        messages = decoder.feed(garbage)
    except p.ProtocolError:
        return
    for message in messages:
        assert isinstance(message, p.Message.__args__)  # type: ignore[attr-defined]


@settings(max_examples=2000, deadline=None)
@given(
    st.recursive(
        st.none()
        | st.booleans()
        | st.integers(min_value=-(2**63), max_value=2**64 - 1)
        | st.text(max_size=8)
        | st.binary(max_size=8),
        lambda children: (
            st.lists(children, max_size=4)
            | st.dictionaries(st.sampled_from(["type", "seq", "v", "tasks", "x"]), children)
        ),
        max_leaves=12,
    )
)
def test_fuzz_structured_payloads(obj: object) -> None:
    try:
        messages = p.FrameDecoder().feed(frame_of(obj))
    except p.ProtocolError:
        return
    assert len(messages) == 1


# --- version 2: spawn requests in finish reports (task trees) ------------------------------


def test_finish_with_spawn_is_sent_as_v2_and_round_trips() -> None:
    report = p.TaskReport(
        task_id=5,
        attempt=1,
        ok=True,
        spawn=(
            p.SpawnRequest(type="child", params=b'{"i":1}', anchors=(3,)),
            p.SpawnRequest(type="side", tracked=False, tenant="other"),
        ),
    )
    encoded = p.encode_message(p.Finish(reports=(report,)))
    wire = msgspec.msgpack.decode(encoded[4:])
    assert wire["v"] == p.SPAWN_VERSION
    assert wire["reports"][0]["spawn"] == [
        {"type": "child", "params": b'{"i":1}', "anchors": [3]},
        {"type": "side", "tenant": "other", "tracked": False},
    ]
    [decoded] = p.FrameDecoder().feed(encoded)
    assert isinstance(decoded, p.Finish)
    assert decoded.reports == (report,)


def test_messages_without_new_fields_stay_v1() -> None:
    # An older broker keeps understanding a newer worker until it spawns.
    for message, _ in TABLE:
        assert "v" not in msgspec.msgpack.decode(p.encode_message(message)[4:])
    assert p.required_version(p.Finish(reports=(p.TaskReport(1, 1, ok=True),))) == 1


def test_bad_spawn_requests_are_protocol_errors() -> None:
    bad = {"type": "finish", "v": 2, "reports": [{"task_id": 1, "attempt": 1, "ok": True}]}
    for spawn in ([{"params": b"1"}], [{"type": "x", "anchors": ["a"]}], [{"type": "x", "z": 1}]):
        bad["reports"][0]["spawn"] = spawn  # type: ignore[index]
        with pytest.raises(p.ProtocolError) as info:
            p.FrameDecoder().feed(frame_of(bad))
        assert info.value.code == "bad_message"


def test_newer_than_v2_is_refused() -> None:
    with pytest.raises(p.ProtocolError) as info:
        p.FrameDecoder().feed(frame_of({"type": "heartbeat", "v": p.PROTOCOL_VERSION + 1}))
    assert info.value.code == "unsupported_version"


def test_a_spawned_childs_max_lost_defaults_as_a_submitted_tasks() -> None:
    from broker.core import entries as e

    assert p.DEFAULT_MAX_LOST == e.DEFAULT_MAX_LOST
    # Sent only when a task sets it: a worker talking to an older broker sends it only then.
    assert b"max_lost" not in msgspec.msgpack.encode(p.SpawnRequest(type="x"))
    assert b"max_lost" in msgspec.msgpack.encode(p.SpawnRequest(type="x", max_lost=0))
