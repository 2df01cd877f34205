"""A real 3-server ZooKeeper ensemble for tests (issue 20), from the jars pyspark ships.

Each member is a :class:`~clients.dev.zk.ZooKeeperServer` run as
``org.apache.zookeeper.server.quorum.QuorumPeerMain`` with its own ``zoo.cfg``: the same
client-side settings as the single server (tickTime 500 ms, 127.0.0.1 only, ``srvr``/
``ruok``/``mntr``, no admin server), ``dataDir/myid``, small ``initLimit``/``syncLimit`` so a
lost member is noticed within seconds, and ``server.N=127.0.0.1:PEER:ELECTION`` for all three.
Every port is reserved for the ensemble's life (tests/support/reserved_ports.py: outside the
kernel's ephemeral range, locked against other test processes) and kept across restarts
(the others' configs name them): a port picked by binding port 0 could be handed to another
process while its member is down, and a member that cannot bind its election port gives it
up after three tries and exits (docs/TESTING.md, findings table).

The ensemble serves when every member it started (and did not stop or kill) has a ``Mode:``
in ``srvr``, has bound its election port (its log says so since its latest start), and the
one leader's ``mntr`` counts all the others as synced followers: the full voter set, so a
later kill of one member never takes the quorum with it. A member that exited or gave up its
election listener meanwhile is launched again, at most :data:`MAX_RELAUNCHES` times per wait.

Bounds: the first start (three JVMs at once) is bounded by :data:`FIRST_START_TIMEOUT_S`
and measured; every later start or restart is bounded by :data:`LATER_START_FACTOR` times
that measured time (never less than :data:`LATER_START_MIN_TIMEOUT_S`), so a slower machine
gets proportionally longer. Signals go to each member's pid only; :meth:`ZooKeeperEnsemble.close`
kills them all and gives the ports back.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Iterator
from pathlib import Path
from types import TracebackType

import pytest

from clients.dev.local_server import HOST
from clients.dev.zk import ZooKeeperError, ZooKeeperServer, four_letter_word
from tests.support.reserved_ports import PortReservation, reserve_port

logger = logging.getLogger(__name__)

SIZE = 3
#: Bound of the first start, before anything is measured: how long a hopeless start takes
#: to fail (measured 4.6 s at load 5 on 2 shared cores; 5-15 s at higher loads).
FIRST_START_TIMEOUT_S = 120.0
#: Later starts are bounded by this many times the first start's measured time: a member
#: restarted under a test's load (brokers, workers, clients beside it) took up to 2.2 times
#: it here, and the load varies.
LATER_START_FACTOR = 4.0
#: The floor of that bound (on a fast machine a start of 3 s would give 12 s).
LATER_START_MIN_TIMEOUT_S = 45.0
#: How often one wait launches a member again that exited or gave up its election listener.
MAX_RELAUNCHES = 2
_QUORUM_MAIN_CLASS = "org.apache.zookeeper.server.quorum.QuorumPeerMain"
_MODE_RE = re.compile(r"^Mode: (\w+)", re.MULTILINE)
_SYNCED_FOLLOWERS_RE = re.compile(r"^zk_synced_followers\s+(\d+)", re.MULTILINE)
# QuorumCnxManager's log lines: its election listener bound the port, or gave it up.
_LISTENING_MARKER = "is accepting connections now, my election bind port"
_LISTENER_LEFT_MARKER = "Leaving listener thread for address"


class EnsembleMember(ZooKeeperServer):
    """One member of a :class:`ZooKeeperEnsemble` (``myid`` = ``member_id``).

    :meth:`start` only launches it: a lone member has no Mode until a quorum forms, so the
    ensemble waits (:meth:`ZooKeeperEnsemble.wait_serving`).
    """

    def __init__(
        self,
        directory: Path,
        member_id: int,
        peers: dict[int, tuple[int, int]],
        *,
        client_port: int,
        max_session_timeout_ms: int | None = None,
        classpath: str | None = None,
        java: str | None = None,
    ) -> None:
        super().__init__(
            directory,
            port=client_port,
            max_session_timeout_ms=max_session_timeout_ms,
            classpath=classpath,
            java=java,
            stop_with_parent=True,
        )
        self.member_id = member_id
        self._peers = peers  # member id -> (peer port, election port), all members
        self.server_name = f"ZooKeeper member {member_id}"
        self._listening_since_offset: int | None = None

    @property
    def peer_port(self) -> int:
        return self._peers[self.member_id][0]

    @property
    def election_port(self) -> int:
        return self._peers[self.member_id][1]

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

    def synced_followers(self) -> int | None:
        """A leader's ``zk_synced_followers`` from ``mntr`` (None: not a leader, or down)."""
        try:
            answer = four_letter_word(HOST, self.port, "mntr", timeout_s=1.0)
        except OSError:
            return None
        match = _SYNCED_FOLLOWERS_RE.search(answer)
        return int(match.group(1)) if match else None

    def election_listener(self) -> str:
        """``up`` once this start's log says the election port is bound, ``left`` when
        ZooKeeper gave the listener up (it cannot vote any more), else ``pending``."""
        if self._listening_since_offset == self._launch_log_offset:
            return "up"
        output = self.log_since_launch(self.start_log_bytes)
        if _LISTENER_LEFT_MARKER in output:
            return "left"
        if _LISTENING_MARKER in output:
            self._listening_since_offset = self._launch_log_offset
            return "up"
        return "pending"

    def lost(self) -> str | None:
        """Why a member that was started is of no use now (None: running, listener not
        given up)."""
        if not self.is_running():
            return f"exited with status {self.exit_code}"
        if self.election_listener() == "left":
            return "gave up its election listener"
        return None

    def _ready(self) -> bool:
        return True

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
    """Three :class:`EnsembleMember` servers on 127.0.0.1 (ids 1, 2, 3) in ``root``.

    ``max_session_timeout_ms``, ``classpath`` and ``java`` go to every member as to a
    :class:`~clients.dev.zk.ZooKeeperServer` (the real Pulsar cluster of
    tests/support/pulsar_cluster.py runs its ensemble on the engines cache's ZooKeeper jars).
    """

    def __init__(
        self,
        root: Path,
        *,
        max_session_timeout_ms: int | None = None,
        classpath: str | None = None,
        java: str | None = None,
    ) -> None:
        self._reservations: list[PortReservation] = []
        try:
            for _ in range(3 * SIZE):
                self._reservations.append(reserve_port())
        except BaseException:
            self._release_ports()
            raise
        ports = iter(r.port for r in self._reservations)
        peers = {n: (next(ports), next(ports)) for n in range(1, SIZE + 1)}
        try:
            self.members = {
                n: EnsembleMember(
                    root / f"zk{n}",
                    n,
                    peers,
                    client_port=next(ports),
                    max_session_timeout_ms=max_session_timeout_ms,
                    classpath=classpath,
                    java=java,
                )
                for n in peers
            }
        except BaseException:
            self._release_ports()
            raise
        # The members started and not stopped or killed since: the voters wait_serving expects.
        self._up: set[int] = set()
        #: The first start's measured time (launch of all three to a full voter set).
        self.first_start_s: float | None = None
        #: What was launched again and why, for a test's output.
        self.relaunches: list[str] = []

    @property
    def connect_string(self) -> str:
        """All three members, for ``--zookeeper`` and ``KazooClient(hosts=...)``."""
        return ",".join(member.connect_string for member in self.members.values())

    @property
    def ports(self) -> list[int]:
        """Every member's client, peer and election port."""
        return sorted(
            port
            for member in self.members.values()
            for port in (member.port, member.peer_port, member.election_port)
        )

    def member(self, member_id: int) -> EnsembleMember:
        return self.members[member_id]

    @property
    def start_timeout_s(self) -> float:
        """The bound of a start or restart: :data:`FIRST_START_TIMEOUT_S` until the first
        start is measured, then :data:`LATER_START_FACTOR` times its time (at least
        :data:`LATER_START_MIN_TIMEOUT_S`)."""
        if self.first_start_s is None:
            return FIRST_START_TIMEOUT_S
        return max(LATER_START_MIN_TIMEOUT_S, LATER_START_FACTOR * self.first_start_s)

    # -- lifecycle ------------------------------------------------------------------------------

    def start(self, timeout_s: float | None = None) -> float:
        """Start every member that is down and wait until the ensemble serves with all
        three voters (:meth:`wait_serving`). Returns the seconds it took; the first start's
        is kept as :attr:`first_start_s`."""
        started = time.monotonic()
        for member_id, member in self.members.items():
            if not member.is_running():
                self._launch(member_id)
        self.wait_serving(timeout_s)
        took_s = time.monotonic() - started
        if self.first_start_s is None:
            self.first_start_s = took_s
        return took_s

    def _launch(self, member_id: int) -> None:
        self.members[member_id].start()
        self._up.add(member_id)

    def wait_serving(self, timeout_s: float | None = None) -> float:
        """Wait until every member started (and not stopped or killed since) serves with
        its election port bound and the leader counts all the others as synced followers.
        A member that exited or gave up its election listener meanwhile is launched again
        (at most :data:`MAX_RELAUNCHES` times). Returns the seconds it took; raises
        :class:`ZooKeeperError` with what was missing and the members' logs."""
        bound_s = self.start_timeout_s if timeout_s is None else timeout_s
        started = time.monotonic()
        relaunched = 0
        while True:
            for member_id in sorted(self._up):
                member = self.members[member_id]
                why = member.lost()
                if why is None:
                    continue
                if relaunched >= MAX_RELAUNCHES:
                    raise ZooKeeperError(
                        f"ZooKeeper member {member_id} {why}, after {relaunched} launches "
                        f"again (election port {member.election_port}){self.log_tails(3000)}"
                    )
                note = f"ZooKeeper member {member_id} {why}: launched again"
                logger.warning(note)
                self.relaunches.append(note)
                member.kill9()
                member.start()
                relaunched += 1
            missing = self._not_serving()
            if not missing:
                return time.monotonic() - started
            if time.monotonic() - started >= bound_s:
                raise ZooKeeperError(
                    f"ensemble not serving within {bound_s:g} s: {'; '.join(missing)}"
                    + self.log_tails(1500)
                )
            time.sleep(0.2)

    def _not_serving(self) -> list[str]:
        """What keeps the started members from serving with all of them voting (empty:
        nothing)."""
        missing: list[str] = []
        modes = {n: self.members[n].mode() for n in sorted(self._up)}
        for member_id, mode in modes.items():
            member = self.members[member_id]
            if mode is None:
                missing.append(f"member {member_id} has no Mode")
            elif member.election_listener() != "up":
                missing.append(f"member {member_id} has not bound its election port yet")
        leaders = [n for n, mode in modes.items() if mode == "leader"]
        if len(leaders) != 1:
            missing.append(f"leaders {leaders}")
        else:
            synced = self.members[leaders[0]].synced_followers()
            if synced != len(self._up) - 1:
                missing.append(
                    f"leader {leaders[0]} has {synced} synced followers, not {len(self._up) - 1}"
                )
        return missing

    def restart(self, member_id: int, timeout_s: float | None = None) -> float:
        """Start a stopped or killed member again (same ports and data) and wait until the
        ensemble serves with it voting (it needs a quorum: at least one other member must
        be up). Returns the seconds it took."""
        started = time.monotonic()
        self._launch(member_id)
        self.wait_serving(timeout_s)
        return time.monotonic() - started

    def stop(self, member_id: int) -> None:
        """SIGTERM, bounded (then SIGKILL)."""
        self._up.discard(member_id)
        self.members[member_id].stop()

    def kill9(self, member_id: int) -> None:
        self._up.discard(member_id)
        self.members[member_id].kill9()

    def close(self) -> None:
        self._up.clear()
        try:
            for member in self.members.values():
                member.kill9()
        finally:
            self._release_ports()

    def _release_ports(self) -> None:
        for reservation in self._reservations:
            reservation.release()

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
