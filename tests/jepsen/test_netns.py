"""The harness's network: namespaces on one bridge reach each other; a port down or an
nftables drop cuts exactly what it says (one way, per peer); heal restores; teardown
removes every namespace and kills what ran in them, also a leftover of a killed run."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.jepsen.netns import (
    Network,
    NetworkError,
    cleanup_leftovers,
    harness_namespaces,
    run,
)
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
    net.unlock_host()  # a killed run's flock goes with its process
    sleeper = subprocess.Popen([*net.exec_prefix("a"), "sleep", "300"])
    # In the namespace before the clean-up: removed earlier, `ip netns exec` fails to enter it
    # (exit 255) instead of being killed there.
    wait_until(
        lambda: str(sleeper.pid) in run("ip", "netns", "pids", "sj-a", check=False).stdout.split(),
        10,
        "the sleeper inside sj-a",
    )
    assert cleanup_leftovers() == ["sj-a", "sj-ctl", "sj-net"]
    assert sleeper.wait(timeout=10) == -9
    assert harness_namespaces() == []


def test_a_second_run_on_the_host_waits_then_fails_naming_the_first() -> None:
    with Network(["a"]) as first:
        second = Network(["b"], lock_wait_s=1.0)
        with pytest.raises(NetworkError, match=rf"pid {os.getpid()}\b.*one run per host"):
            second.__enter__()  # as a second run would: it must not remove the first's
        assert "sj-a" in harness_namespaces()
        first.block("a", ["ctl"])  # the first run still works
    assert harness_namespaces() == []
    with Network(["b"]):  # free again once the first ended
        assert "sj-b" in harness_namespaces()
