"""Snapshots between brokers over HTTP (docs/DESIGN.md §5): serve the latest, download a peer's.

A broker with no usable local snapshot (none, corrupt, or older than the first ledger
still retained) calls :func:`download_latest_snapshot` with its peers' base URLs (found
through ZooKeeper by the caller), then boots from its store as usual.

Wire: ``GET <peer>/api/v1/snapshot/latest`` answers the newest intact snapshot file's
bytes exactly as stored (``application/octet-stream``) with the header
``X-Steward-Snapshot-Position: <ledger_id>:<entry_id>``, or 404 when the peer has none.
The file format carries its own checksums (snapshot/format.py), so the downloader trusts
nothing the peer says: the file is fully verified (header, cluster id, checksum,
decompression and, given a ``decode``, the state body) before the store installs it.

Downloads go to ``.peer-download-*.part`` files in the store's directory (the same
filesystem, so installing is a rename); leftovers of a crashed download are deleted by
the next download. Run one download per store at a time.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import os
import ssl
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Final

import httpx

from snapshot.format import (
    MAGIC,
    CorruptSnapshotError,
    ForeignSnapshotError,
    SnapshotError,
    SnapshotHeader,
    SnapshotInfo,
    read_header,
    read_snapshot,
)
from snapshot.store import SnapshotStore

__all__ = [
    "LATEST_SNAPSHOT_PATH",
    "POSITION_HEADER",
    "download_latest_snapshot",
    "format_position",
    "parse_position",
    "read_latest_snapshot",
]

logger = logging.getLogger(__name__)

LATEST_SNAPSHOT_PATH: Final = "/api/v1/snapshot/latest"
POSITION_HEADER: Final = "X-Steward-Snapshot-Position"
#: Refuse answers larger than this (a broken or hostile peer must not fill the disk).
DEFAULT_MAX_SIZE_BYTES: Final = 16 * 1024**3
_DOWNLOAD_PREFIX: Final = ".peer-download-"
_DOWNLOAD_SUFFIX: Final = ".part"
# Chunks are gathered to this size before one write in a worker thread.
_WRITE_CHUNK_BYTES: Final = 1 << 20


class PeerSnapshotError(Exception):
    """A peer's answer cannot be used (HTTP error, bad headers, too large, undecodable)."""


def format_position(position: tuple[int, int]) -> str:
    return f"{position[0]}:{position[1]}"


def parse_position(value: str | None) -> tuple[int, int]:
    """``"<ledger_id>:<entry_id>"`` -> (ledger_id, entry_id); PeerSnapshotError if malformed."""
    if value is None:
        raise PeerSnapshotError(f"the answer has no {POSITION_HEADER} header")
    ledger, sep, entry = value.strip().partition(":")
    if not sep or not ledger.isdigit() or not entry.isdigit():
        raise PeerSnapshotError(f"malformed {POSITION_HEADER} header {value!r}")
    return int(ledger), int(entry)


# --- serving side ------------------------------------------------------------------------


def read_latest_snapshot(store: SnapshotStore) -> tuple[SnapshotHeader, bytes] | None:
    """The newest snapshot whose stored body matches its checksum, as the file's bytes.

    Blocking: call it from a worker thread. Checks the compressed body's SHA-256 (cheap,
    no decompression) so a bit-rotten newest file is not served while an older intact one
    exists; the downloader verifies everything anyway. Files pruned meanwhile are skipped.
    """
    for info in store.list():
        path, header = info.path, info.header
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            continue  # pruned since the listing
        except OSError as exc:
            logger.warning("snapshot %s not served: cannot read it: %s", path, exc)
            continue
        body_start = len(data) - header.compressed_size_bytes
        # memoryview: no copy of a body of tens of MB just to hash it.
        intact = (
            body_start > len(MAGIC)
            and data.startswith(MAGIC)
            and hashlib.sha256(memoryview(data)[body_start:]).hexdigest() == header.checksum
        )
        if intact:
            return header, data
        # Also the (harmless) case of a file replaced at the same position since the listing.
        logger.warning("snapshot %s not served: its body does not match its checksum", path)
    return None


# --- downloading side --------------------------------------------------------------------


