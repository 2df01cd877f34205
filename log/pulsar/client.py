"""The Pulsar client: its creation, its loggers, its errors as ledger errors, results
handed from its threads to the event loop, and what a ledger's writer and readers use of
their store (:class:`LedgerHandleStore`)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import threading
from collections.abc import Callable
from typing import Any, Protocol, TypeVar

import pulsar  # type: ignore[import-untyped]

from log.api import (
    LedgerError,
    LedgerFencedError,
    LedgerReader,
    LedgerWriter,
    NoSuchLedgerError,
)
from log.pulsar.config import PulsarConfig

_T = TypeVar("_T")

logger = logging.getLogger("log.pulsar")
#: The Pulsar C++ client logs through this logger. Left at NOTSET, it is set to WARNING:
#: at INFO the client logs every connection, producer and reader it creates.
CLIENT_LOGGER = logging.getLogger("log.pulsar.client")


class LedgerHandleStore(Protocol):
    """What a ledger's writer and readers use of the store that made them
    (:class:`~log.pulsar.store.PulsarLedgerStore`): its settings, client and helpers."""

    @property
    def config(self) -> PulsarConfig: ...

    @property
    def client(self) -> Any: ...

    async def blocking(
        self, what: str, func: Callable[..., _T], *args: Any, **kwargs: Any
    ) -> _T: ...

    async def close_quietly(self, handle: Any, what: str) -> None: ...

    async def send_and_wait(self, producer: Any, payload: bytes, what: str) -> None: ...

    def forget(self, handle: LedgerWriter | LedgerReader) -> None: ...


class PulsarPolicyError(LedgerError):
    """The namespace's policies are not what the backend needs and could not be applied."""


def _error_for(exc: BaseException, what: str) -> LedgerError:
    """A ledger error for a Pulsar client exception."""
    if isinstance(exc, LedgerError):
        return exc
    if isinstance(exc, pulsar.ProducerFenced):
        return LedgerFencedError(f"{what}: the producer was fenced (the ledger was recovered)")
    if isinstance(exc, pulsar.TopicNotFound):
        return NoSuchLedgerError(f"{what}: topic not found")
    return LedgerError(f"{what}: {type(exc).__name__}: {exc}")


def _error_for_result(result: Any, what: str) -> LedgerError:
    if result == pulsar.Result.ProducerFenced:
        return LedgerFencedError(f"{what}: the producer was fenced (the ledger was recovered)")
    if result == pulsar.Result.TopicNotFound:
        return NoSuchLedgerError(f"{what}: topic not found")
    return LedgerError(f"{what}: Pulsar error {result}")


def _call_soon_threadsafe(loop: asyncio.AbstractEventLoop, callback: Callable[[], None]) -> None:
    """From a client thread. Never raises: an exception escaping a Pulsar callback kills the
    process, and a closed loop only means that nobody waits any more."""
    with contextlib.suppress(RuntimeError):
        loop.call_soon_threadsafe(callback)


class _ThreadInbox:
    """Items posted by client threads, drained on the loop in batches (one wakeup per batch)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, drain: Callable[[list[Any]], None]) -> None:
        self._loop = loop
        self._drain = drain
        self._lock = threading.Lock()
        self._items: list[Any] = []
        self._scheduled = False

    def post(self, item: Any) -> None:  # any thread
        try:
            with self._lock:
                self._items.append(item)
                if self._scheduled:
                    return
                self._scheduled = True
            _call_soon_threadsafe(self._loop, self.drain_now)
        except Exception:
            # Escaping a Pulsar callback, it would terminate the process.
            logger.exception("cannot hand a Pulsar client result to the event loop")

    def drain_now(self) -> None:  # on the loop
        with self._lock:
            items, self._items = self._items, []
            self._scheduled = False
        if items:
            self._drain(items)


def _make_client(config: PulsarConfig) -> Any:
    if CLIENT_LOGGER.level == logging.NOTSET:
        CLIENT_LOGGER.setLevel(logging.WARNING)
    options: dict[str, Any] = {
        "operation_timeout_seconds": max(1, math.ceil(config.operation_timeout_s)),
        "connection_timeout_ms": max(1000, int(config.operation_timeout_s * 1000)),
        "logger": CLIENT_LOGGER,
        "tls_allow_insecure_connection": config.tls_allow_insecure_connection,
        "tls_validate_hostname": config.tls_validate_hostname,
    }
    if config.auth_token:
        options["authentication"] = pulsar.AuthenticationToken(config.auth_token)
    if config.tls_trust_certs_file:
        options["tls_trust_certs_file_path"] = config.tls_trust_certs_file
    if config.tls_certificate_file:
        options["tls_certificate_file_path"] = config.tls_certificate_file
    if config.tls_private_key_file:
        options["tls_private_key_file_path"] = config.tls_private_key_file
    options.update(config.extra_client_options)
    return pulsar.Client(config.service_url, **options)
