"""The cluster view's logic (broker/server/peer_view.py): lags, unreachable and departed
peers, and the bounds on what is remembered."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import msgspec

from broker.api import api_models as m
from broker.server.peer_view import PeerTable, PeerView, lag_behind
from log.api import LedgerInfo, LedgerList, LedgerState

P = m.Position


def _ledger(ledger_id: int, last: int | None) -> LedgerInfo:
    state = LedgerState.OPEN if last is None else LedgerState.CLOSED
    return LedgerInfo(ledger_id=ledger_id, created_ms=0, state=state, last_entry_id=last)


def _info(broker_id: str) -> dict[str, Any]:
    return {
        "broker_id": broker_id,
        "url": f"http://{broker_id}.invalid:80",
        "worker_address": f"{broker_id}.invalid:7070",
        "version": "1.2.3",
    }


def _health(position: P, role: str = "follower", uptime: float | None = 10.0) -> m.Health:
    return m.Health(
        status="ok",
        writable=role == "leader",
        position=position,
        role=role,
        uptime_secs=uptime,
        version="1.2.3",
    )


def _own(position: P, *, leads: bool) -> m.BrokerSummary:
    return m.BrokerSummary(
        id="b0",
        host="127.0.0.1",
        port=80,
        uptime_secs=5.0,
        is_leader=leads,
        version="1.2.3",
        position=position,
        lag_entries=0 if leads else None,
        reachable=True,
        last_seen_secs_ago=0.0,
        started_at=None,
        member=True,
        unknown_reason=None,
        role="leader" if leads else "follower",
    )


def test_lag_in_one_ledger_and_across_closed_ones() -> None:
    assert lag_behind(P(3, 10), P(3, 25), None) == 15
    assert lag_behind(P(3, 30), P(3, 25), None) == 0  # ahead of the leader's last report
    assert lag_behind(P(4, 0), P(3, 25), None) == 0
    ledgers = (_ledger(1, 99), _ledger(2, 49), _ledger(3, None))
    # 99-90 left in ledger 1, all 50 of ledger 2, entries 0..4 of ledger 3.
    assert lag_behind(P(1, 90), P(3, 4), ledgers) == 9 + 50 + 5
    assert lag_behind(P(2, 49), P(3, 4), ledgers) == 5  # caught up with a closed ledger
    # Unknown without the list, or with an open ledger (or an unlisted one) in between.
    assert lag_behind(P(1, 90), P(3, 4), None) is None
    assert (
        lag_behind(P(1, 90), P(3, 4), (_ledger(1, 99), _ledger(2, None), _ledger(3, None))) is None
    )
    assert lag_behind(P(0, 5), P(3, 4), ledgers) is None


def test_reachable_peers_show_real_values_and_their_lag() -> None:
    table = PeerTable("b0")
    table.set_members([_info("b0"), _info("b1"), _info("b2")], now=100.0)
    table.record("b1", _health(P(2, 7)), now=100.0)
    table.record("b2", _health(P(2, 9)), now=100.0)
    own, b1, b2 = table.summaries(_own(P(2, 10), leads=True), "b0", now=101.5)
    assert own.id == "b0" and own.lag_entries == 0
    assert (b1.id, b1.role, b1.reachable, b1.member) == ("b1", "follower", True, True)
    assert b1.position == P(2, 7) and b1.lag_entries == 3 and b2.lag_entries == 1
    assert b1.uptime_secs == 11.5  # its own uptime when it answered, plus 1.5 s since
    assert b1.last_seen_secs_ago == 1.5 and b1.started_at is not None
    assert b1.unknown_reason is None and b1.version == "1.2.3"
    assert b1.url == "http://b1.invalid:80" and (b1.host, b1.port) == ("b1.invalid", 80)


def test_a_follower_measures_lag_against_the_leaders_report() -> None:
    table = PeerTable("b0")
    table.set_members([_info("b1"), _info("b2")], now=0.0)
    table.record("b1", _health(P(2, 20), role="leader"), now=0.0)
    table.record("b2", _health(P(2, 18)), now=0.0)
    own, b1, b2 = table.summaries(_own(P(2, 15), leads=False), "b1", now=0.5)
    assert (own.lag_entries, b1.lag_entries, b2.lag_entries) == (5, 0, 2)
    assert b1.is_leader and not b2.is_leader


def test_lags_count_against_what_followers_can_apply() -> None:
    # The leader's log ends with a Confirm marker (2:21) no later entry confirms.
    table = PeerTable("b0")
    table.set_members([_info("b1")], now=0.0)
    leader = _health(P(2, 21), role="leader")
    leader.catch_up_position = P(2, 20)
    table.record("b1", leader, now=0.0)
    own, _ = table.summaries(_own(P(2, 20), leads=False), "b1", now=0.5)
    assert own.lag_entries == 0
    # Asked of the leader itself, with its own catch-up position.
    table = PeerTable("b0")
    table.set_members([_info("b1")], now=0.0)
    table.record("b1", _health(P(2, 20)), now=0.0)
    _, b1 = table.summaries(_own(P(2, 21), leads=True), "b0", now=0.5, own_catch_up=P(2, 20))
    assert b1.lag_entries == 0


def test_a_peer_that_stops_answering_is_unreachable_with_when_last_seen() -> None:
    table = PeerTable("b0")
    table.set_members([_info("b1"), _info("b2")], now=0.0)
    table.record("b1", _health(P(2, 5)), now=0.0)
    table.record("b2", _health(P(2, 5)), now=0.0)
    table.record("b2", "ConnectError: connection refused", now=3.0)
    _, _, b2 = table.summaries(_own(P(2, 5), leads=True), "b0", now=4.0)
    assert (b2.reachable, b2.member, b2.role) == (False, True, "unreachable")
    assert b2.position is None and b2.uptime_secs is None and b2.lag_entries is None
    assert b2.last_seen_secs_ago == 4.0
    assert b2.unknown_reason is not None
    assert "connection refused" in b2.unknown_reason and "last seen 4.0 s ago" in b2.unknown_reason
    # Its ZooKeeper session expires: it stays in the view, as having left.
    table.set_members([_info("b1")], now=10.0)
    _, _, b2 = table.summaries(_own(P(2, 5), leads=True), "b0", now=12.0)
    assert (b2.id, b2.reachable, b2.member) == ("b2", False, False)
    assert b2.unknown_reason is not None and "left the membership" in b2.unknown_reason
    assert b2.last_seen_secs_ago == 12.0
    # Back (restarted): afresh, unreachable until its first answer.
    table.set_members([_info("b1"), _info("b2")], now=13.0)
    _, _, b2 = table.summaries(_own(P(2, 5), leads=True), "b0", now=13.0)
    assert b2.member and not b2.reachable and b2.last_seen_secs_ago is None
    assert b2.unknown_reason is not None and "never answered" in b2.unknown_reason


def test_an_unreachable_leader_leaves_lags_unknown_and_says_so() -> None:
    table = PeerTable("b0")
    table.set_members([_info("b1")], now=0.0)
    table.record("b1", "ReadTimeout", now=0.0)
    own, b1 = table.summaries(_own(P(2, 5), leads=False), "b1", now=1.0)
    assert b1.is_leader and not b1.reachable
    assert own.lag_entries is None and own.unknown_reason is not None
    assert "leader is unreachable" in own.unknown_reason
    own, _ = table.summaries(_own(P(2, 5), leads=False), None, now=1.0)
    assert own.unknown_reason is not None and "no leader known" in own.unknown_reason


def test_departed_brokers_are_forgotten_after_a_time_and_beyond_a_count() -> None:
    table = PeerTable("b0", forget_after_s=60.0, max_departed=2)
    table.set_members([_info(f"b{i}") for i in range(1, 5)], now=0.0)
    table.set_members([_info("b4")], now=10.0)  # b1, b2, b3 leave: only 2 are kept
    ids = [s.id for s in table.summaries(_own(P(1, 0), leads=True), "b0", now=10.0)]
    assert len(ids) == 4 and ids[:2] == ["b0", "b4"]
    table.set_members([], now=20.0)  # b4 leaves later: it is the newest departure
    ids = [s.id for s in table.summaries(_own(P(1, 0), leads=True), "b0", now=20.0)]
    assert len(ids) == 3 and ids[1] == "b4"
    table.set_members([], now=75.0)  # more than 60 s after the first departures
    ids = [s.id for s in table.summaries(_own(P(1, 0), leads=True), "b0", now=75.0)]
    assert ids == ["b0", "b4"]
    table.set_members([], now=81.0)
    assert [s.id for s in table.summaries(_own(P(1, 0), leads=True), "b0", now=81.0)] == ["b0"]


def test_a_poll_asks_every_member_and_reads_the_ledger_list_only_when_needed() -> None:
    asked: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        asked.append(request.url.host)
        if request.url.host == "b2.invalid":
            raise httpx.ConnectError("connection refused")
        body = _health(P(1, 95), uptime=3.0)
        return httpx.Response(200, content=msgspec.json.encode(body))

    reads: list[int] = []

    async def ledger_list() -> tuple[LedgerList, int]:
        reads.append(1)
        return LedgerList(ledgers=(_ledger(1, 99), _ledger(2, None))), 7

    own_position = [P(2, 4)]
    view = PeerView(
        "b0",
        members=lambda: [_info("b0"), _info("b1"), _info("b2")],
        leader_id=lambda: "b0",
        own_position=lambda: own_position[0],
        ledger_list=ledger_list,
        ssl_context=None,  # type: ignore[arg-type]  # unused by the mock transport
    )

    async def run() -> list[m.BrokerSummary]:
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            await view.poll(client)
        return view.summaries(_own(own_position[0], leads=True))

    _, b1, b2 = asyncio.run(run())
    assert sorted(asked) == ["b1.invalid", "b2.invalid"]
    assert b1.reachable and b1.lag_entries == 4 + 5  # 96..99 of ledger 1, 0..4 of ledger 2
    assert not b2.reachable and b2.unknown_reason is not None
    assert "ConnectError" in b2.unknown_reason
    assert reads == [1]
    own_position[0] = P(1, 95)  # the leader in b1's ledger: no list needed
    asyncio.run(run())
    assert reads == [1]
