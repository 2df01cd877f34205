"""The leader queue under ``/steward/<cluster>/election`` as one elector last read it: who
is lowest (the leader), that node's info, and whether it is ours (docs/DESIGN.md §4)."""

from __future__ import annotations

from typing import Any

from broker.ha.zk_session import ZkSession, sorted_queue


class LeaderQueue:
    """What the last read of the queue found, and the watches that say when to read again.

    ``holds_lowest``: our queue node was the lowest at the last read (the elector also
    clears it whenever leadership must end before the next read).
    """

    def __init__(self, directory: str) -> None:
        self._directory = directory
        self.holds_lowest = False
        self.leader_node: str | None = None
        self._node_info: dict[str, dict[str, Any]] = {}  # queue node -> info

    def leader_info(self) -> dict[str, Any] | None:
        """The current leader's ``broker_id`` and address info (None: no leader known)."""
        if self.leader_node is None:
            return None
        info = self._node_info.get(self.leader_node)
        return dict(info) if info is not None else None

    async def read(
        self, session: ZkSession, queue_node: str | None, *, want_queue: bool, epoch: int
    ) -> bool | None:
        """Read the queue, set the watches and leadership; False when it must be read again,
        None when ``queue_node`` (ours) is no longer in it."""
        directory = self._directory
        children = sorted_queue(await self._children(session))
        if queue_node is not None and queue_node not in children:
            # Deleted behind our back (an operator, or the end of the session).
            self.holds_lowest = False
            return None
        if not children:
            self.leader_node = None
            self.holds_lowest = False
            # Nobody to watch: watch the directory to learn of the first to join.
            watched = await self._children(session, watched=True)
            return not sorted_queue(watched)
        lowest = children[0]
        # Watch the leader's node (everyone needs to know when it goes) ...
        if not await session.exists_watched(f"{directory}/{lowest}"):
            return False
        if lowest not in self._node_info:
            info = await session.read_info(f"{directory}/{lowest}")
            if info is None:
                return False
            self._node_info[lowest] = info
        # ... and, when queued behind it, the predecessor (so one node's exit wakes one
        # follower's promotion check, not the whole queue's).
        if queue_node is not None and queue_node != lowest:
            predecessor = children[children.index(queue_node) - 1]
            if predecessor != lowest and not await session.exists_watched(
                f"{directory}/{predecessor}"
            ):
                return False
        self.leader_node = lowest
        # leave() or a connection drop may have come while this refresh waited for ZooKeeper.
        self.holds_lowest = want_queue and queue_node == lowest and epoch == session.epoch
        for name in list(self._node_info):
            if name not in children:
                del self._node_info[name]
        return True

    async def _children(self, session: ZkSession, *, watched: bool = False) -> list[str]:
        """The queue directory's children; raises ``NoNodeError`` when it is missing."""
        return await session.get_children(self._directory, watched=watched)
