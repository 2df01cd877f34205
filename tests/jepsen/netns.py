"""The network of a Jepsen run: one network namespace per process, joined by veth pairs to
one bridge (docs/TESTING.md, "Partitions").

Every name starts with :data:`PREFIX` (``sj-``): the bridge lives in its own namespace
(``sj-net``), so the host's namespace gets no link, no address and no route; the nodes
(``sj-zk``, ``sj-b1``..., ``sj-w1``..., ``sj-cl``) and the harness's own control namespace
(``sj-ctl``, where the run's driver observes the cluster) get a private address in
10.77.0.0/24 and loopback. Traffic can only go to those addresses or to loopback.

Faults: :meth:`Network.isolate` takes a node's bridge port down (it reaches nobody);
:meth:`Network.block` drops packets between a node and chosen peers, one way or both,
with an nftables table inside the node's namespace. :meth:`Network.heal` undoes all.
:meth:`Network.teardown` kills every process left in the namespaces (``ip netns pids``,
by pid) and deletes them; :func:`cleanup_leftovers` does the same for any ``sj-``
namespace a killed run left behind. One run per host at a time: :class:`Network` holds
:data:`HOST_LOCK` (``flock``) from before it removes leftovers until its teardown, so a
second run waits for the first, bounded, then fails naming it; it never removes a running
run's namespaces.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from types import TracebackType

PREFIX = "sj-"
SUBNET = "10.77.0"
BRIDGE = "sjbr0"
NETNS_DIR = Path("/var/run/netns")
COMMAND_TIMEOUT_S = 10.0
HOST_LOCK = Path("/run/lock/steward-jepsen.lock")


class NetworkError(RuntimeError):
    """A namespace, link or rule could not be made (the command's output included)."""


def run(*command: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(
        command, capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S, check=False
    )
    if check and result.returncode != 0:
        raise NetworkError(f"{' '.join(command)}: {result.stderr.strip() or result.stdout}")
    return result


def require_tools() -> None:
    """Root, ``ip`` and ``nft``; a missing one fails loudly (never skips)."""
    if os.geteuid() != 0:
        raise NetworkError("the Jepsen harness needs root (network namespaces)")
    for tool in ("ip", "nft"):
        if shutil.which(tool) is None:
            raise NetworkError(f"{tool} is not installed (Debian: apt-get install -y nftables)")


def harness_namespaces() -> list[str]:
    listed = run("ip", "netns", "list").stdout.split("\n")
    return sorted({line.split()[0] for line in listed if line.startswith(PREFIX)})


def kill_namespace_processes(namespace: str, timeout_s: float = 10.0) -> None:
    """SIGKILL every process in ``namespace`` (by pid) and wait until none is left."""
    deadline = time.monotonic() + timeout_s
    while True:
        listed = run("ip", "netns", "pids", namespace, check=False).stdout.split()
        pids = [int(p) for p in listed if not _zombie(int(p))]
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGCONT)  # a stopped process dies only once resumed
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if time.monotonic() > deadline:
            raise NetworkError(f"processes {pids} in {namespace} survived SIGKILL")
        time.sleep(0.05)


def _zombie(pid: int) -> bool:
    """Dead and waiting for its parent to reap it (a killed child of this process)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True  # gone already
    return stat.rsplit(")", 1)[1].split()[0] in ("Z", "X")


def cleanup_leftovers() -> list[str]:
    """Remove what an earlier run left (its processes, namespaces and links)."""
    found = harness_namespaces()
    for namespace in found:
        kill_namespace_processes(namespace)
        run("ip", "netns", "delete", namespace, check=False)
    return found


class Network:
    """The namespaces of one run; a context manager that always tears them down."""

    def __init__(self, nodes: Sequence[str], lock_wait_s: float = 60.0) -> None:
        assert len(nodes) < 200, "one /24"
        self.nodes = [*nodes, "ctl"]
        self.address = {name: f"{SUBNET}.{i + 1}" for i, name in enumerate(self.nodes)}
        self.isolated: set[str] = set()
        self.blocked: dict[str, set[tuple[str, str]]] = {}  # node -> {(direction, peer)}
        self._made: list[str] = []
        self._lock_fd: int | None = None
        self.lock_wait_s = lock_wait_s

    def namespace(self, node: str) -> str:
        return f"{PREFIX}{node}"

    def exec_prefix(self, node: str) -> list[str]:
        """Prefix a command with this to run it in ``node``'s namespace."""
        return ["ip", "netns", "exec", self.namespace(node)]

    def _port(self, node: str) -> str:
        return f"sjv{self.nodes.index(node)}"  # the bridge side of the node's veth pair

    # -- lifecycle ---------------------------------------------------------------------

    def __enter__(self) -> Network:
        try:
            self.create()
        except BaseException:
            self.teardown()
            raise
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.teardown()

    def lock_host(self) -> None:
        """Take the host's one-run lock, waiting up to ``lock_wait_s`` for a running run."""
        wait_s = self.lock_wait_s
        HOST_LOCK.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(HOST_LOCK, os.O_RDWR | os.O_CREAT, 0o644)
        deadline = time.monotonic() + wait_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
                    os.close(fd)
                    raise NetworkError(
                        f"another Jepsen run (pid {holder}) holds this host ({HOST_LOCK}) "
                        f"after {wait_s:.0f} s: one run per host; wait for it or stop it"
                    ) from None
                time.sleep(0.5)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._lock_fd = fd

    def unlock_host(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # releases the flock
            self._lock_fd = None

    def create(self) -> None:
        require_tools()
        self.lock_host()
        cleanup_leftovers()
        net = self.namespace("net")
        self._add_namespace(net)
        run("ip", "-n", net, "link", "add", BRIDGE, "type", "bridge")
        run("ip", "-n", net, "link", "set", BRIDGE, "up")
        for node in self.nodes:
            namespace = self.namespace(node)
            self._add_namespace(namespace)
            # Both ends are made inside namespaces: the host's namespace never holds one.
            run(
                "ip", "link", "add", "eth0", "netns", namespace,
                "type", "veth", "peer", "name", self._port(node), "netns", net,
            )  # fmt: skip
            run("ip", "-n", net, "link", "set", self._port(node), "master", BRIDGE, "up")
            run("ip", "-n", namespace, "addr", "add", f"{self.address[node]}/24", "dev", "eth0")
            run("ip", "-n", namespace, "link", "set", "eth0", "up")

    def _add_namespace(self, namespace: str) -> None:
        run("ip", "netns", "add", namespace)
        self._made.append(namespace)
        run("ip", "-n", namespace, "link", "set", "lo", "up")

    def teardown(self) -> None:
        try:
            for namespace in reversed(self._made):
                kill_namespace_processes(namespace)
            for namespace in reversed(self._made):
                run("ip", "netns", "delete", namespace, check=False)
            self._made.clear()
        finally:
            self.unlock_host()

    # -- faults ------------------------------------------------------------------------

    def isolate(self, node: str) -> None:
        """Take ``node``'s bridge port down: it reaches no one and no one reaches it."""
        run("ip", "-n", self.namespace("net"), "link", "set", self._port(node), "down")
        self.isolated.add(node)

    def block(self, node: str, peers: Iterable[str], direction: str = "both") -> None:
        """Drop ``node``'s packets to (``out``), from (``in``) or both ways with ``peers``."""
        assert direction in ("in", "out", "both"), direction
        rules = self.blocked.setdefault(node, set())
        for peer in peers:
            if peer == node:
                continue
            if direction in ("out", "both"):
                rules.add(("out", peer))
            if direction in ("in", "both"):
                rules.add(("in", peer))
        self._apply(node)

    def _apply(self, node: str) -> None:
        rules = sorted(self.blocked.get(node, ()))
        lines = ["table inet sj {", "  chain input { type filter hook input priority 0;"]
        lines += [f"    ip saddr {self.address[p]} drop" for d, p in rules if d == "in"]
        lines += ["  }", "  chain output { type filter hook output priority 0;"]
        lines += [f"    ip daddr {self.address[p]} drop" for d, p in rules if d == "out"]
        lines += ["  }", "}"]
        prefix = self.exec_prefix(node)
        run(*prefix, "nft", "delete", "table", "inet", "sj", check=False)
        if rules:
            # One file, applied atomically by nft.
            result = subprocess.run(
                [*prefix, "nft", "-f", "-"],
                input="\n".join(lines) + "\n",
                capture_output=True,
                text=True,
                timeout=COMMAND_TIMEOUT_S,
                check=False,
            )
            if result.returncode != 0:
                raise NetworkError(f"nft in {node}: {result.stderr.strip()}")

    def heal(self) -> None:
        """Every port up, every drop rule gone."""
        for node in sorted(self.isolated):
            run("ip", "-n", self.namespace("net"), "link", "set", self._port(node), "up")
        self.isolated.clear()
        for node in sorted(self.blocked):
            self.blocked[node].clear()
            self._apply(node)
        self.blocked.clear()
