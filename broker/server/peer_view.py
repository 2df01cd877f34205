"""What one broker knows of its peers, for ``GET /api/v1/cluster`` (docs/DESIGN.md §4):
who is a member (the advertisements in ZooKeeper), and how each one is doing (its own
``/healthz``, asked every :data:`POLL_INTERVAL_S`).

Why ask the peers over HTTP rather than have each broker refresh its advertisement in
ZooKeeper: ZooKeeper sits on the commit path (the leader checks its leadership there after
every group commit), so periodic writes from every broker would load it for a display; and
"unreachable" is then what it says, measured from the broker asked, within one poll, not
only once a ZooKeeper session expires. The cost is bounded: one small GET per peer per
interval, all concurrent, each bounded by :data:`PEER_TIMEOUT_S`.

Times are the local monotonic clock of the broker asked: a peer reports its own uptime
(no clock skew between hosts), and "last seen" is when this broker last heard from it.

Brokers that leave the membership (stopped, or their session expired) stay in the view as
unreachable, with how long ago they were last seen, for :data:`FORGET_AFTER_S` and at most
:data:`MAX_DEPARTED` of them (the oldest departures are forgotten first).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any, Final

import httpx
import msgspec

from broker.api import api_models as m
from log.api import LedgerInfo, LedgerList

logger = logging.getLogger(__name__)

POLL_INTERVAL_S: Final = 1.0
# Longer than a poll's interval: a loaded but live peer must not flap to "unreachable".
PEER_TIMEOUT_S: Final = 2.0
FORGET_AFTER_S: Final = 600.0
MAX_DEPARTED: Final = 16


def iso_seconds_ago(secs: float) -> str:
    """The wall-clock time ``secs`` ago, as the API writes times."""
    moment = datetime.now(UTC) - timedelta(seconds=secs)
    return moment.isoformat(timespec="milliseconds").replace("+00:00", "Z")


def lag_behind(
    position: m.Position, leader: m.Position, ledgers: Sequence[LedgerInfo] | None
) -> int | None:
    """Entries ``position`` is behind ``leader``; None when ``ledgers`` (the ledger list)
    is needed to count across ledgers but missing or incomplete."""
    if position.ledger_id >= leader.ledger_id:
        # Ahead of the leader's last report counts as caught up.
        return (
            max(0, leader.entry_id - position.entry_id)
            if (position.ledger_id == leader.ledger_id)
            else 0
        )
    if ledgers is None:
        return None
    lag = leader.entry_id + 1  # the leader's ledger, from its start
    counting = False
    for info in ledgers:
        if info.ledger_id == leader.ledger_id:
            return lag if counting else None
        if info.ledger_id == position.ledger_id:
            counting = True
            if info.last_entry_id is None:
                return None
            lag += max(0, info.last_entry_id - position.entry_id)
        elif counting:
            if info.last_entry_id is None:
                return None
            lag += info.last_entry_id + 1
    return None


@dataclass
class _Peer:
    info: dict[str, Any]  # its advertisement in ZooKeeper
    member: bool = True
    left_at: float | None = None  # monotonic: when its advertisement went away
    health: m.Health | None = None  # its last answer
    answered_at: float | None = None  # monotonic
    error: str | None = None  # why the last poll got no answer (None: it answered)


class PeerTable:
    """The peers' last known states; plain data, driven by :class:`PeerView` (and tests)."""

    def __init__(
        self,
        own_id: str,
        *,
        forget_after_s: float = FORGET_AFTER_S,
        max_departed: int = MAX_DEPARTED,
    ) -> None:
        self.own_id = own_id
        self.forget_after_s = forget_after_s
        self.max_departed = max_departed
        self._peers: dict[str, _Peer] = {}
        self.ledgers: tuple[LedgerInfo, ...] | None = None  # for lags across ledgers

    def set_members(self, infos: Sequence[dict[str, Any]], now: float) -> None:
        """The advertisements now in ZooKeeper (``broker_id`` and address info)."""
        present: set[str] = set()
        for info in infos:
            broker_id = str(info.get("broker_id", ""))
            if not broker_id or broker_id == self.own_id:
                continue
            present.add(broker_id)
            peer = self._peers.get(broker_id)
            if peer is None or not peer.member:
                # New, or back after leaving (a restart): start afresh.
                self._peers[broker_id] = _Peer(info=dict(info))
            else:
                peer.info = dict(info)
        for broker_id, peer in self._peers.items():
            if peer.member and broker_id not in present:
                peer.member, peer.left_at = False, now
        self._forget(now)

    def _forget(self, now: float) -> None:
        departed = sorted(
            (p.left_at, broker_id) for broker_id, p in self._peers.items() if p.left_at is not None
        )
        excess = len(departed) - self.max_departed
        for i, (left_at, broker_id) in enumerate(departed):
            if i < excess or now - left_at > self.forget_after_s:
                del self._peers[broker_id]

    def members(self) -> list[tuple[str, str | None]]:
        """(id, URL) of every peer to poll: the current members."""
        return [(i, p.info.get("url")) for i, p in self._peers.items() if p.member]

    def record(self, broker_id: str, answer: m.Health | str, now: float) -> None:
        """A poll's outcome: the peer's health, or why there was no answer."""
        peer = self._peers.get(broker_id)
        if peer is None:
            return  # forgotten meanwhile
        if isinstance(answer, str):
            peer.error = answer
        else:
            peer.health, peer.answered_at, peer.error = answer, now, None

    def needs_ledgers(self, leader_id: str | None, own_position: m.Position) -> bool:
        """Whether a lag must be counted across ledgers (then read the ledger list)."""
        positions = [own_position] + [
            p.health.position for p in self._peers.values() if p.health is not None
        ]
        leader = self._leader_position(leader_id, own_position)
        return leader is not None and any(pos.ledger_id < leader.ledger_id for pos in positions)

    def _leader_position(
        self, leader_id: str | None, own_position: m.Position | None
    ) -> m.Position | None:
        """What lags are counted against: the leader's last entry followers can apply."""
        if leader_id is None:
            return None
        if leader_id == self.own_id:
            return own_position
        peer = self._peers.get(leader_id)
        if peer is None or peer.health is None or not _reachable(peer):
            return None
        return peer.health.catch_up_position or peer.health.position

    def summaries(
        self,
        own: m.BrokerSummary,
        leader_id: str | None,
        now: float,
        own_catch_up: m.Position | None = None,
    ) -> list[m.BrokerSummary]:
        """``own`` then every peer (members by id, then departed ones, latest first), each
        with its lag behind the leader (``own_catch_up``: the position followers catch up
        to when ``own`` leads); what is unknown is null, and says why."""
        leader_pos = self._leader_position(leader_id, own_catch_up or own.position)
        peers = sorted(
            self._peers.items(), key=lambda kv: (not kv[1].member, -(kv[1].left_at or 0), kv[0])
        )
        rows = [own, *(self._summary(i, p, leader_id, now) for i, p in peers)]
        for row in rows:
            if row.position is None or row.lag_entries is not None:
                continue
            if leader_id is None:
                row.unknown_reason = row.unknown_reason or "no leader known: lag unknown"
            elif leader_pos is None:
                row.unknown_reason = row.unknown_reason or "the leader is unreachable: lag unknown"
            else:
                row.lag_entries = lag_behind(row.position, leader_pos, self.ledgers)
                if row.lag_entries is None:
                    row.unknown_reason = "in an older ledger than the leader: lag unknown"
        return rows

    def _summary(
        self, broker_id: str, peer: _Peer, leader_id: str | None, now: float
    ) -> m.BrokerSummary:
        info = peer.info
        url = str(info.get("url", ""))
        host, _, port = url.removeprefix("http://").removeprefix("https://").partition(":")
        health = peer.health
        seen_ago = None if peer.answered_at is None else round(now - peer.answered_at, 3)
        summary = m.BrokerSummary(
            id=broker_id,
            host=host,
            port=int(port) if port.isdigit() else 0,
            uptime_secs=None,
            is_leader=broker_id == leader_id,
            version=str(info.get("version") or (health.version if health else None) or ""),
            position=None,
            lag_entries=None,
            reachable=False,
            last_seen_secs_ago=seen_ago,
            started_at=None,
            member=peer.member,
            unknown_reason=None,
            role="unreachable",
            url=url or None,
            worker_address=info.get("worker_address"),
            worker_tls=bool(info.get("worker_tls", False)),
        )
        seen = "never answered" if seen_ago is None else f"last seen {seen_ago:.1f} s ago"
        if not peer.member:
            left = now - (peer.left_at or now)
            summary.unknown_reason = (
                f"unreachable: left the membership in ZooKeeper {left:.1f} s ago (stopped, "
                f"or its session expired); {seen}"
            )
        elif not _reachable(peer):
            why = peer.error or "not polled yet"
            summary.unknown_reason = f"unreachable: GET /healthz failed ({why}); {seen}"
        else:
            assert health is not None and seen_ago is not None
            summary.reachable = True
            summary.role = health.role
            summary.position = health.position
            summary.version = health.version or summary.version
            if health.uptime_secs is not None:
                summary.uptime_secs = round(health.uptime_secs + seen_ago, 3)
                summary.started_at = iso_seconds_ago(summary.uptime_secs)
            else:
                summary.unknown_reason = "uptime unknown: an older version answered"
        return summary


