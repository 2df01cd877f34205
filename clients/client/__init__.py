"""Python clients for a Steward broker's HTTP API: sync and asyncio.

    with StewardClient("http://b1:8080,http://b2:8080,http://b3:8080") as steward:
        handle = steward.submit("spark.sql", {"query": "SELECT 1 AS x"}, tenant="acme")
        print(handle.result(timeout=60))          # the task's JSON result
        with steward.transaction(tenant="acme") as txn:
            txn.submit("noop")                    # all run, or none (rolled back on error)

Every error the API answers raises a :class:`StewardError` subclass.

Waiting for many tasks. ``wait_many(tasks, timeout=None)`` (handles or ids) returns their
records by id once all are final, and ``iter_finished(tasks, timeout=None)`` yields each
record as its task becomes final; both listen on one server-sent event stream
(``GET /api/v1/events``, docs/API.md) instead of a long poll per task. A stream that ends
or breaks is opened again, on the next broker if need be, for the tasks not seen yet. At
the timeout they raise :class:`WaitTimeoutError` (a ``TaskTimeoutError``; ``task_ids``:
those not final, ``finished``: the records so far)::

    handles = [steward.submit("render", {"page": n}) for n in range(100)]
    for record in steward.iter_finished(handles, timeout=600):
        print(record["id"], record["state"], record.get("result"))

TLS. ``https://`` URLs are always verified, host name included: against
``ca_file`` (a PEM CA bundle, or an ``ssl.SSLContext``) or else the system trust
store; a certificate that does not verify raises :class:`CertificateVerifyError`
at once (no failover retries).

Failover. Give one broker URL or several (a sequence, or one comma-separated
string). Writes (POST, PUT, DELETE) go to the leader: a follower's ``307
not_leader`` answer is followed to the leader it names, which is remembered for
later calls. On a retryable 503 (no leader yet, taking over, deposed), a
connection error or a timeout, a write is sent again, to the known leader or the
next URL, with backoff, for at most ``failover_timeout_s`` (default 30 s); then
:class:`FailoverTimeoutError`. Reads go to the known leader (so a task just
submitted is found), else to the URLs in turn, each tried once on connection
errors. Other errors (4xx) are raised at once.

A write retried after a lost answer may have been applied the first time:

- ``submit`` / ``submit_many``: safe. Each call sends one idempotency key (128
  random bits, or the caller's ``idempotency_key``) on every try; the broker answers a
  repeated key with the first result (same ids) instead of creating tasks again.
- ``cancel``: safe, cancelling is idempotent (a retry after the cancel was
  applied may answer 409 ``ConflictError``: the task is already cancelled).
- ``set_tenant``, ``upload_code``: safe (same values; artifacts are content-addressed).
- ``begin`` (and ``transaction()``): a retry may open a second transaction; the
  one whose answer was lost stays empty and expires after its TTL.
- ``commit`` / ``rollback``: a retry after the first one was applied answers 404
  ``NotFoundError`` (the transaction is no longer open); check its tasks' states.

Pipelining. ``client.producer(linger_ms=, max_batch=)`` batches submissions in the
background: ``p.submit(...)`` returns a future of the task's handle at once (asyncio:
``await p.submit(...)`` returns an asyncio future); each batch is one idempotent request,
retried like ``submit_many``; exiting the ``with`` block flushes. See docs/API.md.

Connections. The clients speak HTTP/1.1 themselves (:mod:`.transport`): a
``StewardClient`` keeps one connection alive per broker and is not thread-safe (give
each thread its own client); an ``AsyncStewardClient`` may be shared by coroutines
(a small pool per broker). A request that finds its kept-alive connection closed by
the broker (before any answer) is sent once more on a new connection.

Layout: :mod:`.errors` (the exceptions), :mod:`.routing` (leader-following and retries,
shared by both clients), :mod:`.encoding` (request bodies, queries, task answers),
:mod:`.api_calls` (each endpoint's request), :mod:`.transport` and
:mod:`.async_transport` (HTTP/1.1), :mod:`.events` (the event-stream parser and the state
of a wait for many tasks), :mod:`.sync_client` and :mod:`.async_client`; the producers in
:mod:`.producing` (the shared core), :mod:`.producer` and :mod:`.async_producer`. Import
the names from ``clients.client``.
"""

from clients.client.async_client import AsyncStewardClient, AsyncTaskHandle, AsyncTransaction
from clients.client.async_producer import AsyncProducer
from clients.client.encoding import FINAL_STATES
from clients.client.errors import (
    AuthenticationError,
    CertificateVerifyError,
    ConflictError,
    ConnectionFailedError,
    FailoverTimeoutError,
    InvalidRequestError,
    NotFoundError,
    PermissionDeniedError,
    StewardError,
    TaskFailedError,
    TaskTimeoutError,
    TenantQueueFullError,
    TreeFailedError,
    UnavailableError,
)
from clients.client.events import EventStreamError, TaskEvent, WaitTimeoutError
from clients.client.producer import Producer
from clients.client.producing import ProducerClosedError, ProducerFullError
from clients.client.routing import DEFAULT_FAILOVER_TIMEOUT_S, parse_urls
from clients.client.sync_client import StewardClient, TaskHandle, Transaction

__all__ = [
    "DEFAULT_FAILOVER_TIMEOUT_S",
    "FINAL_STATES",
    "AsyncProducer",
    "AsyncStewardClient",
    "AsyncTaskHandle",
    "AsyncTransaction",
    "AuthenticationError",
    "CertificateVerifyError",
    "ConflictError",
    "ConnectionFailedError",
    "EventStreamError",
    "FailoverTimeoutError",
    "InvalidRequestError",
    "NotFoundError",
    "PermissionDeniedError",
    "Producer",
    "ProducerClosedError",
    "ProducerFullError",
    "StewardClient",
    "StewardError",
    "TaskEvent",
    "TaskFailedError",
    "TaskHandle",
    "TaskTimeoutError",
    "TenantQueueFullError",
    "Transaction",
    "TreeFailedError",
    "UnavailableError",
    "WaitTimeoutError",
    "parse_urls",
]
