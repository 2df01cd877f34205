"""The state machine's tenant webhooks: their configuration and delivery position
(docs/API.md, Webhooks). The leader delivers; these entries make what it delivered
survive a fail-over (a new leader resumes after the last logged position)."""

from __future__ import annotations

from collections import deque
from typing import Final

import msgspec

from broker.core import entries as e
from broker.core.books import Books
from broker.core.records import ErrorCode, Rejected, Tenant, Webhook
from broker.core.validation import NAME_RE

MAX_URL_CHARS: Final = 2048
MAX_SECRET_CHARS: Final = 256
# A webhook's outbox holds at most this many undelivered events: past it (a receiver down
# for long) the oldest are dropped, identically on every replica; the bound of "at least
# once" (docs/API.md, Webhooks).
MAX_OUTBOX: Final = 100_000


def webhook_problem(url: str, secret: str) -> str | None:
    """Why a webhook is not valid, or None."""
    if not url.startswith(("http://", "https://")) or len(url) > MAX_URL_CHARS:
        return f"url must be an http:// or https:// URL of at most {MAX_URL_CHARS} characters"
    if any(c.isspace() or not c.isprintable() for c in url):
        return "url must not contain spaces or control characters"
    if not 1 <= len(secret) <= MAX_SECRET_CHARS:
        return f"secret must be 1 to {MAX_SECRET_CHARS} characters"
    return None


def set_webhook(books: Books, entry: e.SetWebhook) -> Tenant | Rejected:
    if not NAME_RE.match(entry.tenant):
        return Rejected(ErrorCode.INVALID, "tenant name is not valid")
    if entry.url is not None:
        problem = webhook_problem(entry.url, entry.secret)
        if problem is not None:
            return Rejected(ErrorCode.INVALID, problem)
    tenant = books.tenant(entry.tenant)
    hook = None if entry.url is None else Webhook(entry.url, entry.secret, entry.after)
    tenant.webhook = hook
    # A new webhook delivers from its own entry on; none: nothing to deliver.
    if hook is None:
        books.webhook_outbox.pop(entry.tenant, None)
    else:
        books.webhook_outbox[entry.tenant] = deque()
    # The answer is the tenant as this entry left it: a later entry of the same group
    # commit must not change it before it is sent (webhooks are replaced, not mutated).
    return msgspec.structs.replace(tenant)


def webhook_progress(books: Books, entry: e.WebhookProgress) -> None:
    for mark in entry.marks:
        tenant = books.tenants.get(mark.tenant)
        hook = None if tenant is None else tenant.webhook
        # Only forward: a mark for an older webhook of the tenant never moves it back.
        if tenant is not None and hook is not None and mark.delivered > hook.delivered:
            # A new record, not a change in place: answers already given keep theirs.
            tenant.webhook = msgspec.structs.replace(hook, delivered=mark.delivered)
            outbox = books.webhook_outbox.get(mark.tenant)
            while outbox and outbox[0][0] <= mark.delivered:
                outbox.popleft()


def queue_webhook_events(books: Books, final_ids: list[int]) -> None:
    """Put the final tasks of tenants with a webhook into their outboxes, keyed as the
    event feed keys them (log position, index among the entry's final tasks)."""
    ledger_id, entry_id = books.position
    for index, task_id in enumerate(final_ids):
        task = books.tasks.get(task_id)
        outbox = None if task is None else books.webhook_outbox.get(task.tenant)
        if outbox is not None:
            outbox.append(((ledger_id, entry_id, index), task_id))
            if len(outbox) > MAX_OUTBOX:
                outbox.popleft()
