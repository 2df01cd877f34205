"""The thread behind a ledger reader: it blocks in the client Reader's ``read_next`` and
posts what it receives to the loop, and answers "has the broker more?" probes between two
reads (package docstring)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from typing import Any

import pulsar  # type: ignore[import-untyped]

from log.pulsar.client import _ThreadInbox, logger

#: How long the reader thread blocks in one ``read_next``: the latency of a "has the broker
#: more?" check (done on that thread between reads, so it never races a delivery).
_POLL_MS = 10

_Probe = asyncio.Future[bool | None]


class ReaderThread:
    """One reader thread per client Reader (a new one per re-creation), and the loop side
    of what they post.

    The client's Reader has no callback API, and an abandoned async receive would lose its
    message. Answering probes on the same thread means an answer of "no" comes after every
    message received before it was posted. ``on_message(data, message_id)`` and
    ``on_error(exc)`` run on the loop for the current generation only; ``on_batch()`` after
    each batch of posted items.
    """

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        ledger_id: int,
        *,
        on_message: Callable[[bytes, Any], None],
        on_error: Callable[[BaseException], None],
        on_batch: Callable[[], None],
    ) -> None:
        self._loop = loop
        self._ledger_id = ledger_id
        self._on_message = on_message
        self._on_error = on_error
        self._on_batch = on_batch
        # Bumped on every re-creation: what an older reader thread posts is ignored.
        self.generation = 0
        self._closed = False
        #: Set while the reader's buffer is over its budget: the thread stops reading.
        self.paused = False
        self._wake = threading.Event()
        self._probes: list[_Probe] = []  # loop-side, guarded by _probe_lock
        self._probe_lock = threading.Lock()
        # Messages of the current reader handled, and how many when the last probe answered:
        # more since then means the broker's "more" already arrived (no stall).
        self._handled_count = 0
        self._handled_at_probe = 0
        self._inbox = _ThreadInbox(loop, self._on_items)

    def new_generation(self) -> int:
        """Ignore what earlier threads post from now on; the new generation."""
        self.generation += 1
        return self.generation

    def start(self, reader: Any, generation: int) -> None:
        thread = threading.Thread(
            target=self._run,
            args=(reader, generation),
            name=f"ledger-{self._ledger_id}-reader",
            daemon=True,
        )
        thread.start()

    def resume(self) -> None:
        self.paused = False
        self._wake.set()

    def close(self) -> None:
        self._closed = True
        self.generation += 1
        self._wake.set()
        self.answer_probes(None)

    def progressed_since_probe(self) -> bool:
        """Messages arrived since the last probe was answered."""
        return self._handled_count > self._handled_at_probe

    async def ask(self, timeout_s: float) -> bool | None:
        """Whether the broker holds messages not received yet (None: unknown), answered by
        the current thread after it posted everything it received before."""
        probe: _Probe = self._loop.create_future()
        with self._probe_lock:
            self._probes.append(probe)
        self._wake.set()
        try:
            async with asyncio.timeout(timeout_s):
                return await probe
        except TimeoutError:
            return None

    def answer_probes(self, answer: bool | None) -> None:
        """Answer the waiting probes now (their reader thread is gone or going)."""
        with self._probe_lock:
            probes, self._probes = self._probes, []
        for probe in probes:
            if not probe.done():
                probe.set_result(answer)

    # -- the reader thread --------------------------------------------------------------------

    def _run(self, reader: Any, generation: int) -> None:
        post = self._inbox.post
        while generation == self.generation:
            with self._probe_lock:
                probes, self._probes = self._probes, []
            if probes:
                answer: bool | None
                try:
                    answer = bool(reader.has_message_available())
                except Exception as exc:
                    logger.debug("ledger %d: has_message_available: %s", self._ledger_id, exc)
                    answer = None
                post(("probe", generation, probes, answer))
            if self.paused:
                self._wake.wait(0.1)
                self._wake.clear()
                continue
            try:
                message = reader.read_next(_POLL_MS)
            except pulsar.Timeout:
                continue
            except Exception as exc:
                post(("error", generation, exc, None))
                return
            post(("message", generation, message.data(), message.message_id()))

    # -- on the loop ---------------------------------------------------------------------------

    def _on_items(self, items: list[tuple[str, int, Any, Any]]) -> None:
        for kind, generation, first, second in items:
            if kind == "probe":
                current = generation == self.generation and not self._closed
                self._handled_at_probe = self._handled_count
                for probe in first:
                    if not probe.done():
                        probe.set_result(second if current else None)
            elif generation != self.generation or self._closed:
                continue
            elif kind == "error":
                self._on_error(first)
                self.answer_probes(None)
            else:
                self._handled_count += 1
                self._on_message(first, second)
        self._on_batch()
