"""A deposed leader never gets a write acknowledged, on every ledger backend (issue 5,
acceptance 3; docs/DESIGN.md §4).

Two real :class:`~broker.replication.node.Node` objects share one backend and one ledger list. The
first leads and writes; the second takes over (marks the first's ledger closing, recovers
it, opens its own) while the first still believes it leads (its elector view is stale:
``leadership_check`` keeps answering True). Everything the first proposes afterwards must
fail with a retryable error: the file and memory backends fence its ledger (so their
leader asks ZooKeeper nothing per batch), pulsar-lite cannot (no ExclusiveWithFencing),
and there the ZooKeeper check after the durable batch (ledger list version changed)
refuses it. A third replica that follows the log ends with the new leader's digest: none
of the deposed leader's late entries is part of the history.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.deposed_leader import take_over_tests
from tests.support.ledger_backends import BACKENDS, LedgerBackend


@pytest.fixture(params=sorted(BACKENDS))
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> LedgerBackend:
    kind = BACKENDS[request.param]
    fixtures = {name: request.getfixturevalue(name) for name in kind.fixtures}
    return kind(tmp_path, **fixtures)


@pytest.fixture(params=sorted(name for name, kind in BACKENDS.items() if not kind.fences))
def unfenced_backend(request: pytest.FixtureRequest, tmp_path: Path) -> LedgerBackend:
    """The backends whose leader confirms each batch in ZooKeeper (no fence: §4)."""
    kind = BACKENDS[request.param]
    fixtures = {name: request.getfixturevalue(name) for name in kind.fixtures}
    return kind(tmp_path, **fixtures)


globals().update(take_over_tests())
