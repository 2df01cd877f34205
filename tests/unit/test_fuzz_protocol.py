"""Fuzzing the sans-IO worker protocol decoder (wire/worker_protocol.py) with hypothesis.

Inputs: random bytes, valid frames that are then flipped, truncated, cut, given a
wrong length or an oversized one, well-formed msgpack of the wrong shape under a
real message tag, deep nesting, and valid messages in any order and chunking. The
decoder must only ever return messages or raise :class:`ProtocolError`, stay failed
after an error, keep no more than it was fed, and never wait for (or allocate) a
length it announced above its cap. Together the tests feed at least
``MIN_INPUTS`` generated inputs; every test counts its own.
"""

from __future__ import annotations

import os
import struct
import tracemalloc
from collections import Counter
from collections.abc import Iterator

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from wire import worker_protocol as p

MIN_INPUTS = 10_000
MAX_FRAME_BYTES = 4096
MESSAGE_TYPES = tuple(p.Message.__args__)
TAGS = ("hello", "welcome", "heartbeat", "assign", "finish", "finish_ack", "cancel", "error")
ERROR_CODES = {"frame_too_large", "bad_frame", "bad_message", "unsupported_version"}
# A longer run: STEWARD_FUZZ_SCALE=10 feeds ten times as many inputs.
SCALE = int(os.environ.get("STEWARD_FUZZ_SCALE", 1))
# (test name, examples): their sum is the generated inputs of a run.
EXAMPLES = {
    name: count * SCALE
    for name, count in {
        "random_bytes": 2500,
        "mutated_frames": 2500,
        "wrong_shapes": 2500,
        "valid_streams": 1500,
        "huge_lengths": 1000,
    }.items()
}
inputs_fed: Counter[str] = Counter()

FUZZ = settings(
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


def feed_all(chunks: list[bytes], max_frame_bytes: int = MAX_FRAME_BYTES) -> list[p.Message]:
    """Feed chunks in order; messages until the first ProtocolError (the only error allowed)."""
    decoder = p.FrameDecoder(max_frame_bytes)
    out: list[p.Message] = []
    fed = 0
    for chunk in chunks:
        try:
            messages = decoder.feed(chunk)
        except p.ProtocolError as exc:
            assert exc.code in ERROR_CODES, exc.code
            assert exc.message
            # Failed for good: the connection is closed after the error frame.
            with pytest.raises(p.ProtocolError):
                decoder.feed(p.encode_message(p.Heartbeat(seq=1)))
            return out
        fed += len(chunk)
        for message in messages:
            assert isinstance(message, MESSAGE_TYPES)
            assert p.BASE_VERSION <= message.v <= p.PROTOCOL_VERSION
        out.extend(messages)
        # It keeps only the unfinished frame, never more than it was given.
        assert decoder.buffered_bytes <= min(fed, max_frame_bytes + 4 + len(chunk))
    return out


def chunked(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({c % (len(data) + 1) for c in cuts})
    chunks = []
    start = 0
    for point in [*points, len(data)]:
        chunks.append(data[start:point])
        start = point
    return chunks


def frame(payload: bytes) -> bytes:
    return struct.pack(">I", len(payload)) + payload


# --- strategies -------------------------------------------------------------------------------

names = st.text(max_size=12)
small_ints = st.integers(min_value=0, max_value=2**31)
attempts = st.builds(p.TaskAttempt, small_ints, small_ints)
raw_json = st.sampled_from([b"null", b"{}", b"[1,2]", b'"x"', b"not json", b""])
floats = st.floats(allow_nan=True, allow_infinity=True)

spawns = st.builds(
    p.SpawnRequest,
    type=names,
    params=raw_json,
    tenant=st.none() | names,
    tracked=st.booleans(),
    anchors=st.lists(st.integers(-5, 2**40), max_size=3).map(tuple),
    max_attempts=st.integers(-3, 10),
    resources=st.dictionaries(names, floats, max_size=2),
)
messages: st.SearchStrategy[p.Message] = st.one_of(
    st.builds(
        p.Hello,
        worker_id=names,
        process_id=names,
        version=names,
        task_types=st.dictionaries(names, st.integers(-5, 100), max_size=3),
        resources=st.dictionaries(names, floats, max_size=3),
        tenants=st.lists(names, max_size=3).map(tuple),
        running=st.lists(attempts, max_size=3).map(tuple),
        token=st.none() | names,
    ),
    st.builds(p.Welcome, broker_id=names, keep=st.lists(attempts, max_size=3).map(tuple)),
    st.builds(p.Heartbeat, seq=small_ints),
    st.builds(
        p.Assign,
        tasks=st.lists(
            st.builds(
                p.AssignedTask,
                task_id=small_ints,
                attempt=small_ints,
                type=names,
                tenant=names,
                params=raw_json,
            ),
            max_size=3,
        ).map(tuple),
    ),
    st.builds(
        p.Finish,
        reports=st.lists(
            st.builds(
                p.TaskReport,
                task_id=small_ints,
                attempt=small_ints,
                ok=st.booleans(),
                result=st.none() | raw_json,
                error=st.none() | names,
                spawn=st.lists(spawns, max_size=2).map(tuple),
            ),
            max_size=3,
        ).map(tuple),
    ),
    st.builds(p.FinishAck, tasks=st.lists(attempts, max_size=3).map(tuple)),
    st.builds(p.Cancel, tasks=st.lists(attempts, max_size=3).map(tuple), reason=names),
    st.builds(p.Error, code=names, message=names),
)

FIELD_NAMES = [
    "type",
    "v",
    "worker_id",
    "task_types",
    "resources",
    "tenants",
    "running",
    "token",
    "seq",
    "tasks",
    "reports",
    "spawn",
    "task_id",
    "attempt",
    "ok",
    "result",
    "code",
    "message",
]
msgpack_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**64 - 1)
    | st.floats()
    | st.text(max_size=10)
    | st.binary(max_size=10),
    lambda children: (
        st.lists(children, max_size=4)
        | st.dictionaries(st.text(max_size=10) | st.sampled_from(FIELD_NAMES), children, max_size=4)
    ),
    max_leaves=20,
)