async def download_latest_snapshot(
    peer_urls: Sequence[str],
    store: SnapshotStore,
    *,
    cluster_id: str,
    timeout_s: float = 60.0,
    ssl_context: ssl.SSLContext | None = None,
    min_position: tuple[int, int] | None = None,
    decode: Callable[[bytes], object] | None = None,
    max_size_bytes: int = DEFAULT_MAX_SIZE_BYTES,
    token: str | None = None,
) -> SnapshotInfo | None:
    """Download the latest snapshot of the first peer that has a usable one, and install it.

    ``https://`` peers are verified with ``ssl_context`` (default: httpx's, certifi).

    ``peer_urls`` are base URLs (``http://host:port``), tried in order. A peer is skipped
    (logged at WARNING, the next one tried) when it cannot be reached, answers an error,
    takes longer than ``timeout_s`` for the whole download, or sends a file that fails
    verification: header, ``cluster_id``, the position it announced, checksum,
    decompression, and ``decode(body)`` when given (e.g. ``StateMachine.from_snapshot``,
    so a state this build cannot read is never installed). A peer without a snapshot
    (404), or whose snapshot is older than ``min_position`` (e.g. ``(first retained
    ledger id, -1)``), is skipped at INFO.

    ``token``: the brokers' shared secret, sent as ``Authorization: Bearer`` (brokers
    with authentication on serve snapshots to peers and admins only).

    Returns the installed snapshot, or None when no peer had a usable one.
    """
    if timeout_s <= 0:
        raise ValueError("timeout_s must be positive")
    await asyncio.to_thread(_remove_stale_downloads, store.directory)
    headers = {"authorization": f"Bearer {token}"} if token else {}
    verify: ssl.SSLContext | bool = ssl_context if ssl_context is not None else True
    async with httpx.AsyncClient(
        timeout=httpx.Timeout(timeout_s), headers=headers, verify=verify
    ) as client:
        for peer_url in peer_urls:
            try:
                async with asyncio.timeout(timeout_s):
                    info = await _download_from(
                        client,
                        peer_url,
                        store,
                        cluster_id=cluster_id,
                        min_position=min_position,
                        decode=decode,
                        max_size_bytes=max_size_bytes,
                    )
            except TimeoutError:
                logger.warning(
                    "snapshot download from %s: not done within %g s; trying the next peer",
                    peer_url,
                    timeout_s,
                )
                continue
            except (httpx.HTTPError, OSError, SnapshotError, PeerSnapshotError) as exc:
                logger.warning(
                    "snapshot download from %s failed: %s; trying the next peer",
                    peer_url,
                    _describe(exc),
                )
                continue
            if info is not None:
                logger.info(
                    "installed snapshot at position %s from %s (%d bytes)",
                    info.position,
                    peer_url,
                    info.header.compressed_size_bytes,
                )
                return info
    return None


async def _download_from(
    client: httpx.AsyncClient,
    peer_url: str,
    store: SnapshotStore,
    *,
    cluster_id: str,
    min_position: tuple[int, int] | None,
    decode: Callable[[bytes], object] | None,
    max_size_bytes: int,
) -> SnapshotInfo | None:
    url = peer_url.rstrip("/") + LATEST_SNAPSHOT_PATH
    async with client.stream("GET", url) as response:
        if response.status_code == 404:
            logger.info("peer %s has no snapshot", peer_url)
            return None
        if response.status_code != 200:
            await response.aread()
            raise PeerSnapshotError(f"HTTP {response.status_code}: {response.text[:300]}")
        position = parse_position(response.headers.get(POSITION_HEADER))
        if min_position is not None and position < min_position:
            logger.info(
                "peer %s has a snapshot at %s, older than the %s needed; skipped",
                peer_url,
                position,
                min_position,
            )
            return None
        declared = response.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > max_size_bytes:
            raise PeerSnapshotError(f"snapshot of {declared} bytes is over {max_size_bytes}")
        fd, temp_name = tempfile.mkstemp(
            dir=store.directory, prefix=_DOWNLOAD_PREFIX, suffix=_DOWNLOAD_SUFFIX
        )
        temp_path = Path(temp_name)
        try:
            with os.fdopen(fd, "wb") as file:
                buffer = bytearray()
                size_bytes = 0
                async for chunk in response.aiter_bytes():
                    size_bytes += len(chunk)
                    if size_bytes > max_size_bytes:
                        raise PeerSnapshotError(f"snapshot is over {max_size_bytes} bytes")
                    buffer += chunk
                    if len(buffer) >= _WRITE_CHUNK_BYTES:
                        await asyncio.to_thread(file.write, buffer)
                        buffer = bytearray()
                if buffer:
                    await asyncio.to_thread(file.write, buffer)
            return await asyncio.to_thread(
                _verify_and_install, temp_path, store, cluster_id, position, decode
            )
        finally:
            # Gone already when installed (renamed into the store). Not in a thread: this
            # also runs on cancellation, and an unlink is quick.
            with contextlib.suppress(FileNotFoundError):
                os.unlink(temp_name)


def _verify_and_install(
    path: Path,
    store: SnapshotStore,
    cluster_id: str,
    announced: tuple[int, int],
    decode: Callable[[bytes], object] | None,
) -> SnapshotInfo:
    header = read_header(path)  # cheap checks first: a foreign file is not decompressed
    if header.cluster_id != cluster_id:
        raise ForeignSnapshotError(
            path, f"belongs to cluster {header.cluster_id!r}, not {cluster_id!r}"
        )
    if header.position != announced:
        raise CorruptSnapshotError(
            path, f"the peer announced position {announced}, the file says {header.position}"
        )
    if decode is not None:
        _, body = read_snapshot(path)  # full verification, then the state itself
        try:
            decode(body)
        except Exception as exc:
            raise PeerSnapshotError(f"the state in the snapshot cannot be decoded: {exc}") from exc
        del body
    # Verifies again (streaming, whatever the size) and moves the file in durably.
    return store.install(path)


def _remove_stale_downloads(directory: Path) -> None:
    for path in directory.glob(f"{_DOWNLOAD_PREFIX}*{_DOWNLOAD_SUFFIX}"):
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
            logger.info("removed stale snapshot download %s", path)


def _describe(exc: BaseException) -> str:
    if isinstance(exc, SnapshotError):
        return exc.reason
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
