"""The state machine's tenant webhooks (broker/core/webhooks.py): SetWebhook sets or
removes a tenant's webhook, WebhookProgress only moves its delivered key forward, both
survive a snapshot, and a snapshot's tenants written before webhooks still decode; each
webhook's outbox holds the tenant's undelivered events, keyed by log position, in every
snapshot, until a logged delivery takes them out."""

from __future__ import annotations

import msgspec

from broker.core import StateMachine
from broker.core import entries as e
from broker.core.records import Rejected, Tenant, Webhook
from tests.support.machine import Machine


def apply(machine: StateMachine, entry: e.Entry) -> object:
    # As a node does: the entry goes through its encoding.
    decoded = e.decode_record(e.encode_entry(entry))
    assert isinstance(decoded, type(entry))
    return machine.apply(decoded).result


def test_set_progress_remove_and_snapshot() -> None:
    machine = StateMachine()
    url = "https://hooks.example/x"
    tenant = apply(
        machine, e.SetWebhook(time_ms=1, tenant="t", url=url, secret="k", after=(3, 4, 9))
    )
    assert isinstance(tenant, Tenant) and tenant.webhook == Webhook(url, "k", (3, 4, 9))
    mark = e.WebhookMark
    apply(machine, e.WebhookProgress(time_ms=2, marks=(mark("t", (3, 6, 1)), mark("u", (9, 9, 9)))))
    assert machine.tenants["t"].webhook == Webhook(url, "k", (3, 6, 1))
    assert "u" not in machine.tenants  # a mark for a tenant without a webhook does nothing
    apply(machine, e.WebhookProgress(time_ms=3, marks=(mark("t", (3, 5, 0)),)))
    assert machine.tenants["t"].webhook == Webhook(url, "k", (3, 6, 1))  # never back
    loaded = StateMachine.from_snapshot(machine.encode_snapshot())
    assert loaded.tenants["t"].webhook == Webhook(url, "k", (3, 6, 1))
    assert loaded.digest() == machine.digest()
    apply(machine, e.SetWebhook(time_ms=4, tenant="t", url=None))
    assert machine.tenants["t"].webhook is None


def test_invalid_webhooks_are_rejected() -> None:
    machine = StateMachine()
    for url, secret in [
        ("ftp://x", "k"),
        ("http://a b", "k"),
        ("http://x", ""),
        ("http://x", "k" * 257),
    ]:
        result = apply(machine, e.SetWebhook(time_ms=1, tenant="t", url=url, secret=secret))
        assert isinstance(result, Rejected), (url, secret)
    assert isinstance(
        apply(machine, e.SetWebhook(time_ms=1, tenant="bad name", url=None)), Rejected
    )


def test_a_tenant_written_before_webhooks_decodes() -> None:
    class OldTenant(msgspec.Struct, array_like=True):
        name: str
        max_waiting: int = 0
        max_running: int = 0
        weight: float = 1.0

    old = msgspec.msgpack.encode(OldTenant("t", 5, 2, 3.0))
    assert msgspec.msgpack.decode(old, type=Tenant) == Tenant("t", 5, 2, 3.0, webhook=None)


def test_the_outbox_holds_undelivered_events_across_a_snapshot() -> None:
    driver = Machine()
    machine = driver.m
    machine.position = (7, 1)
    url = "https://hooks.example/x"
    driver.apply(e.SetWebhook(time_ms=driver.at(), tenant="t", url=url, secret="k"))
    machine.position = (7, 2)
    hooked = [driver.add("t"), driver.add("t")]
    other = driver.add("quiet")
    machine.position = (7, 3)
    driver.cancel(other)  # a tenant without a webhook has no outbox
    assert "quiet" not in machine.webhook_outbox
    machine.position = (7, 4)
    driver.cancel(hooked[1])
    machine.position = (8, 0)
    driver.cancel(hooked[0])
    assert list(machine.webhook_outbox["t"]) == [((7, 4, 0), hooked[1]), ((8, 0, 0), hooked[0])]
    loaded = StateMachine.from_snapshot(machine.encode_snapshot())
    assert loaded.webhook_outbox == machine.webhook_outbox
    assert loaded.digest() == machine.digest()
    mark = e.WebhookMark("t", (7, 4, 0))
    driver.apply(e.WebhookProgress(time_ms=driver.at(), marks=(mark,)))
    assert list(machine.webhook_outbox["t"]) == [((8, 0, 0), hooked[0])]
    driver.apply(e.SetWebhook(time_ms=driver.at(), tenant="t", url=None))
    assert machine.webhook_outbox == {}
