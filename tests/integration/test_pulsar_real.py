"""Real Apache Pulsar (issue 31, first step): the standalone harness of
clients/dev/pulsar_standalone.py, and the engine's own fencing, which pulsar-lite lacks.

A producer with access mode ``ExclusiveWithFencing`` writes; a second one with the same mode
takes the topic over; the first one's next send fails with ``pulsar.ProducerFenced`` and the
topic holds only what was acknowledged, in order. The same steps on pulsar-lite show the
difference: there the deposed producer's late send is acknowledged and stored (docs/TESTING.md,
"Real Apache Pulsar").

The standalone is started once for the module (it takes tens of seconds) and killed, as a
process group, when the module ends. Every wait is bounded.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Iterator

import pulsar  # type: ignore[import-untyped]
import pytest

from clients.dev.pulsar_lite import PulsarLiteServer
from clients.dev.pulsar_standalone import PulsarStandalone
from tests.support.listening import listening_addresses
from tests.support.pulsar_fixture import started_standalone

logger = logging.getLogger(__name__)

# The module's bound: the standalone's first start (FIRST_START_TIMEOUT_S) plus the tests.
pytestmark = pytest.mark.timeout(300)

OPERATION_TIMEOUT_S = 30
SEND_TIMEOUT_MS = 10_000
READ_TIMEOUT_MS = 10_000


@pytest.fixture(scope="module")
def standalone(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PulsarStandalone]:
    yield from started_standalone(tmp_path_factory)


def fenced_producer(client: pulsar.Client, topic: str) -> pulsar.Producer:
    return client.create_producer(
        topic,
        access_mode=pulsar.ProducerAccessMode.ExclusiveWithFencing,
        batching_enabled=False,
        send_timeout_millis=SEND_TIMEOUT_MS,
    )


def read_topic(client: pulsar.Client, topic: str) -> list[bytes]:
    """Every message of the topic, from the earliest (bounded: stops at the end)."""
    reader = client.create_reader(topic, pulsar.MessageId.earliest, receiver_queue_size=1)
    try:
        messages: list[bytes] = []
        while reader.has_message_available():
            messages.append(reader.read_next(timeout_millis=READ_TIMEOUT_MS).data())
        return messages
    finally:
        reader.close()


def take_over(service_url: str) -> tuple[bool, list[bytes]]:
    """A writer, a second writer taking the topic over, the first one's late send. Returns
    whether that late send failed with ProducerFenced, and what the topic holds (read
    through a third client)."""
    topic = f"persistent://public/default/fencing-{uuid.uuid4().hex[:12]}"
    old_client = pulsar.Client(service_url, operation_timeout_seconds=OPERATION_TIMEOUT_S)
    new_client = pulsar.Client(service_url, operation_timeout_seconds=OPERATION_TIMEOUT_S)
    check_client = pulsar.Client(service_url, operation_timeout_seconds=OPERATION_TIMEOUT_S)
    try:
        old = fenced_producer(old_client, topic)
        old.send(b"old-1")
        old.send(b"old-2")
        new = fenced_producer(new_client, topic)
        fenced = False
        try:
            old.send(b"old-late")
        except pulsar.ProducerFenced:
            fenced = True
        new.send(b"new-1")
        return fenced, read_topic(check_client, topic)
    finally:
        for client in (old_client, new_client, check_client):
            client.close()


def test_standalone_serves_on_loopback_within_its_measured_bounds(
    standalone: PulsarStandalone,
) -> None:
    assert standalone.pid is not None and standalone.first_start_s is not None
    logger.warning(
        "Pulsar %s standalone: started in %.1f s, RSS %.0f MB",
        standalone.version,
        standalone.first_start_s,
        standalone.rss_mb(),
    )
    addresses = listening_addresses(standalone.pid)
    assert addresses, "the standalone listens on nothing"
    assert all(address.startswith("127.0.0.1:") for address in addresses), addresses
    for port in (standalone.port, standalone.web_port, standalone.bookie_port):
        assert f"127.0.0.1:{port}" in addresses, (port, addresses)


def test_real_pulsar_fences_the_deposed_producer(standalone: PulsarStandalone) -> None:
    fenced, stored = take_over(standalone.service_url)
    assert fenced, "the old producer's send after the take-over was acknowledged"
    assert stored == [b"old-1", b"old-2", b"new-1"]


def test_pulsar_lite_does_not_fence(pulsar_lite: PulsarLiteServer) -> None:
    # What the fencing test above shows against: pulsar-lite ignores access modes.
    fenced, stored = take_over(pulsar_lite.service_url)
    assert not fenced
    assert stored == [b"old-1", b"old-2", b"old-late", b"new-1"]
