"""The asyncio client offers every call the sync client does (issue 18's schedules and
bulk cancel were missing from it)."""

from __future__ import annotations

import inspect

from clients.client import AsyncStewardClient, StewardClient

# Sync-only by design: the context-manager protocol (the async client's is __aenter__/
# __aexit__, and aclose instead of close).
SYNC_ONLY = {"close"}


def _public(cls: type) -> dict[str, object]:
    return {
        name: member
        for name, member in inspect.getmembers(cls)
        if not name.startswith("_") and callable(member)
    }


def test_every_sync_call_has_an_async_twin_with_the_same_parameters() -> None:
    sync, asynchronous = _public(StewardClient), _public(AsyncStewardClient)
    missing = sorted(set(sync) - set(asynchronous) - SYNC_ONLY)
    assert not missing, f"AsyncStewardClient lacks {missing}"
    for name in sorted(set(sync) - SYNC_ONLY):
        sync_params = inspect.signature(sync[name]).parameters  # type: ignore[arg-type]
        async_params = inspect.signature(asynchronous[name]).parameters  # type: ignore[arg-type]
        assert list(sync_params) == list(async_params), name
