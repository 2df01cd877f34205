"""The worker protocol's conversation table (wire/conversation.py)."""

from __future__ import annotations

import typing

import pytest

from wire import conversation as conversation_module
from wire import worker_protocol as p
from wire.conversation import (
    ALLOWED,
    REFUSALS,
    Conversation,
    Role,
    State,
    may_send,
)

ALL_TYPES = frozenset(typing.get_args(p.Message))
HELLO = p.Hello(worker_id="w1")
WELCOME = p.Welcome(broker_id="b")
ERROR = p.Error(code="x", message="y")


def active(role: Role) -> Conversation:
    conversation = Conversation(role)
    if role is Role.WORKER:
        conversation.send(HELLO)
        conversation.receive(WELCOME)
    else:
        conversation.receive(HELLO)
        conversation.send(WELCOME)
    assert conversation.state is State.ACTIVE
    return conversation


def refusal(conversation: Conversation, frame: p.Message) -> tuple[str, str]:
    """The (code, message) of the ProtocolError with which ``conversation`` refuses ``frame``."""
    with pytest.raises(p.ProtocolError) as caught:
        conversation.receive(frame)
    return caught.value.code, caught.value.message


def check_active_receive(role: Role, kind: type[p.Message], legal: bool, refused: str) -> None:
    """An active ``role`` side takes a ``kind`` frame (an Error closes the conversation), or,
    when it is not ``legal``, refuses it as an unexpected message saying ``refused``."""
    conversation = active(role)
    if legal:
        conversation.receive(kind())
        assert conversation.state is (State.CLOSED if kind is p.Error else State.ACTIVE)
    else:
        assert refusal(conversation, kind()) == ("unexpected_message", refused)


def test_every_frame_type_of_the_protocol_is_in_the_table() -> None:
    in_table = frozenset().union(*ALLOWED.values())
    assert in_table == ALL_TYPES
    # ... and the table names every (sender, state) pair, with a refusal for each.
    pairs = {(role, state) for role in Role for state in State}
    assert set(ALLOWED) == pairs
    assert set(REFUSALS) == pairs


def test_the_module_docstring_draws_the_table_as_it_is() -> None:
    """The table in conversation.py's docstring (the one a reader sees first) names, per
    state, exactly the frames ALLOWED lets each side send."""
    lines = (conversation_module.__doc__ or "").splitlines()
    header = next(i for i, line in enumerate(lines) if line.strip().startswith("state "))
    broker_column = lines[header].index("broker may send")
    worker_column = lines[header].index("worker may send")
    drawn: dict[tuple[Role, State], set[str]] = {}
    state = State.AWAIT_HELLO
    for line in lines[header + 1 :]:
        if not line.strip():
            break
        if line[:worker_column].strip():
            state = State[line[:worker_column].strip()]
        for role, cell in (
            (Role.WORKER, line[worker_column:broker_column]),
            (Role.BROKER, line[broker_column:]),
        ):
            names = {name.strip() for name in cell.split(",")} - {"", "(nothing)"}
            drawn.setdefault((role, state), set()).update(names)
    assert drawn == {pair: {kind.__name__ for kind in kinds} for pair, kinds in ALLOWED.items()}


def test_each_frame_type_has_one_sender_except_heartbeat_and_error() -> None:
    def senders(kind: type[p.Message]) -> set[Role]:
        return {role for (role, _), kinds in ALLOWED.items() if kind in kinds}

    for kind in ALL_TYPES:
        expected = 2 if kind in (p.Heartbeat, p.Error) else 1
        assert len(senders(kind)) == expected, kind


def test_the_handshake_moves_hello_then_welcome_to_active() -> None:
    worker, broker = Conversation(Role.WORKER), Conversation(Role.BROKER)
    worker.send(HELLO)
    broker.receive(HELLO)
    assert worker.state is broker.state is State.AWAIT_WELCOME
    broker.send(WELCOME)
    worker.receive(WELCOME)
    assert worker.state is broker.state is State.ACTIVE


@pytest.mark.parametrize(
    ("first", "code", "text"),
    [
        (p.Heartbeat(), "bad_handshake", "the first message must be hello"),
        (p.Finish(), "bad_handshake", "the first message must be hello"),
        (ERROR, "bad_handshake", "the first message must be hello"),
    ],
)
def test_the_broker_refuses_anything_but_hello_first(
    first: p.Message, code: str, text: str
) -> None:
    assert refusal(Conversation(Role.BROKER), first) == (code, text)


def test_the_broker_refuses_frames_between_hello_and_welcome() -> None:
    broker = Conversation(Role.BROKER)
    broker.receive(HELLO)
    for frame in (HELLO, p.Heartbeat(), ERROR):
        assert refusal(broker, frame) == ("bad_handshake", "wait for welcome before sending more")


@pytest.mark.parametrize("kind", sorted(ALL_TYPES, key=lambda k: k.__name__))
def test_active_frames_from_a_worker(kind: type[p.Message]) -> None:
    legal = kind in (p.Heartbeat, p.Finish, p.Output, p.Error, p.Progress)
    assert may_send(Role.WORKER, State.ACTIVE, kind()) is legal
    check_active_receive(Role.BROKER, kind, legal, f"a worker may not send {kind.__name__}")


@pytest.mark.parametrize("kind", sorted(ALL_TYPES, key=lambda k: k.__name__))
def test_active_frames_from_the_broker(kind: type[p.Message]) -> None:
    legal = kind in (p.Heartbeat, p.Assign, p.FinishAck, p.Cancel, p.FetchOutput, p.Error)
    check_active_receive(Role.WORKER, kind, legal, f"unexpected {kind.__name__} from the broker")


def test_the_worker_expects_welcome_or_error_after_hello() -> None:
    worker = Conversation(Role.WORKER)
    worker.send(HELLO)
    assert refusal(worker, p.Assign()) == (
        "unexpected_message",
        f"expected Welcome, got {p.Assign()!r}",
    )
    refused = Conversation(Role.WORKER)
    refused.send(HELLO)
    refused.receive(ERROR)  # e.g. unauthorized: the broker refused the Hello
    assert refused.closed


def test_sending_checks_the_table_but_error_always_goes() -> None:
    worker = Conversation(Role.WORKER)
    with pytest.raises(p.ProtocolError) as caught:
        worker.send(p.Heartbeat())  # before Hello: a bug on this side
    assert caught.value.code == "local_protocol_error"
    worker.send(ERROR)  # answering a breach is allowed in any state
    assert worker.closed
    broker = active(Role.BROKER)
    with pytest.raises(p.ProtocolError):
        broker.send(p.Finish())
    broker.send(p.Assign())
    assert broker.state is State.ACTIVE


def test_nothing_is_legal_after_the_conversation_closed() -> None:
    for role in Role:
        conversation = active(role)
        conversation.receive(ERROR)
        assert conversation.closed
        for kind in ALL_TYPES:
            with pytest.raises(p.ProtocolError):
                conversation.receive(kind())
            if kind is not p.Error:
                with pytest.raises(p.ProtocolError):
                    conversation.send(kind())
