"""The leader queue under ``/steward/<cluster>/election``, one elector's side of it
(docs/DESIGN.md §4): our queue node (made when we want to lead, given up when we leave),
and what the last read found: who is lowest (the leader), that node's info, whether it is
ours."""

from __future__ import annotations

import logging
import uuid
from typing import Any

from broker.ha.zk_session import ZkSession, sorted_queue

# The elector's logger: these messages are the elector's (docs/DESIGN.md §4).
logger = logging.getLogger("broker.ha.election")


class LeaderQueue:
    """Our node in the queue, and the queue as last read (from the loop).

    ``want``: this elector wants to be in the queue. ``token`` is known before the create
    returns, ``node`` (the name) only after. ``holds_lowest``: our node was the lowest at
    the last read (the elector also clears it whenever leadership must end before the next
    read).
    """

    def __init__(self, directory: str, name: str, name_prefix: str, info: bytes) -> None:
        self._directory = directory
        self._name = name
        self._name_prefix = name_prefix
        self._info = info
        self.want = False
        self.token: str | None = None
        self.node: str | None = None
        self.stale: set[str] = set()  # tokens of our nodes to delete
        self.holds_lowest = False
        self.leader_node: str | None = None
        self._node_info: dict[str, dict[str, Any]] = {}  # queue node -> info

    def leader_info(self) -> dict[str, Any] | None:
        """The current leader's ``broker_id`` and address info (None: no leader known)."""
        if self.leader_node is None:
            return None
        info = self._node_info.get(self.leader_node)
        return dict(info) if info is not None else None

    # -- our node -----------------------------------------------------------------------------

    def give_up(self) -> None:
        """Leadership ends here: our node (if any) is to be deleted, a new one goes last."""
        if self.token is not None:
            self.stale.add(self.token)
            self.token = self.node = None
        self.holds_lowest = False

    def forget(self) -> None:
        """The session that owned our nodes ended: the server deleted them all."""
        self.token = self.node = None
        self.stale.clear()
        self.holds_lowest = False

    async def delete_stale(self, session: ZkSession) -> None:
        for token in sorted(self.stale):
            await self.delete(session, token)
            self.stale.discard(token)

    async def delete(self, session: ZkSession, token: str) -> None:
        await session.delete_matching(self._directory, f"_{token}_")

    async def ensure_queued(self, session: ZkSession) -> bool:
        """Make our node when we want one and have none; False when :meth:`give_up` or the
        end of the session came in between (look again: the next refresh deletes it)."""
        if self.want and self.node is None:
            token = self.token = self.token or uuid.uuid4().hex[:12]
            name = await session.create_or_adopt(
                self._directory, token, self._name_prefix, self._info
            )
            if self.token != token:
                return False
            self.node = name
            logger.info("elector %s: queued as %s", self._name, name)
        return True

    # -- reading ------------------------------------------------------------------------------

    async def read(self, session: ZkSession, *, epoch: int) -> bool:
        """Read the queue, set the watches and leadership; False when it must be read again.

        Raises ``NoNodeError`` when the directory is missing.
        """
        directory = self._directory
        children = sorted_queue(await session.get_children(directory))
        if self.node is not None and self.node not in children:
            # Deleted behind our back (an operator, or the end of the session).
            logger.warning("elector %s: queue node %s vanished", self._name, self.node)
            self.token = self.node = None
            self.holds_lowest = False
            return False
        if not children:
            self.leader_node = None
            self.holds_lowest = False
            # Nobody to watch: watch the directory to learn of the first to join.
            watched = await session.get_children(directory, watched=True)
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
        if self.node is not None and self.node != lowest:
            predecessor = children[children.index(self.node) - 1]
            if predecessor != lowest and not await session.exists_watched(
                f"{directory}/{predecessor}"
            ):
                return False
        self.leader_node = lowest
        # leave() or a connection drop may have come while this refresh waited for ZooKeeper.
        self.holds_lowest = self.want and self.node == lowest and epoch == session.epoch
        for name in list(self._node_info):
            if name not in children:
                del self._node_info[name]
        return True
