"""The ``pulsar`` ledger backend (docs/DESIGN.md §3): one persistent Pulsar topic per ledger.

Brokers on several hosts share no disk, only ZooKeeper and the Pulsar cluster (Apache Pulsar
>= 2.11, or pulsar-lite for tests and the local dev cluster), as Majordodo does with
BookKeeper.

Topics and messages
-------------------
Ledger ``N`` is the topic ``persistent://<tenant>/<namespace>/<cluster>-ledger-<N:012d>``.
Ids come from an allocator shared by every broker (``ledger_ids``; in a cluster the
:class:`log.zk_list.ZooKeeperLedgerIdAllocator`) and must never repeat.

Every message payload starts with a small binary header, ``HEADER`` (big-endian
``[u8 magic][u8 kind][i64 entry id][i64 last add confirmed]``). The header is in the payload
rather than in message properties because it travels with the entries whatever reads them
(one ``struct`` unpack, no string map per message), because one message carries several
entries (group commit, below), and so readers never depend on MessageId arithmetic to
number entries: the writer numbers them.

Kinds of messages, in a topic's order:

- ``CREATED`` (entry id field = the ledger id): written durably by ``create_ledger`` before
  the writer is handed out. Every ledger's topic is therefore non-empty, which lets a reader
  tell an existing ledger from an unknown one and makes ``has_message_available`` safe (it
  fails on an empty pulsar-lite topic).
- ``ENTRIES``: consecutive entries from the header's entry id on, each framed as
  ``[u32 length][bytes]``, all with the header's LAC.
- ``SEAL``: the end of the ledger, written by recovery (``open_ledger(recovery=True)``) and by
  a writer's clean ``close()``. **The first SEAL in the topic ends the ledger for every
  reader**: the ledger is the run of consecutive entry ids ``0..k`` before it. A writer that
  cannot be fenced (pulsar-lite) may append after a SEAL and even get those appends
  acknowledged, but no reader ever returns them, so the recovered length is the same for
  everyone, and recovery finds the end deterministically (it reads up to its own SEAL)
  instead of guessing it from a receive timeout.
- ``DELETED``: written by ``delete_ledger``; readers that reach it fail with
  :class:`~log.api.NoSuchLedgerError` (pulsar-lite cannot delete topics).

Readers accept an entry only when its id is exactly the next one expected: duplicates
(producer resends after a reconnect; pulsar-lite redeliveries) are dropped. An id past the
next one (a gap), or a MessageId that does not increase, makes the reader start over from
the last message it accepted, once per position; if the gap is still there, it is real (the
writer failed at that entry and never acknowledged anything after it) and the entries after
it are dropped. All readers apply the same rule to the same stored order, so they agree.

Writing
-------
Group commit, as in the file backend: ``append`` only queues; on the next event-loop
iteration everything queued goes out in as few messages as ``max_message_bytes`` allows
(while at most ``max_pending_sends`` messages are unacknowledged; more appends wait), so
Pulsar's per-message cost is shared and pulsar-lite's broken producer batching is not
needed. The producer itself is non-batched by default (``PulsarConfig.batching``) and sends
asynchronously; ``append`` returns a future resolved when the broker acknowledges the
message carrying the entry as durable, in call order, whatever order the client's
callbacks come in. The
client's callbacks run on its own threads; results are handed to the event loop with
``call_soon_threadsafe``. A failed send fails that append and every later one (the writer is
dead after that: :class:`~log.api.LedgerFencedError` for ``ProducerFenced``, else
:class:`~log.api.LedgerError`).

Fencing
-------
With ``PulsarConfig.fencing`` (real Pulsar >= 2.11) the writer's producer uses the
``ExclusiveWithFencing`` access mode, and recovery first takes the topic over with a
producer of the same mode, which fences the old writer (its sends fail with
``ProducerFenced``), then writes the SEAL and reads up to it. pulsar-lite ignores access
modes, so with it ``fencing`` must be False and ``can_fence`` is False: a deposed writer in
another process keeps getting acknowledgements, for entries no reader will ever return.
The replicated log does not rely on that: the leader confirms in ZooKeeper that it still
leads before it answers (docs/DESIGN.md §4), and entries carry as LAC only what it confirmed
(``LedgerWriter.confirm``, see broker/replication/history.py and leader.py). A writer of
the same store is fenced locally by recovery in any case.

Deletion and listing
--------------------
``delete_ledger`` writes the ``DELETED`` marker (when the ledger is known to exist), removes
the id from the catalog (below) and, with ``PulsarConfig.admin_url``, deletes the topic
through the admin REST API (``DELETE /admin/v2/persistent/{tenant}/{namespace}/{topic}``).
A failure there is logged and ignored: pulsar-lite has no admin API, so its topics stay on
disk (logically deleted by the marker) until the whole pulsar-lite data directory goes.

Which ledgers exist is answered by a *catalog*: the ``ledger_ids`` allocator when it also
has ``exists``, ``list_ids`` and ``remove`` (:class:`LedgerCatalog`; the ZooKeeper allocator
has them), for every broker and across restarts. Without one, ``list_ledgers`` knows the
ledgers this store created and did not delete, plus the topics the admin API lists, and an
unknown ledger is recognised by its topic having no ``CREATED`` message within
``PulsarConfig.open_wait_s``.

Namespace policy
----------------
The namespace must keep every message until Steward deletes the topic: **infinite retention**
(``retentionTimeInMinutes=-1``, ``retentionSizeInMB=-1``; readers hold no durable
subscription, so without retention acknowledged-by-nobody messages would be trimmed) and
**no inactive-topic deletion** (``deleteWhileInactive=false``; a closed ledger has no
producer and usually no reader for days). :meth:`PulsarLedgerStore.ensure_namespace_retention`
checks and applies both at start-up through the admin API:

    pulsar-admin namespaces set-retention TENANT/NAMESPACE --time -1 --size -1
    pulsar-admin namespaces set-inactive-topic-policies TENANT/NAMESPACE \\
        --disable-delete-while-inactive -t 1h -m delete_when_no_subscriptions

pulsar-lite
-----------
What pulsar-lite 0.2.0 gets wrong and how this package copes (checked on this machine): no
producer access modes (``fencing=False``); readers with ``receiver_queue_size`` > 1 or
batched producers see duplicates, out-of-order deliveries and stalls
(``reader_queue_size=1``, ``batching=False``, the reader's next-id rule, and a reader that
starts over when it stalls); ``seek`` is broken
(never used: a reader is re-created from the last MessageId it accepted instead, inclusive,
because a reader started exclusive of a MessageId receives nothing from pulsar-lite);
``has_message_available`` raises on an empty topic, and on a reader started inclusive that
has received nothing yet the client seeks first, which hangs (so it is only asked once the
current reader received a message); no admin API (see above); each Reader leaves a
subscription behind (readers are re-created only on a stall, a gap or a rewind).
:meth:`PulsarConfig.for_pulsar_lite` and :meth:`PulsarConfig.for_apache_pulsar` give the
settings for each.
"""

from __future__ import annotations

from log.pulsar.client import CLIENT_LOGGER, PulsarPolicyError, logger
from log.pulsar.config import LedgerCatalog, PulsarConfig
from log.pulsar.reader import READER_BUFFER_BYTES, PulsarLedgerReader
from log.pulsar.store import PulsarLedgerStore
from log.pulsar.wire import (
    ENTRY_LENGTH,
    HEADER,
    MAGIC,
    MAX_ENTRY_SIZE_BYTES,
    Kind,
    decode_entries,
    encode_entries,
    encode_message,
)
from log.pulsar.writer import PulsarLedgerWriter

__all__ = [
    "CLIENT_LOGGER",
    "ENTRY_LENGTH",
    "HEADER",
    "MAGIC",
    "MAX_ENTRY_SIZE_BYTES",
    "READER_BUFFER_BYTES",
    "Kind",
    "LedgerCatalog",
    "PulsarConfig",
    "PulsarLedgerReader",
    "PulsarLedgerStore",
    "PulsarLedgerWriter",
    "PulsarPolicyError",
    "decode_entries",
    "encode_entries",
    "encode_message",
    "logger",
]
