"""The conversation table of one worker connection (h11's ``_state.py`` shape).

Sans-IO like :mod:`wire.worker_protocol`: both sides keep one :class:`Conversation` per
connection and feed it every frame they send (:meth:`Conversation.send`) and receive
(:meth:`Conversation.receive`). A frame the table does not allow in the current state is
a :class:`~wire.worker_protocol.ProtocolError` (the receiving side answers it with an
Error frame and closes, as for an undecodable frame). docs/DESIGN.md §8 (worker protocol)::

    state           worker may send                  broker may send
    AWAIT_HELLO     Hello                            Error
    AWAIT_WELCOME   (nothing)                        Welcome, Error
    ACTIVE          Heartbeat, Finish, Output,       Heartbeat, Assign, FinishAck,
                    Progress, Error                  Cancel, FetchOutput, Error
    CLOSED          (nothing)                        (nothing)

Transitions: Hello moves AWAIT_HELLO to AWAIT_WELCOME, Welcome moves AWAIT_WELCOME to
ACTIVE, an Error (either side, any state) moves to CLOSED. Sending an Error is always
allowed: it is how a side answers the other's breach. Which optional frames a peer takes
(Output, FetchOutput: the ``output`` flags of Hello and Welcome; Progress: the ``progress``
flag of Welcome) is the sides' business, not the table's.
"""

from __future__ import annotations

import enum
from typing import Final

from wire import worker_protocol as p


class Role(enum.Enum):
    WORKER = "worker"
    BROKER = "broker"


class State(enum.Enum):
    AWAIT_HELLO = "await_hello"
    AWAIT_WELCOME = "await_welcome"
    ACTIVE = "active"
    CLOSED = "closed"


#: Per (sender, state): the frame types the sender may send.
ALLOWED: Final[dict[tuple[Role, State], frozenset[type[p.Message]]]] = {
    (Role.WORKER, State.AWAIT_HELLO): frozenset({p.Hello}),
    (Role.WORKER, State.AWAIT_WELCOME): frozenset(),
    (Role.WORKER, State.ACTIVE): frozenset({p.Heartbeat, p.Finish, p.Output, p.Error, p.Progress}),
    (Role.WORKER, State.CLOSED): frozenset(),
    (Role.BROKER, State.AWAIT_HELLO): frozenset({p.Error}),
    (Role.BROKER, State.AWAIT_WELCOME): frozenset({p.Welcome, p.Error}),
    (Role.BROKER, State.ACTIVE): frozenset(
        {p.Heartbeat, p.Assign, p.FinishAck, p.Cancel, p.FetchOutput, p.Error}
    ),
    (Role.BROKER, State.CLOSED): frozenset(),
}

#: Per (frame type, state): the state the frame moves the conversation to (else it stays).
TRANSITIONS: Final[dict[tuple[type[p.Message], State], State]] = {
    (p.Hello, State.AWAIT_HELLO): State.AWAIT_WELCOME,
    (p.Welcome, State.AWAIT_WELCOME): State.ACTIVE,
    **{(p.Error, state): State.CLOSED for state in State},
}

#: Per (sender, state): the error code and text a receiver answers an illegal frame with
#: (``{name}``: the frame's type, ``{message!r}``: the frame).
REFUSALS: Final[dict[tuple[Role, State], tuple[str, str]]] = {
    (Role.WORKER, State.AWAIT_HELLO): ("bad_handshake", "the first message must be hello"),
    (Role.WORKER, State.AWAIT_WELCOME): ("bad_handshake", "wait for welcome before sending more"),
    (Role.WORKER, State.ACTIVE): ("unexpected_message", "a worker may not send {name}"),
    (Role.WORKER, State.CLOSED): ("unexpected_message", "{name} after the conversation ended"),
    (Role.BROKER, State.AWAIT_HELLO): ("unexpected_message", "expected Hello first, got {name}"),
    (Role.BROKER, State.AWAIT_WELCOME): ("unexpected_message", "expected Welcome, got {message!r}"),
    (Role.BROKER, State.ACTIVE): ("unexpected_message", "unexpected {name} from the broker"),
    (Role.BROKER, State.CLOSED): ("unexpected_message", "{name} after the conversation ended"),
}


def may_send(sender: Role, state: State, message: p.Message) -> bool:
    return type(message) in ALLOWED[sender, state]


class Conversation:
    """One connection's state, seen from ``our_role``'s side."""

    def __init__(self, our_role: Role, state: State = State.AWAIT_HELLO) -> None:
        self.our_role = our_role
        self.their_role = Role.BROKER if our_role is Role.WORKER else Role.WORKER
        self.state = state

    @property
    def closed(self) -> bool:
        return self.state is State.CLOSED

    def send(self, message: p.Message) -> None:
        """Record a frame we send; ProtocolError (code ``local_protocol_error``) if the
        table forbids it (a bug on our side). An Error is always allowed."""
        if not isinstance(message, p.Error) and not may_send(self.our_role, self.state, message):
            raise p.ProtocolError(
                "local_protocol_error",
                f"a {self.our_role.value} may not send {type(message).__name__} "
                f"in state {self.state.name}",
            )
        self._advance(message)

    def receive(self, message: p.Message) -> None:
        """Record a frame the peer sent; ProtocolError if the table forbids it."""
        if not may_send(self.their_role, self.state, message):
            code, text = REFUSALS[self.their_role, self.state]
            raise p.ProtocolError(code, text.format(name=type(message).__name__, message=message))
        self._advance(message)

    def _advance(self, message: p.Message) -> None:
        self.state = TRANSITIONS.get((type(message), self.state), self.state)
