"""The instruments replication reports to, as a Protocol: replication imports no metrics.

The leader's write path observes append latency and group-commit batch sizes, a follower
its lag, every broker its snapshots' duration and sizes. ``broker.observability``'s
``BrokerMetrics`` satisfies :class:`ReplicationMetrics` and ``observe_node`` injects it
(docs/DESIGN.md §9); until then a node reports to :class:`NoReplicationMetrics`.
"""

from __future__ import annotations

from typing import Protocol


class Observer(Protocol):
    """A histogram: one observation."""

    def observe(self, amount: float, /) -> None: ...


class Setter(Protocol):
    """A gauge: set to a value."""

    def set(self, value: float, /) -> None: ...


class ReplicationMetrics(Protocol):
    """What replication reports (read-only members: any observer or gauge type fits)."""

    @property
    def append_latency(self) -> Observer:
        """From handing an entry to the ledger until it is durable (leader)."""

    @property
    def follower_lag_seconds(self) -> Setter:
        """From the leader stamping the entry last applied here until it was applied."""

    @property
    def follower_lag_entries(self) -> Setter:
        """Entries read from the leader's ledger, not applied yet (unconfirmed)."""

    @property
    def snapshot_duration(self) -> Observer:
        """Time to encode, compress and durably write a snapshot."""

    @property
    def snapshot_size(self) -> Setter:
        """The last snapshot's file size (compressed)."""

    @property
    def snapshot_body(self) -> Setter:
        """The last snapshot's encoded state before compression."""

    def observe_batch(self, entries: int) -> None:
        """Entries made durable together by one group commit."""


class _Nothing:
    """An observer and a gauge that keep nothing."""

    __slots__ = ()

    def observe(self, amount: float, /) -> None:
        pass

    def set(self, value: float, /) -> None:
        pass


_NOTHING = _Nothing()


class NoReplicationMetrics:
    """The default: every instrument drops what it is given."""

    append_latency = follower_lag_seconds = follower_lag_entries = _NOTHING
    snapshot_duration = snapshot_size = snapshot_body = _NOTHING

    def observe_batch(self, entries: int) -> None:
        pass
