"""A worker connection's handshake on the leader: Hello in, through the log, Welcome out.

The Hello is read under a size cap and a timeout, its token checked (the shared worker
token, or a worker credential issued through the API and its tenant scope), and the
(re)connection with the reconciliation of the tasks the worker still runs is logged as a
RegisterWorker entry; only then does the worker get its Welcome (docs/DESIGN.md §8).
"""

from __future__ import annotations

import asyncio
import hmac
import logging
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING

from broker.core import NAME_RE, TASK_TYPE_RE, ErrorCode, Rejected, WorkerReconciled
from broker.core import entries as e
from broker.replication.node import Node
from broker.security.auth import Role as CallerRole
from broker.security.auth import hash_token
from broker.workers.liveness import Liveness
from broker.workers.session import Session
from wire import worker_protocol as p
from wire.conversation import Conversation

if TYPE_CHECKING:
    from broker.workers.link_config import WorkerLinkConfig

# One logger for all of the worker link's parts (operators and tests filter on this name).
logger = logging.getLogger("broker.workers.worker_link")


class Handshake:
    """Turns a new connection into a registered :class:`Session` (or a ProtocolError)."""

    def __init__(
        self,
        node: Node,
        config: WorkerLinkConfig,
        sessions: dict[str, Session],
        liveness: Liveness,
        on_registered: Callable[[], None],
    ) -> None:
        self.node = node
        self.config = config
        self.sessions = sessions  # the link's: a registered session is added here
        self.liveness = liveness
        self.on_registered = on_registered
        self.unauthenticated = 0  # connections whose hello is not accepted yet
        # Connections waiting for a handshake slot, first come first served; a freed slot
        # passes straight to the first (so a newcomer cannot take it in between).
        self._slot_waiters: deque[asyncio.Future[None]] = deque()
        # Worker ids whose Hello is being logged: a concurrent Hello for one is refused.
        self._registering: set[str] = set()

    @property
    def waiting_for_slot(self) -> int:
        """Connections waiting for a handshake slot."""
        return len(self._slot_waiters)

    async def acquire(self, wait_s: float) -> bool:
        """Take a handshake slot (``max_unauthenticated`` at most), waiting up to
        ``wait_s`` for one: a reconnect storm (every worker of a failed leader at once)
        queues instead of being refused and retrying. False: none came in time."""
        if self.unauthenticated < self.config.max_unauthenticated and not self._slot_waiters:
            self.unauthenticated += 1
            return True
        waiter = asyncio.get_running_loop().create_future()
        self._slot_waiters.append(waiter)
        try:
            await asyncio.wait_for(asyncio.shield(waiter), wait_s)
        except (TimeoutError, asyncio.CancelledError) as exc:  # none in time, or stopping
            if waiter.done():
                self.release()  # handed over just as the wait ended: pass it on
            else:
                waiter.cancel()
                self._slot_waiters.remove(waiter)
            if isinstance(exc, TimeoutError):
                return False
            raise
        return True

    def release(self) -> None:
        """A handshake ended (welcomed or not): its slot goes to the first waiter."""
        while self._slot_waiters:
            waiter = self._slot_waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return
        self.unauthenticated -= 1

    async def accept(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        peer: object,
        decoder: p.FrameDecoder,
        conversation: Conversation,
    ) -> Session:
        """Read the Hello (TimeoutError after ``hello_timeout_s``) and register it; the
        caller holds a slot (:meth:`acquire`), released here."""
        try:
            hello = await asyncio.wait_for(
                self._read_hello(reader, decoder, conversation),
                timeout=self.config.hello_timeout_s,
            )
            return await self._register(hello, writer, peer, conversation)
        finally:
            self.release()

    async def _read_hello(
        self, reader: asyncio.StreamReader, decoder: p.FrameDecoder, conversation: Conversation
    ) -> p.Hello:
        while True:
            data = await reader.read(65536)
            if not data:
                raise ConnectionError("closed before hello")
            try:
                messages = decoder.feed(data)
            except p.ProtocolError as exc:
                if exc.code == "frame_too_large":
                    raise p.ProtocolError("frame_too_large", f"{exc.message} of a hello") from None
                raise
            if messages:
                # The first must be a Hello; nothing may follow it before the Welcome.
                for message in messages:
                    conversation.receive(message)
                hello = messages[0]
                assert isinstance(hello, p.Hello)
                return hello

    def _credential(self, hello: p.Hello) -> tuple[str | None, tuple[str, ...] | None]:
        """(credential id, tenants it may serve) of a Hello's token; ProtocolError when it
        names none. Credential None is the shared token (or authentication off); tenants
        None: every tenant."""
        expected = self.config.token
        presented = (hello.token or "").encode("utf-8", "surrogatepass")
        # constant time: the comparison must not leak how much of a guess was right
        if expected is not None and hmac.compare_digest(presented, expected.encode()):
            return None, None
        if self.config.worker_credentials and hello.token:
            state = self.node.state
            token_id = state.token_ids_by_hash.get(hash_token(hello.token))
            token = state.tokens.get(token_id) if token_id is not None else None
            if token is not None and token.role == CallerRole.WORKER.value:
                return token.id, tuple(token.tenants) or None
        if expected is None and not self.config.worker_credentials:
            return None, None  # authentication off
        raise p.ProtocolError("unauthorized", "wrong or missing worker token")

    async def _register(
        self,
        hello: p.Hello,
        writer: asyncio.StreamWriter,
        peer: object,
        conversation: Conversation,
    ) -> Session:
        credential, scope = self._credential(hello)
        if not NAME_RE.match(hello.worker_id):
            raise p.ProtocolError("bad_handshake", "worker_id must be a valid name")
        if any(n < 0 for n in hello.task_types.values()) or any(
            not (a >= 0) for a in hello.resources.values()
        ):
            raise p.ProtocolError("bad_handshake", "capacities and resources must be >= 0")
        if hello.task_names is not None and len(hello.task_names) > p.MAX_HELLO_TASK_NAMES:
            raise p.ProtocolError(
                "bad_handshake",
                f"task_names lists {len(hello.task_names)} types, over the limit of "
                f"{p.MAX_HELLO_TASK_NAMES}: a worker with more lists none",
            )
        tenants = tuple(hello.tenants)
        if scope is not None:
            # A scoped credential serves its tenants only: "all" narrows to them, anything
            # beyond them is refused (a worker must not silently serve less than it asked).
            outside = sorted(set(tenants) - set(scope))
            if outside:
                raise p.ProtocolError(
                    "forbidden",
                    f"this worker credential may serve tenants {', '.join(scope)} only, "
                    f"not {', '.join(outside)}",
                )
            tenants = tenants or scope
        worker_id = hello.worker_id
        if self.liveness.live_session(worker_id) is not None or worker_id in self._registering:
            # Taking over a live connection would hand its tasks to whoever asked.
            raise p.ProtocolError(
                "worker_id_in_use",
                f"worker {worker_id} is connected on another live connection; "
                "retry once it is gone, or use another --worker-id",
            )
        self._registering.add(worker_id)
        try:
            return await self._register_checked(
                hello, writer, credential, tenants, peer, conversation
            )
        finally:
            self._registering.discard(worker_id)

    async def _give_back_unreceived(
        self, hello: p.Hello, credential: str | None, listed: tuple[e.TaskAttempt, ...]
    ) -> None:
        """Attempts assigned to this very process that it does not hold never reached it
        (the Assign was lost with a connection or a leader): they are given back, not
        counted against max_attempts, before the RegisterWorker would count them as lost
        (docs/DESIGN.md §6, "Lost assignments"). Decided on the leader's state: an
        assignment applied after this check meets the RegisterWorker's rule, which counts it."""
        lost = self.node.state.unreceived_attempts(
            hello.worker_id, hello.process_id, credential, listed
        )
        if not lost:
            return
        error = (
            f"given back: the assignment never reached worker {hello.worker_id} "
            f"(its process {hello.process_id} came back without it)"
        )
        outcomes = tuple(
            e.TaskOutcome(
                task_id=ta.task_id,
                worker_id=hello.worker_id,
                attempt=ta.attempt,
                ok=False,
                error=error,
                released=True,
            )
            for ta in lost
        )
        await self.node.propose(lambda stamp: e.finish_tasks(stamp.now_ms, outcomes))
        logger.info(
            "worker %s (process %s) came back without %d assigned tasks: given back, "
            "attempts not counted",
            hello.worker_id,
            hello.process_id,
            len(lost),
        )

    async def _register_checked(
        self,
        hello: p.Hello,
        writer: asyncio.StreamWriter,
        credential: str | None,
        tenants: tuple[str, ...],
        peer: object,
        conversation: Conversation,
    ) -> Session:
        previous = self.sessions.pop(hello.worker_id, None)
        if previous is not None:
            # The same worker reconnected before we noticed the old (silent) connection died.
            previous.close()
        # Contact now: until the session is registered below, the heartbeat loop must
        # not judge this worker (connected in the state, no session) by an old contact.
        self.liveness.contact(hello.worker_id)
        address = writer.get_extra_info("peername")
        entry_running = tuple(e.TaskAttempt(r.task_id, r.attempt) for r in hello.running)
        # The names a submit could use (the state machine skips any other too).
        task_names = (
            None
            if hello.task_names is None
            else tuple(n for n in hello.task_names if TASK_TYPE_RE.match(n))
        )
        if hello.lists_unacked:
            await self._give_back_unreceived(hello, credential, entry_running)
        node = self.node
        result = await node.propose(
            lambda stamp: e.RegisterWorker(
                # Attempts it comes back without end as lost, not counted (docs/DESIGN.md
                # §6, "Lost workers").
                v=e.register_version(
                    node.state.registration_loses_attempts(hello.worker_id, entry_running),
                    task_names,
                ),
                time_ms=stamp.now_ms,
                worker_id=hello.worker_id,
                address=f"{address[0]}:{address[1]}" if address else "",
                process_id=hello.process_id,
                resources=dict(hello.resources),
                task_types=dict(hello.task_types),
                tenants=tenants,
                running=entry_running,
                credential=credential,
                task_names=task_names,
            )
        )
        if isinstance(result, Rejected):
            code = "worker_id_in_use" if result.code == ErrorCode.CONFLICT else "bad_handshake"
            raise p.ProtocolError(code, result.message)
        assert isinstance(result, WorkerReconciled)
        keep = {(k.task_id, k.attempt) for k in result.keep}
        session = Session(
            hello.worker_id,
            writer,
            self.config.max_frame_bytes,
            credential,
            peer,
            now=self.liveness.clock(),
            conversation=conversation,
        )
        session.answers_fetch = hello.output
        interval_ms, timeout_ms = self.liveness.timing_ms(welcoming=True)
        session.heartbeat_interval_s = interval_ms / 1000
        session.heartbeat_timeout_s = timeout_ms / 1000
        session.send(
            p.Welcome(
                broker_id=self.node.config.broker_id,
                heartbeat_interval_ms=interval_ms,
                heartbeat_timeout_ms=timeout_ms,
                keep=tuple(p.TaskAttempt(t, a) for t, a in sorted(keep)),
                drop=tuple(r for r in hello.running if (r.task_id, r.attempt) not in keep),
                output=True,
                progress=True,
                tenant_weights={
                    name: tenant.weight
                    for name, tenant in self.node.state.tenants.items()
                    if tenant.weight != 1.0
                },
            )
        )
        self.sessions[hello.worker_id] = session
        self.liveness.contact(hello.worker_id)
        logger.info(
            "worker %s connected (process %s), keeps %d tasks, lost %d",
            hello.worker_id,
            hello.process_id,
            len(keep),
            len(result.lost),
        )
        self.on_registered()
        return session