@st.composite
def wrong_shapes(draw: st.DrawFn) -> bytes:
    """A msgpack map under a real tag whose fields are random values (often wrong types)."""
    tag = draw(st.sampled_from(TAGS))
    fields = draw(st.dictionaries(st.sampled_from(FIELD_NAMES), msgpack_values, max_size=5))
    fields["type"] = tag
    if draw(st.booleans()):
        fields["v"] = draw(st.integers(min_value=-(2**63), max_value=2**64 - 1))
    return msgspec.msgpack.encode(fields)


@st.composite
def mutated_stream(draw: st.DrawFn) -> bytes:
    """Valid frames, then byte flips, cuts, insertions and rewritten length prefixes."""
    data = bytearray(b"".join(p.encode_message(m) for m in draw(st.lists(messages, max_size=4))))
    for _ in range(draw(st.integers(0, 6))):
        kind = draw(st.sampled_from(["flip", "cut", "insert", "length", "truncate"]))
        position = draw(st.integers(0, max(0, len(data))))
        if kind == "flip" and data:
            data[position % len(data)] ^= draw(st.integers(1, 255))
        elif kind == "cut" and data:
            del data[position : position + draw(st.integers(1, 16))]
        elif kind == "insert":
            data[position:position] = draw(st.binary(min_size=1, max_size=16))
        elif kind == "length":
            data[position:position] = struct.pack(">I", draw(st.integers(0, 2**32 - 1)))
        elif kind == "truncate":
            del data[position:]
    return bytes(data)


# --- the fuzz tests ---------------------------------------------------------------------------


@settings(FUZZ, max_examples=EXAMPLES["random_bytes"])
@given(st.lists(st.binary(max_size=300), min_size=1, max_size=6))
def test_random_bytes_only_give_messages_or_protocol_errors(chunks: list[bytes]) -> None:
    inputs_fed["random_bytes"] += 1
    feed_all(chunks)


@settings(FUZZ, max_examples=EXAMPLES["mutated_frames"])
@given(mutated_stream(), st.lists(st.integers(0, 10_000), max_size=5))
def test_mutated_frames_only_give_messages_or_protocol_errors(data: bytes, cuts: list[int]) -> None:
    inputs_fed["mutated_frames"] += 1
    feed_all(chunked(data, cuts))


@settings(FUZZ, max_examples=EXAMPLES["wrong_shapes"])
@given(wrong_shapes())
def test_wrong_shapes_under_real_tags_are_refused_or_decoded(payload: bytes) -> None:
    inputs_fed["wrong_shapes"] += 1
    try:
        message = p.decode_payload(payload)
    except p.ProtocolError as exc:
        assert exc.code in ERROR_CODES
        return
    assert isinstance(message, MESSAGE_TYPES)
    assert feed_all([frame(payload)]) == [message]


