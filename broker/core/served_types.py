"""The served task types: which task type names the cluster's workers have ever listed, and
for which tenants, so a submit of a type no worker serving its tenant ever registered is
refused (docs/DESIGN.md §6, "Served task types"; the refusal: broker/core/validation.py).

Replicated state, changed only by RegisterWorker entries: every broker answers the same.
"""

from __future__ import annotations

from typing import Final

from broker.core import entries as e
from broker.core.books import Books
from broker.core.records import WorkerState
from broker.core.validation import TASK_TYPE_RE

#: The key of the names listed by workers serving every tenant (no tenant name is empty).
ALL_TENANTS: Final = ""
#: Most names one registration lists (wire/worker_protocol.py's MAX_HELLO_TASK_NAMES:
#: a worker with more lists none; tests/unit/test_served_types.py holds them equal).
MAX_TASK_NAMES_PER_WORKER: Final = 1000
#: Most names recorded over all tenants. A name that does not fit leaves its tenant (or
#: every tenant, for a worker serving all) unchecked from then on: the record is an aid to
#: the submitter, and refusing a type a worker does serve would be worse than accepting.
MAX_SERVED_TYPE_NAMES: Final = 10_000


def record_served_types(books: Books, entry: e.RegisterWorker) -> None:
    """Add the names ``entry`` lists to each tenant its worker serves (invalid names,
    which no submit could use, and names past the per-worker cap are skipped)."""
    if entry.task_names is None:
        return
    names = [n for n in entry.task_names[:MAX_TASK_NAMES_PER_WORKER] if TASK_TYPE_RE.match(n)]
    total = sum(len(known) for known in books.served_types.values())
    for scope in sorted(set(entry.tenants)) or [ALL_TENANTS]:
        known = books.served_types.setdefault(scope, {})
        for name in names:
            if name in known or scope in books.served_types_full:
                continue
            if total >= MAX_SERVED_TYPE_NAMES:
                books.served_types_full.add(scope)
                continue
            known[name] = None
            total += 1


def type_served(books: Books, tenant: str, type_name: str) -> bool | None:
    """Whether a worker serving ``tenant`` ever listed ``type_name``: True; False: none
    did; None: the record cannot tell (no worker ever listed its types, the tenant's
    record is over the cap, or a worker serving the tenant that does not list its types
    is not dead). A read-only query for the API's submit."""
    if not books.served_types:
        return None  # no worker listed its types yet: the cluster knows nothing
    for scope in (ALL_TENANTS, tenant):
        if type_name in books.served_types.get(scope, ()):
            return True
    if ALL_TENANTS in books.served_types_full or tenant in books.served_types_full:
        return None
    for worker in books.workers.values():
        if (
            not worker.lists_task_names
            and worker.state != WorkerState.DEAD
            and (not worker.tenants or tenant in worker.tenants)
        ):
            return None
    return False
