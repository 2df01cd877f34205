"""Backends for the ledger contract tests (tests/unit/test_ledger_contract.py).

A backend hands out any number of stores (and ledger-list stores) over the *same*
storage, so tests can restart a store, or fence a writer from a second store. To run the
contract against another backend, subclass :class:`LedgerBackend` and add it to
:data:`BACKENDS`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from pathlib import Path

from log.api import LedgerListStore, LedgerStore
from log.file import FileLedgerListStore, FileLedgerStore
from log.memory import MemoryLedgerCluster, MemoryLedgerListStore, MemoryLedgerStore


class LedgerBackend(ABC):
    def __init__(self, tmp_path: Path) -> None:
        self.tmp_path = tmp_path
        self._stores: list[LedgerStore] = []

    def new_store(self) -> LedgerStore:
        """A new store over this backend's storage (a "restart" when the old one is closed)."""
        store = self._make_store()
        self._stores.append(store)
        return store

    @abstractmethod
    def _make_store(self) -> LedgerStore: ...

    @abstractmethod
    def new_list_store(self) -> LedgerListStore:
        """A ledger-list store over this backend's one ledger list."""

    async def close(self) -> None:
        for store in self._stores:
            await store.close()


class MemoryBackend(LedgerBackend):
    def __init__(self, tmp_path: Path) -> None:
        super().__init__(tmp_path)
        self.cluster = MemoryLedgerCluster()
        self.list_store = MemoryLedgerListStore()

    def _make_store(self) -> LedgerStore:
        return MemoryLedgerStore(self.cluster)

    def new_list_store(self) -> LedgerListStore:
        return self.list_store


class FileBackend(LedgerBackend):
    def _make_store(self) -> LedgerStore:
        return FileLedgerStore(self.tmp_path / "ledgers")

    def new_list_store(self) -> LedgerListStore:
        return FileLedgerListStore(self.tmp_path / "ledgers.json")


BACKENDS: dict[str, type[LedgerBackend]] = {
    "memory": MemoryBackend,
    "file": FileBackend,
}
