"""The harness's network: namespaces on one bridge reach each other; a port down or an
nftables drop cuts exactly what it says (one way, per peer); heal restores; teardown
removes every namespace and kills what ran in them, also a leftover of a killed run."""

from __future__ import annotations

import subprocess
import sys

from tests.jepsen.netns import Network, cleanup_leftovers, harness_namespaces
from tests.support.worker_procs import wait_until

PORT = 8000


def connects(net: Network, source: str, target: str) -> bool:
    code = f"import socket; socket.create_connection(('{net.address[target]}', {PORT}), 1)"
    result = subprocess.run(
        [*net.exec_prefix(source), sys.executable, "-c", code], capture_output=True, timeout=10
    )
    return result.returncode == 0


def test_partitions_cut_what_they_say_and_teardown_removes_everything() -> None:
    with Network(["a", "b", "c"]) as net:
        assert set(harness_namespaces()) == {"sj-a", "sj-b", "sj-c", "sj-ctl", "sj-net"}
        serve = ["-m", "http.server", "--bind", net.address["a"], str(PORT)]
        server = subprocess.Popen(
            [*net.exec_prefix("a"), sys.executable, *serve],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            wait_until(lambda: connects(net, "b", "a"), 20, "the server in a")
            assert connects(net, "c", "a")
            net.block("a", ["b"], "in")  # b's packets to a dropped; c unaffected
            assert not connects(net, "b", "a")
            assert connects(net, "c", "a")
            net.heal()
            assert connects(net, "b", "a")
            net.isolate("a")
            assert not connects(net, "c", "a")
            net.heal()
            assert connects(net, "c", "a")
        finally:
            leftover = server
    # The teardown killed the server (by its namespace) and removed every namespace.
    assert leftover.wait(timeout=10) == -9
    assert harness_namespaces() == []


def test_a_killed_runs_leftovers_are_cleaned_up() -> None:
    net = Network(["a"])
    net.create()  # never torn down, as after a SIGKILL of the run
    sleeper = subprocess.Popen([*net.exec_prefix("a"), "sleep", "300"])
    assert cleanup_leftovers() == ["sj-a", "sj-ctl", "sj-net"]
    assert sleeper.wait(timeout=10) == -9
    assert harness_namespaces() == []