def _reachable(peer: _Peer) -> bool:
    return peer.member and peer.error is None and peer.health is not None


def describe_error(exc: BaseException) -> str:
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


class PeerView:
    """Polls the members' ``/healthz`` in the background into a :class:`PeerTable`."""

    def __init__(
        self,
        own_id: str,
        members: Callable[[], list[dict[str, Any]]],
        leader_id: Callable[[], str | None],
        own_position: Callable[[], m.Position],
        ledger_list: Callable[[], Awaitable[tuple[LedgerList, int]]],
        ssl_context: ssl.SSLContext,
    ) -> None:
        self.table = PeerTable(own_id)
        self._members = members
        self._leader_id = leader_id
        self._own_position = own_position
        self._ledger_list = ledger_list
        self._ssl_context = ssl_context
        self._task: asyncio.Task[None] | None = None

    def summaries(
        self, own: m.BrokerSummary, own_catch_up: m.Position | None = None
    ) -> list[m.BrokerSummary]:
        now = time.monotonic()
        self.table.set_members(self._members(), now)
        return self.table.summaries(own, self._leader_id(), now, own_catch_up)

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="steward-peer-view")

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _run(self) -> None:
        async with httpx.AsyncClient(timeout=PEER_TIMEOUT_S, verify=self._ssl_context) as client:
            while True:
                try:
                    await self.poll(client)
                except Exception:  # the view must outlive any one bad round
                    logger.exception("polling the peer brokers failed")
                await asyncio.sleep(POLL_INTERVAL_S)

    async def poll(self, client: httpx.AsyncClient) -> None:
        """One round: every member's /healthz, concurrently; the ledger list when a lag
        must be counted across ledgers."""
        self.table.set_members(self._members(), time.monotonic())
        members = self.table.members()
        answers = await asyncio.gather(*(_ask(client, url) for _, url in members))
        now = time.monotonic()
        for (broker_id, _), answer in zip(members, answers, strict=True):
            self.table.record(broker_id, answer, now)
        if self.table.needs_ledgers(self._leader_id(), self._own_position()):
            with contextlib.suppress(Exception):  # lags stay unknown (and say so)
                ledger_list, _ = await asyncio.wait_for(self._ledger_list(), PEER_TIMEOUT_S)
                self.table.ledgers = ledger_list.ledgers
        else:
            self.table.ledgers = None


async def _ask(client: httpx.AsyncClient, url: str | None) -> m.Health | str:
    if not url:
        return "no URL advertised"
    try:
        response = await client.get(url + "/healthz")
        # A 503 still carries the body.
        return msgspec.json.decode(response.content, type=m.Health)
    except (httpx.HTTPError, msgspec.DecodeError) as exc:
        return describe_error(exc)
