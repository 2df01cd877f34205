"""Ledger-list checks shared by the ledger contract (tests/support/ledger_contract.py) and
the ZooKeeper list store's own tests (tests/integration/test_zookeeper.py)."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import pytest

from log.api import BadVersionError, LedgerList, LedgerListStore


async def check_compare_and_set(
    store: LedgerListStore, sample: LedgerList, writer: str
) -> tuple[int, LedgerList, int]:
    """Create ``sample`` in an empty store, refuse stale versions, replace it by version.

    Returns the first version, the replacing list (``sample`` without its first ledger,
    written by ``writer``) and its version.
    """
    with pytest.raises(BadVersionError):
        await store.compare_and_set(sample, 0)  # does not exist yet
    version = await store.compare_and_set(sample, -1)
    assert await store.get() == (sample, version)
    with pytest.raises(BadVersionError):
        await store.compare_and_set(LedgerList(), -1)  # exists already
    with pytest.raises(BadVersionError):
        await store.compare_and_set(LedgerList(), version + 1)
    updated = LedgerList(ledgers=sample.ledgers[1:], first_ledger_id=1, writer=writer)
    new_version = await store.compare_and_set(updated, version)
    assert new_version > version
    return version, updated, new_version


async def one_winner(stores: Sequence[LedgerListStore], round_number: int, version: int) -> int:
    """Every store tries to replace ``version`` at once: exactly one wins, the others get
    BadVersionError. Returns the winner's new version."""
    attempts = [
        s.compare_and_set(LedgerList(writer=f"{round_number}-{i}"), version)
        for i, s in enumerate(stores)
    ]
    results = await asyncio.gather(*attempts, return_exceptions=True)
    winners = [r for r in results if isinstance(r, int)]
    assert len(winners) == 1, results
    assert all(isinstance(r, BadVersionError) for r in results if not isinstance(r, int))
    return winners[0]
