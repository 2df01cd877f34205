"""How to reach Pulsar and how to use it (:class:`PulsarConfig`), and the ledger catalog."""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from typing import Any, Protocol, runtime_checkable

import pulsar  # type: ignore[import-untyped]

_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
_COMPRESSION = {
    "none": pulsar.CompressionType.NONE,
    "lz4": pulsar.CompressionType.LZ4,
    "zlib": pulsar.CompressionType.ZLib,
    "zstd": pulsar.CompressionType.ZSTD,
    "snappy": pulsar.CompressionType.SNAPPY,
}


@runtime_checkable
class LedgerCatalog(Protocol):
    """Which ledgers exist, shared by every store on the same Pulsar cluster and namespace."""

    async def exists(self, ledger_id: int) -> bool: ...

    async def list_ids(self) -> list[int]: ...

    async def remove(self, ledger_id: int) -> None: ...


@dataclass(frozen=True, slots=True)
class PulsarConfig:
    """How to reach Pulsar and how to use it. The defaults are safe for pulsar-lite; see
    :meth:`for_apache_pulsar` for a real cluster."""

    service_url: str
    #: ``http(s)://host:8080`` of the admin REST API; None: no topic deletion, no policy check.
    admin_url: str | None = None
    tenant: str = "public"
    namespace: str = "default"
    #: Prefix of the topic names (the Steward cluster's name), so clusters can share a namespace.
    cluster: str = "steward"
    auth_token: str | None = None
    #: CA bundle for ``pulsar+ssl://`` and ``https://`` admin URLs.
    tls_trust_certs_file: str | None = None
    tls_allow_insecure_connection: bool = False
    tls_validate_hostname: bool = True
    #: Client certificate and key, for brokers that require mutual TLS.
    tls_certificate_file: str | None = None
    tls_private_key_file: str | None = None
    #: Producer batching (pulsar-lite readers see duplicates and reorderings with it; on
    #: Apache Pulsar it costs latency for little: :meth:`for_apache_pulsar`).
    batching: bool = False
    batching_max_publish_delay_ms: int = 1
    #: ``none``, ``lz4``, ``zlib``, ``zstd`` or ``snappy``.
    compression: str = "none"
    #: Reader receive queue (pulsar-lite needs 1).
    reader_queue_size: int = 1
    #: Use and rely on ``ExclusiveWithFencing`` producers (real Pulsar >= 2.11 only).
    fencing: bool = False
    send_timeout_ms: int = 30_000
    #: Bound of every client operation (creating producers and readers, closing, lookups).
    operation_timeout_s: float = 30.0
    #: Messages handed to the producer and not acknowledged yet; more appends wait here.
    max_pending_sends: int = 1000
    #: Group commit: the appends of one event-loop iteration (and those waiting for a free
    #: send slot) share messages of up to this many entry bytes.
    max_message_bytes: int = 1024 * 1024
    #: A reader that receives nothing this long although the broker has more starts over.
    reader_stall_s: float = 1.0
    #: Without a catalog: how long an open waits for the CREATED message of a ledger before
    #: calling it unknown.
    open_wait_s: float = 2.0
    extra_client_options: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in ("tenant", "namespace", "cluster"):
            value = getattr(self, name)
            if not _NAME_RE.match(value):
                raise ValueError(f"invalid Pulsar {name} {value!r}")
        if self.compression not in _COMPRESSION:
            raise ValueError(
                f"unknown compression {self.compression!r}; one of {', '.join(_COMPRESSION)}"
            )
        if self.reader_queue_size < 1 or self.max_pending_sends < 1:
            raise ValueError("reader_queue_size and max_pending_sends must be >= 1")

    @classmethod
    def for_pulsar_lite(cls, service_url: str, **overrides: Any) -> PulsarConfig:
        """Settings pulsar-lite 0.2.0 needs: no fencing, no batching, reader queue of 1."""
        return replace(cls(service_url), **overrides)

    @classmethod
    def for_apache_pulsar(
        cls, service_url: str, admin_url: str | None, **overrides: Any
    ) -> PulsarConfig:
        """A real Pulsar cluster (>= 2.11): fencing, LZ4, a reader queue of 100, no producer
        batching. Chosen from measurements on Apache Pulsar 3.0.7 (docs/BENCHMARKS.md, "Apache
        Pulsar: producer batching and reader queues"): producer batching cost about 1.2 ms
        of append latency with 1 and 32 appenders (p50 4.7 vs 3.6 ms) for 8% more throughput
        with 1000, since the writer already packs each event-loop iteration's appends into
        one message (group commit), and the leader answers only once an append is durable.
        A reader queue of 100 catches up 3-4 times faster than 1, as fast as 1000 on a quiet
        machine, and bounds what a reader's client may hold to 100 messages (each at most
        ``max_message_bytes``) where 1000 would allow ten times that. LZ4 cost nothing
        measurable and compresses real entries (msgpack)."""
        measured = cls(
            service_url,
            admin_url=admin_url,
            fencing=True,
            batching=False,
            compression="lz4",
            reader_queue_size=100,
        )
        return replace(measured, **overrides)

    def topic(self, ledger_id: int) -> str:
        return f"persistent://{self.tenant}/{self.namespace}/{self.topic_name(ledger_id)}"

    def topic_name(self, ledger_id: int) -> str:
        return f"{self.cluster}-ledger-{ledger_id:012d}"

    def ledger_id_of(self, topic: str) -> int | None:
        """The ledger id of a topic of this cluster (full or short name), else None."""
        short = topic.rsplit("/", 1)[-1]
        prefix = f"{self.cluster}-ledger-"
        if short.startswith(prefix) and short[len(prefix) :].isdigit():
            return int(short[len(prefix) :])
        return None
