"""The ledger store: ledgers as topics, recovery, deletion and listing (package docstring);
the admin REST API is :class:`~log.pulsar.admin.PulsarAdmin`."""

from __future__ import annotations

import asyncio
import functools
import re
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import httpx
import pulsar  # type: ignore[import-untyped]

from log.api import (
    LedgerError,
    LedgerFencedError,
    LedgerReader,
    LedgerStore,
    LedgerWriter,
    NoSuchLedgerError,
)
from log.pulsar.admin import PulsarAdmin
from log.pulsar.client import (
    _call_soon_threadsafe,
    _error_for,
    _error_for_result,
    _make_client,
    logger,
)
from log.pulsar.config import _COMPRESSION, LedgerCatalog, PulsarConfig
from log.pulsar.reader import PulsarLedgerReader
from log.pulsar.wire import Kind, encode_message
from log.pulsar.writer import PulsarLedgerWriter

_T = TypeVar("_T")
# What a Pulsar topic name may not hold (a checker's name is made safe with it).
_TOPIC_UNSAFE = re.compile(r"[^A-Za-z0-9_.=-]")


class PulsarLedgerStore(LedgerStore):
    """Ledgers as Pulsar topics; see the :mod:`log.pulsar` docstring.

    ``ledger_ids`` allocates ids (never repeating, increasing); when it also implements
    :class:`LedgerCatalog` (the ZooKeeper allocator does) it is the catalog too, unless
    ``catalog`` names another one.
    """

    can_fence = False

    def __init__(
        self,
        config: PulsarConfig,
        ledger_ids: Callable[[], Awaitable[int]],
        *,
        catalog: LedgerCatalog | None = None,
        admin_transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        super().__init__()
        self.config = config
        self.can_fence = config.fencing
        self._ledger_ids = ledger_ids
        if catalog is None and isinstance(ledger_ids, LedgerCatalog):
            catalog = ledger_ids
        self._catalog = catalog
        self._admin = PulsarAdmin(config, admin_transport)
        self.client = _make_client(config)
        self._created: set[int] = set()  # created by this store and not deleted
        self._deleted: set[int] = set()
        self._ledger_writers: dict[int, PulsarLedgerWriter] = {}
        self._ledger_readers: dict[int, set[PulsarLedgerReader]] = {}
        self._highest_id = 0

    # -- helpers for writers and readers --------------------------------------------------

    async def blocking(self, what: str, func: Callable[..., _T], *args: Any, **kwargs: Any) -> _T:
        """Run a blocking client call in a thread, bounded by the operation timeout."""
        timeout_s = self.config.operation_timeout_s + 1
        try:
            async with asyncio.timeout(timeout_s):
                return await asyncio.to_thread(functools.partial(func, *args, **kwargs))
        except TimeoutError:
            raise LedgerError(f"cannot {what}: no answer from Pulsar in {timeout_s:g} s") from None
        except Exception as exc:
            raise _error_for(exc, f"cannot {what}") from exc

    async def close_quietly(self, handle: Any, what: str) -> None:
        """Close a producer or reader; failures only logged (nothing depends on them)."""
        try:
            await self.blocking(f"close the {what}", handle.close)
        except LedgerError as exc:
            logger.info("%s", exc)

    async def send_and_wait(self, producer: Any, payload: bytes, what: str) -> None:
        """Send one message and wait for its durable acknowledgement (bounded)."""
        loop = asyncio.get_running_loop()
        done: asyncio.Future[Any] = loop.create_future()

        def settle(result: Any) -> None:
            if not done.done():
                done.set_result(result)

        def sent(result: Any, message_id: Any) -> None:  # on a client thread
            _call_soon_threadsafe(loop, lambda: settle(result))

        try:
            producer.send_async(payload, sent)
            async with asyncio.timeout(self.config.send_timeout_ms / 1000 + 1):
                result = await done
        except TimeoutError:
            raise LedgerError(f"{what}: not acknowledged in time") from None
        except Exception as exc:
            raise _error_for(exc, what) from exc
        if result != pulsar.Result.Ok:
            raise _error_for_result(result, what)

    def forget(self, handle: LedgerWriter | LedgerReader) -> None:
        super().forget(handle)
        if isinstance(handle, PulsarLedgerWriter):
            if self._ledger_writers.get(handle.ledger_id) is handle:
                del self._ledger_writers[handle.ledger_id]
        elif isinstance(handle, PulsarLedgerReader):
            readers = self._ledger_readers.get(handle.ledger_id)
            if readers is not None:
                readers.discard(handle)
                if not readers:
                    del self._ledger_readers[handle.ledger_id]

    async def _create_producer(self, ledger_id: int) -> Any:
        config = self.config
        access_mode = (
            pulsar.ProducerAccessMode.ExclusiveWithFencing
            if config.fencing
            else pulsar.ProducerAccessMode.Shared
        )
        return await self.blocking(
            f"create a producer for ledger {ledger_id}",
            self.client.create_producer,
            config.topic(ledger_id),
            batching_enabled=config.batching,
            batching_max_publish_delay_ms=config.batching_max_publish_delay_ms,
            send_timeout_millis=config.send_timeout_ms,
            max_pending_messages=config.max_pending_sends,
            block_if_queue_full=False,
            compression_type=_COMPRESSION[config.compression],
            access_mode=access_mode,
        )

    async def _write_marker(self, ledger_id: int, kind: Kind) -> None:
        """SEAL or DELETED, through a producer of its own. With fencing, creating it fences
        the ledger's writer first (ExclusiveWithFencing)."""
        producer = await self._create_producer(ledger_id)
        try:
            await self.send_and_wait(
                producer, encode_message(kind, -1, -1), f"ledger {ledger_id}: {kind.name} marker"
            )
        finally:
            await self.close_quietly(producer, f"{kind.name} producer of ledger {ledger_id}")

    async def verify_fencing(self, checker: str) -> bool:
        """Whether the broker enforces ``ExclusiveWithFencing``, tried on a scratch topic of
        ``checker``'s own (a broker passes its id).

        Raises :class:`LedgerError` when ``PulsarConfig.fencing`` is set and the broker does
        not enforce it (pulsar-lite): ``can_fence`` would be a lie there. A start-up check.
        One topic per checker: brokers of a cluster start at once, and two checks on one topic
        fence each other's producers, so that one of them could read "not enforced".
        """
        self._check_open()
        topic = f"persistent://{self.config.tenant}/{self.config.namespace}/"
        topic += f"{self.config.cluster}-fencing-check-{_TOPIC_UNSAFE.sub('_', checker)}"
        fencing_mode = pulsar.ProducerAccessMode.ExclusiveWithFencing
        create = functools.partial(
            self.client.create_producer, topic, batching_enabled=False, access_mode=fencing_mode
        )
        try:
            first = await self.blocking("create a fencing-check producer", create)
        except LedgerError as exc:
            # The first contact: without a token (or with one Pulsar rejects) the client
            # only times out; with an untrusted certificate it fails to connect.
            raise LedgerError(
                f"{exc} (check the service URL {self.config.service_url}, the auth token "
                "(--pulsar-token) and, with pulsar+ssl://, the CA (--pulsar-tls-ca-file))"
            ) from exc
        try:
            second = await self.blocking("create a second fencing-check producer", create)
            await self.close_quietly(second, "fencing-check producer")
            try:
                await self.send_and_wait(first, b"fenced?", "fencing check")
                enforced = False
            except LedgerFencedError:
                enforced = True
        finally:
            await self.close_quietly(first, "fencing-check producer")
        if self.config.fencing and not enforced:
            raise LedgerError(
                f"PulsarConfig.fencing is set but {self.config.service_url} does not enforce "
                "ExclusiveWithFencing (pulsar-lite?): set fencing=False there"
            )
        return enforced

    # -- the LedgerStore interface ---------------------------------------------------------

    async def create_ledger(self) -> LedgerWriter:
        self._check_open()
        ledger_id = await self._ledger_ids()
        if ledger_id <= self._highest_id:
            raise LedgerError(
                f"the ledger id allocator returned {ledger_id} after {self._highest_id}"
            )
        self._highest_id = ledger_id
        try:
            producer = await self._create_producer(ledger_id)
            try:
                await self.send_and_wait(
                    producer,
                    encode_message(Kind.CREATED, ledger_id, -1),
                    f"ledger {ledger_id}: CREATED marker",
                )
            except BaseException:
                await self.close_quietly(producer, f"producer of ledger {ledger_id}")
                raise
        except BaseException:
            if self._catalog is not None:
                try:
                    await self._catalog.remove(ledger_id)
                except LedgerError as exc:
                    logger.warning("ledger %d: could not release its id: %s", ledger_id, exc)
            raise
        writer = PulsarLedgerWriter(self, ledger_id, producer)
        self._created.add(ledger_id)
        self._ledger_writers[ledger_id] = writer
        self._writers.add(writer)
        return writer

    async def open_ledger(self, ledger_id: int, *, recovery: bool) -> LedgerReader:
        self._check_open()
        if ledger_id in self._deleted or ledger_id < 1:
            raise NoSuchLedgerError(f"no ledger {ledger_id}")
        if self._catalog is not None and not await self._catalog.exists(ledger_id):
            raise NoSuchLedgerError(f"no ledger {ledger_id} (not in the catalog)")
        reader = PulsarLedgerReader(self, ledger_id)
        self._readers.add(reader)
        self._ledger_readers.setdefault(ledger_id, set()).add(reader)
        try:
            await reader.start()
            # With a catalog the ledger exists: wait as long as any operation for its first
            # message; without one, an unknown ledger's empty topic is told by a timeout.
            known = self._catalog is not None or ledger_id in self._created
            wait_s = self.config.operation_timeout_s if known else self.config.open_wait_s
            if not await reader.wait_for_first_message(wait_s, exists=known):
                raise NoSuchLedgerError(
                    f"no ledger {ledger_id}: topic {self.config.topic(ledger_id)} has no "
                    f"CREATED message (waited {wait_s:g} s)"
                )
            if recovery:
                await self._recover(reader)
        except BaseException:
            await reader.close()
            raise
        return reader

    async def _recover(self, reader: PulsarLedgerReader) -> None:
        ledger_id = reader.ledger_id
        writer = self._ledger_writers.get(ledger_id)
        if writer is not None:
            writer.fence_locally()
        # The first SEAL in the topic ends the ledger (ours, or an earlier one).
        await self._write_marker(ledger_id, Kind.SEAL)
        await reader.settle(
            lambda: reader.sealed_last_entry_id is not None, self.config.operation_timeout_s
        )
        last = reader.sealed_last_entry_id
        if last is None:
            raise LedgerError(f"ledger {ledger_id}: recovery did not find the SEAL it wrote")
        reader.mark_recovered(last)
        logger.info("ledger %d recovered: last entry %d", ledger_id, last)

    async def delete_ledger(self, ledger_id: int) -> None:
        self._check_open()
        writer = self._ledger_writers.get(ledger_id)
        if writer is not None:
            writer.on_deleted()
        known = ledger_id in self._created or ledger_id in self._ledger_readers
        if self._catalog is not None and not known:
            known = await self._catalog.exists(ledger_id)
        if known and ledger_id not in self._deleted:
            # In the topic, so readers in every process learn it (pulsar-lite keeps the topic).
            await self._write_marker(ledger_id, Kind.DELETED)
        if self._catalog is not None:
            await self._catalog.remove(ledger_id)
        self._created.discard(ledger_id)
        self._deleted.add(ledger_id)
        for reader in list(self._ledger_readers.get(ledger_id, ())):
            reader.mark_deleted()
        if self.config.admin_url is not None:
            await self._admin.delete_topic(ledger_id)

    async def list_ledgers(self) -> list[int]:
        self._check_open()
        if self._catalog is not None:
            return await self._catalog.list_ids()
        ids = set(self._created)
        if self.config.admin_url is not None:
            ids.update(await self._admin.list_ledgers())
        return sorted(ids - self._deleted)

    async def close(self) -> None:
        if self._closed:
            return
        await super().close()
        await self.close_quietly(self.client, "Pulsar client")
        await self._admin.close()

    async def ensure_namespace_retention(self) -> None:
        """Check the namespace's policies and apply what the backend needs (package doc);
        see :meth:`PulsarAdmin.ensure_namespace_retention`."""
        await self._admin.ensure_namespace_retention()
