"""The ledger contract (log/api.py, docs/DESIGN.md §3), run against every backend in BACKENDS
(in-process ones and pulsar-lite, with ids and the list in ZooKeeper). The tests live in
tests/support/ledger_contract.py; tests/integration/test_ledger_real_pulsar.py runs the same
ones on real Apache Pulsar (a JVM: a real-process module) with its own ``backend``."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from tests.support.ledger_backends import BACKENDS, LedgerBackend
from tests.support.ledger_contract import contract_tests

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(params=sorted(BACKENDS))
async def backend(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[LedgerBackend]:
    backend_type = BACKENDS[request.param]
    fixtures = {name: request.getfixturevalue(name) for name in backend_type.fixtures}
    backend = backend_type(tmp_path, **fixtures)
    yield backend
    await backend.close()


globals().update(contract_tests())
