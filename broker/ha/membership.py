"""The brokers' advertisements under ``/steward/<cluster>/brokers`` as one elector last read
them: the membership the cluster summary is made from (docs/DESIGN.md §4)."""

from __future__ import annotations

import uuid
from typing import Any

from broker.ha.zk_session import ZkSession, sorted_queue


class BrokerDirectory:
    """This broker's advertisement (an ephemeral sequential node holding ``info``) and every
    advertised broker's info, by advertisement node, kept from the loop."""

    def __init__(self, directory: str, name_prefix: str, info: bytes) -> None:
        self._directory = directory
        self._name_prefix = name_prefix
        self._info = info
        # Our advertisement: the token is known before the create returns, the name only after.
        self._ad_token: str | None = None
        self.ad_node: str | None = None
        self._brokers: dict[str, dict[str, Any]] = {}  # advertisement node -> info

    def forget(self) -> None:
        """The session that owned our advertisement ended (or it was withdrawn)."""
        self._ad_token = self.ad_node = None

    async def advertise(self, session: ZkSession) -> bool:
        """Create our advertisement when missing; False when the session ended meanwhile."""
        if self.ad_node is None:
            token = self._ad_token = self._ad_token or uuid.uuid4().hex[:12]
            name = await session.create_or_adopt(
                self._directory, token, self._name_prefix, self._info
            )
            if self._ad_token != token:
                return False  # the session ended meanwhile: start over on the next refresh
            self.ad_node = name
        return True

    async def withdraw(self, session: ZkSession) -> None:
        """Delete our advertisement (if one was made)."""
        if self._ad_token is not None:
            await session.delete_matching(self._directory, f"_{self._ad_token}_")

    def brokers(self) -> list[dict[str, Any]]:
        """Every advertised broker's ``broker_id`` and address info, oldest first."""
        ordered = sorted_queue(list(self._brokers))
        return [dict(self._brokers[name]) for name in ordered]

    async def refresh(self, session: ZkSession) -> None:
        """Re-read the directory (watched) and the info of advertisements not seen before.

        Raises ``NoNodeError`` when the directory is missing.
        """
        children = await session.get_children(self._directory, watched=True)
        names = set(children)
        for name in list(self._brokers):
            if name not in names:
                del self._brokers[name]
        for name in sorted_queue(children):
            if name not in self._brokers:
                info = await session.read_info(f"{self._directory}/{name}")
                if info is not None:
                    self._brokers[name] = info