@settings(FUZZ, max_examples=EXAMPLES["valid_streams"])
@given(st.lists(messages, max_size=6), st.lists(st.integers(0, 10_000), max_size=8))
def test_valid_messages_in_any_order_and_chunking_round_trip(
    sent: list[p.Message], cuts: list[int]
) -> None:
    inputs_fed["valid_streams"] += 1
    data = b"".join(p.encode_message(m, p.DEFAULT_MAX_FRAME_BYTES) for m in sent)
    decoded = feed_all(chunked(data, cuts), max_frame_bytes=p.DEFAULT_MAX_FRAME_BYTES)
    # Compared as bytes: NaN resources are not equal to themselves.
    assert b"".join(p.encode_message(m, p.DEFAULT_MAX_FRAME_BYTES) for m in decoded) == data


@settings(FUZZ, max_examples=EXAMPLES["huge_lengths"])
@given(
    st.integers(min_value=MAX_FRAME_BYTES + 1, max_value=2**32 - 1),
    st.binary(max_size=64),
    st.integers(0, 3),
)
def test_announced_huge_lengths_are_refused_at_once(
    length: int, tail: bytes, valid_before: int
) -> None:
    inputs_fed["huge_lengths"] += 1
    decoder = p.FrameDecoder(MAX_FRAME_BYTES)
    before = b"".join(p.encode_message(p.Heartbeat(seq=i)) for i in range(valid_before))
    with pytest.raises(p.ProtocolError) as info:
        decoder.feed(before + struct.pack(">I", length) + tail)
    assert info.value.code == "frame_too_large"


def test_fuzz_inputs_add_up() -> None:
    """Runs after the fuzz tests of this module (pytest keeps file order)."""
    ran = {name for name in EXAMPLES if inputs_fed[name]}
    if ran != set(EXAMPLES):
        pytest.fail(f"run the whole module to count inputs; only ran {sorted(ran)}")
    total = sum(inputs_fed.values())
    print(f"\nprotocol decoder fuzz: {total} generated inputs {dict(inputs_fed)}")
    assert total >= MIN_INPUTS


# --- regressions found by fuzzing and the bounds it relies on --------------------------------


def nested(depth: int) -> bytes:
    """A heartbeat with an unknown field nested ``depth`` arrays deep."""
    return b"\x82\xa4type\xa9heartbeat\xa1x" + b"\x91" * depth + b"\xc0"


@pytest.mark.parametrize("depth", [1_000, 1_000_000])
def test_deep_nesting_is_a_protocol_error_not_a_recursion_error(depth: int) -> None:
    with pytest.raises(p.ProtocolError) as info:
        p.FrameDecoder(p.DEFAULT_MAX_FRAME_BYTES).feed(frame(nested(depth)))
    assert info.value.code == "bad_frame"


def test_a_string_that_is_not_utf8_is_a_protocol_error() -> None:
    # Found by the mutation fuzz: msgspec raised UnicodeDecodeError past decode_payload.
    payload = b"\x82\xa4type\xa5hello\xa9worker_id\xa2\x00\xc2"
    with pytest.raises(p.ProtocolError) as info:
        p.FrameDecoder().feed(frame(payload))
    assert info.value.code == "bad_frame"


@pytest.mark.parametrize("version", [0, -1, -(2**63)])
def test_versions_below_1_are_refused(version: int) -> None:
    with pytest.raises(p.ProtocolError) as info:
        p.decode_payload(msgspec.msgpack.encode({"type": "heartbeat", "v": version}))
    assert info.value.code == "bad_message"


def test_a_length_just_under_the_cap_is_not_allocated_up_front() -> None:
    decoder = p.FrameDecoder()  # 16 MiB cap
    tracemalloc.start()
    try:
        for _ in range(100):
            decoder.feed(struct.pack(">I", p.DEFAULT_MAX_FRAME_BYTES) + b"x" * 10)
            decoder = p.FrameDecoder()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1024 * 1024


def test_one_byte_at_a_time_never_loops() -> None:
    data = b"".join(p.encode_message(p.Heartbeat(seq=i)) for i in range(50))
    decoder = p.FrameDecoder()
    out: list[p.Message] = []
    for byte in iter_bytes(data):
        out.extend(decoder.feed(byte))
    assert [m.seq for m in out if isinstance(m, p.Heartbeat)] == list(range(50))


def iter_bytes(data: bytes) -> Iterator[bytes]:
    for index in range(len(data)):
        yield data[index : index + 1]
