"""A real 3-server ZooKeeper ensemble for tests (issue 20), from the jars pyspark ships.

Each member is a :class:`~clients.dev.zk.ZooKeeperServer` run as
``org.apache.zookeeper.server.quorum.QuorumPeerMain`` with its own ``zoo.cfg``: the same
client-side settings as the single server (tickTime 500 ms, 127.0.0.1 only, ``srvr``/
``ruok``/``mntr``, no admin server), ``dataDir/myid``, small ``initLimit``/``syncLimit`` so a
lost member is noticed within seconds, and ``server.N=127.0.0.1:PEER:ELECTION`` for all three.
Every port is chosen once and kept across restarts (the others' configs name them).

A member is ready when its ``srvr`` answers with a ``Mode:`` line (leader or follower): a
member without a quorum answers "not currently serving requests". The ensemble starts all
three JVMs, then waits for all three Modes (5-15 s on a busy machine). Every wait is bounded
and signals go to each member's pid only; :meth:`ZooKeeperEnsemble.close` stops them all.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from pathlib import Path
from types import TracebackType

import pytest

from clients.dev.local_server import HOST, free_port
from clients.dev.zk import ZooKeeperError, ZooKeeperServer, four_letter_word

SIZE = 3
START_TIMEOUT_S = 45.0
_QUORUM_MAIN_CLASS = "org.apache.zookeeper.server.quorum.QuorumPeerMain"
_MODE_RE = re.compile(r"^Mode: (\w+)", re.MULTILINE)


class EnsembleMember(ZooKeeperServer):
    """One member of a :class:`ZooKeeperEnsemble` (``myid`` = ``member_id``)."""

    def __init__(
        self,
        directory: Path,
        member_id: int,
        peers: dict[int, tuple[int, int]],
        *,
        client_port: int,
    ) -> None:
        super().__init__(directory, port=client_port, stop_with_parent=True)
        self.member_id = member_id
        self._peers = peers  # member id -> (peer port, election port), all members
        # Launch without waiting for a Mode: a lone member has none until a quorum forms.
        self.launch_only = False
        self.server_name = f"ZooKeeper member {member_id}"

    def mode(self) -> str | None:
        """``leader``/``follower`` from ``srvr``; None when down or not serving."""
        if not self.is_running():
            return None
        try:
            answer = four_letter_word(HOST, self.port, "srvr", timeout_s=1.0)
        except OSError:
            return None
        match = _MODE_RE.search(answer)
        return match.group(1) if match else None

    def _ready(self) -> bool:
        return self.launch_only or self.mode() is not None

    def _write_config(self) -> None:
        super()._write_config()
        (self.data_dir / "myid").write_text(f"{self.member_id}\n")
        lines = [
            # In ticks: a follower syncs within 5 s, and is dropped after 2 s of silence.
            "initLimit=10",
            "syncLimit=4",
            *(
                f"server.{n}={HOST}:{peer}:{election}"
                for n, (peer, election) in sorted(self._peers.items())
            ),
        ]
        with self.config_path.open("a") as config:
            config.write("\n".join(lines) + "\n")

    def _command(self) -> list[str]:
        command = super()._command()
        command[command.index("org.apache.zookeeper.server.ZooKeeperServerMain")] = (
            _QUORUM_MAIN_CLASS
        )
        return command

    def kill9(self) -> None:
        """SIGKILL (a crash: no clean shutdown); no-op when not running."""
        self._kill_process()


class ZooKeeperEnsemble:
    """Three :class:`EnsembleMember` servers on 127.0.0.1 (ids 1, 2, 3) in ``root``."""

    def __init__(self, root: Path) -> None:
        peers = {n: (free_port(), free_port()) for n in range(1, SIZE + 1)}
        self.members = {
            n: EnsembleMember(root / f"zk{n}", n, peers, client_port=free_port()) for n in peers
        }

    @property
    def connect_string(self) -> str:
        """All three members, for ``--zookeeper`` and ``KazooClient(hosts=...)``."""
        return ",".join(member.connect_string for member in self.members.values())

    def member(self, member_id: int) -> EnsembleMember:
        return self.members[member_id]

    # -- lifecycle ------------------------------------------------------------------------------

    def start(self, timeout_s: float = START_TIMEOUT_S) -> None:
        """Start every member that is down and wait until all serve (have a Mode)."""
        down = [m for m in self.members.values() if not m.is_running()]
        for member in down:
            member.launch_only = True
            try:
                member.start()
            finally:
                member.launch_only = False
        self.wait_serving(timeout_s)

    def wait_serving(self, timeout_s: float = START_TIMEOUT_S) -> None:
        """Wait until every running member has a Mode and there is exactly one leader."""
        deadline = time.monotonic() + timeout_s
        while True:
            modes = self.modes()
            running = [n for n, m in self.members.items() if m.is_running()]
            if all(modes.get(n) for n in running) and list(modes.values()).count("leader") == 1:
                return
            if time.monotonic() >= deadline:
                raise ZooKeeperError(
                    f"ensemble not serving within {timeout_s:g} s (modes {modes}); "
                    + "".join(
                        f"\n--- member {n} ---\n{m.log_tail(1500)}" for n, m in self.members.items()
                    )
                )
            time.sleep(0.2)

    def restart(self, member_id: int, timeout_s: float = START_TIMEOUT_S) -> None:
        """Start a stopped or killed member again (same ports and data) and wait until it
        serves (it needs a quorum: at least one other member must be up)."""
        self.members[member_id].start(timeout_s)

    def stop(self, member_id: int) -> None:
        """SIGTERM, bounded (then SIGKILL)."""
        self.members[member_id].stop()

    def kill9(self, member_id: int) -> None:
        self.members[member_id].kill9()

    def close(self) -> None:
        for member in self.members.values():
            member.kill9()

    def __enter__(self) -> ZooKeeperEnsemble:
        try:
            self.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    # -- roles ----------------------------------------------------------------------------------

    def modes(self) -> dict[int, str | None]:
        return {n: member.mode() for n, member in self.members.items()}

    def leader(self) -> int | None:
        """The id of the member whose ``srvr`` says leader (None: none now)."""
        leaders = [n for n, mode in self.modes().items() if mode == "leader"]
        return leaders[0] if len(leaders) == 1 else None

    def followers(self) -> list[int]:
        return [n for n, mode in self.modes().items() if mode == "follower"]

    def log_tails(self, max_bytes: int = 2000) -> str:
        return "".join(
            f"\n----- ZooKeeper member {n} ({m.log_path}) -----\n{m.log_tail(max_bytes)}"
            for n, m in self.members.items()
        )


def started_ensemble(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ZooKeeperEnsemble]:
    """A fixture body (module scope in tests/integration/test_zk_ensemble.py): a started
    ensemble, shared by the tests (a test may leave members down: the next one starts
    them), every member killed at the end."""
    with ZooKeeperEnsemble(tmp_path_factory.mktemp("zk-ensemble")) as ensemble:
        yield ensemble
